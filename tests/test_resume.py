"""Resume reproduces an uninterrupted run bit for bit: real train.py processes, real checkpoints.

Every run trains with augmentation (seeded per sample), dropout and drop-path (torch's per-rank RNG)
and an EMA of the weights on CPU in fp32, so any state the checkpoint forgot would show up as a
different weight.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import evaluate
import train
from core.cli import report_errors
from core.config_load import load_config
from core.errors import UserError
from engine.checkpoint.formats import load_checkpoint, read_checkpoint
from engine.checkpoint.resume import check_resumable
from tests.compare import allow_best_of_the_stop, as_file_checkpoint, assert_same, rows_without_timing
from tests.helpers import (REPO, RUN, as_written_before_the_rename, read_jsonl, run_on_ranks, run_script, script_env,
                           wait_for_file)

@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted reference: 2 epochs of 8 steps in one process with a loader worker, as the resumed runs (the
    worker count sets the compute threads, core/startup.compute_threads, and fp32 results follow the threads)."""
    out = tmp_path_factory.mktemp("straight") / "run"
    run_script("train.py", *RUN, f"output_dir={out}", "data.num_workers=1")
    return out


@pytest.mark.slow
def test_resume_at_epoch_boundary_is_bitwise_identical(straight, tmp_path):
    """Also from a checkpoint laid out as before issue 46 (best_top1, val_top1, no best_epoch)."""
    out = tmp_path / "run"
    run_script("train.py", *RUN, f"output_dir={out}", "data.num_workers=1", "train.max_steps=8")  # epoch 0, then stop
    first = load_checkpoint(out / "last.pth")
    assert (first["epoch"], first["epoch_step"], first["global_step"]) == (1, 0, 8)
    torch.save(as_written_before_the_rename(first), out / "last.pth")
    run_script("train.py", *RUN, f"output_dir={out}", "data.num_workers=1")  # resume=auto picks up last.pth
    expected, resumed = load_checkpoint(straight / "last.pth"), load_checkpoint(out / "last.pth")
    # The old layout has no best_epoch: known again only if epoch 1 is a new best.
    assert resumed["best_epoch"] == (1 if expected["best_epoch"] == 1 else None)
    resumed["best_epoch"] = expected["best_epoch"]
    assert_same(expected, resumed)
    assert_same(load_checkpoint(straight / "best.pth"), load_checkpoint(out / "best.pth"))
    assert rows_without_timing(out) == rows_without_timing(straight)


def kill_once_written(args: list[str], checkpoint: Path) -> None:
    """Start train.py with `args` and SIGKILL it as soon as its first step checkpoint exists."""
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=REPO, env=script_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_file(checkpoint, proc)
        proc.send_signal(signal.SIGKILL)  # possibly in the middle of writing the next one
        proc.wait(timeout=30)
    finally:
        proc.kill()


@pytest.mark.slow
def test_resume_after_a_kill_mid_epoch_is_bitwise_identical(straight, tmp_path):
    """Step checkpoints every step, a worker process, SIGKILL at a mid-epoch checkpoint, then resume."""
    out = tmp_path / "run"
    args = [*RUN, f"output_dir={out}", "train.ckpt_every_steps=1", "data.num_workers=1", "train.keep_last_k=1"]
    kill_once_written(args, out / "last.pth")
    interrupted = load_checkpoint(out / "last.pth")
    assert 0 < interrupted["epoch_step"] < 8 and interrupted["epoch"] == 0, "the kill should land mid-epoch 0"
    run_script("train.py", *args)
    assert_same(load_checkpoint(straight / "last.pth"), load_checkpoint(out / "last.pth"))
    assert rows_without_timing(out) == rows_without_timing(straight)
    assert sorted(p.name for p in out.glob("epoch_*.pth")) == ["epoch_0001.pth"]  # keep_last_k=1


