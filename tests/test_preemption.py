"""Running under a scheduler: a preempted job stops at one step on every rank and resumes exactly, logs read well
in a file, and torchrun's failure summary names the real cause.

Every test runs real `train.py` / `evaluate.py` processes (torchrun, or two processes started the way srun starts
them) on dummy data with a tiny model, and sends real signals.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import shlex
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
import torch

from core.signals import HANDLED
from engine.checkpoint.formats import load_checkpoint
from engine.hooks import EpochEnd, Hook
from engine.state import TrainState
from engine.trainer import MEASURED_COLUMNS
from tests.compare import assert_same
from tests.helpers import (HANG, REPO, TINY as TINY_HERE, Batches, children, corrupt_in_batch, free_port,
                           make_image_folder, read_jsonl, run_on_ranks, run_script, script_env, train_here)

PREEMPTED = 124
TINY = ["--config", "configs/dummy.yaml", "model.name=test_resnet", "model.channels_last=false", "amp='off'",
        "data.img_size=16", "data.dummy_image_size=20", "data.dummy_val_size=20", "train.batch_size=8"]
# 2 ranks x batch 8 over 2048 images: 128 optimizer steps per epoch (a few seconds); a log line after every step.
PREEMPTIBLE = [*TINY, "data.dummy_train_size=2048", "data.num_workers=2", "train.epochs=2", "logging.interval=1"]
STEP_LINE = re.compile(r"epoch (\d+) step (\d+)/(\d+) \| loss (\d+\.\d+) \| lr (\S+) \| (\d+) img/s \| "
                       r"step (\d+\.\d) ms, input wait (\d+)% \| ETA epoch (\d+:\d\d:\d\d), run (\d+:\d\d:\d\d)$", re.M)
STOP_LINE = re.compile(r"^preempted by (SIGTERM|SIGUSR1) at global step (\d+): (\S+) written; resume=auto continues$",
                       re.M)
INTERRUPT_LINE = re.compile(r"^interrupted \(SIGINT\) at global step (\d+): (\S+) written; to continue, run in (\S+): "
                            r"(.+)$", re.M)
STOPPING = "stopping after this step (or validation batch) to write last.pth (Ctrl-C again stops at once, without it)"
# A stop inside an epoch's validation: last.pth holds the trained steps and the validation they are owed.
CUT_LINE = re.compile(r"^(?:preempted by (?:SIGTERM|SIGUSR1)|interrupted \(SIGINT\)) at global step (\d+), during "
                      r"(epoch \d+'s validation|the validation at step \d+), which the continued run does first: "
                      r"(\S+) written; (?:resume=auto continues|to continue, run in .+)$", re.M)


def wait_for(log: Path, pattern: str, procs: list[subprocess.Popen], timeout: float = 240) -> None:
    """Until `pattern` appears in the log file (the processes must still run)."""
    deadline = time.monotonic() + timeout
    while not re.search(pattern, log.read_text(errors="replace")):
        assert all(p.poll() is None for p in procs), log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{pattern!r} never appeared"
        time.sleep(0.02)


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(REPO / "train.py"), *args]


def assert_stopped_mid_epoch(out: Path, text: str, signame: str, steps: int = 128) -> int:
    """The one line rank 0 printed, and last.pth at the step it names (mid-epoch 0); returns that step."""
    stops = STOP_LINE.findall(text) if signame != "SIGINT" else [
        ("SIGINT", step, path) for step, path, *_ in INTERRUPT_LINE.findall(text)]
    assert len(stops) == 1, text[-4000:]
    name, step, path = stops[0]
    assert (name, path) == (signame, str(out / "last.pth"))
    ckpt = load_checkpoint(out / "last.pth")
    assert (ckpt["epoch"], ckpt["global_step"], ckpt["epoch_step"]) == (0, int(step), int(step))
    assert 2 <= int(step) < steps, text[-4000:]
    assert not (out / "metrics.jsonl").exists() or read_jsonl(out / "metrics.jsonl") == []  # no half epoch row
    return int(step)


def assert_same_run(whole: Path, resumed: Path) -> None:
    """last.pth bitwise and the metrics.jsonl rows (timings aside) of an uninterrupted run and a resumed one."""
    assert_same(load_checkpoint(whole / "last.pth"), load_checkpoint(resumed / "last.pth"))
    rows = [{k: v for k, v in row.items() if k not in MEASURED_COLUMNS}
            for run in (whole, resumed) for row in read_jsonl(run / "metrics.jsonl")]
    assert rows[:2] == rows[2:] and [row["epoch"] for row in rows[:2]] == [0, 1]


@pytest.fixture(scope="module")
def whole_two_ranks(tmp_path_factory) -> Path:
    """PREEMPTIBLE on 2 ranks, uninterrupted: what a stopped and resumed run must end with."""
    out = tmp_path_factory.mktemp("whole") / "run"
    run_script("train.py", *PREEMPTIBLE, f"output_dir={out}", nproc=2)
    return out


def sigint_default() -> None:
    """In the child before exec: a background job of a shell script (as CI may run pytest) starts with SIGINT
    ignored, which the training process keeps; a terminal's foreground job has the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def in_terminal(cmd: list[str], log: Path, cwd: Path = REPO) -> subprocess.Popen:
    """`cmd` as the foreground job of a terminal: a process group of its own, which Ctrl-C signals as a whole."""
    with log.open("w") as f:
        return subprocess.Popen(cmd, cwd=cwd, env=script_env(), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=sigint_default)


