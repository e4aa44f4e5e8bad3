"""Faults during training, for real: a worker killed under torchrun, a rank that fails, a loss that blows up.

Every test launches real `train.py` processes (torchrun for 2 ranks) on dummy data with a tiny model.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import torch

from data.loader import EpochSampler
from engine.checkpoint import load_checkpoint
from tests.helpers import REPO, make_image_folder, read_jsonl, run_script, script_env

TINY = ["--config", "configs/dummy.yaml", "model.name=test_resnet", "model.channels_last=false", "amp='off'",
        "data.img_size=16", "data.dummy_image_size=20", "data.dummy_val_size=20", "data.num_workers=0",
        "train.batch_size=8", "logging.progress=false", "logging.interval=100"]


def children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux /proc; no psutil needed)."""
    pids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def test_worker_killed_under_torchrun_resumes_and_finishes_every_epoch_once(tmp_path):
    out = tmp_path / "run"
    every = 4
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           str(REPO / "train.py"), *TINY, "data.dummy_train_size=256", "train.epochs=3",  # 16 steps/epoch
           f"train.ckpt_every_steps={every}", "resume=auto", f"output_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "last.pth").exists():  # the first step checkpoint: training is under way
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.01)
        workers = children(proc.pid)
        assert len(workers) == 2
        os.kill(workers[-1], signal.SIGKILL)
        log, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    (tmp_path / "torchrun.log").write_text(log)
    assert proc.returncode == 0, log[-4000:]
    assert re.search(r"failed \(exitcode: -9\)", log)  # torchrun saw the killed worker and restarted the group
    resumed = re.findall(r"resuming from \S+last.pth \((.*?), global step (\d+)\)", log)
    assert len(resumed) == 1, log[-4000:]
    step = int(resumed[0][1])
    assert 0 < step < 48 and step % every == 0  # from a step checkpoint, mid-run: < `every` steps redone
    assert [row["epoch"] for row in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2]
    final = load_checkpoint(out / "last.pth")
    assert (final["epoch"], final["global_step"]) == (3, 48)
