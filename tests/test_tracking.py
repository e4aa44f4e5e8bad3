"""W&B tracking with the real wandb package, offline: one run per job, the logged values equal
metrics.jsonl, the run id survives in checkpoints, and no wandb failure can stop a training.

Runs are read back from their run-<id>.wandb files with tests/wandb_reader.py.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from engine.config import load_config
from engine.errors import UserError
from tests.helpers import REPO, read_jsonl, run_script, script_env
from tests.wandb_reader import find_runs, read_run

pytestmark = pytest.mark.slow  # real train.py runs with an offline W&B run each

# 128 train images, batch 16 per rank: 8 steps per epoch on 1 rank, 4 on 2 ranks; 37 val images.
# 32 px, not 16: at 16 px layer4's stride-2 conv sees a 1x1 input, whose bf16 weight gradient on CPU
# is NaN in about half of the steps (torch 2.14.1; docs/reliability.md, known upstream issues).
TINY = ["--config", "configs/dummy.yaml", "model.name=resnet10t", "data.img_size=32", "data.dummy_image_size=32",
        "data.dummy_train_size=128", "data.dummy_val_size=37", "train.batch_size=16", "logging.interval=2",
        "logging.progress=false"]


def checkpoint(path: Path) -> dict:
    return torch.load(path, weights_only=True, map_location="cpu")


def run_python(code: str, *args: str, env: dict) -> subprocess.CompletedProcess:
    """`python -c code args` from the repo root; fails the test with its output if it exits non-zero."""
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    return proc


def tracker_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "WARNING W&B" in line]


def test_two_rank_job_makes_one_run_whose_values_equal_metrics_jsonl(tmp_path):
    wandb_dir, out = tmp_path / "wandb", tmp_path / "run"
    wandb_dir.mkdir()
    proc = run_script("train.py", *TINY, f"output_dir={out}", "train.epochs=2", "logging.wandb=true",
                      "logging.wandb_log_checkpoints=true", "logging.wandb_project=tests",
                      "logging.wandb_group=g1", "logging.wandb_tags=[tiny,ddp]", "logging.wandb_notes=two ranks",
                      nproc=2, env=script_env(WANDB_DIR=str(wandb_dir)))
    assert proc.stderr.count("Tracking run with wandb") == 1  # only rank 0 called wandb.init
    [path] = find_runs(tmp_path)
    run = read_run(path)
    rows = read_jsonl(out / "metrics.jsonl")

    assert run.exit_code == 0
    assert [v for _, v in run.values("val_top1")] == [r["val_top1"] for r in rows]
    # each epoch's row is logged whole, at the global step that ends the epoch (4 steps per epoch)
    epoch_rows = [h for h in run.history if "val_top1" in h]
    assert [h["_step"] for h in epoch_rows] == [4, 8]
    for row, logged in zip(rows, epoch_rows):
        assert {k: logged[k] for k in row} == row
    # every logging.interval=2 steps: loss, lr and img/s over the last 2 steps; 2 windows of 32 images
    # per epoch, so their mean is the epoch's all-reduced train_loss
    losses = run.values("interval/train_loss")
    assert [s for s, _ in losses] == [2, 4, 6, 8]
    for epoch, row in enumerate(rows):
        window_mean = (losses[2 * epoch][1] + losses[2 * epoch + 1][1]) / 2
        assert window_mean == pytest.approx(row["train_loss"], rel=1e-12)
    assert [v for s, v in run.values("interval/lr") if s in (4, 8)] == [r["lr"] for r in rows]
    assert all(v > 0 for _, v in run.values("interval/img_per_s"))

    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert {k: v for k, v in run.config.items() if k != "_wandb"} == {**resolved, "world_size": 2}
    assert run.summary["best_val_top1"] == max(r["val_top1"] for r in rows)
    assert (run.run.project, run.run.run_group, list(run.run.tags), run.run.notes, run.run.job_type,
            run.run.display_name) == ("tests", "g1", ["tiny", "ddp"], "two ranks", "train", "run")
    assert checkpoint(out / "last.pth")["wandb_id"] == checkpoint(out / "best.pth")["wandb_id"] == run.run_id

    [artifact] = run.artifacts
    [entry] = artifact.manifest.contents
    md5 = base64.b64encode(hashlib.md5((out / "best.pth").read_bytes()).digest()).decode()
    assert (artifact.type, artifact.name, entry.path, entry.digest) == ("model", f"model-{run.run_id}", "best.pth", md5)
    assert json.loads(artifact.metadata)["val_top1"] == max(r["val_top1"] for r in rows)


def test_no_api_key_and_no_mode_runs_offline_and_says_so_once(tmp_path):
    home, out = tmp_path / "home", tmp_path / "run"
    env = {k: v for k, v in script_env().items() if not k.startswith("WANDB_")}
    # a fresh user: no key in the environment, no ~/.netrc, no wandb settings; a bounded init if we got it wrong
    env.update(HOME=str(home), NETRC=str(home / ".netrc"), WANDB_CONFIG_DIR=str(home / "wandb-config"),
               WANDB_INIT_TIMEOUT="30")
    proc = run_script("train.py", *TINY, f"output_dir={out}", "train.epochs=1", "logging.wandb=true", env=env)
    notes = tracker_warnings(proc.stderr)
    assert len(notes) == 1 and "no API key and no WANDB_MODE, so the run is offline" in notes[0], proc.stderr
    [path] = find_runs(out / "wandb")  # without WANDB_DIR the run lives beside the checkpoints
    assert path.parent.name.startswith("offline-run-")
    run = read_run(path)
    assert [v for _, v in run.values("val_top1")] == [r["val_top1"] for r in read_jsonl(out / "metrics.jsonl")]


def test_failing_wandb_init_leaves_training_running_with_one_warning(tmp_path):
    out = tmp_path / "run"
    # an invalid WANDB_MODE makes the real wandb.init raise (pydantic ValidationError)
    proc = run_script("train.py", *TINY, f"output_dir={out}", "train.epochs=1", "logging.wandb=true",
                      env={**script_env(WANDB_DIR=str(tmp_path)), "WANDB_MODE": "not-a-mode"})
    warnings = tracker_warnings(proc.stderr)
    assert len(warnings) == 1 and "W&B wandb.init failed" in warnings[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert [r["epoch"] for r in read_jsonl(out / "metrics.jsonl")] == [0]
    assert checkpoint(out / "last.pth")["wandb_id"] is None
    assert find_runs(tmp_path) == []


def test_wandb_is_not_imported_when_tracking_is_off(tmp_path):
    code = ("import sys, train; train.main(sys.argv[1:]); "
            "assert 'wandb' not in sys.modules, [m for m in sys.modules if m.startswith('wandb')]")
    run_python(code, *TINY, f"output_dir={tmp_path}", "train.epochs=1", "train.max_steps=2",
               env=script_env())
    assert checkpoint(tmp_path / "last.pth")["wandb_id"] is None


def test_resumed_training_continues_the_run_id_stored_in_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    env = script_env(WANDB_DIR=str(tmp_path))
    run_script("train.py", *TINY, f"output_dir={out}", "train.epochs=1", "logging.wandb=true", env=env)
    stored = checkpoint(out / "last.pth")["wandb_id"]
    run_script("train.py", *TINY, f"output_dir={out}", "train.epochs=2", "logging.wandb=true", env=env)  # resumes
    assert checkpoint(out / "last.pth")["wandb_id"] == stored
    first, second = (read_run(p) for p in find_runs(tmp_path))
    assert first.run_id == second.run_id == stored
    assert (first.run.resume, second.run.resume) == (False, True)
    last_step_of_first = max(s for s, _ in first.values("val_top1"))
    assert last_step_of_first < second.values("val_top1")[0][0]  # the curve continues where it stopped


EVALUATE = """
import sys
from pathlib import Path
import logging
import cv2, numpy as np
from engine.config import LoggingConfig
from engine.tracking import WandbTracker

