"""SIGTERM as an exception in the main process: raised at once, except inside blocks that must not be cut.

A scheduler or torchrun ends a job with SIGTERM. Raising `Terminated` from the handler lets the entry point
print one line and exit 143 with every file closed; inside `sigterm_deferred()` (a torch.save, whose C++
writer aborts the process if a Python exception cuts it) the signal is held until the block ends.
Forked DataLoader workers inherit the handler and simply exit: their parent reports.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Iterator


class Terminated(BaseException):
    """SIGTERM arrived; a BaseException so that no `except Exception` on the way swallows it."""


_held = 0  # depth of sigterm_deferred blocks in progress
_pending = False  # a SIGTERM arrived inside one


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into Terminated in this process for the duration of the block."""
    main_pid = os.getpid()

    def handler(signum: int, frame) -> None:
        global _pending
        if os.getpid() != main_pid:
            os._exit(128 + signum)
        if _held:
            _pending = True
            return
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (e.g. called from a test's thread): leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def sigterm_deferred() -> Iterator[None]:
    """Hold a SIGTERM that arrives inside the block; raise Terminated right after it."""
    global _held, _pending
    _held += 1
    try:
        yield
    finally:
        _held -= 1
    if _pending and not _held:
        _pending = False
        raise Terminated()
