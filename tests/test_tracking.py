"""Tracking with the real wandb and tensorboard packages, offline: one run per job, the logged values equal
metrics.jsonl, the run id survives in checkpoints, and no tracker failure can stop a training.

W&B runs are read back from their run-<id>.wandb files with tests/wandb_reader.py, TensorBoard event files
with tensorboard's own readers.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from core.config_load import load_config
from core.errors import UserError
from tests.helpers import REPO, read_jsonl, run_on_ranks, run_script, script_env
from tests.wandb_reader import find_runs, read_run

pytestmark = pytest.mark.slow  # real train.py runs with an offline W&B run each

# 128 train images, batch 16 per rank: 8 steps per epoch on 1 rank, 4 on 2 ranks; 37 val images.
# 32 px, not 16: at 16 px layer4's stride-2 conv sees a 1x1 input, whose bf16 weight gradient on CPU
# is NaN in about half of the steps (torch 2.14.1; docs/reliability.md, known upstream issues).
TINY = ["--config", "configs/dummy.yaml", "model.name=resnet10t", "data.img_size=32", "data.dummy_image_size=32",
        "data.dummy_train_size=128", "data.dummy_val_size=37", "train.batch_size=16", "logging.interval=2",
        "logging.progress=false"]


# test_resnet at 32 px, 3 epochs of 8 steps: val_top1 improves in epochs 0 and 1, then ties (seed 0)
SMALL = ["--config", "configs/dummy.yaml", "model.name=test_resnet", "data.img_size=32", "data.dummy_image_size=32",
         "data.dummy_train_size=128", "data.dummy_val_size=37", "train.batch_size=16", "logging.interval=2",
         "logging.progress=false", "logging.curves=false"]


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


def md5_b64(path: Path) -> str:
    """A file's MD5 as W&B's artifact manifests write it."""
    return base64.b64encode(hashlib.md5(path.read_bytes()).digest()).decode()


def model_versions(run) -> list:
    """The run's `model` artifact records (W&B tables travel as `run_table` artifacts too)."""
    return [artifact for artifact in run.artifacts if artifact.type == "model"]


def staged_files(artifact) -> dict[str, Path]:
    """An artifact's files by their name in it: offline, W&B keeps them in WANDB_DATA_DIR's staging folder."""
    return {entry.path: Path(entry.local_path) for entry in artifact.manifest.contents}


def improvements(rows: list[dict], key: str = "val_top1", sign: int = 1) -> list[int]:
    """The epochs whose `key` beat every earlier one (sign -1: lower is better): those wrote best.pth."""
    best, epochs = -math.inf, []
    for row in rows:
        if sign * row[key] > best:
            best = sign * row[key]
            epochs.append(row["epoch"])
    return epochs


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a TensorBoard log folder, as (step, value), read the way TensorBoard's scalar
    dashboard reads them (its data provider over an event multiplexer)."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer

    multiplexer = plugin_event_multiplexer.EventMultiplexer(tensor_size_guidance={"scalars": 0})
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, str(logdir))
    found = provider.read_scalars(context.RequestContext(), experiment_id="", plugin_name="scalars",
                                  downsample=10 ** 6)
    assert list(found) == ["."], found.keys()  # one run: the event files of the tensorboard folder itself
    return {tag: [(point.step, point.value) for point in points] for tag, points in found["."].items()}


@pytest.mark.slow
def test_two_rank_job_makes_one_run_whose_values_equal_metrics_jsonl(tmp_path):
    wandb_dir, out = tmp_path / "wandb", tmp_path / "run"
    wandb_dir.mkdir()
    proc = run_on_ranks("train.py", *TINY, f"output_dir={out}", "train.epochs=2", "train.best_metric=val_loss",
                        "logging.wandb=true",
                        "logging.wandb_log_checkpoints=true", "logging.wandb_project=tests",
                        "logging.wandb_group=g1", "logging.wandb_tags=[tiny,ddp]", "logging.wandb_notes=two ranks",
                        "logging.tensorboard=true",
                        nproc=2, env={"WANDB_DIR": str(wandb_dir), "WANDB_DATA_DIR": str(tmp_path / "data")})
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
    steps, waits = run.values("interval/step_s"), run.values("interval/input_wait")  # engine/speed.py
    assert len(steps) == len(waits) == 4 and all(v > 0 for _, v in steps) and all(0 <= v <= 1 for _, v in waits)

    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert {k: v for k, v in run.config.items() if k != "_wandb"} == {**resolved, "world_size": 2}
    # the best of train.best_metric, named for it
    assert run.summary["best_val_loss"] == min(r["val_loss"] for r in rows) and "best_val_top1" not in run.summary
    assert (run.run.project, run.run.run_group, list(run.run.tags), run.run.notes, run.run.job_type,
            run.run.display_name) == ("tests", "g1", ["tiny", "ddp"], "two ranks", "train", "run")
    assert checkpoint(out / "last.pth")["wandb_id"] == checkpoint(out / "best.pth")["wandb_id"] == run.run_id
    # TensorBoard: one event file, from rank 0, with the same scalars
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert tensorboard_scalars(out / "tensorboard")["val_top1"] == run.values("val_top1")

    # rank 0 alone logs a model version each time best.pth is written; the last holds the final best.pth
    assert len(model_versions(run)) == len(improvements(rows, "val_loss", -1))
    artifact = model_versions(run)[-1]
    [entry] = artifact.manifest.contents
    assert (artifact.type, artifact.name, entry.path, entry.digest) == (
        "model", f"model-{run.run_id}", "best.pth", md5_b64(out / "best.pth"))
    metadata = json.loads(artifact.metadata)
    assert (metadata["best_metric"], metadata["val_loss"]) == ("val_loss", min(r["val_loss"] for r in rows))
    assert "val_top1" not in metadata


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


