"""A run never destroys a previous run's record: output_dir is locked, and untouched until the run starts.

Most runs go through `train.main` in-process via report_errors (what `python train.py` runs) on a tiny
image folder; the lock and the file-size limit need real processes.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import train
from assembly.start import check_same_config
from core.cli import report_errors
from core.dist import DistInfo
from core.errors import UserError
from core.files import save_atomic
from engine.checkpoint.formats import load_checkpoint
from engine.checkpoint.run_dir import FolderLock, RunRecord
from engine.checkpoint.saver import Checkpointer
from engine.state import TrainState
from tests.helpers import REPO, make_image_folder, read_jsonl, script_env, wait_for_file

TINY = ["--config", "configs/dummy.yaml", "model.name=test_resnet", "model.channels_last=false", "amp='off'",
        "data.name=imagefolder", "data.img_size=16", "data.num_workers=0", "train.batch_size=4",
        "logging.progress=false"]


def last_error(capsys, code: int) -> str:
    """The one line the user sees; asserts the exit code and that no traceback was printed."""
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """A good image folder, and a copy whose every training image is unreadable (a run fails in its first step)."""
    root = tmp_path_factory.mktemp("data")
    counts = {"train": {"a": 8, "b": 8}, "val": {"a": 2, "b": 2}}
    good, bad = make_image_folder(root / "good", counts, size=20), make_image_folder(root / "bad", counts, size=20)
    for path in (bad / "train").rglob("*.png"):
        path.write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    return good, bad


@pytest.fixture(scope="module")
def finished(data, tmp_path_factory) -> Path:
    """A finished 4-epoch run: last.pth, best.pth, epoch_0000..0003.pth, 4 metrics rows, config.yaml."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert report_errors(train.main, [*TINY, f"data.root={data[0]}", "train.epochs=4", "train.keep_last_k=4",
                                      f"output_dir={out}"]) == 0
    assert len(read_jsonl(out / "metrics.jsonl")) == 4
    return out


@pytest.fixture
def run(finished, tmp_path) -> Path:
    """A copy of the finished run to break."""
    return Path(shutil.copytree(finished, tmp_path / "run"))


# Checkpoint files: mode, failed writes, what a stopped run says is on disk

def test_divergence_message_says_what_is_on_disk(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    checkpointer = Checkpointer(tmp_path, DistInfo(0, 1, 0, 1, torch.device("cpu")), 0, model=model,
                                optimizer=optimizer, scheduler=scheduler, scaler=None, config={},
                                class_names=["a", "b"])
    model[1].running_mean.fill_(float("nan"))
    with pytest.raises(UserError, match="no checkpoint was written") as err:
        checkpointer.save(TrainState(global_step=2))
    assert "last.pth" not in str(err.value) and not list(tmp_path.iterdir())
    model[1].running_mean.fill_(0.0)
    checkpointer.save(TrainState(global_step=3))
    model[1].running_mean.fill_(float("nan"))
    with pytest.raises(UserError, match=f"{tmp_path}/last.pth keeps the last good state \\(global step 3\\)"):
        checkpointer.save(TrainState(global_step=4))


def test_best_and_epoch_files_are_links_to_last_and_keep_their_step(tmp_path):
    """A new best and an epoch file are hard links to the last.pth just written (one write, not three); the next
    last.pth replaces the name only, so best.pth keeps the step it was chosen at."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpointer = Checkpointer(tmp_path, DistInfo(0, 1, 0, 1, torch.device("cpu")), 2, model=model,
                                optimizer=optimizer, scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1),
                                scaler=None, config={}, class_names=["a", "b"])
    checkpointer.save(TrainState(epoch=1, global_step=3), metric_value=50.0, best=True, epoch_file=True)
    inodes = {p.name: p.stat().st_ino for p in tmp_path.glob("*.pth")}
    assert inodes.keys() == {"last.pth", "best.pth", "epoch_0000.pth"} and len(set(inodes.values())) == 1
    checkpointer.save(TrainState(epoch=2, global_step=6), metric_value=40.0, best=False, epoch_file=True)
    steps = {p.name: torch.load(p, weights_only=True)["global_step"] for p in tmp_path.glob("*.pth")}
    assert steps == {"last.pth": 6, "best.pth": 3, "epoch_0000.pth": 3, "epoch_0001.pth": 6}


def sgd_checkpointer(out: Path, async_save: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, Checkpointer]:
    """A stepped linear model (momentum in the optimizer state) and the Checkpointer of a 1-process run."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    checkpointer = Checkpointer(out, DistInfo(0, 1, 0, 1, torch.device("cpu")), 0, model=model, optimizer=optimizer,
                                scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1), scaler=None, config={},
                                class_names=["a", "b", "c"], async_save=async_save)
    return model, optimizer, checkpointer


