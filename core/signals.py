"""SIGTERM, SIGUSR1 and SIGINT: stop training at a step boundary with a checkpoint, or stop at once outside training.

A scheduler ends a job with SIGTERM, and Slurm warns with a signal of the user's choice before a time limit
(`sbatch --signal=USR1@120`). While a run trains (`training_steps()`: fit holds it over its epochs, their steps,
validations and the hooks after them), both only ask for a stop: the loop asks every rank at each step boundary,
the validation at each batch boundary and fit once an epoch's hooks (its checkpoint) are done (one all-reduce
each), every rank stops at the same place, last.pth is written (a validation cut short is recorded in it, and
the continued run does it first) and the process exits with PREEMPTED. From then on the process ignores both, so
that a SIGTERM sent once the first rank has exited (srun --kill-on-bad-exit) cannot turn that exit code into a
signal.

Outside training (start-up, evaluation) SIGTERM raises `Terminated` at once, so the entry point prints one line
and exits 143; inside `sigterm_deferred()` (a torch.save, whose C++ writer aborts the process if a Python
exception cuts it) the signal is held until the block ends. SIGUSR1 is only ever recorded.

Before that, from the first lines of a script (`handle_early()`, called before its imports, which take seconds),
both are recorded: a SIGUSR1 is then acted on at the first training step, a SIGTERM as soon as the entry point
runs (one line, exit 143); the default action would kill the process with no line. Under torchrun the same call
asks Linux to send this process SIGTERM when torchrun dies (prctl PR_SET_PDEATHSIG): torchrun ends at once on a
signal it does not handle (SIGUSR1: exit 138), and its workers, re-parented to PID 1, would train on alone and
keep output_dir locked. The kernel does it for nothing, at any moment (start-up, evaluation, training), so no
step pays for a check; a torchrun that dies during the worker's first milliseconds, before the call, is missed.

SIGINT (Ctrl-C) is handled the same way, once: inside training steps it asks for the same stop (rank 0 says so
at once), and the entry point then prints the command that continues the run and exits 130; outside training it
raises KeyboardInterrupt (held inside `sigterm_deferred()` like SIGTERM): one line `interrupted`, exit 130. The
first SIGINT puts back the default action, so a second one ends the process at once, whatever it is doing: no
save starts, and a write it cuts leaves only a hidden temp file (every checkpoint is written beside its name and
renamed into place), which the next save removes. Under torchrun the workers get SIGINT from torchrun only (it
starts each in a session of its own); on a second Ctrl-C torchrun sends them SIGTERM, so a worker that got SIGINT
gives SIGTERM its default action too. A process started with SIGINT ignored (a shell script's background job)
keeps ignoring it. During the imports (`handle_early()`) a SIGINT ends the process at once with the one line.

DataLoader workers must not die of these signals (the parent would fail on their exit before it reaches a step
boundary): they are forked inside `workers_shielded()`, which blocks all three, then `worker_signals()` moves
each to a process group of its own (torchrun's and srun's group signals, and a terminal's Ctrl-C, miss it),
ignores SIGUSR1 and SIGINT and takes SIGTERM again, so that their parent's shutdown still ends them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Iterator

PREEMPTED = 124  # exit code of a run stopped by SIGTERM/SIGUSR1 with last.pth written (as timeout(1) uses)
INTERRUPTED = 130  # exit code of a run stopped by SIGINT, with or without last.pth (128 + SIGINT, as shells report)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
HANDLED = (*STOP_SIGNALS, signal.SIGINT)


class Terminated(BaseException):
    """SIGTERM arrived outside training; a BaseException so that no `except Exception` on the way swallows it."""

    def __init__(self) -> None:
        super().__init__(launcher_gone() or "a scheduler or torchrun ended the job")


class Preempted(BaseException):
    """Every rank stopped at the same place (after an optimizer step; `during`: inside a validation, which the
    continued run does first) because a rank got SIGTERM, SIGUSR1 or SIGINT."""

    def __init__(self, signum: int, step: int, during: str = "") -> None:
        what = "interrupted (SIGINT)" if signum == signal.SIGINT else f"preempted by {signal.Signals(signum).name}"
        super().__init__(f"{what} at global step {step}" + (f", during {during}" if during else ""))
        self.signum, self.step = signum, step
        self.checkpoint: Path | None = None  # set once last.pth holds this step
        self.overrides: list[str] = []  # key=value to add to the command that started the run so that it continues


_held = 0  # depth of sigterm_deferred blocks in progress
_pending = 0  # the signal (SIGTERM or SIGINT, the larger) that arrived inside one, 0: none
_in_steps = 0  # depth of training_steps blocks
_requested = 0  # the stop signal received (SIGTERM wins over SIGUSR1, SIGUSR1 over SIGINT), 0: none
_interrupted = False  # a SIGINT arrived: the next one takes the default action (ends the process)
_stopping = False  # every rank agreed to stop: signals are recorded, never raised, until the process exits
_early = 0  # the stop signal received between handle_early() and stop_on_sigterm() (0: none)
_launcher = 0  # pid of the torchrun that started this process (0: not under torchrun)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def handle_early() -> None:
    """First thing in a script, before its imports: record SIGTERM and SIGUSR1 until stop_on_sigterm() takes them
    over, end at once with one line on SIGINT, and under torchrun get SIGTERM when torchrun dies (see the module
    docstring)."""
    global _launcher
    for signum in STOP_SIGNALS:
        signal.signal(signum, record_early)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, interrupted_early)
    if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform == "linux":
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0:
            _launcher = os.getppid()


def record_early(signum: int, frame) -> None:
    """The handler from handle_early() on: nothing is running yet that a stop could cut."""
    global _early
    _early = max(_early, signum)


def interrupted_early(signum: int, frame) -> None:
    """SIGINT during the imports: nothing has started that a stop could save or cut."""
    os.write(2, b"interrupted\n")
    os._exit(INTERRUPTED)


def launcher_pid() -> int:
    """The pid of the torchrun that started this process (0: not under torchrun)."""
    return _launcher


def launcher_gone() -> str:
    """Why a SIGTERM came, when it came because torchrun died ("" otherwise)."""
    if _launcher and os.getppid() != _launcher:
        return f"its launcher, torchrun (pid {_launcher}), exited"
    return ""


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Handle SIGTERM, SIGUSR1 and SIGINT in this process for the duration of the block (see the module
    docstring)."""
    global _requested, _stopping, _early, _interrupted
    main_pid = os.getpid()
    # A new run (in-process callers such as tests run several), with what arrived since handle_early().
    _requested, _stopping, early, _early, _interrupted = _early, False, _early, 0, False
    if early == signal.SIGTERM:
        raise Terminated()

    def handler(signum: int, frame) -> None:
        global _pending, _requested
        if os.getpid() != main_pid:  # a forked child that has not set handlers of its own: its parent reports
            if signum == signal.SIGTERM:
                os._exit(128 + signum)
            return
        if signum == signal.SIGINT:
            interrupt()
        if signum == signal.SIGUSR1 or _in_steps or _stopping:
            _requested = max(_requested, signum)
            return
        if _held:
            _pending = max(_pending, signum)
            return
        raise_for(signum)

    signums = HANDLED if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN else STOP_SIGNALS
    try:
        previous = [signal.signal(signum, handler) for signum in signums]
    except ValueError:  # not the main thread (e.g. called from a test's thread): leave signals alone
        yield
        return
    try:
        yield
    finally:
        for signum, old in zip(signums, previous):  # a stopping process ignores them until it has exited
            if _interrupted and signal.getsignal(signum) is signal.SIG_DFL:
                continue  # interrupt() set it: a second Ctrl-C still ends the exit at once
            signal.signal(signum, signal.SIG_IGN if _stopping and signum != signal.SIGINT else old)


