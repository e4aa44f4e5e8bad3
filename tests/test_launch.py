"""Launching goes wrong in one line: stray launch variables, a backend without its devices, SIGTERM, a folder
given as a checkpoint."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
import torch

import evaluate
import train
from core.cli import report_errors
from core.dist import collective_timeout
from engine.checkpoint.formats import load_checkpoint
from tests.helpers import REPO, TINY, free_port, script_env, wait_for_file



@pytest.mark.slow
def test_stray_launch_variables_say_what_is_awaited_and_end_in_one_line(tmp_path):
    # An sbatch script calling `python train.py` without srun: SLURM says 2 tasks, nobody else starts.
    env = script_env(SLURM_PROCID="0", SLURM_NTASKS="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "train.py", *TINY, "dist.rendezvous_timeout_s=3",
                           f"output_dir={tmp_path / 'run'}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "rank 0 of 2: waiting up to 3 s for all processes to join at 127.0.0.1:" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the 2 processes did not meet at 127.0.0.1:") and "within 3 s" in last, last
    assert "SLURM_PROCID=0 SLURM_NTASKS=2 MASTER_ADDR=127.0.0.1" in last and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_collective_timeout_is_shorter_without_an_elastic_agent():
    assert collective_timeout(0, {"TORCHELASTIC_RUN_ID": "x"}) == 1800
    assert collective_timeout(0, {"SLURM_PROCID": "0"}) == 600  # srun: survivors of a dead rank wait this long
    assert collective_timeout(42, {}) == 42


def test_nccl_without_gpus_is_one_line(tmp_path, capsys):
    code = report_errors(train.main, [*TINY, "dist.backend=nccl", f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("error: dist.backend=nccl needs CUDA GPUs and this process sees none; "
                                            "use dist.backend=auto (gloo on CPU)")


def test_a_folder_given_as_checkpoint_is_named_as_a_folder(tiny_run, capsys):
    code = report_errors(evaluate.main, [str(tiny_run)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"error: checkpoint {tiny_run} is a folder, not a file (it holds "
                                            f"best.pth, last.pth); give the .pth file itself, e.g. "
                                            f"{tiny_run / 'best.pth'}")


@pytest.mark.slow
def test_sigterm_during_training_stops_after_the_step_with_one_line_and_quiet_workers(tmp_path):
    # Outside training SIGTERM stops at once (exit 143): tests/test_preemption.py. Here a step checkpoint was just
    # written for the step the run stops at: last.pth is not written a second time for it.
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", *TINY, "data.num_workers=2", "data.dummy_train_size=2048", "train.epochs=5",
           "train.ckpt_every_steps=1", f"output_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=script_env(), stderr=subprocess.PIPE, text=True)
    try:
        wait_for_file(out / "last.pth", proc)  # training is under way, workers running
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 124, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(rf"preempted by SIGTERM at global step (\d+): {re.escape(str(out))}/last.pth written; "
                        "resume=auto continues", last), err[-3000:]
    assert load_checkpoint(out / "last.pth")["global_step"] == int(re.search(r"step (\d+)", last)[1])
    assert "Traceback" not in err and "ConnectionResetError" not in err and "DataLoader worker" not in err


def test_sigterm_inside_a_checkpoint_write_waits_for_the_write_to_finish(tmp_path):
    import pytest
    import torch

    from core.files import save_atomic
    from core.signals import Terminated, sigterm_deferred, stop_on_sigterm

    class SignalMidWrite:
        def __reduce__(self):  # runs inside torch.save's C++ writer, the place a raise would abort the process
            os.kill(os.getpid(), signal.SIGTERM)
            return (int, (7,))

    with stop_on_sigterm(), pytest.raises(Terminated):
        save_atomic({"step": SignalMidWrite(), "w": torch.ones(3)}, tmp_path / "last.pth")
    # written whole, then the signal was raised (our own test file: safe to unpickle its int(7) call)
    assert torch.load(tmp_path / "last.pth", weights_only=False)["step"] == 7
    with stop_on_sigterm(), pytest.raises(Terminated):
        with sigterm_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("not reached: Terminated is raised as the block ends")


def test_sigterm_during_a_background_write_stops_the_run_and_the_write_finishes(tmp_path):
    """train.async_save: SIGTERM sent from inside the writer thread's torch.save reaches the main thread (Python
    runs handlers there), which stops at once (Terminated) while it waits; close() lets the write end, whole."""
    from core.dist import DistInfo
    from core.signals import Terminated, stop_on_sigterm
    from engine.checkpoint.saver import Checkpointer
    from engine.state import TrainState

    class SignalMidWrite:
        def __reduce__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            return (int, (7,))

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpointer = Checkpointer(tmp_path, DistInfo(0, 1, 0, 1, torch.device("cpu")), 0, model=model,
                                optimizer=optimizer, scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1),
                                scaler=None, config={"step": SignalMidWrite()}, class_names=["a", "b"],
                                async_save=True)
    with stop_on_sigterm(), pytest.raises(Terminated):
        try:
            checkpointer.save(TrainState(epoch=1, global_step=1))
            checkpointer.wait()
        finally:
            checkpointer.close()
    assert checkpointer.writer is None
    # written whole (our own test file: safe to unpickle its int(7) call)
    assert torch.load(tmp_path / "last.pth", weights_only=False)["config"]["step"] == 7


class ReportsWorkerHook(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> bool:
        import sys

        from data.loader import _quiet_if_parent_gone
        return sys.excepthook is _quiet_if_parent_gone


def test_workers_stay_quiet_when_their_parent_is_gone(capsys):
    """multiprocessing's resource-sharing thread in a worker reports a parent that died mid-handshake through
    sys.excepthook; the workers' hook drops exactly those connection errors."""
    from core.config import DataConfig
    from data.loader import _loader_kwargs, _quiet_if_parent_gone

    kwargs = _loader_kwargs(DataConfig(num_workers=2, persistent_workers=False), torch.device("cpu"), 0)
    assert all(torch.utils.data.DataLoader(ReportsWorkerHook(), batch_size=None, **kwargs))
    for error in (ConnectionResetError("reset by peer"), EOFError(), BrokenPipeError()):
        _quiet_if_parent_gone(type(error), error, None)
    assert capsys.readouterr().err == ""
    _quiet_if_parent_gone(ValueError, ValueError("a real bug"), None)
    assert "ValueError: a real bug" in capsys.readouterr().err