def hold_writes(monkeypatch) -> threading.Event:
    """Checkpoint writes wait, before they write, until the returned event is set."""
    release = threading.Event()

    def held_save(obj, path):
        release.wait()
        save_atomic(obj, path)

    monkeypatch.setattr("engine.checkpoint.saver.save_atomic", held_save)
    return release


def test_a_background_write_holds_the_state_of_its_save_not_of_later_steps(tmp_path, monkeypatch):
    """train.async_save: the writer thread is held before it writes while the run goes on (weights and momentum
    changed in place); the file has the state at save(), so the thread wrote a copy, not the live tensors."""
    model, optimizer, checkpointer = sgd_checkpointer(tmp_path, async_save=True)
    release = hold_writes(monkeypatch)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = optimizer.state[model.weight]["momentum_buffer"].clone()
    checkpointer.save(TrainState(epoch=1, global_step=1))
    assert checkpointer.writer.is_alive() and not (tmp_path / "last.pth").exists()  # save() returned first
    with torch.no_grad():
        model.weight.add_(1.0)
        model.bias.mul_(-1.0)
        optimizer.state[model.weight]["momentum_buffer"].add_(5.0)
    release.set()
    checkpointer.wait()
    ckpt = load_checkpoint(tmp_path / "last.pth")
    assert all(torch.equal(ckpt["model"][k], v) for k, v in saved.items())
    assert torch.equal(ckpt["optimizer"]["state"][0]["momentum_buffer"], momentum)
    assert ckpt["global_step"] == 1 and checkpointer.writer is None


def test_a_fork_waits_for_the_background_write(tmp_path, monkeypatch):
    """A DataLoader forking its workers while the writer thread runs could deadlock the child on a lock the thread
    held: os.fork() first lets the write end. A before-fork hook registered after the app's runs first (Python runs
    them in reverse order), so it knows the fork has begun and only then lets the held write go on."""
    _, _, checkpointer = sgd_checkpointer(tmp_path, async_save=True)
    release, forking = hold_writes(monkeypatch), threading.Event()
    checkpointer.save(TrainState(epoch=1, global_step=1))  # registers the app's hook
    os.register_at_fork(before=forking.set)  # stays registered: harmless for later forks
    releaser = threading.Thread(target=lambda: (forking.wait(), release.set()))
    releaser.start()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    on_disk_at_fork = (tmp_path / "last.pth").exists()  # the parent resumes after the fork, so after the write
    os.waitpid(pid, 0)
    releaser.join()
    assert on_disk_at_fork and checkpointer.write_done.is_set()
    checkpointer.wait()


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_write_stops_the_run_at_save_or_at_the_next_wait(tmp_path, async_save):
    """A folder where last.pth goes: the write fails with the one-line error, at save() itself or, written in the
    background, at the next wait() (or save); the folder is left as it was."""
    _, _, checkpointer = sgd_checkpointer(tmp_path, async_save=async_save)
    (tmp_path / "last.pth").mkdir()
    (tmp_path / "last.pth" / "mine.txt").write_text("mine\n")
    error = f"cannot write checkpoint {tmp_path}/last.pth \\(Is a directory\\).*last.pth is as it was before this run"
    if async_save:
        checkpointer.save(TrainState(epoch=1, global_step=1))
        with pytest.raises(UserError, match=error):
            checkpointer.wait()
        checkpointer.wait()  # reported once
    else:
        with pytest.raises(UserError, match=error):
            checkpointer.save(TrainState(epoch=1, global_step=1))
    assert [p.name for p in tmp_path.rglob("*")] == ["last.pth", "mine.txt"]


