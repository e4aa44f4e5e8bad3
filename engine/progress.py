"""The training loop's progress on rank 0.

Progress goes to a terminal as a tqdm bar; to a file (stderr redirected, as under a scheduler) as one plain
log line every `logging.interval` steps, which a bar's carriage returns would turn into one endless line.
Other ranks show no progress.
"""

from __future__ import annotations

import logging
import sys
from typing import Iterable

from tqdm import tqdm

from core.logs import duration

log = logging.getLogger(__name__)


class Progress:
    """One epoch's progress on rank 0: a tqdm bar over `batches` on a terminal, else a log line per `show`.

    Iterate over it instead of `batches`; disabled (other ranks, logging.progress=false) it only passes them on.
    """

    def __init__(self, batches: Iterable, num_batches: int, epoch: int, steps: int, enabled: bool,
                 terminal: bool | None = None) -> None:
        self.epoch, self.steps, self.enabled = epoch, steps, enabled
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self.bar = tqdm(batches, total=num_batches, desc=f"epoch {epoch}", disable=not (enabled and self.terminal),
                        dynamic_ncols=True, leave=False, file=sys.stderr)

    def __iter__(self):
        return iter(self.bar)

    def show(self, step: int, stats: dict[str, float], epoch_eta_s: float, run_eta_s: float) -> None:
        """`step` of the epoch's `steps` is done; stats: the interval's train_loss, lr, img_per_s, step_s (seconds per
        optimizer step) and input_wait (the share of the time spent waiting for batches: engine/speed.py)."""
        if not self.enabled:
            return
        if self.terminal:  # the bar shows the epoch's own ETA
            self.bar.set_postfix(loss=f"{stats['train_loss']:.4f}", lr=f"{stats['lr']:.3g}",
                                 img_s=f"{stats['img_per_s']:.0f}", step=f"{stats['step_s'] * 1000:.0f}ms",
                                 wait=f"{stats['input_wait']:.0%}", run_eta=duration(run_eta_s))
            return
        log.info("epoch %d step %d/%d | loss %.4f | lr %.4g | %.0f img/s | step %.1f ms, input wait %.0f%% | "
                 "ETA epoch %s, run %s", self.epoch, step, self.steps, stats["train_loss"], stats["lr"],
                 stats["img_per_s"], stats["step_s"] * 1000, stats["input_wait"] * 100, duration(epoch_eta_s),
                 duration(run_eta_s))