def test_wandb_and_tensorboard_are_not_imported_when_tracking_is_off(tmp_path):
    code = ("import sys, train; train.main(sys.argv[1:]); "
            "assert not [m for m in sys.modules if m.startswith('wandb') or 'tensorboard' in m], "
            "[m for m in sys.modules if m.startswith('wandb') or 'tensorboard' in m]")
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


def agent_command(sweep_file: Path, params: dict[str, float]) -> list[str]:
    """The command `wandb agent` starts for a trial of the sweep file with these parameter values, built by wandb's
    own functions (wandb_agent.Agent._run_job's substitution): `--key=value` arguments."""
    from wandb.sdk.launch.sweeps import utils as sweep_utils

    sweep = yaml.safe_load(sweep_file.read_text())
    variables = sweep_utils.create_sweep_command_args({"args": {k: {"value": v} for k, v in params.items()}})
    variables["program"] = [sweep["program"]]
    command = []
    for part in sweep_utils.create_sweep_command(sweep["command"]):
        command += variables.get(part[2:-1], []) if part.startswith("${") and part.endswith("}") else [part]
    return command


def test_sweep_agent_trials_under_torchrun_are_the_agents_runs_each_in_its_own_folder(tmp_path):
    """configs/sweep_digits.yaml's command as `wandb agent` starts it (its environment: WANDB_SWEEP_ID, WANDB_RUN_ID,
    WANDB_SWEEP_PARAM_PATH; its argv: --optim.lr=...) on 2 gloo ranks, cut to a tiny run into one output_dir: each
    trial is the agent's W&B run, in its own folder with the trial's config; a trial that resumes another trial's
    checkpoint is still the agent's run, a branch in its own folder (issue 38 item 3)."""
    from tests.helpers import TINY as SMALLEST

    wandb_dir, sweep = tmp_path / "wandb", tmp_path / "sweep"
    trials = {"trial1": {"optim.lr": 0.05, "train.epochs": 1}, "trial2": {"optim.lr": 0.2, "train.epochs": 1},
              "trial3": {"optim.lr": 0.1, "train.epochs": 2, "resume": f"{sweep}/trial1/last.pth"}}
    for run_id, params in trials.items():
        command = agent_command(REPO / "configs" / "sweep_digits.yaml", params)
        assert command[:4] == ["torchrun", "--standalone", "--nproc_per_node=2", "train.py"]
        assert f"--optim.lr={params['optim.lr']}" in command
        param_file = tmp_path / f"config-{run_id}.yaml"  # what the agent writes for wandb.init to read
        param_file.write_text(yaml.safe_dump({k: {"value": v} for k, v in params.items()}))
        env = {"WANDB_SWEEP_ID": "sweep1", "WANDB_RUN_ID": run_id, "WANDB_SWEEP_PARAM_PATH": str(param_file),
               "WANDB_DIR": str(wandb_dir)}
        tiny = [a for a in SMALLEST if not a.startswith("train.epochs=")]  # a sweep parameter here
        own = command[4:]
        del own[own.index("--config"):own.index("--config") + 2]  # SMALLEST's --config dummy in its place: one a run
        run_on_ranks("train.py", *own, *tiny, f"output_dir={sweep}", nproc=2, env=env)
    runs = {run.run_id: run for run in map(read_run, find_runs(wandb_dir))}
    assert sorted(runs) == sorted(trials) and {run.run.sweep_id for run in runs.values()} == {"sweep1"}
    assert sorted(p.name for p in sweep.iterdir()) == sorted(trials)
    for run_id, params in trials.items():
        folder, run = sweep / run_id, runs[run_id]
        resolved = yaml.safe_load((folder / "config.yaml").read_text())
        assert (resolved["output_dir"], resolved["optim"]["lr"]) == (str(folder), params["optim.lr"])
        flat = [key for key in params if "." in key]  # the sweep's own keys, which wandb.init adds to the config
        assert {k: v for k, v in run.config.items() if k not in ("_wandb", *flat)} == {**resolved, "world_size": 2}
        assert checkpoint(folder / "last.pth")["wandb_id"] == run_id and not run.run.resume
    assert [row["epoch"] for row in read_jsonl(sweep / "trial3" / "metrics.jsonl")] == [1]  # after trial 1's epoch 0
    assert [row["epoch"] for row in read_jsonl(sweep / "trial1" / "metrics.jsonl")] == [0]  # trial 1 untouched