def test_a_run_whose_last_background_write_fails_exits_2(data, tmp_path, monkeypatch, capsys):
    """train.async_save: the run's last checkpoint is written while the run ends; a failure of that write is the
    run's (one line, exit 2), not a line logged under exit 0. The disk is full for every checkpoint write."""
    def full_disk(obj, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr("engine.checkpoint.saver.save_atomic", full_disk)
    code = report_errors(train.main, [*TINY, f"data.root={data[0]}", "train.async_save=true", "train.max_steps=1",
                                      f"output_dir={tmp_path / 'run'}"])
    line = last_error(capsys, code)
    assert code == 2 and line.startswith(f"error: cannot write checkpoint {tmp_path}/run/last.pth (No space left"), line


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_checkpoints_get_the_mode_of_other_run_files(umask, tmp_path):
    old = os.umask(umask)
    try:
        save_atomic({"w": torch.zeros(3)}, tmp_path / "last.pth")
        (tmp_path / "metrics.jsonl").write_text("{}\n")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"last.pth": 0o666 & ~umask, "metrics.jsonl": 0o666 & ~umask}


@pytest.mark.slow
def test_checkpoint_over_the_file_size_limit_is_one_line_and_keeps_the_old_file(run, data):
    """RLIMIT_FSIZE (SIGXFSZ ignored, so writes fail with EFBIG): torch.save reports a bare RuntimeError."""
    limit = 64 * 1024  # config.yaml and metrics.jsonl fit, a checkpoint does not
    assert (run / "last.pth").stat().st_size > limit

    before = (run / "last.pth").read_bytes()
    # bash: the ignored signal and the limit carry over to the exec'd python (no preexec_fn in a threaded pytest)
    limited = ["bash", "-c", f"trap '' XFSZ; ulimit -f {limit // 1024}; exec \"$@\"", "bash"]
    proc = subprocess.run([*limited, sys.executable, str(REPO / "train.py"), *TINY, f"data.root={data[0]}",
                           f"output_dir={run}", "train.epochs=5"], cwd=REPO, env=script_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: cannot write checkpoint {run}/last.pth (File too large)"), line
    assert (run / "last.pth").read_bytes() == before
    assert not [p.name for p in run.iterdir() if p.name.endswith(".tmp")]


# Resuming with another optimizer

@pytest.mark.parametrize("change", ["optim.name=adamw", "optim.no_decay_norm_bias=false"])
def test_resume_with_another_optimizer_is_refused_naming_the_key(change, run, data, capsys):
    """resume=<path> continues a run with changes on purpose, but not with an optimizer its state does not fit."""
    line = last_error(capsys, report_errors(train.main, [*TINY, f"data.root={data[0]}", f"output_dir={run}",
                                                         "train.epochs=5", change, f"resume={run}/last.pth"]))
    key = change.split("=")[0]
    assert f"checkpoint {run}/last.pth was trained with {key}=" in line and f"this run has {key}=" in line
    assert "model.init_from" in line


def test_optimizer_state_of_other_parameter_groups_is_refused():
    from engine.checkpoint.resume import check_optimizer_state

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    one_group = torch.optim.SGD(model.parameters(), lr=0.1)
    two_groups = torch.optim.SGD([{"params": [model[0].weight]}, {"params": [model[0].bias, *model[1].parameters()]}],
                                 lr=0.1)
    check_optimizer_state(one_group.state_dict(), one_group, Path("x.pth"))
    with pytest.raises(UserError, match=r"checkpoint x.pth holds optimizer state for 1 parameter group\(s\) of "
                                        r"\[4\] tensors, this run's optimizer has 2 of \[1, 3\]"):
        check_optimizer_state(one_group.state_dict(), two_groups, Path("x.pth"))


# resume=auto continues the folder's own run only

def test_resume_auto_continues_only_the_folders_own_run(run, data, capsys):
    """Started again unchanged, a finished run says so and writes nothing; with another optim.lr it is refused in one
    line naming the change and the ways out (issue 38 item 2)."""
    base = [*TINY, f"data.root={data[0]}", f"output_dir={run}", "train.epochs=4", "train.keep_last_k=4"]
    before = snapshot(run)
    assert report_errors(train.main, base) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"the run in {run} is finished (all 4 epochs of train.epochs done): nothing was trained or written; raise "
        "train.epochs (or train.max_steps, train.early_stop_patience) to continue it, or use another output_dir for "
        "a new run")
    assert snapshot(run) == before
    line = last_error(capsys, report_errors(train.main, [*base, "optim.lr=0.05", "seed=1"]))
    assert line == (f"error: output_dir {run} holds a run made with another config (optim.lr 0.01 -> 0.05, seed 0 -> "
                    "1), which resume=auto does not continue; use another output_dir for a new run, or "
                    f"resume={run}/last.pth to continue that run with these changes (with another output_dir: a "
                    "branch of it in a new folder)")
    assert snapshot(run) == before  # a continuation with the keys it may change: test_a_resumed_run_rewrites_...


