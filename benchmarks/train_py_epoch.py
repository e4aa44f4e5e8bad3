"""Run train.py's training as `python train.py ARGS` does, and report its last epoch in wall and CPU time.

train.py's metrics.jsonl gives each epoch's wall-clock img/s. On a machine shared with other jobs the
CPU time the training process spent on that epoch is a steadier measure of its cost, so this wrapper adds one
hook to the run (assembly.launch.train's `hooks`): it reads both clocks before each epoch and after each of its
optimizer steps (nothing is added to the step itself) and, on rank 0, prints the last epoch as a JSON line.
Used by loop_overhead.py and ddp_scaling.py.

    taskset -c 0 python benchmarks/train_py_epoch.py --config configs/dummy.yaml amp=bf16 train.epochs=2
"""

from __future__ import annotations

import json
import os
import sys
import time

import harness  # noqa: F401  (puts the repo on sys.path)
import train
from assembly import launch
from core.cli import report_errors
from engine.hooks import EpochEnd, Hook
from engine.state import TrainState


class EpochClock(Hook):
    """Wall and CPU seconds from an epoch's start to its last optimizer step (its validation left out)."""

    def __init__(self) -> None:
        self.epochs: list[dict] = []

    def before_epoch(self, state: TrainState) -> None:
        self.start = self.last = (time.perf_counter(), time.process_time())

    def after_step(self, state: TrainState) -> None:
        self.last = (time.perf_counter(), time.process_time())

    def after_epoch(self, state: TrainState, end: EpochEnd) -> None:
        (wall0, cpu0), (wall1, cpu1) = self.start, self.last
        self.epochs.append({**end.row, "wall_s": wall1 - wall0, "cpu_s": cpu1 - cpu0})


def main(argv: list[str]) -> int:
    args, clock = train.parse_args(argv), EpochClock()
    code = launch.train(args.config, args.overrides, args.print_config, args.dry_run, args.find_lr, hooks=[clock])
    if code == 0 and os.environ.get("RANK", "0") == "0":
        last = clock.epochs[-1]
        world = int(os.environ.get("WORLD_SIZE", 1))
        images = last["train_img_per_s"] * last["epoch_time_s"]  # over all ranks
        print(json.dumps({"img_per_s": last["train_img_per_s"], "img_per_cpu_s": images / world / last["cpu_s"],
                          "epochs": len(clock.epochs)}))
    return code


if __name__ == "__main__":
    sys.exit(report_errors(main))
