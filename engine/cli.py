"""Entry-point plumbing: argument parsing shared by train.py and evaluate.py, and error reporting.

A UserError becomes one line on stderr and exit code 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from engine.errors import UserError


def report_errors(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> int:
    """Run main(argv); turn a UserError into a one-line message (rank 0, or the rank that failed)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        return main(argv) or 0
    except UserError as err:
        if "--debug" in argv:
            raise
        import torch.distributed as dist

        # Before the process group exists every rank fails the same way: rank 0 alone says so.
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
        if rank == 0 or dist.is_initialized():
            prefix = f"[rank {rank}] " if dist.is_initialized() and dist.get_world_size() > 1 else ""
            print(f"{prefix}error: {err}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