def interrupt() -> None:
    """The first SIGINT: the next one ends the process (under torchrun, which answers a second Ctrl-C with SIGTERM,
    SIGTERM too); inside training steps rank 0 says that the run stops."""
    global _interrupted
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if _launcher or "TORCHELASTIC_RUN_ID" in os.environ:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _interrupted = True
    if (_in_steps or _stopping) and int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0:
        # os.write: a print() here could land inside one the main thread is making (a reentrant write raises)
        os.write(2, b"\n" * os.isatty(2) + b"stopping after this step (or validation batch) to write last.pth "
                 b"(Ctrl-C again stops at once, without it)\n")


def raise_for(signum: int) -> None:
    """Outside training: SIGTERM raises Terminated, SIGINT KeyboardInterrupt."""
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


@contextlib.contextmanager
def training_steps() -> Iterator[None]:
    """Inside: SIGTERM and SIGINT ask for a stop at the next step (or validation batch) boundary instead of raising.

    A SIGTERM or SIGINT that came after the last check (the ranks agreed to go on) has no boundary left in the
    block: it is acted on as the (outermost) block ends, as one that arrives outside training steps.
    """
    global _in_steps
    _in_steps += 1
    try:
        yield
    finally:
        _in_steps -= 1
    if not _in_steps and not _stopping and (_requested == signal.SIGTERM or _interrupted):
        raise_for(_requested if _requested == signal.SIGTERM else signal.SIGINT)