def ctrl_c(proc: subprocess.Popen) -> None:
    """What a terminal does on Ctrl-C: SIGINT to every process of the foreground process group."""
    os.killpg(proc.pid, signal.SIGINT)


def continue_as_printed(text: str, log: Path) -> subprocess.Popen:
    """Start the command rank 0 printed to continue an interrupted run, where it said to."""
    (_, _, cwd, command), = INTERRUPT_LINE.findall(text)
    return in_terminal(shlex.split(command), log, Path(cwd))


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_both_ranks_at_one_step_and_resume_equals_an_uninterrupted_run(tmp_path,
                                                                                                 whole_two_ranks):
    stopped = tmp_path / "stopped"
    log = tmp_path / "stopped.log"
    with log.open("w") as f:
        proc = subprocess.Popen(torchrun(*PREEMPTIBLE, f"output_dir={stopped}"), cwd=REPO, env=script_env(),
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_for(log, r"epoch 0 step 2/128", [proc])
        proc.send_signal(signal.SIGTERM)  # torchrun sends SIGTERM to each worker's process group (workers too)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    text = log.read_text()
    assert_stopped_mid_epoch(stopped, text, "SIGTERM")
    assert "[rank0]: Traceback" not in text and "[rank1]: Traceback" not in text, text[-4000:]
    assert "DataLoader worker" not in text and "ConnectionResetError" not in text

    run_script("train.py", *PREEMPTIBLE, f"output_dir={stopped}", "resume=auto", nproc=2)
    assert_same_run(whole_two_ranks, stopped)


@pytest.mark.slow
def test_ctrl_c_on_torchrun_stops_both_ranks_and_the_printed_command_continues_bitwise(tmp_path, whole_two_ranks):
    # Ctrl-C reaches torchrun alone (it starts each worker in a session of its own); torchrun sends SIGINT to each
    # worker's process group and waits for them (30 s, --shutdown-timeout) before SIGKILL.
    out, log = tmp_path / "run", tmp_path / "run.log"
    proc = in_terminal(torchrun(*PREEMPTIBLE, f"output_dir={out}"), log)
    try:
        wait_for(log, r"epoch 0 step 2/128", [proc])
        assert all(os.getpgid(worker) != proc.pid for worker in children(proc.pid))
        ctrl_c(proc)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    text = log.read_text()
    assert_stopped_mid_epoch(out, text, "SIGINT")
    assert text.count(STOPPING) == 1, text[-4000:]  # rank 0 alone, at once
    assert "[rank0]: Traceback" not in text and "[rank1]: Traceback" not in text, text[-4000:]
    assert "DataLoader worker" not in text and "ConnectionResetError" not in text
    command = INTERRUPT_LINE.findall(text)[0][3]
    assert command == shlex.join(torchrun(*PREEMPTIBLE, f"output_dir={out}")), command  # resume=auto: the same

    resumed = continue_as_printed(text, tmp_path / "resumed.log")
    assert resumed.wait(timeout=HANG) == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    assert_same_run(whole_two_ranks, out)


@pytest.mark.slow
def test_ctrl_c_stops_one_process_a_second_stops_it_at_once_and_the_printed_command_continues_bitwise(tmp_path):
    # 32 steps per epoch on one process; DataLoader workers in the terminal's process group until they leave it.
    args = [*PREEMPTIBLE, "data.dummy_train_size=256", "train.ckpt_every_steps=4"]
    whole, out, log = tmp_path / "whole", tmp_path / "run", tmp_path / "run.log"
    run_script("train.py", *args, f"output_dir={whole}")
    proc = in_terminal([sys.executable, "train.py", *args, f"output_dir={out}"], log)
    try:
        wait_for(log, r"epoch 0 step 2/32", [proc])
        ctrl_c(proc)
        assert proc.wait(timeout=120) == 130
    finally:
        proc.kill()
    text = log.read_text()
    first = assert_stopped_mid_epoch(out, text, "SIGINT", steps=32)
    assert text.count(STOPPING) == 1 and "Traceback" not in text and "DataLoader worker" not in text, text[-3000:]
    assert INTERRUPT_LINE.findall(text)[0][2:] == (str(REPO), shlex.join([sys.executable, "train.py", *args,
                                                                           f"output_dir={out}"]))

    # The printed command continues; Ctrl-C twice: the second ends it at once, writing nothing more.
    log = tmp_path / "again.log"
    again = continue_as_printed(text, log)
    try:
        wait_for(log, rf"epoch 0 step {first + 1}/32", [again])
        ctrl_c(again)
        wait_for(log, re.escape(STOPPING), [again])  # the first was handled: the next takes the default action
        os.kill(again.pid, signal.SIGSTOP)  # whatever it is doing now (finishing the step, writing last.pth)
        before = (out / "last.pth").read_bytes()
        ctrl_c(again)
        os.kill(again.pid, signal.SIGCONT)
        assert again.wait(timeout=60) == -signal.SIGINT, log.read_text()[-3000:]
    finally:
        again.kill()
    assert (out / "last.pth").read_bytes() == before  # nothing written after the second Ctrl-C
    assert load_checkpoint(out / "last.pth")["epoch"] == 0  # whole: mid-epoch, from a step checkpoint or the stop

    resumed = continue_as_printed(text, tmp_path / "resumed.log")
    assert resumed.wait(timeout=HANG) == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    assert_same_run(whole, out)


def srun_like(rank: int, port: int, args: list[str], log: Path) -> subprocess.Popen:
    """One rank started as srun starts a task (no torchrun), in its own process group like a Slurm task."""
    env = script_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with log.open("w") as f:
        return subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=REPO, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.slow
def test_sigusr1_to_one_rank_and_its_workers_stops_every_rank_at_the_same_step(tmp_path):
    out = tmp_path / "run"
    logs = [tmp_path / f"rank{rank}.log" for rank in (0, 1)]
    port = free_port()
    procs = [srun_like(rank, port, [*PREEMPTIBLE, f"output_dir={out}"], logs[rank]) for rank in (0, 1)]
    try:
        wait_for(logs[0], r"epoch 0 step 2/128", procs)
        os.killpg(procs[1].pid, signal.SIGUSR1)  # Slurm's --signal reaches every process of the task
        codes = [proc.wait(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    rank0, rank1 = (log.read_text() for log in logs)
    assert codes == [PREEMPTED, PREEMPTED], rank0[-3000:] + rank1[-3000:]
    assert_stopped_mid_epoch(out, rank0, "SIGUSR1")
    assert rank0.strip().splitlines()[-1].startswith("preempted by SIGUSR1")
    assert rank1.strip() == "", rank1[-3000:]  # the other ranks stay quiet, their DataLoader workers too
    assert "Traceback" not in rank0


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, PREEMPTED), (signal.SIGINT, 130)])
def test_a_stop_signal_during_the_epochs_validation_keeps_the_trained_epoch_with_one_line(tmp_path, signum, code):
    # Was: exit 143 (130) at once and nothing saved, the epoch's steps lost. Now the validation (8000 images) stops at
    # a batch boundary, last.pth holds the trained epoch and the validation it is owed; DataLoader workers stay quiet.
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    proc = in_terminal([sys.executable, "train.py", *TINY, "data.dummy_train_size=64", "data.num_workers=2",
                        "data.dummy_val_size=8000", "train.epochs=1", "logging.interval=1", f"output_dir={out}"], log)
    try:
        wait_for(log, r"epoch 0 step 8/8", [proc])  # the last step: evaluation of 8000 images follows
        if signum == signal.SIGINT:
            ctrl_c(proc)
        else:
            proc.send_signal(signum)
        assert proc.wait(timeout=120) == code, log.read_text()[-3000:]
    finally:
        proc.kill()
    text = log.read_text()
    assert CUT_LINE.findall(text) == [("8", "epoch 0's validation", str(out / "last.pth"))], text[-3000:]
    assert CUT_LINE.match(text.strip().splitlines()[-1]), text[-3000:]
    assert "Traceback" not in text and "DataLoader worker" not in text
    assert_owes_validation(out, epoch=0, step=8, mid_epoch=False)