@pytest.mark.slow
def test_output_dir_placeholders_give_a_folder_per_launch_and_resume_finds_its_own(data, tmp_path, capsys):
    """output_dir=<...>/{model.name}/{run_id}: two launches, two folders, each config.yaml naming its own; resume=<its
    last.pth> with the same template continues that run in its folder (issue 38 item 2)."""
    import yaml

    base = [*TINY, f"data.root={data[0]}", "train.epochs=1", f"output_dir={tmp_path}/runs/{{model.name}}/{{run_id}}"]
    for _ in range(2):
        assert report_errors(train.main, base) == 0
    first, second = folders = sorted((tmp_path / "runs" / "test_resnet").iterdir())
    for folder in folders:
        assert yaml.safe_load((folder / "config.yaml").read_text())["output_dir"] == str(folder)
    before = snapshot(second)
    assert report_errors(train.main, [*base, "train.epochs=2", f"resume={first}/last.pth"]) == 0
    assert [row["epoch"] for row in read_jsonl(first / "metrics.jsonl")] == [0, 1]
    assert sorted((tmp_path / "runs" / "test_resnet").iterdir()) == folders and snapshot(second) == before
    line = last_error(capsys, report_errors(train.main, [*TINY, f"output_dir={tmp_path}/{{name}}"]))
    assert line == (f"error: output_dir '{tmp_path}/{{name}}' has the unknown placeholder {{name}}; use "
                    "{model.name}, {timestamp}, {run_id}, or a folder name without braces")


def rank_config_check(rank: int, world: int) -> str:
    """train.py's check that every process trains one config, on a real gloo group whose ranks got other seeds."""
    from core.config_load import load_config

    try:
        check_same_config(load_config("dummy", [f"seed={rank}"]))
    except UserError as err:
        return str(err)
    return ""


def test_processes_launched_with_other_configs_are_refused(tmp_path):
    """A launcher that gives ranks other arguments or environment (a sweep agent per node) is one line on every
    rank, not a mix of runs trained as one (issue 38 item 3: every rank trains the same resolved config)."""
    from tests.helpers import run_ranks

    assert run_ranks(rank_config_check, 2, tmp_path) == [
        "process 1 has another config than process 0 (seed 0 -> 1); launch every process with the same arguments and "
        "environment (one W&B sweep agent per job, which starts torchrun)"] * 2


def test_continuation_changes_leave_out_what_a_continuation_may_change():
    """Keys the checkpoint's app did not have count at their default; optim.lr derived from optim.lr_base is not
    the user's change."""
    from core.config import to_dict
    from core.config_load import load_config
    from engine.checkpoint.resume import continuation_changes

    saved = to_dict(load_config("dummy", ["optim.lr_base=0.1", "optim.lr=0.4"]))
    del saved["data"]["mix_mode"], saved["train"]["best_metric"]
    saved["data"]["path_column"] = "name"
    allowed = ["data.path_column=name", "optim.lr_base=0.1", "optim.lr=0.2", "train.epochs=9", "train.global_batch_size=64",
               "dist.strategy=fsdp", "logging.wandb=true", "logging.wandb_tags=[a]", "train.ckpt_format=sharded",
               "output_dir=elsewhere"]
    assert continuation_changes(saved, load_config("dummy", allowed)) == []
    changed = ["optim.lr=0.2", "data.mix_mode=batch", "model.kwargs.img_size=24", "data.mean=[0.5,0.5,0.5]"]
    assert continuation_changes(saved, load_config("dummy", changed)) == [
        "data.mean [0.485, 0.456, 0.406] -> [0.5, 0.5, 0.5]", "data.mix_mode pair -> batch",
        'data.path_column name -> ""',  # an emptied key, which printed as "name -> ,"
        "model.kwargs.img_size None -> 24", "optim.lr 0.4 -> 0.2", "optim.lr_base 0.1 -> 0.0"]