def test_sigterm_after_the_last_step_check_stops_as_the_training_steps_end():
    """A SIGTERM between the last step's stop check and the end of the epoch's steps (its logging, hooks) was only
    recorded, and the run evaluated and finished with exit 0; it is now acted on as the steps end."""
    from core.signals import Terminated, stop_on_sigterm, training_steps

    with stop_on_sigterm(), pytest.raises(Terminated):
        with training_steps():
            os.kill(os.getpid(), signal.SIGTERM)  # recorded only: inside the steps a SIGTERM asks for a stop
        raise AssertionError("not reached: Terminated is raised as the steps end")
    with stop_on_sigterm():  # a SIGUSR1 there waits for the next step, as documented
        with training_steps():
            os.kill(os.getpid(), signal.SIGUSR1)


@pytest.fixture
def signal_handlers_restored():
    """A test that sends itself SIGINT leaves pytest's handlers as it found them (the first Ctrl-C puts back SIGINT's
    default action, a stopping run ignores SIGTERM and SIGUSR1), and core.signals as a new run finds it."""
    from core.signals import stop_on_sigterm

    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    yield
    with stop_on_sigterm():  # resets the recorded signal and the stop
        pass
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_ctrl_c_after_the_last_step_check_stops_as_the_training_steps_end(signal_handlers_restored, capsys):
    """A Ctrl-C between the last step's stop check and the end of the epoch's steps has no step boundary left to
    stop at: it is acted on as the steps end (one line, exit 130), never swallowed by a run that carries on."""
    from core.signals import training_steps

    def main(argv: list[str]) -> int:
        with training_steps():
            os.kill(os.getpid(), signal.SIGINT)  # recorded only: inside the steps a Ctrl-C asks for a stop
        raise AssertionError("not reached: KeyboardInterrupt is raised as the steps end")

    assert report_errors(main, []) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "interrupted"


def test_ctrl_c_inside_training_steps_stops_at_the_next_check_a_second_one_ends_at_once_and_exits_130(
        signal_handlers_restored, capsys):
    """The first Ctrl-C only asks for a stop, which the next step's check (Precision.step, as the loop calls it)
    returns; it puts back SIGINT's default action, kept while the run exits, so that a second Ctrl-C ends the process
    at once; the entry point prints the command that continues the run and exits 130 (not a preemption's 124)."""
    from core.signals import Preempted, requested, stop, training_steps
    from engine.precision import Precision

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def main(argv: list[str]) -> int:
        with training_steps():
            os.kill(os.getpid(), signal.SIGINT)
            assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL  # a second Ctrl-C: the default action
            model(torch.ones(1, 2)).sum().backward()
            stepped, signum = Precision("cpu", None).step(optimizer, model, 0.0, requested())
            assert stepped and signum == signal.SIGINT
            stop(signum)  # as engine/trainer.py does with the answer every rank got
            raise Preempted(signum, 1)

    assert report_errors(main, []) == 130
    assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL  # still, while the process exits
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("interrupted (SIGINT) at global step 1: None written; to continue, run in "), last


def test_a_finished_run_is_freed_by_reference_counting_alone(tmp_path, monkeypatch):
    """No hook refers back to the run (ValidateEvery gets the validation and the other hooks as arguments): once
    fit returns, the Run, its hooks and its validation (with their loaders) are freed without the cycle collector."""
    import gc
    import weakref

    import assembly.fit

    made = []

    def observed(*args, **kwargs):
        run = build_run(*args, **kwargs)
        made.extend(weakref.ref(part) for part in (run, run.validation, *run.hooks))
        return run

    build_run = assembly.fit.build_run
    monkeypatch.setattr(assembly.fit, "build_run", observed)
    gc.collect()
    gc.disable()
    try:
        assert report_errors(train.main, [*TINY, "train.val_every_steps=2", f"output_dir={tmp_path}"]) == 0
        alive = [ref() for ref in made if ref() is not None]
    finally:
        gc.enable()
    assert len(made) > 3 and not alive, [type(part).__name__ for part in alive]