def assert_owes_validation(out: Path, epoch: int, step: int, mid_epoch: bool) -> None:
    """last.pth holds `step` and the validation a stop cut short there; metrics.jsonl has no row for it."""
    ckpt = load_checkpoint(out / "last.pth")
    assert (ckpt["epoch"], ckpt["global_step"], ckpt["unvalidated"]["mid_epoch"]) == (epoch, step, mid_epoch)
    rows = read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    assert step not in [row["step"] for row in rows]


class SignalAt(Hook):
    """Sends this process `signum` once, at global step `step`: after that step (`where="step"`: past its stop check,
    so the next place that can act on it is the validation at that step, the epoch's or train.val_every_steps'), or
    once the validation at that step has its row and last.pth (`where="validation"`: while the hooks after it run)."""

    def __init__(self, signum: int, where: str, step: int) -> None:
        self.signum, self.where, self.step = signum, where, step

    def after_step(self, state: TrainState) -> None:
        if self.where == "step" and state.global_step == self.step:
            os.kill(os.getpid(), self.signum)

    def after_epoch(self, state: TrainState, end: EpochEnd) -> None:
        if self.where == "validation" and end.row["step"] == self.step:
            os.kill(os.getpid(), self.signum)


def main(argv: list[str]) -> int:
    """train.py's main with SignalAt on one rank; argv: SIGNAL WHERE STEP RANK, then train.py's arguments. In this
    process through report_errors; on each rank of run_on_ranks("tests/test_preemption.py", ...)."""
    import train
    from assembly import launch

    name, where, step, rank, *rest = argv
    args = train.parse_args(rest)
    signals = [SignalAt(signal.Signals[name], where, int(step))] if os.environ.get("RANK", "0") == rank else []
    return launch.train(args.config, args.overrides, hooks=signals)