# Nothing in the folder changes until the run starts (its first write)

def test_resume_none_refuses_a_folder_holding_any_run_record(run, data, capsys):
    for name in ("last.pth", "epoch_0000.pth", "epoch_0001.pth", "epoch_0002.pth", "epoch_0003.pth"):
        (run / name).unlink()
    before = snapshot(run)
    line = last_error(capsys, report_errors(train.main, [*TINY, f"data.root={data[1]}", f"output_dir={run}",
                                                         "resume=none"]))
    assert f"output_dir {run} already holds a run (best.pth, config.yaml, metrics.jsonl) and resume=none" in line
    assert "another output_dir" in line
    assert snapshot(run) == before


def test_resume_auto_without_last_pth_refuses_a_folder_holding_a_run_record(run, data, capsys):
    for name in ("last.pth", "epoch_0000.pth", "epoch_0001.pth", "epoch_0002.pth"):
        (run / name).unlink()
    before = snapshot(run)
    line = last_error(capsys, report_errors(train.main, [*TINY, f"data.root={data[1]}", f"output_dir={run}"]))
    found = "best.pth, config.yaml, epoch_0003.pth, metrics.jsonl"
    assert f"output_dir {run} holds a run ({found}) but no last.pth" in line
    assert f"resume={run}/epoch_0003.pth" in line
    assert snapshot(run) == before


def test_resume_from_elsewhere_refuses_a_folder_holding_a_run_record(run, finished, data, capsys):
    for name in ("last.pth", "epoch_0000.pth", "epoch_0001.pth", "epoch_0002.pth", "epoch_0003.pth"):
        (run / name).unlink()
    before = snapshot(run)
    line = last_error(capsys, report_errors(train.main, [*TINY, f"data.root={data[1]}", f"output_dir={run}",
                                                         f"resume={finished}/epoch_0001.pth"]))
    assert f"output_dir {run} already holds another run (best.pth, config.yaml, metrics.jsonl)" in line
    assert snapshot(run) == before


FAILING_STARTS = {  # name: (overrides, text of the error line)
    "every image unreadable": (["train.epochs=5", "optim.lr=0.05", "resume={run}/last.pth"], "cannot read image"),
    "another config under resume=auto": (["train.epochs=5", "optim.lr=0.05"], "optim.lr 0.01 -> 0.05"),
    "resume from an earlier epoch file": (["resume={run}/epoch_0000.pth"], "cannot read image"),
    "another optimizer": (["train.epochs=5", "optim.name=adamw"], "optim.name"),
}


@pytest.mark.parametrize("name", FAILING_STARTS)
def test_a_run_that_fails_to_start_leaves_the_folder_byte_identical(name, run, data, capsys):
    overrides, expected = FAILING_STARTS[name]
    before = snapshot(run)
    argv = [*TINY, f"data.root={data[1]}", f"output_dir={run}", *(o.format(run=run) for o in overrides)]
    assert expected in last_error(capsys, report_errors(train.main, argv))
    assert snapshot(run) == before  # config.yaml, metrics.jsonl (4 rows), last.pth at epoch 4, everything