EVALUATE = """
import sys
from pathlib import Path
import logging
import cv2, numpy as np
from core.config import LoggingConfig
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
tracker.use_model(png, "abc123")  # logging.wandb_log_checkpoints is off: no model artifact to declare
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
    assert model_versions(run) == []


@pytest.mark.parametrize("override, message", [
    ("logging.wandb_project=team/proj", "'logging.wandb_project' is 'team/proj'"),
    ("logging.wandb_tags=[" + "x" * 65 + "]", "'logging.wandb_tags' has"),
    ("logging.wandb_tags=baseline", "'logging.wandb_tags' must be a list of str"),
])
def test_names_wandb_would_refuse_are_config_errors(override, message):
    with pytest.raises(UserError, match=message):
        load_config("configs/dummy.yaml", ["logging.wandb=true", override])


@pytest.fixture(scope="module")
def tracked(tmp_path_factory) -> tuple[Path, Path]:
    """One small training with every tracking option on: W&B (model versions, sample table) and TensorBoard."""
    root = tmp_path_factory.mktemp("tracked")
    out = root / "run"
    # WANDB_DATA_DIR: W&B stages artifact copies there until they are uploaded (here: never)
    env = script_env(WANDB_DIR=str(root / "wandb"), WANDB_DATA_DIR=str(root / "wandb-data"))
    (root / "wandb").mkdir()
    # seed 3: val_top1 32.4, 29.7, 45.9 (a best, a worse epoch, a best), so both sides of "a new best" are seen
    run_script("train.py", *SMALL, f"output_dir={out}", "train.epochs=3", "seed=3", "logging.wandb=true",
               "logging.wandb_log_checkpoints=true", "logging.wandb_samples=5", "logging.tensorboard=true",
               "logging.wandb_errors=3", env=env)
    return out, root


@pytest.mark.slow
def test_summary_holds_the_best_val_top1_and_val_loss_and_epoch_charts_use_the_epoch_axis(tracked):
    out, root = tracked
    [path] = find_runs(root / "wandb")
    run = read_run(path)
    rows = read_jsonl(out / "metrics.jsonl")
    assert run.summary["val_top1"] == {"max": max(r["val_top1"] for r in rows), "last": rows[-1]["val_top1"]}
    assert run.summary["val_loss"] == {"min": min(r["val_loss"] for r in rows), "last": rows[-1]["val_loss"]}
    assert run.summary["val_top5"]["max"] == max(r["val_top5"] for r in rows)
    assert run.summary["best_val_top1"] == max(r["val_top1"] for r in rows)
    epoch_keys = set(rows[0]) - {"epoch"}
    assert {key for key, m in run.metrics.items() if m.step_metric == "epoch"} == epoch_keys
    assert [v for _, v in run.values("epoch")] == [r["epoch"] for r in rows]  # the axis itself is logged


@pytest.mark.slow
def test_every_new_best_is_a_model_version_with_aliases_best_and_latest(tracked):
    out, root = tracked
    [path] = find_runs(root / "wandb")
    run = read_run(path)
    rows = read_jsonl(out / "metrics.jsonl")
    improved = improvements(rows)
    assert 2 <= len(improved) < len(rows)  # the run improves after its first epoch, and once does not
    versions = model_versions(run)
    assert [json.loads(a.metadata)["epoch"] for a in versions] == improved
    for artifact, epoch in zip(versions, improved):
        [entry] = artifact.manifest.contents
        assert (artifact.name, sorted(artifact.aliases), entry.path) == (
            f"model-{run.run_id}", ["best", "latest"], "best.pth")
        assert json.loads(artifact.metadata)["val_top1"] == rows[epoch]["val_top1"]  # best_metric's name: its value
        # the staged copy is the best.pth of that epoch: a later best.pth did not replace it
        assert md5_b64(staged_files(artifact)["best.pth"]) == entry.digest
        assert checkpoint(staged_files(artifact)["best.pth"])["epoch"] == epoch + 1
    assert versions[-1].manifest.contents[0].digest == md5_b64(out / "best.pth")


@pytest.mark.slow
def test_sample_table_holds_the_augmented_images_the_model_is_fed(tracked):
    import cv2

    from core.config_load import load_config
    from data.loader import build_datasets

    out, root = tracked
    [path] = find_runs(root / "wandb")
    run = read_run(path)
    assert [step for step, _ in run.values("train_samples")] == [0]
    [artifact] = [a for a in run.artifacts if a.name == f"run-{run.run_id}-train_samples"]
    files = staged_files(artifact)
    table = json.loads(files["train_samples.table.json"].read_text())
    assert table["columns"] == ["index", "path", "image", "label", "class"]
    assert len(table["data"]) == 5 and len({row[0] for row in table["data"]}) == 5
    cfg = load_config(str(out / "config.yaml"))
    train_set, _ = build_datasets(cfg.data, seed=cfg.seed)  # the run's own seed
    for index, path, image, label, name in table["data"]:
        assert (type(index), image["_type"], type(label), type(name)) == (int, "image-file", int, str)  # typed cells
        assert path == train_set.path(index)  # where the image comes from, for a person to open
        expected, expected_label = train_set[(0, index)]  # epoch 0's augmentation of sample `index`
        png = cv2.imread(str(files[image["path"]]), cv2.IMREAD_UNCHANGED)
        assert (png[..., ::-1] == expected.permute(1, 2, 0).numpy()).all()  # PNG is lossless; cv2 reads BGR
        assert (label, name) == (expected_label, train_set.classes[expected_label])


@pytest.mark.slow
def test_each_validation_logs_its_worst_images_and_confusion_matrix(tracked):
    """Issue 48: each validation's logging.wandb_errors=3 worst images by loss, read back from the offline run's
    files: typed cells (an image, class names, numbers), at most 3 rows, worst first, the images evaluation's own;
    and W&B's confusion matrix of every validation image."""
    from core.config_load import load_config
    from data.loader import build_datasets

    out, root = tracked
    [path] = find_runs(root / "wandb")
    run = read_run(path)
    rows = read_jsonl(out / "metrics.jsonl")
    assert len(run.values("val/worst")) == len(rows) == len(run.values("val/confusion_table"))  # one per validation
    cfg = load_config(str(out / "config.yaml"))
    _, val_set = build_datasets(cfg.data, seed=cfg.seed)
    import cv2

    for artifact in [a for a in run.artifacts if a.name.startswith(f"run-{run.run_id}-valworst")]:
        files = staged_files(artifact)
        [name] = [n for n in files if n.endswith(".table.json")]
        table = json.loads(files[name].read_text())
        assert table["columns"] == ["index", "path", "image", "true", "predicted", "confidence", "loss"]
        assert 0 < len(table["data"]) <= 3
        losses = [row[6] for row in table["data"]]
        assert losses == sorted(losses, reverse=True)
        for index, path, image, true, predicted, confidence, loss in table["data"]:
            assert path == val_set.path(index)
            assert (type(index), image["_type"], type(true), type(predicted), type(confidence), type(loss)) == \
                (int, "image-file", str, str, float, float)
            expected, label = val_set[index]
            png = cv2.imread(str(files[image["path"]]), cv2.IMREAD_UNCHANGED)
            assert (png[..., ::-1] == expected.permute(1, 2, 0).numpy()).all() and true == val_set.classes[label]
    assert len([a for a in run.artifacts if a.name.startswith(f"run-{run.run_id}-valworst")]) >= 1


