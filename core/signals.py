"""SIGTERM and SIGUSR1: stop training at a step boundary with a checkpoint, or stop at once outside training.

A scheduler ends a job with SIGTERM, and Slurm warns with a signal of the user's choice before a time limit
(`sbatch --signal=USR1@120`). While training steps run (`training_steps()`), both only ask for a stop: the loop
asks every rank at each step boundary (one all-reduce), every rank stops after the same step, last.pth is
written and the process exits with PREEMPTED. From then on the process ignores both, so that a SIGTERM sent
once the first rank has exited (srun --kill-on-bad-exit) cannot turn that exit code into a signal.

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

DataLoader workers must not die of these signals (the parent would fail on their exit before it reaches a step
boundary): they are forked inside `workers_shielded()`, which blocks both, then `worker_signals()` moves each
to a process group of its own (torchrun's and srun's group signals miss it), ignores SIGUSR1 and takes SIGTERM
again, so that their parent's shutdown still ends them.
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
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Terminated(BaseException):
    """SIGTERM arrived outside training; a BaseException so that no `except Exception` on the way swallows it."""

    def __init__(self) -> None:
        super().__init__(launcher_gone() or "a scheduler or torchrun ended the job")


class Preempted(BaseException):
    """Every rank stopped after the same optimizer step because a rank got SIGTERM or SIGUSR1."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(f"preempted by {signal.Signals(signum).name} at global step {step}")
        self.signum, self.step = signum, step
        self.checkpoint: Path | None = None  # set once last.pth holds this step


_held = 0  # depth of sigterm_deferred blocks in progress
_pending = False  # a SIGTERM arrived inside one
_in_steps = 0  # depth of training_steps blocks
_requested = 0  # the stop signal received (SIGTERM wins over SIGUSR1 in the message), 0: none
_stopping = False  # every rank agreed to stop: signals are recorded, never raised, until the process exits
_early = 0  # the stop signal received between handle_early() and stop_on_sigterm() (0: none)
_launcher = 0  # pid of the torchrun that started this process (0: not under torchrun)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def handle_early() -> None:
    """First thing in a script, before its imports: record SIGTERM and SIGUSR1 until stop_on_sigterm() takes them
    over, and under torchrun get SIGTERM when torchrun dies (see the module docstring)."""
    global _launcher
    for signum in STOP_SIGNALS:
        signal.signal(signum, record_early)
    if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform == "linux":
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0:
            _launcher = os.getppid()


def record_early(signum: int, frame) -> None:
    """The handler from handle_early() on: nothing is running yet that a stop could cut."""
    global _early
    _early = max(_early, signum)


def launcher_gone() -> str:
    """Why a SIGTERM came, when it came because torchrun died ("" otherwise)."""
    if _launcher and os.getppid() != _launcher:
        return f"its launcher, torchrun (pid {_launcher}), exited"
    return ""


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Handle SIGTERM and SIGUSR1 in this process for the duration of the block (see the module docstring)."""
    global _requested, _stopping, _early
    main_pid = os.getpid()
    # A new run (in-process callers such as tests run several), with what arrived since handle_early().
    _requested, _stopping, early, _early = _early, False, _early, 0
    if early == signal.SIGTERM:
        raise Terminated()

    def handler(signum: int, frame) -> None:
        global _pending, _requested
        if os.getpid() != main_pid:  # a forked child that has not set handlers of its own: its parent reports
            if signum == signal.SIGTERM:
                os._exit(128 + signum)
            return
        if signum == signal.SIGUSR1 or _in_steps or _stopping:
            _requested = max(_requested, signum)
            return
        if _held:
            _pending = True
            return
        raise Terminated()

    try:
        previous = [signal.signal(signum, handler) for signum in STOP_SIGNALS]
    except ValueError:  # not the main thread (e.g. called from a test's thread): leave signals alone
        yield
        return
    try:
        yield
    finally:
        for signum, old in zip(STOP_SIGNALS, previous):  # a stopping process ignores them until it has exited
            signal.signal(signum, signal.SIG_IGN if _stopping else old)


@contextlib.contextmanager
def training_steps() -> Iterator[None]:
    """Inside: SIGTERM asks for a stop at the next step boundary instead of raising.

    A SIGTERM that came after the last step's check (the ranks agreed to go on) has no boundary left in the block:
    it is acted on as the block ends, as one that arrives outside training steps.
    """
    global _in_steps
    _in_steps += 1
    try:
        yield
    finally:
        _in_steps -= 1
    if not _in_steps and not _stopping and _requested == signal.SIGTERM:
        raise Terminated()


def requested() -> int:
    """The stop signal this process received (0: none)."""
    return _requested


def stop(signum: int) -> None:
    """Every rank agreed to stop (`signum`: the signal one of them got); from now on signals are only recorded."""
    global _requested, _stopping
    _requested, _stopping = max(_requested, signum), True


@contextlib.contextmanager
def workers_shielded() -> Iterator[None]:
    """Fork DataLoader workers inside the block: they start with SIGTERM and SIGUSR1 blocked, until their
    worker_init_fn calls worker_signals().

    A worker that died of a SIGTERM sent to the process group (torchrun, Slurm) makes the parent's SIGCHLD
    handler raise "DataLoader worker ... is killed" before the step finishes. The parent still gets the signals
    (through another of its threads); a SIGTERM is held until the block ends, so that Terminated never leaves a
    DataLoader iterator half built.
    """
    with sigterm_deferred():
        old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def worker_signals() -> None:
    """In a DataLoader worker: leave the training process's process group, so the SIGTERM or SIGUSR1 that torchrun
    or srun sends to the group reaches only the parent (which decides when to stop); ignore SIGUSR1 (Slurm's
    --signal reaches every process of a step); and take SIGTERM again, so that the parent's own shutdown
    (multiprocessing's terminate(), also at interpreter exit) still ends the worker."""
    os.setpgrp()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@contextlib.contextmanager
def sigterm_deferred() -> Iterator[None]:
    """Hold a SIGTERM that arrives inside the block; raise Terminated right after it.

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
        _pending = False
        raise Terminated()