@pytest.fixture
def own_signals():
    """This process's signal handlers as they were: a stopped run leaves SIGTERM and SIGUSR1 ignored (and after a
    Ctrl-C, SIGINT at its default) until its process exits, which here is pytest's."""
    saved = {signum: signal.getsignal(signum) for signum in HANDLED}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_the_validation_stops_at_a_batch_boundary_and_owes_itself(own_signals):
    """The mechanism: a SIGTERM while the validation loads batch 1 is answered at batch 2 (the ranks' all-reduce is
    read one batch late); the validation stops there, and the state says which validation is owed."""
    from torch import nn

    from core.config import DataConfig
    from core.dist import DistInfo
    from core.signals import Preempted, stop_on_sigterm, training_steps
    from engine.precision import Precision
    from engine.validation import Validation

    class SignalWhileLoading(Batches):
        served = 0

        def __iter__(self):
            for batch in list.__iter__(self):
                self.served += 1
                if self.served == 2:
                    os.kill(os.getpid(), signal.SIGTERM)
                yield batch

    torch.manual_seed(0)
    loader = SignalWhileLoading([(torch.randint(0, 255, (4, 3, 4, 4), dtype=torch.uint8), torch.tensor([0, 1, 2, 0]))
                                 for _ in range(10)], classes=3)
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 3))
    validation = Validation(model, None, loader, Precision("cpu", None), DistInfo(0, 1, 0, 1, torch.device("cpu")),
                            lambda images: images.float() / 255, DataConfig(), torch.optim.SGD(model.parameters(), 0.1),
                            "val_top1", gather_outcomes=False)
    state = TrainState(epoch=3, global_step=40, epoch_step=10)
    with pytest.raises(Preempted) as stopped, stop_on_sigterm(), training_steps():
        validation(state, {"train_loss": 1.5}, finished=True)
    assert loader.served == 3  # of 10
    assert str(stopped.value) == ("preempted by SIGTERM at global step 40, during epoch 3's validation, which the "
                                  "continued run does first")
    assert state.unvalidated == {"train": {"train_loss": 1.5}, "mid_epoch": False}
    assert state.state_dict()["unvalidated"] == state.unvalidated  # what last.pth keeps


