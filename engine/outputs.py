"""Files and folders written for the user (exports, predictions, evaluations, shards): nothing else is lost.

An output replaces only what is recognisably an earlier output of the same kind (the caller's `ours` test),
atomically: a file by one rename of a temp file beside it; a folder by renaming the old one aside, the new
one in, then removing the old (a SIGTERM waits for both renames). Temp names are unique per process, so two
commands writing the same path cannot delete each other's files. Anything else at the path is refused with
one line and left as it is. New files get mode 0666 minus the umask, like the run's other files.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
from pathlib import Path
from typing import Callable, Iterator

from engine.errors import UserError
from engine.signals import sigterm_deferred

Recognise = Callable[[Path], bool]  # True when the existing path is an earlier output of this kind


def temp_name(path: Path, tag: str = "tmp") -> Path:
    """A hidden name beside `path`, unique to this process (and to this call)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.{tag}")


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
