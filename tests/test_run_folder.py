"""A run never destroys a previous run's record: output_dir is locked, and untouched until the run starts.

Most runs go through `train.main` in-process via report_errors (what `python train.py` runs) on a tiny
image folder; the lock and the file-size limit need real processes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train
from engine.checkpoint import Checkpointer, load_checkpoint, save_atomic
from engine.cli import report_errors
from engine.dist import DistInfo
from engine.errors import UserError
from engine.trainer import TrainState
from tests.helpers import REPO, make_image_folder, read_jsonl, script_env

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
    line = last_error(capsys, report_errors(train.main, [*TINY, f"data.root={data[0]}", f"output_dir={run}",
                                                         "train.epochs=5", change]))
    key = change.split("=")[0]
    assert f"checkpoint {run}/last.pth was trained with {key}=" in line and f"this run has {key}=" in line
    assert "model.init_from" in line


def test_optimizer_state_of_other_parameter_groups_is_refused():
    from engine.resume import check_optimizer_state

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    one_group = torch.optim.SGD(model.parameters(), lr=0.1)
    two_groups = torch.optim.SGD([{"params": [model[0].weight]}, {"params": [model[0].bias, *model[1].parameters()]}],
                                 lr=0.1)
    check_optimizer_state(one_group.state_dict(), one_group, Path("x.pth"))
    with pytest.raises(UserError, match=r"checkpoint x.pth holds optimizer state for 1 parameter group\(s\) of "
                                        r"\[4\] tensors, this run's optimizer has 2 of \[1, 3\]"):
        check_optimizer_state(one_group.state_dict(), two_groups, Path("x.pth"))


def test_truncated_last_pth_names_the_newest_readable_epoch_file(run, data, capsys):
    for name in ("last.pth", "epoch_0003.pth"):
        (run / name).write_bytes((run / name).read_bytes()[:5000])
    before = snapshot(run)
    line = last_error(capsys, report_errors(train.main, [*TINY, f"data.root={data[0]}", f"output_dir={run}"]))
    assert f"checkpoint {run}/last.pth cannot be read" in line
    assert f"resume={run}/epoch_0002.pth continues from the newest readable epoch file" in line
    assert snapshot(run) == before


# One live run per folder

def wait_for(path: Path, proc: subprocess.Popen) -> None:
    """Until `path` exists, while `proc` still runs (the deadline only catches a hang)."""
    deadline = time.monotonic() + 120
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


@pytest.mark.slow
def test_second_live_run_is_refused_and_a_killed_run_leaves_no_lock(tmp_path):
    out = tmp_path / "run"
    args = ["--config", "configs/dummy.yaml", "model.name=test_resnet", "model.channels_last=false", "amp='off'",
            "data.img_size=16", "data.dummy_image_size=20", "data.dummy_train_size=100000", "data.dummy_val_size=10",
            "train.batch_size=8", "train.ckpt_every_steps=1", "logging.progress=false", f"output_dir={out}"]
    first = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=REPO, env=script_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(out / "last.pth", first)  # training, and far from done (12,500 steps)
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
