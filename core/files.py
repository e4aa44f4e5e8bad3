"""Every file the app writes, through one idiom: a temp file beside the target, fsynced, then one rename.

Checkpoints (save_atomic), the run's config.yaml and metrics.jsonl (atomic_file), best.pth linked to last.pth
(link_atomic), and the user-facing outputs (exports, predictions, evaluations, shards, the CSV part files) all
go through here. A crash mid-write leaves the previous file whole.

An output replaces only what is recognisably an earlier output of the same kind (the caller's `ours` test),
atomically: a file by one rename of a temp file beside it; a folder by renaming the old one aside, the new
one in, then removing the old (a SIGTERM waits for both renames). Temp names are unique per process, so two
commands writing the same path cannot delete each other's files. Anything else at the path is refused with
one line and left as it is. New files get mode 0666 minus the umask, like the run's other files.
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Sequence

import torch

from core.errors import UserError
from core.signals import sigterm_deferred

Recognise = Callable[[Path], bool]  # True when the existing path is an earlier output of this kind


TEMP = re.compile(r"\.(?P<name>.+?)(?:\.\d+)?\.[0-9a-f]{8}\.(?P<tag>tmp|old)")  # temp_name's (older ones: no pid)


def temp_name(path: Path, tag: str = "tmp") -> Path:
    """A hidden name beside `path`, unique to this process (and to this call)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.{tag}")


def remove_dead_temps(folder: Path, ours: Callable[[str], bool]) -> None:
    """Remove the temp files and folders a killed writer left in `folder` under our temp names for the outputs
    `ours` names (a SIGKILL mid-write leaves a checkpoint-sized one). Only for a caller that alone writes those
    outputs there, between its writes (a run holding the folder's lock): then no live writer owns one."""
    for path in folder.iterdir():
        match = TEMP.fullmatch(path.name)
        if match and match["tag"] == "tmp" and ours(match["name"]):
            remove(path)


def describe(path: Path) -> str:
    """What is at `path`, for a message."""
    if path.is_symlink():
        return "a symbolic link"
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir())
        shown = ", ".join(inside[:4]) + (", ..." if len(inside) > 4 else "")
        return f"a folder ({shown})" if inside else "an empty folder"
    return "a file" if path.is_file() else "not a regular file"


def check_folder(path: Path, option: str) -> None:
    """The folder `path` goes into exists and is a folder (nothing is created for an output file)."""
    parent = path.parent
    if parent.is_dir():
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UserError(f"{option} {path}: the folder {parent} is not writable (permission denied); "
                            f"choose another {option}")
        return
    if parent.exists():
        raise UserError(f"{option} {path}: {parent} is a file, not a folder; choose another {option}")
    raise UserError(f"{option} {path}: the folder {parent} does not exist; create it or choose another {option}")


def check_replaceable(path: Path, ours: Recognise, expected: str, option: str) -> None:
    """Refuse when something is at `path` that is not an earlier output (`expected` says what one is)."""
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_symlink() or not ours(path):
        raise UserError(f"{path} is {describe(path)}, not {expected}; it was left as it is: move it away or "
                        f"choose another {option}")


def write_new(path: Path, data: bytes) -> None:
    """`data` into a new file (it must not exist), fsynced; mode 0666 minus the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def remove(path: Path) -> None:
    """Delete one of our temp files or folders, if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def temp_beside(path: Path) -> Iterator[Path]:
    """A unique temp path beside `path` for the block to write (a file or a folder); removed afterwards if left."""
    tmp = temp_name(path)
    try:
        yield tmp
    finally:
        remove(tmp)