@pytest.mark.slow
def test_sharded_checkpoint_killed_mid_epoch_resumes_bitwise_identical(straight, tmp_path):
    """train.ckpt_format=sharded: last.dcp/ every step, SIGKILL mid-epoch (maybe mid-save), resume=auto; the same
    weights, EMA, optimizer state, RNG and metrics as the uninterrupted file-format run."""
    out = tmp_path / "run"
    args = [*RUN, f"output_dir={out}", "train.ckpt_every_steps=1", "data.num_workers=1", "train.ckpt_format=sharded"]
    kill_once_written(args, out / "last.dcp")
    interrupted = read_checkpoint(out / "last.dcp")
    assert 0 < interrupted["epoch_step"] < 8 and interrupted["epoch"] == 0, "the kill should land mid-epoch 0"
    run_script("train.py", *args)
    assert not (out / "last.pth").exists() and not list(out.glob(".last.dcp.*"))
    assert_same(load_checkpoint(straight / "last.pth"), as_file_checkpoint(out / "last.dcp"))
    assert rows_without_timing(out) == rows_without_timing(straight)


@pytest.mark.slow
def test_two_ranks_resume_mid_epoch_after_max_steps(tmp_path):
    """2 processes x 4 steps per epoch; stop at step 3 (mid-epoch), resume; per-rank RNG states continue."""
    straight, out = tmp_path / "straight", tmp_path / "run"
    one_epoch = [*RUN, "train.epochs=1"]
    run_on_ranks("train.py", *one_epoch, f"output_dir={straight}", nproc=2)
    run_on_ranks("train.py", *one_epoch, f"output_dir={out}", "train.max_steps=3", nproc=2)
    partial = load_checkpoint(out / "last.pth")
    assert (partial["epoch"], partial["epoch_step"], len(partial["rng"])) == (0, 3, 2)
    assert not torch.equal(partial["rng"][0]["torch"], partial["rng"][1]["torch"])  # dropout differs per rank
    partial_top1 = read_jsonl(out / "metrics.jsonl")[0][partial["best_metric"]]  # the evaluation at the stop
    run_on_ranks("train.py", *one_epoch, f"output_dir={out}", nproc=2)
    expected, resumed = load_checkpoint(straight / "last.pth"), load_checkpoint(out / "last.pth")
    allow_best_of_the_stop(expected, resumed, partial_top1, partial["epoch"])
    assert_same(expected, resumed)
    assert rows_without_timing(out) == rows_without_timing(straight)


@pytest.mark.slow
def test_checkpoint_of_another_model_is_refused_without_touching_it(straight, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    # resume=<path>: a continuation on purpose (resume=auto refuses any other model.name before reading the data)
    assert report_errors(train.main, [*RUN, f"output_dir={out}", "model.name=resnet18", f"resume={out}/last.pth"]) == 2
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr
    error = stderr.strip().splitlines()[-1]
    assert error.startswith("error: checkpoint ") and "is a test_resnet but model.name is resnet18" in error
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # nothing overwritten


@pytest.mark.slow
def test_resume_none_refuses_an_output_dir_with_a_checkpoint(straight, capsys):
    before = (straight / "last.pth").read_bytes()
    assert report_errors(train.main, [*RUN, f"output_dir={straight}", "resume=none"]) == 2
    *logged, error = capsys.readouterr().err.strip().splitlines()
    assert all(" INFO " in line for line in logged), logged  # the run's first line, once torch loaded; no traceback
    assert error.startswith("error: ")
    assert "already holds a run (best.pth, config.yaml, last.pth, metrics.jsonl) and resume=none; use resume=auto" \
        in error
    assert (straight / "last.pth").read_bytes() == before


@pytest.mark.slow
def test_class_count_mismatch_on_a_real_checkpoint(straight):
    cfg = load_config(str(REPO / RUN[1]), RUN[2:])
    ckpt = load_checkpoint(straight / "last.pth")
    with pytest.raises(UserError, match="has 10 classes but the data has 5"):
        check_resumable(ckpt, straight / "last.pth", cfg, [f"class_{i}" for i in range(5)], 1)


@pytest.mark.slow
def test_evaluate_ema_weights_of_a_resumable_checkpoint(straight, tmp_path, capsys):
    """evaluate.py --ema on the EMA the run kept: the same top-1 as the run's own EMA evaluation."""
    out = tmp_path / "eval"
    assert report_errors(evaluate.main, [str(straight / "last.pth"), "--ema", "--output-dir", str(out)]) == 0
    result = json.loads((out / "eval.json").read_text())
    last_row = read_jsonl(straight / "metrics.jsonl")[-1]
    assert result["ema"] is True and result["n"] == 37
    assert result["top1"] == last_row["ema_val_top1"] and result["top5"] == last_row["ema_val_top5"]
    assert f"top1 {result['top1']:.2f}%" in capsys.readouterr().out
