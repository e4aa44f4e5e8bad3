"""Run train.py exactly as `python train.py ARGS` does, and report its last epoch in wall and CPU time.

train.py's metrics.jsonl gives each epoch's wall-clock img/s. On a machine shared with other jobs the
CPU time the training process spent on that epoch is a steadier measure of its cost, so this wrapper
times each call of train.py's `train_one_epoch` with both clocks (around the call: nothing is added to
the loop) and, on rank 0, prints the last epoch as a JSON line. Used by loop_overhead.py and ddp_scaling.py.

    taskset -c 0 python benchmarks/train_py_epoch.py --config configs/dummy.yaml amp=bf16 train.epochs=2
"""

from __future__ import annotations

import json
import os
import sys
import time

import harness  # noqa: F401  (puts the repo on sys.path)
import train
from core.cli import report_errors

EPOCHS: list[dict] = []


def timed_train_one_epoch(*args, **kwargs) -> dict:
    start, cpu_start = time.perf_counter(), time.process_time()
    stats = REAL_TRAIN_ONE_EPOCH(*args, **kwargs)
    EPOCHS.append({**stats, "wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu_start})
    return stats


REAL_TRAIN_ONE_EPOCH = train.train_one_epoch
train.train_one_epoch = timed_train_one_epoch

if __name__ == "__main__":
    code = report_errors(train.main)
    if code == 0 and not EPOCHS:
        raise SystemExit("train.py no longer calls train.train_one_epoch; update benchmarks/train_py_epoch.py")
    if code == 0 and os.environ.get("RANK", "0") == "0":
        last = EPOCHS[-1]
        world = int(os.environ.get("WORLD_SIZE", 1))
        images = last["train_img_per_s"] * last["epoch_time_s"]  # over all ranks
        print(json.dumps({"img_per_s": last["train_img_per_s"], "img_per_cpu_s": images / world / last["cpu_s"],
                          "epochs": len(EPOCHS)}))
    sys.exit(code)