# 4 steps an epoch on one process, 2 epochs; 5 validation batches of 8 (3 per rank of 2 with data.dummy_train_size=64)
CUT = [*TINY_HERE, "data.dummy_val_size=40", "train.epochs=2"]


def assert_same_rows(whole: Path, resumed: Path) -> None:
    """last.pth bitwise and every metrics.jsonl row (timings aside) of an uninterrupted run and a continued one."""
    assert_same(load_checkpoint(whole / "last.pth"), load_checkpoint(resumed / "last.pth"))
    rows = [[{k: v for k, v in row.items() if k not in MEASURED_COLUMNS} for row in read_jsonl(run / "metrics.jsonl")]
            for run in (whole, resumed)]
    assert rows[0] == rows[1] and rows[0], rows


def stopped_here(code: int, *args: str) -> None:
    """main() in this process (report_errors: the exit code, the one line) exits with `code`."""
    from core.cli import report_errors

    assert report_errors(main, list(args)) == code, args


@pytest.mark.slow
def test_sigterm_in_the_epochs_validation_keeps_the_epoch_and_the_continued_run_equals_an_uninterrupted_one(
        tmp_path, capfd, own_signals):
    # Was: Terminated (exit 143) with no checkpoint, the epoch's steps lost.
    whole, out = tmp_path / "whole", tmp_path / "run"
    train_here(*CUT, f"output_dir={whole}")
    capfd.readouterr()
    stopped_here(PREEMPTED, "SIGTERM", "step", "4", "0", *CUT, f"output_dir={out}")
    err = capfd.readouterr().err
    assert CUT_LINE.findall(err) == [("4", "epoch 0's validation", str(out / "last.pth"))], err[-3000:]
    assert_owes_validation(out, epoch=0, step=4, mid_epoch=False)
    train_here(*CUT, f"output_dir={out}")  # validates epoch 0 first, then trains epoch 1
    assert_same_rows(whole, out)


@pytest.mark.slow
@pytest.mark.parametrize("name, code", [("SIGUSR1", PREEMPTED), ("SIGINT", 130)])
def test_sigusr1_and_ctrl_c_in_the_epochs_validation_keep_the_epoch_too(tmp_path, capfd, own_signals, name, code):
    out = tmp_path / "run"
    stopped_here(code, name, "step", "4", "0", *CUT, "train.epochs=1", f"output_dir={out}")
    err = capfd.readouterr().err
    assert CUT_LINE.findall(err) == [("4", "epoch 0's validation", str(out / "last.pth"))], err[-3000:]
    assert err.count(STOPPING) == (name == "SIGINT")
    assert_owes_validation(out, epoch=0, step=4, mid_epoch=False)


@pytest.mark.slow
def test_a_stop_at_a_validation_inside_the_epoch_stops_there_and_saves_once(tmp_path, capfd, own_signals):
    # train.val_every_steps=3: validations at steps 3, 4 (the epoch's), 6, 8. Was: a stop during the validation at
    # step 3 waited for it, its checkpoint, step 4 and a second save. Now: cut at a batch (the continued run does it
    # first), or, once its row and checkpoint exist, a stop at step 3 with no other save.
    every = [*CUT, "train.val_every_steps=3"]
    whole, cut, after = tmp_path / "whole", tmp_path / "cut", tmp_path / "after"
    train_here(*every, f"output_dir={whole}")
    capfd.readouterr()
    stopped_here(PREEMPTED, "SIGTERM", "step", "2", "0", *every, f"output_dir={cut}")  # step 3's check says stop
    assert CUT_LINE.findall(capfd.readouterr().err) == [("3", "the validation at step 3", str(cut / "last.pth"))]
    assert_owes_validation(cut, epoch=0, step=3, mid_epoch=True)
    stopped_here(PREEMPTED, "SIGTERM", "validation", "3", "0", *every, f"output_dir={after}")
    assert STOP_LINE.findall(capfd.readouterr().err) == [("SIGTERM", "3", str(after / "last.pth"))]
    ckpt = load_checkpoint(after / "last.pth")
    assert (ckpt["global_step"], ckpt["unvalidated"], ckpt["metric_value"]) == (3, None, read_jsonl(
        after / "metrics.jsonl")[-1]["val_top1"])  # the validation's own checkpoint, not a second one
    for out in (cut, after):
        train_here(*every, f"output_dir={out}")
        assert_same_rows(whole, out)


