"""Is the run input-bound? The host time the training process spends blocked waiting for its next batch.

`LoaderWait` wraps the loader's iterator and times each `next` with the host clock: no device sync, nothing
added to a step but two clock reads. The epoch's first optimizer step (workers starting up, warm-up, cuDNN's
autotuning, compilation) is left out of both the wait and the wall time it is a share of, also where the
batches are read one ahead (CUDA: the loader's next for batch i+1 comes before step i runs). The loop reads the share every `logging.interval` steps and at
the epoch's end, reduced to the largest over ranks in the all-reduce it already makes there (SumMeter).
Above INPUT_BOUND over an epoch, `InputAdvice` says once, on rank 0, what to change.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterator, TypeVar

from core.config import DataConfig
from engine.hooks import EpochEnd, Hook
from engine.state import TrainState

log = logging.getLogger(__name__)

INPUT_BOUND = 0.10  # an epoch whose input wait is above this share of its time gets the advice
T = TypeVar("T")


def clock_start(accum_steps: int, read_ahead: bool) -> int:
    """The loader's next() call made when the epoch's second optimizer step asks for its first batch: the
    (accum_steps + 1)-th, one later when the batches are read one ahead."""
    return accum_steps + 1 + int(read_ahead)


class LoaderWait:
    """An iterator over `batches` that adds up the host seconds each `next` blocked, from the `start_at`-th call on.

    The epoch's first step is start-up (workers starting, the first step's warm-up or compilation) and is left
    out of both the wait and the time it is a share of: the clock starts at the call clock_start() names.
    `clock` is the host clock (settable for the tests).
    """

    def __init__(self, batches: Iterator[T], start_at: int = 2, clock: Callable[[], float] = time.perf_counter) -> None:
        self.batches, self.start_at, self.clock = batches, start_at, clock
        self.asked = 0  # next() calls so far
        self.waited = 0.0  # seconds blocked in next(), from the start_at-th call on
        self.since: float | None = None  # host clock at the start_at-th call
        self.mark = (0.0, 0.0)  # (waited, clock) at the previous interval() call

    def __iter__(self) -> LoaderWait:
        return self

    def __next__(self) -> T:
        asked = self.clock()
        self.asked += 1
        if self.asked == self.start_at:
            self.since, self.mark = asked, (0.0, asked)
        batch = next(self.batches)
        if self.asked >= self.start_at:
            self.waited += self.clock() - asked
        return batch

    def interval(self) -> float:
        """The share of the time since the previous call (or the clock's start) spent waiting; starts a new one."""
        if self.since is None:
            return 0.0
        now = self.clock()
        waited, since = self.mark
        self.mark = (self.waited, now)
        return share(self.waited - waited, now - since)

    def epoch(self) -> float:
        """The share of the time since the clock's start spent waiting."""
        return share(self.waited, self.clock() - self.since) if self.since is not None else 0.0


def share(waited: float, wall: float) -> float:
    return min(waited / wall, 1.0) if wall > 0 else 0.0


class InputAdvice(Hook):
    """Rank 0 says once per run what to change when an epoch waited for its input more than INPUT_BOUND."""

    def __init__(self, cfg: DataConfig, cores: int, is_main: bool) -> None:
        self.cfg, self.cores, self.is_main = cfg, cores, is_main
        self.given = False

    def after_epoch(self, state: TrainState, end: EpochEnd) -> None:
        if end.mid_epoch:  # a validation of train.val_every_steps: the epoch's input wait is not yet measured
            return
        wait = end.row["train_input_wait"]
        if self.given or not self.is_main or wait <= INPUT_BOUND:
            return
        self.given = True
        log.warning(advice(self.cfg, self.cores, state.epoch, wait, end.row["train_step_s"]))


def advice(cfg: DataConfig, cores: int, epoch: int, wait: float, step_s: float) -> str:
    """What to change, with the figures: workers and cores, read-ahead, the images' size on disk."""
    if cfg.num_workers == 0:
        workers = (f"data.num_workers=0 decodes and augments in the training process itself: set it to up to "
                   f"{max(cores - 1, 1)} (this process has {cores} CPU core(s))")
    elif cfg.num_workers < cores - 1:
        workers = (f"raise data.num_workers (now {cfg.num_workers}) toward {cores - 1}: this process has {cores} "
                   "CPU core(s)")
    else:
        workers = (f"data.num_workers={cfg.num_workers} already uses this process's {cores} CPU core(s): more "
                   "cores per process (fewer processes per node, or a larger CPU allocation) would help")
    return (f"input-bound: epoch {epoch} waited for its next batch {wait:.0%} of its time (above "
            f"{INPUT_BOUND:.0%}; {step_s * 1000:.1f} ms per optimizer step, largest over ranks). {workers}; raise "
            f"data.prefetch_factor (now {cfg.prefetch_factor}) if the wait comes in bursts; store images near "
            f"data.img_size={cfg.img_size} px on disk (large files cost decoding time) or as shards "
            "(python -m data.make_shards, data.name=wds) when reading many small files is slow")
