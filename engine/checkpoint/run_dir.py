"""The run folder (output_dir): one live run at a time, and nothing in it changes until the run starts.

A run locks `<output_dir>/.lock` before it reads anything there: a POSIX record lock held by rank 0 for
the run's lifetime, so a second run into the folder is refused instead of resuming the first one's
checkpoint mid-run. The kernel drops the lock when the process dies, however it dies (SIGKILL too), and
unlike flock() it is not inherited by forked DataLoader workers, which could outlive a killed parent.
A lock holds on a file, not on a path: if the folder is removed mid-run, a new run could make it again and lock
it. So before each write (checkpoint, metrics row, config.yaml, profile) the run checks that the folder and lock
file at the path are still the ones it locked, and stops with one line if not; nothing it writes makes the
folder again.

output_dir may name its folder with placeholders, `{model.name}`, `{timestamp}` and `{run_id}` (a W&B sweep agent's
run id, else a fresh one), resolved once by rank 0 for every rank (`resolve_output_dir`); under a sweep agent every
trial gets its own folder, `/{run_id}` added when output_dir has none.

The run starts at its first write (its first checkpoint or metrics row). Until then config.yaml and
metrics.jsonl stay as they are, so a run that fails while building, restoring or training its first
steps leaves the previous run's record byte for byte. At the start metrics.jsonl keeps the rows of the
epochs before the one the run resumes, and config.yaml becomes this run's, each replaced atomically.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import logging
import os
import re
import secrets
import socket
import string
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from core.dist import all_gather_object, broadcast_object, get_world_size, is_main, rank0_decides
from core.errors import UserError
from core.files import atomic_file
from core.logs import MetricsFile
from core.startup import sweep_run_id

log = logging.getLogger(__name__)
LOCK = ".lock"
PLACEHOLDERS = ("{model.name}", "{timestamp}", "{run_id}")
RUN_ID_CHARS = string.ascii_lowercase + string.digits  # as W&B's own run ids
_filled: dict[str, str] = {}  # resolve_output_dir's folders made from placeholders -> the template (for continue_with)


def resolve_output_dir(template: str, model_name: str, resume: str) -> str:
    """output_dir with its placeholders filled, decided by rank 0 and the same on every rank (a timestamp or a
    fresh id drawn on each would scatter one run over several folders). With resume=<checkpoint> in a folder the
    template names, that folder: the run continues where it was."""
    if (run_id := sweep_run_id()) and "{run_id}" not in template:
        template = f"{template.rstrip('/')}/{{run_id}}"  # each sweep trial its own folder
    unknown = [name for name in re.findall(r"{[^{}]*}", template) if name not in PLACEHOLDERS]
    if unknown:
        raise UserError(f"output_dir {template!r} has the unknown placeholder {unknown[0]}; use "
                        f"{', '.join(PLACEHOLDERS)}, or a folder name without braces")
    if not any(name in template for name in PLACEHOLDERS):
        return template
    folder = rank0_decides(lambda: fill_placeholders(template, model_name, resume, run_id))
    _filled[folder] = template
    return folder


def continue_with(output_dir: str, resume: str) -> list[str]:
    """The overrides that make the command that started a run continue it: `output_dir=<folder>` where the command
    names a template (run again, it would fill it anew) and `resume=auto` where it gives another resume."""
    return [*([f"output_dir={output_dir}"] if output_dir in _filled else []),
            *(["resume=auto"] if resume != "auto" else [])]


def fill_placeholders(template: str, model_name: str, resume: str, run_id: str | None) -> str:
    """The folder output_dir's placeholders name for this launch: {run_id} the sweep agent's (a trial's own folder,
    a branch of the run it resumes), else resume=<checkpoint>'s folder where it fits the template, else {timestamp}
    now and a fresh {run_id}."""
    name = folder_name(model_name)
    if resume not in ("auto", "none") and run_id is None:
        folder = os.path.abspath(Path(resume).parent)
        if re.fullmatch(template_pattern(os.path.abspath(template), name), folder):
            return folder
    values = {"{model.name}": name, "{timestamp}": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
              "{run_id}": folder_name(run_id or "".join(secrets.choice(RUN_ID_CHARS) for _ in range(8)))}
    for placeholder, value in values.items():
        template = template.replace(placeholder, value)
    return template


def template_pattern(template: str, name: str) -> str:
    """A regular expression of the folders the template names for model `name`, whatever {timestamp} and {run_id}."""
    wildcards = {"{model.name}": re.escape(name), "{timestamp}": r"\d{8}-\d{6}", "{run_id}": r"[^/]+"}
    return "".join(wildcards.get(part, re.escape(part)) for part in re.split(r"({[^{}]*})", template))


def folder_name(text: str) -> str:
    """text as one folder's name: hf-hub:timm/x -> hf-hub_timm_x."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)