@pytest.mark.slow
def test_sigusr1_to_one_rank_in_the_validation_stops_both_and_the_continued_run_equals_an_uninterrupted_one(
        tmp_path):
    # gloo, 2 ranks: rank 1 alone gets SIGUSR1 after epoch 0's last step; both stop at the same validation batch.
    args = [*CUT, "data.dummy_train_size=64"]
    whole, out = tmp_path / "whole", tmp_path / "run"
    run_on_ranks("train.py", *args, f"output_dir={whole}", nproc=2)
    stopped = run_on_ranks("tests/test_preemption.py", "SIGUSR1", "step", "4", "1", *args, f"output_dir={out}",
                           nproc=2, exit_code=PREEMPTED)
    # one line: rank 0's (rank 1 stays quiet)
    assert CUT_LINE.findall(stopped.stderr) == [("4", "epoch 0's validation", str(out / "last.pth"))], stopped.stderr
    assert_owes_validation(out, epoch=0, step=4, mid_epoch=False)
    run_on_ranks("train.py", *args, f"output_dir={out}", nproc=2)
    assert_same_rows(whole, out)


def test_dataloader_workers_start_shielded_and_a_sigterm_meanwhile_waits_for_the_iterator(tmp_path):
    from torch.utils.data import DataLoader

    from core.signals import Terminated, stop_on_sigterm, workers_shielded

    loader = DataLoader(list(range(64)), batch_size=4, num_workers=1)
    built, before = [], set(children(os.getpid()))
    # A thread that does not block the signals takes the SIGTERM, so the handler runs while the iterator is built.
    done = threading.Event()
    bystander = threading.Thread(target=done.wait)
    bystander.start()
    try:
        with stop_on_sigterm(), pytest.raises(Terminated):
            with workers_shielded():
                os.kill(os.getpid(), signal.SIGTERM)
                built.append(iter(loader))  # the worker forks here
            raise AssertionError("not reached: Terminated is raised as the block ends")
    finally:
        done.set()
        bystander.join()
    batches = built[0]
    (worker,) = set(children(os.getpid())) - before
    blocked = int(re.search(r"^SigBlk:\s*([0-9a-f]+)$", Path(f"/proc/{worker}/status").read_text(), re.M)[1], 16)
    assert all(blocked >> (signum - 1) & 1 for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT))
    os.kill(worker, signal.SIGTERM)  # as torchrun and Slurm signal the whole process group
    os.kill(worker, signal.SIGUSR1)
    os.kill(worker, signal.SIGINT)  # as a terminal's Ctrl-C does
    assert [int(b.sum()) for b in batches] == [4 * i * 4 + 6 for i in range(16)]  # the worker still serves
    del batches


@pytest.mark.slow
def test_log_file_gets_one_plain_line_every_interval(tmp_path):
    proc = run_script("train.py", *TINY, "data.dummy_train_size=64", "data.num_workers=0", "train.epochs=2",
                      "logging.interval=3", f"output_dir={tmp_path / 'run'}")  # stderr is a pipe, not a terminal
    lines = STEP_LINE.findall(proc.stderr)
    # 8 steps per epoch; a line at global steps 3, 6, 9, 12, 15
    assert [(int(e), int(s), int(n)) for e, s, n, *_ in lines] == [(0, 3, 8), (0, 6, 8), (1, 1, 8), (1, 4, 8),
                                                                   (1, 7, 8)], proc.stderr[-3000:]
    assert all(float(loss) > 0 and int(speed) > 0 and float(step_ms) > 0 and 0 <= int(wait) <= 100
               for _, _, _, loss, _, speed, step_ms, wait, _, _ in lines)
    assert "it/s]" not in proc.stderr and "\r" not in proc.stderr  # no tqdm bar in a file