@contextlib.contextmanager
def folder_locked(folder: Path) -> Iterator[None]:
    """An exclusive flock on `folder` while the block runs: two commands replacing outputs there take turns."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        fd = None
    try:
        if fd is not None:
            with contextlib.suppress(OSError):  # a filesystem without flock: the renames stay atomic, unserialised
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def replace_with(tmp: Path, path: Path, ours: Recognise, expected: str, option: str) -> None:
    """Move the written `tmp` to `path`, over an earlier output only (checked again here, under the folder's lock)."""
    with sigterm_deferred(), folder_locked(path.parent):
        check_replaceable(path, ours, expected, option)
        if not tmp.is_dir() or not path.exists():
            os.replace(tmp, path)  # one rename (a folder onto nothing is one rename too)
            return
        aside = temp_name(path, "old")
        os.rename(path, aside)
        try:
            os.rename(tmp, path)
        except OSError:
            os.rename(aside, path)
            raise
        remove(aside)


def write_output(path: Path, data: bytes, ours: Recognise, expected: str, option: str) -> None:
    """A whole file written beside `path` and moved over it (over an earlier output only)."""
    with temp_beside(path) as tmp:
        write_new(tmp, data)
        replace_with(tmp, path, ours, expected, option)


def starts_with(*heads: bytes) -> Recognise:
    """A recogniser for a regular file that starts with one of `heads` (an output's header or magic bytes)."""
    def ours(path: Path) -> bool:
        if not path.is_file():
            return False
        with path.open("rb") as f:
            return f.read(max(map(len, heads))).startswith(heads)
    return ours


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A new file beside `path`, fsynced and moved over it only if the block succeeds.

    Created with mode 0666 minus the umask, like any other file the run writes (mkstemp would give 0600).
    """
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def link_atomic(source: Path, path: Path) -> bool:
    """`path` becomes a hard link to `source` (a file just written whole), replacing it atomically; False where the
    file system has no hard links (the caller writes a copy). A later os.replace of `source` leaves `path` as it is."""
    tmp = temp_name(path)
    try:
        os.link(source, tmp)
    except OSError:
        return False
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return True


class WriteErrors:
    """A binary file that keeps the OSError of a failed write: torch.save reports it as a bare RuntimeError."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.error = f, None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.f.flush()


def save_atomic(obj: dict[str, Any], path: str | os.PathLike) -> None:
    """torch.save to a temp file beside `path` (its folder must exist: a run folder removed mid-run is never made
    again), fsync, then os.replace it into place; a failed write is an OSError."""
    path = Path(path)
    with sigterm_deferred(), atomic_file(path) as f:
        writer = WriteErrors(f)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is None:
                raise
            raise writer.error from None  # e.g. ENOSPC, EFBIG ("[enforce fail at inline_container.cc] unexpected pos")


CSV_OUTPUT = starts_with(b"index,path,")  # the header of every CSV file evaluate.py and predict.py write


def write_csv(rows: list[dict[str, Any]], path: Path, columns: Sequence[str]) -> None:
    """CSV with `columns`, written to a temp file and moved into place (over an earlier one of ours only)."""
    with temp_beside(path) as tmp:
        with tmp.open("x", newline="", errors="surrogateescape") as f:  # names that are not UTF-8, byte for byte
            writer = csv.DictWriter(f, fieldnames=list(columns))
            writer.writeheader()
            writer.writerows(rows)
        replace_with(tmp, path, CSV_OUTPUT, f"an earlier {path.name} of evaluate.py or predict.py", "--output-dir")


def part_file(out: Path, stem: str, rank: int) -> Path:
    """Where `rank` writes its rows before rank 0 merges them."""
    return out / f"{stem}.part{rank}.csv"


def merge_parts(out: Path, stem: str, world_size: int, size: int) -> list[dict[str, str]]:
    """Rank 0: every rank's part file read back, checked to hold each index 0..size-1 once, sorted; parts removed."""
    parts = [part_file(out, stem, rank) for rank in range(world_size)]
    rows: list[dict[str, str]] = []
    for part in parts:
        with part.open(newline="", errors="surrogateescape") as f:
            rows += list(csv.DictReader(f))
    rows.sort(key=lambda row: int(row["index"]))
    if [int(row["index"]) for row in rows] != list(range(size)):
        raise RuntimeError(f"merged {stem} do not cover indices 0..{size - 1} exactly once")
    for part in parts:
        part.unlink()
    return rows