@pytest.mark.slow
def test_a_resumed_run_rewrites_config_and_metrics_once_it_writes(run, data):
    assert report_errors(train.main, [*TINY, f"data.root={data[0]}", f"output_dir={run}", "train.epochs=5",
                                      "train.keep_last_k=4"]) == 0
    assert [row["epoch"] for row in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert "epochs: 5" in (run / "config.yaml").read_text()
    assert report_errors(train.main, [*TINY, f"data.root={data[0]}", f"output_dir={run}", "train.epochs=4",
                                      "train.keep_last_k=4", f"resume={run}/epoch_0001.pth"]) == 0
    assert [row["epoch"] for row in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2, 3]  # epochs 2, 3 anew
    assert "epochs: 4" in (run / "config.yaml").read_text()
    assert sorted(p.name for p in run.iterdir()) == ["best.pth", "config.yaml", "curves.png", "epoch_0001.pth",
                                                     "epoch_0002.pth", "epoch_0003.pth", "epoch_0004.pth", "last.pth",
                                                     "metrics.jsonl", "samples.png"]


def test_truncated_last_pth_names_the_newest_readable_epoch_file(run, data, capsys):
    for name in ("last.pth", "epoch_0003.pth"):
        (run / name).write_bytes((run / name).read_bytes()[:5000])
    before = snapshot(run)
    line = last_error(capsys, report_errors(train.main, [*TINY, f"data.root={data[0]}", f"output_dir={run}"]))
    assert f"checkpoint {run}/last.pth cannot be read" in line
    assert "to continue from another checkpoint of this run: " in line and f"resume={run}/best.pth" in line
    assert f"resume={run}/epoch_0002.pth (global step 12)" in line  # the newest readable epoch file
    line = last_error(capsys, report_errors(train.main, [*TINY, f"data.root={data[0]}", f"output_dir={run}",
                                                         "resume=none"]))
    assert "resume=auto" not in line and f"{run}/last.pth cannot be read" in line
    assert f"resume={run}/epoch_0002.pth" in line
    assert snapshot(run) == before


def test_run_file_that_cannot_be_written_is_one_line(run, data, capsys):
    """Root-proof: a directory where metrics.jsonl should be (chmod does not stop root)."""
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    line = last_error(capsys, report_errors(train.main, [*TINY, f"data.root={data[0]}", f"output_dir={run}",
                                                         "train.epochs=5"]))
    assert line.startswith(f"error: cannot write {run}/metrics.jsonl (Is a directory)"), line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0555 folder anyway")
def test_read_only_run_folder_is_one_line(run, data, capsys):
    run.chmod(0o555)
    try:
        line = last_error(capsys, report_errors(train.main, [*TINY, f"data.root={data[0]}", f"output_dir={run}",
                                                             "train.epochs=5"]))
    finally:
        run.chmod(0o755)
    assert f"output_dir {run} is not writable (Permission denied)" in line


# One live run per folder


@pytest.mark.slow
def test_second_live_run_is_refused_and_a_killed_run_leaves_no_lock(tmp_path):
    out = tmp_path / "run"
    args = ["--config", "configs/dummy.yaml", "model.name=test_resnet", "model.channels_last=false", "amp='off'",
            "data.img_size=16", "data.dummy_image_size=20", "data.dummy_train_size=100000", "data.dummy_val_size=10",
            "train.batch_size=8", "train.ckpt_every_steps=1", "logging.progress=false", f"output_dir={out}"]
    first = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=REPO, env=script_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_file(out / "last.pth", first)  # training, and far from done (12,500 steps)
        second = subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=REPO, env=script_env(),
                                capture_output=True, text=True, timeout=120)
        assert first.poll() is None  # the two runs overlapped
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
        assert second.stderr.strip().splitlines()[-1] == (
            f"error: output_dir {out} is in use by another run (process {first.pid} on {socket.gethostname()}); "
            "wait for it to end, "
            "or choose another output_dir")
        first.send_signal(signal.SIGKILL)  # no clean-up: the lock must not outlive the process
        first.wait(timeout=30)
    finally:
        first.kill()
        first.communicate()
    step = load_checkpoint(out / "last.pth")["global_step"]
    third = subprocess.run([sys.executable, str(REPO / "train.py"), *args, f"train.max_steps={step + 1}"],
                           cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=120)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"global step {step})" in third.stderr  # it resumed the killed run's checkpoint
    assert load_checkpoint(out / "last.pth")["global_step"] == step + 1


