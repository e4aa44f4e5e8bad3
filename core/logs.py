"""Rank 0 speaks: log setup, the per-epoch metrics.jsonl file and the end-of-run summary (the training progress:
engine/progress.py). Other ranks log warnings only (prefixed with their rank)."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Callable


def setup_logging(rank: int, level: str = "INFO") -> None:
    """Rank 0 logs at `level`; the other ranks only warn, tagged with their rank."""
    fmt = "%(asctime)s %(levelname)s %(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s %(message)s"
    logging.basicConfig(level=level if rank == 0 else "WARNING", format=fmt, datefmt="%H:%M:%S",
                        stream=sys.stderr, force=True)
    if rank != 0:
        warnings.filterwarnings("ignore")  # library warnings are the same on every rank; rank 0 shows them


log = logging.getLogger(__name__)


def duration(seconds: float) -> str:
    """H:MM:SS, hours unbounded (a multi-day run reads 53:10:07)."""
    total = max(int(round(seconds)), 0) if math.isfinite(seconds) else 0
    return f"{total // 3600}:{total % 3600 // 60:02d}:{total % 60:02d}"


class MetricsFile:
    """metrics.jsonl: one JSON object per validation (each epoch's, and train.val_every_steps' inside epochs), appended
    and flushed as soon as it is done."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def append(self, row: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")

    def keep_only(self, keep: Callable[[dict], bool]) -> None:
        """Drop the rows `keep` refuses, atomically (a resumed run writes them again, once)."""
        if not self.path.exists():
            return
        kept = [row for row in self.rows() if keep(row)]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
        os.replace(tmp, self.path)

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


MAIN_COLUMNS = ("train_loss", "val_loss", "val_top1", "val_top5", "val_balanced_acc", "val_macro_f1",  # single-label
                "val_map", "val_f1")  # multi-label


def shown(name: str, value: float | None) -> str:
    """A metric as the epoch lines show it: losses to 4 decimals, percentages to 2."""
    if value is None:
        return f"{name} n/a"
    return f"{name} {value:.4f}" if name.endswith("loss") else f"{name} {value:.2f}"


def run_summary(rows: list[dict], metric: str, best_value: float, best_epoch: int | None, wall_s: float,
                out: str | Path, cut_short: bool = False) -> str:
    """The end of a run in three lines (as timm's `*** Best metric` and Lightning's results table): the best value
    of `metric` (train.best_metric, the one best.pth follows) and its epoch, the last metrics.jsonl row's main
    metrics, the training speed over `rows` (total images / total training seconds, not a mean of the epochs'
    img/s) and this process's wall time, and the output folder. `cut_short`: the run stopped inside its last epoch
    (train.max_steps, or a stop rule at a validation inside it), whose row is then not a whole epoch's."""
    if math.isfinite(best_value):
        at = f" at epoch {best_epoch}" if best_epoch is not None else ""
        best = f"*** best {shown(metric, best_value)}{at} (best.pth)"
    else:
        best = f"*** no best {metric}: no evaluation gave a number"
    if not rows:
        return f"{best}\n*** no epoch in metrics.jsonl; wall time {duration(wall_s)}; outputs in {out}"
    last = rows[-1]
    columns = [c for c in MAIN_COLUMNS if c in last] + ([metric] if metric not in MAIN_COLUMNS and metric in last
                                                       else [])
    timed = [r for r in rows if r.get("train_images") is not None and r.get("epoch_time_s")]
    seconds = sum(r["epoch_time_s"] for r in timed)
    speed = (f"training at {sum(r['train_images'] for r in timed) / seconds:.0f} img/s" if seconds else
             "no training speed (measured at an epoch's end, which this run did not reach)")
    mid = sum("epoch_time_s" not in r for r in rows)  # validations inside epochs: no timings
    partial = cut_short and "epoch_time_s" in last  # the row of the epoch the stop cut short
    epochs = f"{len(rows) - mid - partial} whole epoch(s)"
    epochs += f", epoch {last['epoch']} cut short at step {last['step']}" if cut_short and "step" in last else ""
    epochs += f" and {mid} validation(s) inside epochs" if mid else ""
    return (f"{best}\n*** last epoch {last['epoch']}: {' '.join(shown(c, last[c]) for c in columns)}\n"
            f"*** {epochs} in metrics.jsonl, {speed}; wall time {duration(wall_s)}; outputs in {out}")
