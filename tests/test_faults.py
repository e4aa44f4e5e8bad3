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

import pytest
import torch

from core.dist import DistInfo
from core.errors import UserError
from engine.checkpoint.formats import load_checkpoint
from engine.checkpoint.saver import Checkpointer
from engine.state import TrainState
from tests.helpers import (REPO, TINY as BASE, children, corrupt_in_batch, make_image_folder, read_jsonl, run_script,
                           script_env, wait_for_file)

TINY = [*BASE, "data.dummy_val_size=20", "logging.interval=100"]  # 2 validation batches per rank


@pytest.mark.slow
def test_worker_killed_under_torchrun_resumes_and_finishes_every_epoch_once(tmp_path):
    out = tmp_path / "run"
    every = 4
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           str(REPO / "train.py"), *TINY, "data.dummy_train_size=256", "train.epochs=3",  # 16 steps/epoch
           f"train.ckpt_every_steps={every}", "resume=auto", f"output_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    straight = tmp_path / "straight"  # the same run, uninterrupted, alongside
    uninterrupted = subprocess.Popen([*cmd[:-1], f"output_dir={straight}"], cwd=REPO, env=script_env(),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_file(out / "last.pth", proc)  # the first step checkpoint: training is under way
        workers = children(proc.pid)
        assert len(workers) == 2
        os.kill(workers[-1], signal.SIGKILL)
        log, _ = proc.communicate(timeout=240)
        assert uninterrupted.wait(timeout=240) == 0
    finally:
        proc.kill()
        uninterrupted.kill()
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
    expected = load_checkpoint(straight / "last.pth")["model"]  # fp32: the restart changed nothing, bit for bit
    assert [k for k, v in expected.items() if not torch.equal(v, final["model"][k])] == []


@pytest.mark.slow
def test_rank_that_fails_at_step_3_stops_the_job_with_its_own_error(tmp_path):
    root = make_image_folder(tmp_path / "data", {"train": {"a": 16, "b": 16}, "val": {"a": 4, "b": 4}}, size=20)
    bad = corrupt_in_batch(root, rank=1, batch=2, batch_size=4)
    start = time.monotonic()
    proc = run_script("train.py", *TINY, "data.name=imagefolder", f"data.root={root}", "train.batch_size=4",
                      "train.epochs=1", f"output_dir={tmp_path / 'run'}", nproc=2, check=False, timeout=120)
    seconds = time.monotonic() - start
    (tmp_path / "torchrun.log").write_text(f"{seconds:.1f} s\n{proc.stderr}")
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if "error:" in line and "Traceback" not in line]
    assert ours[0] == f"[rank 1] error: cannot read image {bad} (corrupt, truncated or not an image); " \
                      "remove or replace it; or set data.skip_corrupt=true to drop unreadable training images " \
                      "(counted each epoch)", proc.stderr[-3000:]
    assert "[rank0]: Traceback" not in proc.stderr  # rank 0, cut off by the dead peer, says so in one line


@pytest.mark.slow
def test_nonfinite_gradients_stop_every_rank_and_keep_the_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    small = [*TINY, "data.dummy_train_size=64", f"output_dir={out}"]
    run_script("train.py", *small, "train.epochs=1")  # one good epoch: last.pth at global step 8
    good = hashlib.sha256((out / "last.pth").read_bytes()).hexdigest()
    # lr 1e30 (epochs=3 keeps the cosine schedule far from 0 at 4 steps/epoch on 2 ranks): the first step
    # blows the weights up, the next forward passes are inf/NaN.
    proc = run_script("train.py", *small, "train.epochs=3", "optim.lr=1e30", "train.max_nonfinite=2",
                      f"resume={out / 'last.pth'}", nproc=2, check=False)  # another lr: continued on purpose
    assert proc.returncode != 0
    stops = re.findall(r"^\[rank (\d)\] error: the gradients were inf or NaN for 2 optimizer steps in a row "
                       r"\(up to global step (\d+)", proc.stderr, re.M)  # not torchrun's summary, which repeats them
    assert stops == [("0", "11")], proc.stderr[-3000:]  # said once: every rank stops at the same step, rank 0 speaks
    assert "stopped: a collective failed" not in proc.stderr  # no rank was left waiting for another
    assert "step 10: inf or NaN gradients, optimizer step skipped (1 in a row)" in proc.stderr
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr
    assert hashlib.sha256((out / "last.pth").read_bytes()).hexdigest() == good
    assert [row["epoch"] for row in read_jsonl(out / "metrics.jsonl")] == [0]


def test_checkpoint_with_nan_weights_is_not_written(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    info = DistInfo(0, 1, 0, 1, torch.device("cpu"))
    checkpointer = Checkpointer(tmp_path, info, 0, model=model, optimizer=optimizer, scheduler=scheduler,
                                scaler=None, config={}, class_names=["a", "b"])
    checkpointer.save(TrainState(global_step=1))
    good = (tmp_path / "last.pth").read_bytes()
    model[1].running_mean.fill_(float("nan"))  # what one NaN forward pass in train mode does
    with pytest.raises(UserError, match=r"inf/NaN values \(1.running_mean\) at global step 2"):
        checkpointer.save(TrainState(global_step=2))
    assert (tmp_path / "last.pth").read_bytes() == good


@pytest.mark.slow
def test_unwritable_output_dir_stops_every_rank_before_training(tmp_path):
    (tmp_path / "file").write_text("a regular file, so nothing can be created under it (even as root)")
    out = tmp_path / "file" / "run"
    proc = run_script("train.py", *TINY, "data.dummy_train_size=64", f"output_dir={out}", nproc=2, check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error:" in line and "traceback :" not in line]
    assert errors == [f"[rank 0] error: output_dir {out} is not writable (Not a directory); choose another "
                      "output_dir"], proc.stderr[-3000:]
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr
    assert "epoch 0" not in proc.stderr