def test_a_removed_run_folder_stops_every_write_and_is_never_made_again(tmp_path):
    """Issue 41 item 1, in one process: after `rm -rf` the record and the checkpointer refuse to write (the folder
    is not made again), then refuse a folder made again by another lock; the lost lock, released, leaves the new
    one's lock file (the old release removed it, so a third run would have been let in)."""
    out = tmp_path / "run"
    first = FolderLock(out)
    record = RunRecord(out, {"seed": 0}, first_epoch=0, lock=first)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpointer = Checkpointer(out, DistInfo(0, 1, 0, 1, torch.device("cpu")), 0, model=model, optimizer=optimizer,
                                scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1), scaler=None, config={},
                                class_names=["a", "b"], lock=first)
    record.append({"epoch": 0})
    checkpointer.save(TrainState(epoch=1, global_step=1))
    shutil.rmtree(out)
    gone = (f"output_dir {out} was removed while this run was writing to it; the run stopped and wrote nothing more "
            "there (it never makes the folder again)")
    for write in (lambda: record.append({"epoch": 1}), lambda: checkpointer.save(TrainState(epoch=2, global_step=2))):
        with pytest.raises(UserError, match=re.escape(gone)):
            write()
    assert not out.exists()
    second = FolderLock(out)  # another run takes the path (in this process too: POSIX locks are per process)
    with pytest.raises(UserError, match=re.escape(f"output_dir {out} was removed and made again (another run may be "
                                                  "using it now) while this run was writing to it")):
        checkpointer.save(TrainState(epoch=2, global_step=2))
    first.release()
    assert sorted(p.name for p in out.iterdir()) == [".lock"] and second.holds_path()
    second.release()
    assert not out.exists()


@pytest.mark.slow
def test_a_run_whose_folder_is_removed_stops_and_the_next_run_holds_the_folder(tmp_path, capsys):
    """Issue 41 item 1 with real processes: a run stopped (SIGSTOP) after its first step checkpoint, its folder
    removed, the same command started again (and stopped mid-run); the first run, continued, stops at its next
    write with one line; the second run's lock still refuses a third; the second finishes with one run's record
    (metrics.jsonl read 0,3,1,4,2,5,... when both ran on)."""
    out = tmp_path / "run"
    args = ["--config", "configs/dummy.yaml", "model.name=test_resnet", "model.channels_last=false", "amp='off'",
            "data.img_size=16", "data.dummy_image_size=20", "data.dummy_train_size=96", "data.dummy_val_size=10",
            "data.num_workers=0", "train.batch_size=8", "train.ckpt_every_steps=1", "logging.progress=false",
            f"output_dir={out}"]
    started = []

    def start(*more: str) -> subprocess.Popen:
        started.append(subprocess.Popen([sys.executable, str(REPO / "train.py"), *args, *more], cwd=REPO,
                                        env=script_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True))
        wait_for_file(out / "last.pth", started[-1])
        started[-1].send_signal(signal.SIGSTOP)
        return started[-1]

    try:
        first = start("train.epochs=20")  # 240 steps: far from done (before the fix: it ran them all, rc 0)
        shutil.rmtree(out)
        second = start("train.epochs=2")
        first.send_signal(signal.SIGCONT)
        _, err = first.communicate(timeout=300)
        assert first.returncode == 2 and "Traceback" not in err, err[-3000:]
        assert err.strip().splitlines()[-1].startswith(f"error: output_dir {out} was removed and made again"), err
        line = last_error(capsys, report_errors(train.main, [*args, "train.epochs=2"]))  # a third run
        assert f"is in use by another run (process {second.pid} " in line, line
        second.send_signal(signal.SIGCONT)
        _, err = second.communicate(timeout=300)
        assert second.returncode == 0, err[-3000:]
    finally:
        for proc in started:
            proc.kill()
            proc.communicate()
    assert [row["epoch"] for row in read_jsonl(out / "metrics.jsonl")] == [0, 1]
    assert load_checkpoint(out / "last.pth")["global_step"] == 24
    assert sorted(p.name for p in out.iterdir()) == ["best.pth", "config.yaml", "curves.png", "last.pth",
                                                     "metrics.jsonl", "samples.png"]
