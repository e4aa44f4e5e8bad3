"""Entry-point plumbing: error reporting and exit codes shared by train.py and evaluate.py.

A UserError becomes one line on stderr and exit code 2; `--debug` shows the traceback instead.
A rank whose peer died (its collective fails with a connection error) says so in one line and
exits 1: the peer's own error is the one that explains the failure. A run stopped by SIGTERM or SIGUSR1
during training exits 124 once last.pth holds the step every rank stopped at (engine/signals.py);
SIGTERM outside training ends the run with one line and exit code 143. DataLoader workers stay quiet.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable

from engine.errors import UserError
from engine.signals import PREEMPTED, Preempted, Terminated, stop_on_sigterm

PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Timed out", "timed out")


def report_errors(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> int:
    """Run main(argv); turn a UserError into a one-line message (rank 0, or the rank that failed)."""
    argv = sys.argv[1:] if argv is None else argv
    import torch.distributed as dist

    from engine.dist import cleanup

    def prefix() -> str:
        return f"[rank {dist.get_rank()}] " if dist.is_initialized() and dist.get_world_size() > 1 else ""

    # The final messages are print()ed to stderr, not logged: they must appear whatever the rank's
    # log level and must be the last line a user sees.
    try:
        with stop_on_sigterm():
            return main(argv) or 0
    except UserError as err:
        if "--debug" in argv:
            raise
        # Before the process group exists every rank fails the same way: rank 0 alone says so.
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
        line = f"{prefix()}error: {err}"
        if rank == 0 or err.before_group or (dist.is_initialized() and not err.all_ranks):
            print(line, file=sys.stderr, flush=True)
        return 2
    except RuntimeError as err:
        if "--debug" in argv or not lost_peer(err):
            raise
        first = str(err).strip().splitlines()[0]
        line = (f"[rank {dist.get_rank()}] stopped: a collective failed because another process failed, was killed "
                f"or hung ({first}); that process's own error says why")
        print(line, file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Terminated:
        line = (f"{prefix()}stopped by SIGTERM (a scheduler or torchrun ended the job); with resume=auto the same "
                "command continues from the last checkpoint in output_dir")
        print(line, file=sys.stderr, flush=True)
        return 128 + signal.SIGTERM
    except Preempted as stopped:
        line = f"{stopped}: {stopped.checkpoint} written; resume=auto continues"
        if not dist.is_initialized() or dist.get_rank() == 0:  # every rank stopped at the same step
            print(line, file=sys.stderr, flush=True)
        return PREEMPTED
    finally:
        cleanup()  # only now: the messages above need to know whether a process group existed


def lost_peer(err: RuntimeError) -> bool:
    """A collective that failed because another rank is gone or stuck (gloo/NCCL errors, timeouts)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    return isinstance(err, dist.DistError) or any(text in str(err) for text in PEER_LOST)