@pytest.mark.slow
def test_terminal_keeps_the_bar_with_the_run_eta(tmp_path):
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))  # tqdm draws nothing 0 wide
    proc = subprocess.Popen([sys.executable, "train.py", *TINY, "data.dummy_train_size=64", "data.num_workers=0",
                             "train.epochs=1", "logging.interval=2", f"output_dir={tmp_path / 'run'}"],
                            cwd=REPO, env=script_env(), stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the process closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=120) == 0
    screen = b"".join(chunks).decode(errors="replace")
    assert re.search(r"epoch 0: .*run_eta=\d+:\d\d:\d\d, step=\d+ms, wait=\d+%", screen), screen[-3000:]
    assert not STEP_LINE.search(screen)


def summary_root_cause(text: str) -> str:
    """The "Root Cause" block of torchrun's ChildFailedError summary."""
    assert "Root Cause (first observed failure):" in text, text[-4000:]
    return text.split("Root Cause (first observed failure):")[1].split("=====")[0]


@pytest.mark.slow
def test_torchrun_summary_names_the_failing_rank_and_its_one_line_error(tmp_path):
    root = make_image_folder(tmp_path / "data", {"train": {"a": 16, "b": 16}, "val": {"a": 4, "b": 4}}, size=20)
    bad = corrupt_in_batch(root, rank=1, batch=2, batch_size=4)
    proc = run_script("train.py", *TINY, "data.name=imagefolder", f"data.root={root}", "train.batch_size=4",
                      "data.num_workers=0", "train.epochs=1", f"output_dir={tmp_path / 'run'}", nproc=2, check=False)
    root_cause = summary_root_cause(proc.stderr)
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)", root_cause), root_cause
    assert (f"traceback : [rank 1] error: cannot read image {bad} (corrupt, truncated or not an image); "
            "remove or replace it") in root_cause, root_cause
    assert "<N/A>" not in proc.stderr.split("Failures:")[1]