@pytest.mark.slow
def test_evaluation_run_declares_the_trained_model_version_as_its_input(tracked, tmp_path):
    out, root = tracked
    [train_path] = find_runs(root / "wandb")
    trained = read_run(train_path)
    env = script_env(WANDB_DIR=str(tmp_path), WANDB_DATA_DIR=str(root / "wandb-data"))
    run_script("evaluate.py", str(out / "best.pth"), "--output-dir", str(tmp_path / "eval"), env=env)
    [path] = find_runs(tmp_path)
    run = read_run(path)
    assert run.run.job_type == "eval"
    [used] = model_versions(run)
    # an input (use_after_commit), not an output of the eval run (user_created: no producing run); W&B
    # resolves it to the training's version with the same digest instead of adding a version
    assert (used.name, used.type, used.use_after_commit, used.user_created) == (
        f"model-{trained.run_id}", "model", True, True)
    assert used.digest == model_versions(trained)[-1].digest
    assert [e.path for e in used.manifest.contents] == ["best.pth"]


@pytest.mark.slow
def test_tensorboard_holds_the_same_scalars_as_wandb_and_metrics_jsonl(tracked):
    out, root = tracked
    scalars = tensorboard_scalars(out / "tensorboard")
    [path] = find_runs(root / "wandb")
    run = read_run(path)
    rows = read_jsonl(out / "metrics.jsonl")
    for key in rows[0]:
        assert scalars[key] == [(8 * (r["epoch"] + 1), r[key]) for r in rows], key  # exact: stored as doubles
    for key in ("interval/train_loss", "interval/lr", "interval/img_per_s", "interval/input_wait", "interval/step_s"):
        assert scalars[key] == run.values(key), key
    assert [s for s, _ in scalars["interval/train_loss"]] == list(range(2, 25, 2))
    tables = ("train_samples", "val/worst", "val/confusion_table")  # W&B tables, not scalars: TensorBoard has none
    wandb_keys = {k for row in run.history for k in row if not k.startswith("_") and k not in tables}
    assert set(scalars) == wandb_keys
    assert [k for k in rows[0] if k.startswith("val_recall/")]  # the per-class columns are among those compared