def check_writable(folder: Path) -> None:
    """Whether the run could create and write `folder`, without creating it (train.py --dry-run)."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"output_dir {folder} cannot be created: {existing} is a file; choose another output_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"output_dir {folder} is not writable ({existing}: permission denied); "
                        "choose another output_dir")


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[FolderLock | None]:
    """Hold the run folder's lock (rank 0) while the block runs; refuse a folder another live run holds.

    Yields the lock on rank 0 (None on the others), for the run's writers to check it still holds the path.
    """
    held: list[FolderLock] = []  # rank 0's lock (it holds a file descriptor, so it stays on rank 0)
    rank0_decides(lambda: held.append(FolderLock(folder)))
    try:
        yield held[0] if held else None
    finally:
        for lock in held:
            lock.release()


def check_shared(folder: Path, key: str = "output_dir") -> None:
    """Every process sees rank 0's output_dir (`key`: the option that named it, for the message): rank 0 writes a
    probe file there, every rank reads it back. Rank 0 writes the checkpoints, metrics and the sharded folder's swap,
    and every rank writes its shards (evaluate.py and predict.py: their part files) into it, so it must be one
    folder for all (a file system every node mounts, at a path that means it on each)."""
    if get_world_size() == 1:
        return
    token = broadcast_object(secrets.token_hex(8) if is_main() else None)
    probe = folder / f".shared-check.{token}"
    rank0_decides(lambda: probe.write_text(token))
    try:
        seen = probe.read_text() == token
    except OSError:
        seen = False
    found = all_gather_object((socket.gethostname(), seen))
    rank0_decides(lambda: probe.unlink(missing_ok=True))
    blind = [f"rank {rank} on {host}" for rank, (host, ok) in enumerate(found) if not ok]
    if blind:
        raise UserError(f"{key} {folder} is not the same folder for every process: {', '.join(blind)} cannot "
                        f"see the file rank 0 (on {found[0][0]}) wrote there; put {key} on storage every node "
                        "shares, at a path that names it on each (an absolute path; docs/clusters.md)",
                        all_ranks=True)


Identity = tuple[int, int]  # (device, inode): which file or folder a path names


def identity(path: Path) -> Identity | None:
    """What `path` names now (None: nothing)."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


class FolderLock:
    """`<folder>/.lock`, locked by this process; creates the folder (and removes it again if the run left it empty)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.created = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
        self.fd: int | None = None
        self.ids: tuple[Identity, Identity] | None = None  # the folder's and the lock file's, once locked
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self.fd = self.lock_file()
            self.ids = identity(folder), identity(folder / LOCK)
        except OSError as err:
            self.release()
            raise UserError(f"output_dir {folder} is not writable ({err.strerror}); "
                            "choose another output_dir") from None

    def holds_path(self) -> bool:
        """Whether the folder and lock file at the path are still the ones this lock was taken on: a run folder
        removed (and maybe made again by another run) leaves the lock on deleted files, where it refuses no one."""
        if self.ids is None:
            return True  # not locked yet: nothing to have lost
        folder, lock_file = self.ids
        return identity(self.folder) == folder and (self.fd is None or identity(self.folder / LOCK) == lock_file)

    def check(self) -> None:
        """Before each write into the folder: stop the run (UserError) if the lock no longer holds on the path."""
        if self.holds_path():
            return
        now = identity(self.folder)
        what = ("was removed" if now is None else
                "was removed and made again (another run may be using it now)" if now != self.ids[0] else
                f"lost this run's lock ({LOCK} was removed or replaced)")
        raise UserError(f"output_dir {self.folder} {what} while this run was writing to it; the run stopped and wrote "
                        "nothing more there (it never makes the folder again): start the run again into another "
                        "output_dir, or into this one once no other run uses it")

    def lock_file(self) -> int | None:
        """The locked lock file's descriptor (None where the filesystem has no locks); UserError if it is held."""
        path = self.folder / LOCK
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                if err.errno in (errno.EACCES, errno.EAGAIN):
                    raise UserError(f"output_dir {self.folder} is in use by another run (process {owner}); "
                                    "wait for it to end, or choose another output_dir") from None
                if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    log.warning("cannot lock %s (%s): a second run into this folder at once would not be refused",
                                path, err.strerror)
                    return None
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # a run that ended removed the file after we opened it: lock the new one
        os.ftruncate(fd, 0)
        host = socket.gethostname()
        os.pwrite(fd, f"{os.getpid()} on {host}\n".encode(), 0)
        return fd

    def release(self) -> None:
        """Remove the lock file while still holding it, then unlock; remove the folders it created if empty. A path
        this lock no longer holds (the folder was removed, maybe another run's now) is left alone."""
        ours = self.holds_path()
        if self.fd is not None:
            if ours:
                (self.folder / LOCK).unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None
        for folder in self.created if ours else []:
            try:
                folder.rmdir()
            except OSError:
                break