@pytest.mark.slow  # a torchrun of 2 processes (fast tier budget)
def test_torchrun_summary_of_evaluate_shows_the_one_line_error(tmp_path):
    missing = tmp_path / "nope.pth"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "evaluate.py"), str(missing)]
    proc = subprocess.run(cmd, cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert (f"traceback : error: checkpoint {missing} does not exist; check the path"
            in summary_root_cause(proc.stderr)), proc.stderr[-3000:]


@pytest.mark.parametrize("code, requeued", [(PREEMPTED, True), (2, False), (0, False)])
def test_sbatch_script_requeues_only_a_preempted_run(tmp_path, code, requeued):
    # No Slurm here: srun and scontrol are stand-ins that record how the script calls them.
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "srun $* @ $MASTER_ADDR:$MASTER_PORT" >> {calls}\nexit {code}\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "scontrol $*" >> {calls}\n'
                                      '[ "$1" = show ] && printf "node-a\\nnode-b\\n"\nexit 0\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = script_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node-[a-b]",
                     SLURM_JOB_NUM_NODES="2")
    proc = subprocess.run(["bash", "scripts/slurm_train.sbatch", "--config", "resnet50", "output_dir=/shared/r50"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert calls.read_text().splitlines() == [
        "scontrol show hostnames node-[a-b]",
        "srun --kill-on-bad-exit=1 python train.py resume=auto --config resnet50 output_dir=/shared/r50 @ node-a:24242",
        *(["scontrol requeue 4242"] if requeued else [])]


def in_imports(pid: int) -> bool:
    """The script is importing: it handles SIGTERM (handle_early ran) or has begun loading libtorch."""
    caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)$", Path(f"/proc/{pid}/status").read_text(), re.M)[1], 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1) or "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def signal_during_imports(runs: list[tuple[str, list[str]]], signum: int, logs: list[Path]) -> list[int]:
    """Run `python script args` for each run at once, send each `signum` while its imports run (seconds of them);
    their exit codes."""
    procs = []
    try:
        for (script, args), log in zip(runs, logs):
            with log.open("w") as f:
                procs.append(subprocess.Popen([sys.executable, script, *args], cwd=REPO, env=script_env(), stdout=f,
                                              stderr=subprocess.STDOUT))
        waiting = list(zip(procs, logs))
        while waiting:
            for proc, log in list(waiting):
                assert proc.poll() is None, log.read_text()
                if in_imports(proc.pid):
                    proc.send_signal(signum)
                    waiting.remove((proc, log))
            time.sleep(0.002)
        return [proc.wait(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()


@pytest.mark.slow
def test_sigterm_during_the_imports_is_one_line_worded_for_each_tool(tmp_path):
    # Was: killed with exit 143 and no line; and the line (after the imports) spoke of resume=auto everywhere.
    # (train.py's line, "with resume=auto the same command continues ...", comes the same way.)
    words = {"evaluate.py": "run the same command again to evaluate from the start",
             "predict.py": "run the same command again to predict from the start",
             "export.py": "run the same command again to export"}
    args = {"evaluate.py": [str(tmp_path / "a.pth")], "predict.py": [str(tmp_path / "a.pth"), str(tmp_path)],
            "export.py": [str(tmp_path / "a.pth"), "--format", "onnx"]}
    logs = [tmp_path / f"{script}.log" for script in words]
    codes = signal_during_imports([(script, args[script]) for script in words], signal.SIGTERM, logs)
    for (script, after), code, log in zip(words.items(), codes, logs):
        text = log.read_text()
        assert code == 143 and text.strip().splitlines() == [
            f"stopped by SIGTERM (a scheduler or torchrun ended the job); {after}"], (script, code, text[-3000:])


@pytest.mark.slow
def test_sigusr1_during_the_imports_is_acted_on_at_the_first_step(tmp_path):
    # Was: killed with exit 138 and no line. train.py stops after its first step; export.py has no steps: it goes on.
    out, logs = tmp_path / "run", [tmp_path / "train.log", tmp_path / "export.log"]
    codes = signal_during_imports([("train.py", [*TINY, "data.dummy_train_size=64", "data.num_workers=0",
                                                 f"output_dir={out}"]),
                                   ("export.py", [str(tmp_path / "a.pth"), "--format", "onnx"])], signal.SIGUSR1, logs)
    text = logs[0].read_text()
    assert codes[0] == PREEMPTED, text[-3000:]
    assert STOP_LINE.findall(text) == [("SIGUSR1", "1", str(out / "last.pth"))], text[-3000:]
    assert load_checkpoint(out / "last.pth")["global_step"] == 1
    assert (codes[1], logs[1].read_text()) == (2, f"error: checkpoint {tmp_path / 'a.pth'} does not exist; check "
                                                  "the path\n")


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its new parent to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_workers_stop_with_a_checkpoint_when_torchrun_dies(tmp_path):
    # SIGUSR1 to torchrun kills torchrun alone (it does not handle it): exit 138. Its workers used to train on,
    # re-parented to PID 1, holding output_dir's lock; now each gets SIGTERM from the kernel (PR_SET_PDEATHSIG).
    out, log = tmp_path / "run", tmp_path / "run.log"
    with log.open("w") as f:
        proc = subprocess.Popen(torchrun(*PREEMPTIBLE, f"output_dir={out}"), cwd=REPO, env=script_env(),
                                stdout=f, stderr=subprocess.STDOUT)
    workers: list[int] = []
    try:
        wait_for(log, r"epoch 0 step 2/128", [proc])
        workers = children(proc.pid)
        assert len(workers) == 2
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=60) == -signal.SIGUSR1
        deadline = time.monotonic() + HANG
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        proc.kill()
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    assert_stopped_mid_epoch(out, text, "SIGTERM")
    assert "Traceback" not in text, text[-3000:]


def test_the_printed_command_names_a_templated_folder_and_resume_auto_only_where_needed(tmp_path):
    # Run again as it was, output_dir=runs/{timestamp} would start a new folder, resume=<file> restart from the file.
    from engine.checkpoint.run_dir import continue_with, resolve_output_dir

    folder = resolve_output_dir(f"{tmp_path}/{{model.name}}-{{timestamp}}", "test_resnet", "auto")
    assert continue_with(folder, "auto") == [f"output_dir={folder}"]
    assert continue_with(str(tmp_path), "auto") == []
    assert continue_with(str(tmp_path), f"{tmp_path}/epoch_0001.pth") == ["resume=auto"]