@pytest.mark.slow
def test_tensorboard_holds_each_validations_confusion_matrix_figure(tracked):
    """The confusion matrix of every validation as a TensorBoard image (a figure), at the validation's step."""
    import cv2
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = tracked
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    figures = events.Images("val/confusion")
    rows = read_jsonl(out / "metrics.jsonl")
    assert [f.step for f in figures] == [r["step"] for r in rows]
    for figure in figures:
        png = cv2.imdecode(np.frombuffer(figure.encoded_image_string, np.uint8), cv2.IMREAD_COLOR)
        assert png.shape == (figure.height, figure.width, 3) and png.std() > 0


def test_a_tensorboard_failure_is_one_warning_and_training_goes_on(tmp_path, capsys):
    import train
    from core.cli import report_errors

    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").write_text("a file where the log folder should be\n")
    argv = [*SMALL, f"output_dir={out}", "train.epochs=1", "train.max_steps=2", "data.num_workers=0",
            "logging.tensorboard=true"]
    assert report_errors(train.main, argv) == 0  # in-process, as `python train.py` runs it
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "WARNING TensorBoard" in line]
    assert len(warnings) == 1 and f"TensorBoard writing {out / 'tensorboard'} failed" in warnings[0], err
    assert "Traceback" not in err
    assert [r["epoch"] for r in read_jsonl(out / "metrics.jsonl")] == [0]
    assert (out / "tensorboard").read_text() == "a file where the log folder should be\n"


@pytest.mark.slow
def test_a_resumed_run_replaces_later_tensorboard_events_and_a_run_that_fails_to_start_hides_none(tmp_path):
    out = tmp_path / "run"
    args = [*SMALL, f"output_dir={out}", "data.dummy_train_size=64", "logging.tensorboard=true", "train.keep_last_k=2",
            "train.epochs=2"]
    run_script("train.py", *args)  # 4 steps per epoch: steps 1-8, epoch rows at 4 and 8
    before = tensorboard_scalars(out / "tensorboard")
    # a branch from epoch 0 that fails before its first write (NaN at once): the first run's events stay visible
    proc = run_script("train.py", *args, f"resume={out}/epoch_0000.pth", "optim.lr=1e30", "train.max_nonfinite=1",
                      check=False)
    assert proc.returncode == 2 and "inf or NaN" in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert tensorboard_scalars(out / "tensorboard") == before
    # the same branch with another data order: its steps 5-8 replace the first run's, as its metrics.jsonl rows do
    run_script("train.py", *args, f"resume={out}/epoch_0000.pth", "seed=1")
    after = tensorboard_scalars(out / "tensorboard")
    rows = read_jsonl(out / "metrics.jsonl")
    for key in ("val_top1", "train_loss"):
        assert after[key] == [(4 * (r["epoch"] + 1), r[key]) for r in rows], key
    assert after["train_loss"][0] == before["train_loss"][0] and after["train_loss"][1] != before["train_loss"][1]
    assert [s for s, _ in after["interval/train_loss"]] == [2, 4, 6, 8]
    assert after["interval/train_loss"][:2] == before["interval/train_loss"][:2]
