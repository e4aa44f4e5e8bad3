"""Entry-point plumbing shared by train.py, evaluate.py and predict.py: reading argv, error reporting and exit codes.

Config overrides may come anywhere among a tool's flags, as `key=value`, `--key=value` or `--key value`
(`parse_with_overrides`); they all become `key=value` for core/config_load.py.

A UserError becomes one line on stderr and exit code 2; `--debug` shows the traceback instead.
A rank whose peer died (its collective fails with a lost connection or a timeout) says so in one line
and exits 1: the peer's own error is the one that explains the failure. Any other collective error (CUDA,
out of memory inside NCCL) is this rank's own: one line saying so, then its traceback. A run stopped by
SIGTERM or SIGUSR1 during training exits 124 once last.pth holds the step every rank stopped at (core/signals.py);
SIGTERM outside training ends the run with one line and exit code 143. A run stopped by SIGINT (Ctrl-C) during
training exits 130 once last.pth is written, rank 0 printing the command that continues it (`continue_command`);
outside training SIGINT prints `interrupted` and exits 130 too. DataLoader workers stay quiet.

Under torchrun each of these lines also goes to the rank's error file (TORCHELASTIC_ERROR_FILE), so that
torchrun's failure summary shows it instead of "<N/A>"; `run_main` adds torch's `record`, which writes the
traceback of anything else (a bug) there.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import math
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Callable, NoReturn

from core.config import Config
from core.errors import UserError
from core.signals import INTERRUPTED, PREEMPTED, Preempted, Terminated, launcher_pid, stop_on_sigterm

# What a collective says when another rank is gone or stuck: gloo's TCP errors and timeouts, NCCL's watchdog
# timeout and remote error. Any other collective error (a CUDA error, an out-of-memory inside NCCL, invalid
# usage) is this rank's own.
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Connection refused", "Broken pipe",
             "Timed out", "timed out", "Socket Timeout", "Watchdog caught collective operation timeout",
             "ncclRemoteError", "remote process exit")


def parse_with_overrides(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The tool's flags and its config overrides in any order, each override as `key=value`, `--key=value` or
    `--key value` (a W&B sweep agent's form): one reading of argv for train.py, evaluate.py and predict.py."""
    flags = {flag for action in parser._actions for flag in action.option_strings}
    return parser.parse_intermixed_args(as_overrides(argv, flags))


class GivenOnce(argparse.Action):
    """A flag with one value (`--config`): given twice is one line, where argparse keeps the last silently (`--config
    a --config b` read b alone)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: str,
                 option_string: str | None = None) -> None:
        if (before := getattr(namespace, self.dest, None)) is not None:
            raise UserError(f"{option_string} given twice ({before!r}, then {values!r}); a run reads one config file: "
                            "copy the keys you need from one into the other, or give them as key=value overrides")
        setattr(namespace, self.dest, values)


def parse_without_overrides(parser: argparse.ArgumentParser, argv: list[str], why: str) -> argparse.Namespace:
    """A tool that takes no config overrides (export.py): `amp=bf16` is one line saying why, not argparse's
    `unrecognized arguments` beside docs that name the key."""
    _, rest = parser.parse_known_args(argv)
    if overrides := [item for item in rest if is_config_override(item.removeprefix("--"))]:
        raise UserError(f"{parser.prog} takes no config overrides ({' '.join(overrides)}): {why}")
    return parser.parse_args(argv)


def as_overrides(argv: list[str], flags: set[str]) -> list[str]:
    """argv with `--key=value` and `--key value` rewritten as `key=value` where key is a config key's form (dotted,
    or a top-level key such as seed), not one of the tool's `flags`; anything else is left to argparse."""
    top_level = {f.name for f in dataclasses.fields(Config)}
    out, rest = [], list(argv)
    while rest:
        item = rest.pop(0)
        name, eq, value = item[2:].partition("=")
        if not item.startswith("--") or f"--{name}" in flags or not ("." in name or name in top_level):
            out.append(item)
            continue
        if not eq:
            if not rest or rest[0].startswith("--") or is_config_override(rest[0]):
                raise UserError(f"{item} needs a value: {item}=VALUE or {name}=VALUE")
            value = rest.pop(0)
        out.append(f"{name}={value}")
    return out


def is_config_override(item: str) -> bool:
    """Whether item reads as `key=value` for a schema key (or an option under a `kwargs` mapping): after `--key`
    it is the next override, not key's value (`--output_dir optim.lr=0.3` would take the text as a folder)."""
    from core.config import key_facts

    name, eq, _ = item.partition("=")
    keys = key_facts()
    return bool(eq) and (name in keys or any(name.startswith(f"{k}.") and k.endswith("kwargs") for k in keys))


def run_main(main: Callable[[list[str]], int | None], after_sigterm: str) -> NoReturn:
    """`python train.py ...`: main(sys.argv[1:]) through report_errors, and torch's `record` under torchrun (it writes
    the error file torchrun reports); alone, the fault handler record would enable, and no torch import before the
    arguments are parsed (`--help` answers at once)."""
    if "TORCHELASTIC_ERROR_FILE" not in os.environ:
        faulthandler.enable(all_threads=True)
        sys.exit(report_errors(main, after_sigterm=after_sigterm))
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(report_errors)(main, after_sigterm=after_sigterm))