logging.basicConfig(format="%(levelname)s %(message)s")
out = Path(sys.argv[1])
png = out / "confusion_matrix.png"
cv2.imwrite(str(png), np.arange(12 * 16 * 3, dtype=np.uint8).reshape(12, 16, 3))
rows = [{"index": i, "path": f"val/{i}.png", "label": "ab"[i % 2], "pred": "a", "confidence": 0.5 + i / 10,
         "top5": ["a", "b"]} for i in range(3)]
tracker = WandbTracker(LoggingConfig(wandb=True), is_main=True)
tracker.start({"checkpoint": "best.pth"}, out, job_type="eval")
tracker.log_evaluation({"top1": 66.5, "loss": 0.25, "n": 3, "per_class": {"a": 100.0, "b": 0.0}}, png, rows)
tracker.log(1, {"not_json": object()})  # wandb raises TypeError: one warning, then tracking is off
tracker.log(2, {"after_failure": 1.0})
tracker.finish()
print(f"active={tracker.active}")  # wandb's own exit hook closes the run after this
"""


def test_evaluation_logs_metrics_confusion_matrix_and_predictions_table(tmp_path):
    proc = run_python(EVALUATE, str(tmp_path), env=script_env(WANDB_DIR=str(tmp_path)))
    warnings = tracker_warnings(proc.stderr)
    assert len(warnings) == 1 and "W&B logging failed (TypeError" in warnings[0], proc.stderr
    assert "active=False" in proc.stdout.splitlines()
    [path] = find_runs(tmp_path)
    run = read_run(path)
    assert run.run.job_type == "eval"
    assert {k: run.summary[f"eval/{k}"] for k in ("top1", "loss", "n", "per_class")} == {
        "top1": 66.5, "loss": 0.25, "n": 3, "per_class": {"a": 100.0, "b": 0.0}}
    [row] = [h for h in run.history if "eval/predictions" in h]
    table = json.loads((path.parent / "files" / row["eval/predictions"]["path"]).read_text())
    assert table["columns"] == ["index", "path", "label", "pred", "confidence", "top5"]
    assert table["data"] == [[i, f"val/{i}.png", "ab"[i % 2], "a", 0.5 + i / 10, "['a', 'b']"] for i in range(3)]
    image = path.parent / "files" / row["eval/confusion_matrix"]["path"]
    assert image.read_bytes() == (tmp_path / "confusion_matrix.png").read_bytes()
    assert not any("after_failure" in h for h in run.history)


@pytest.mark.parametrize("override, message", [
    ("logging.wandb_project=team/proj", "'logging.wandb_project' is 'team/proj'"),
    ("logging.wandb_tags=[" + "x" * 65 + "]", "'logging.wandb_tags' has"),
    ("logging.wandb_tags=baseline", "'logging.wandb_tags' must be a list of str"),
])
def test_names_wandb_would_refuse_are_config_errors(override, message):
    with pytest.raises(UserError, match=message):
        load_config("configs/dummy.yaml", ["logging.wandb=true", override])