class RunRecord:
    """config.yaml and metrics.jsonl: untouched until the run's first write, then replaced atomically.

    Every method is a collective: rank 0 writes, every rank learns whether it could.
    """

    def __init__(self, folder: Path, config: dict[str, Any], first_epoch: int, lock: FolderLock | None = None,
                 files: dict[str, bytes] | None = None, first_step: int = 0) -> None:
        self.folder, self.config, self.first_epoch, self.first_step = folder, config, first_epoch, first_step
        self.files = files or {}  # written beside config.yaml at the start (data.val_fraction's train.txt, val.txt)
        self.lock = lock  # rank 0's lock on the folder (train.py); each write first checks it still holds the path
        self.metrics = MetricsFile(folder / "metrics.jsonl")
        self.started = False

    def start(self) -> None:
        """Call before the run's first write; a no-op after the first call."""
        if not self.started:
            self.write(self.start_files)
            self.started = True

    def append(self, row: dict[str, Any]) -> None:
        """One validation's metrics row (the run starts here if it has not yet)."""
        self.start()
        self.write(lambda: self.metrics.append(row))

    def rows(self) -> list[dict[str, Any]]:
        """metrics.jsonl's rows of this run, read on rank 0 (before its first write: the rows start_files keeps)."""
        rows = self.metrics.rows()
        return rows if self.started else [row for row in rows if kept(row, self.first_epoch, self.first_step)]

    def start_files(self) -> None:
        """metrics.jsonl keeps the rows before this run's first step (kept: each validation's row is written once);
        the run's own files (`files`); config.yaml."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.metrics.keep_only(lambda row: kept(row, self.first_epoch, self.first_step))
        for name, content in self.files.items():
            with atomic_file(self.folder / name) as f:
                f.write(content)
        with atomic_file(self.folder / "config.yaml") as f:
            f.write(yaml.safe_dump(self.config, sort_keys=False).encode())

    def write(self, action: Callable[[], None]) -> None:
        """Run `action` on rank 0; an OSError becomes one line on every rank's behalf."""
        def attempt() -> None:
            if self.lock is not None:
                self.lock.check()
            try:
                action()
            except OSError as err:
                name = err.filename2 or err.filename or self.folder
                raise UserError(f"cannot write {name} ({err.strerror or err}); free disk space, make output_dir "
                                "writable, or choose another output_dir") from None

        rank0_decides(attempt)


def kept(row: dict[str, Any], epoch: int, step: int) -> bool:
    """Whether a run resumed at (`epoch`, global `step`) keeps a metrics.jsonl row: those of earlier epochs, and
    those of validations inside the resumed epoch up to its step (train.val_every_steps: rows without the epoch's
    timings). The row of a train.max_steps stop in that epoch goes: the resumed run validates the epoch's end."""
    if row["epoch"] < epoch:
        return True
    return row["epoch"] == epoch and "epoch_time_s" not in row and row.get("step", step + 1) <= step