def requested() -> int:
    """The stop signal this process received (0: none)."""
    return _requested


def stop(signum: int) -> None:
    """Every rank agreed to stop (`signum`: the signal one of them got); from now on signals are only recorded."""
    global _requested, _stopping
    _requested, _stopping = max(_requested, signum), True


def stop_together(signum: int, step: int, during: str = "") -> None:
    """`signum`: the largest stop signal over ranks, from one all-reduce every rank made at the same place (0: none,
    go on); all raise Preempted there together."""
    if signum:
        stop(signum)
        raise Preempted(signum, step, during)


@contextlib.contextmanager
def workers_shielded() -> Iterator[None]:
    """Fork DataLoader workers inside the block: they start with SIGTERM, SIGUSR1 and SIGINT blocked, until their
    worker_init_fn calls worker_signals().

    A worker that died of a SIGTERM sent to the process group (torchrun, Slurm) makes the parent's SIGCHLD
    handler raise "DataLoader worker ... is killed" before the step finishes. The parent still gets the signals
    (through another of its threads); a SIGTERM is held until the block ends, so that Terminated never leaves a
    DataLoader iterator half built. A worker that took a terminal's Ctrl-C before leaving the group would end
    its loop quietly and the parent would wait for its batches.
    """
    with sigterm_deferred():
        old = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def worker_signals() -> None:
    """In a DataLoader worker: leave the training process's process group, so the SIGTERM, SIGUSR1 or SIGINT that
    torchrun, srun or a terminal sends to the group reaches only the parent (which decides when to stop); ignore
    SIGUSR1 (Slurm's --signal reaches every process of a step) and SIGINT (a pending one is dropped); and take
    SIGTERM again, so that the parent's own shutdown (multiprocessing's terminate(), also at interpreter exit)
    still ends the worker. A parent that dies of a second Ctrl-C is noticed by torch's watchdog in each worker."""
    os.setpgrp()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED)


@contextlib.contextmanager
def sigterm_deferred() -> Iterator[None]:
    """Hold a SIGTERM or a first SIGINT that arrives inside the block; raise Terminated (KeyboardInterrupt) right
    after it.

    Python runs signal handlers in the main thread only: another thread (the background checkpoint writer) is
    never cut by one, so there the block holds nothing (the main thread waits for that thread before exiting).
    """
    global _held, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _held += 1
    try:
        yield
    finally:
        _held -= 1
    if _pending and not _held:
        signum, _pending = _pending, 0
        raise_for(signum)