def report_errors(main: Callable[[list[str]], int | None], argv: list[str] | None = None, *,
                  after_sigterm: str = "run the same command again") -> int:
    """Run main(argv); turn a UserError into a one-line message (rank 0, or the rank that failed).

    `after_sigterm` ends the line of a run stopped by SIGTERM: what the tool's user can do next."""
    argv = sys.argv[1:] if argv is None else argv

    def prefix() -> str:
        group = rank_and_size()
        return f"[rank {group[0]}] " if group and group[1] > 1 else ""

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
        if rank == 0 or err.before_group or (rank_and_size() is not None and not err.all_ranks):
            print(line, file=sys.stderr, flush=True)
        tell_torchrun(line, caused_here=True)
        return 2
    except RuntimeError as err:
        group = rank_and_size()
        line = collective_failure_line(err, group[0]) if group and group[1] > 1 and "--debug" not in argv else None
        if line is None:
            raise
        print(line, file=sys.stderr, flush=True)
        if not peer_lost_error(err):
            raise  # this rank's own failure: its traceback follows the line (and goes to torchrun's summary)
        tell_torchrun(line, caused_here=False)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        tell_torchrun("interrupted", caused_here=False)
        return INTERRUPTED
    except Terminated as err:
        line = f"{prefix()}stopped by SIGTERM ({err}); {after_sigterm}"
        print(line, file=sys.stderr, flush=True)
        tell_torchrun(line, caused_here=False)
        return 128 + signal.SIGTERM
    except Preempted as stopped:
        interrupted = stopped.signum == signal.SIGINT
        line = f"{stopped}: {stopped.checkpoint} written; " + (how_to_continue(stopped) if interrupted
                                                                 else "resume=auto continues")
        if (group := rank_and_size()) is None or group[0] == 0:  # every rank stopped at the same step
            print(line, file=sys.stderr, flush=True)
        tell_torchrun(line, caused_here=True)
        return INTERRUPTED if interrupted else PREEMPTED
    finally:
        if "torch" in sys.modules:  # only now: the messages above need to know whether a process group existed
            from core.dist import cleanup

            cleanup()


def rank_and_size() -> tuple[int, int] | None:
    """(rank, world size) of this process's group, or None without one. Without torch loaded no group can exist, and
    torch is not imported to learn it: --help and the refusals made before the first torch import stay fast."""
    if "torch" not in sys.modules:
        return None
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else None


def how_to_continue(stopped: Preempted) -> str:
    """The end of the line of a run stopped by Ctrl-C: the command that continues it, when this process can see
    the whole command (one process, or torchrun on one node), else what to run."""
    command = continue_command(stopped.overrides)
    if command is not None:
        return f"to continue, run in {os.getcwd()}: {command}"
    added = f" with {' '.join(stopped.overrides)} added" if stopped.overrides else ""
    return f"to continue, launch the same command again{added}: resume=auto continues from it"


def continue_command(overrides: list[str]) -> str | None:
    """The command line that started this process, or its torchrun's (one node), with `overrides` added at the end
    (the last value of a key wins); None under another launcher or several nodes (srun, torchrun per node)."""
    if launcher_pid():
        if os.environ.get("WORLD_SIZE") != os.environ.get("LOCAL_WORLD_SIZE"):
            return None  # other nodes' torchrun commands differ (--node-rank) and are not ours to see
        try:
            argv = Path(f"/proc/{launcher_pid()}/cmdline").read_bytes().decode().split("\0")[:-1]
        except OSError:
            return None
        script = shutil.which("torchrun")
        if len(argv) > 1 and script and os.path.realpath(argv[1]) == os.path.realpath(script):
            argv = ["torchrun", *argv[2:]]  # run through its #! line: `torchrun` on PATH is that same file
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return None
    else:
        argv = list(sys.orig_argv)
    return shlex.join([*argv, *overrides])


def tell_torchrun(line: str, caused_here: bool) -> None:
    """Write `line` to this rank's torchrun error file (TORCHELASTIC_ERROR_FILE), in torch's ErrorHandler format.

    torchrun names the failure with the earliest timestamp the root cause, and timestamps are whole seconds:
    a rank stopped by another's failure rounds its time up, the failing rank down, so a tie cannot make
    the bystander the root cause.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    stamp = math.floor(now) if caused_here else math.ceil(now)
    try:
        Path(path).write_text(json.dumps({"message": {"message": line, "extraInfo": {"timestamp": str(stamp)}}}))
    except OSError:
        pass  # the summary then says <N/A>; stderr has the line anyway


def peer_lost_error(err: RuntimeError) -> bool:
    """Only a lost connection or a timeout means another rank failed, was killed or hung."""
    import torch.distributed as dist

    return isinstance(err, (dist.DistNetworkError, dist.DistStoreError)) or any(t in str(err) for t in PEER_LOST)


def collective_failure_line(err: RuntimeError, rank: int) -> str | None:
    """The one line that names who failed: another rank (a lost peer) or this one (any other collective error)."""
    import torch.distributed as dist

    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if peer_lost_error(err):
        return (f"[rank {rank}] stopped: a collective failed because another process failed, was killed or hung "
                f"({first}); that process's own error says why")
    if isinstance(err, dist.DistError):
        return f"[rank {rank}] error: a collective failed in this process itself ({first}); traceback follows"
    return None
