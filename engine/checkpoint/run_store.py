"""output_dir at a URL (s3://bucket/prefix, gs://..., any fsspec URL): the run works in a local staging folder that
mirrors it, so every module writes files as it does on disk and only this one talks to the store.

The staging folder is `.cache/object_store/runs/<scheme>/<bucket>/<prefix>` under the current folder; a checkpoint
read from a URL (evaluate.py, predict.py, export.py, average_checkpoints.py) lands in `.cache/object_store/fetched/...`
with the small files of its run folder. At the start rank 0 takes the run's lock object (`<url>/.lock`: host, pid,
time; on S3 a conditional put; refreshed every LOCK_REFRESH_S, stale after LOCK_STALE_S or, on the same host, once
its process is gone), empties the staging folder and copies the run there from the URL (the URL is the truth), so
resume, another config's refusal and a finished run's notice work on the copy as on disk. After each validation's
hooks and when the run ends (stopped, failed or finished) the files that changed are uploaded, last.pth last
(core/store.upload: atomic per file); files the run removed (older epoch checkpoints) are removed from the URL. A
sharded last.dcp/ goes up whole after them (put_folder: object storage renames no folder, so it passes through
`last.dcp.next/`; a reader, pull or fetched, takes the whole one of the two, never a mix of two saves). An output at
a URL (export.py --output) is written in `.cache/object_store/outputs/...` and uploaded the same way (output_at).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlparse

from core.errors import UserError
from core.files import TEMP, remove
from core.store import TEMP_TAG, download, filesystem, is_url, join, read_bytes, retrying, upload
from engine.checkpoint.formats import METADATA

log = logging.getLogger(__name__)
STAGING = Path(".cache") / "object_store"
LOCK = ".lock"
LOCK_REFRESH_S = 60.0
LOCK_STALE_S = 600.0  # a lock object not refreshed for this long is a dead run's (another host's: no pid to ask)
CONDITIONAL = ("s3", "s3a")  # schemes whose puts take If-None-Match / If-Match (s3fs): the lock is a conditional put
LOST = ("PreconditionFailed", "ConditionalRequestConflict")  # S3's answers to a conditional put another writer beat
SHARDED = "last.dcp"  # train.ckpt_format=sharded's checkpoint: a folder, uploaded whole by put_folder
NEXT = ".next"  # `<folder>.next` at a URL: a sharded folder on its way in, whole once its .metadata is there
LAST = ("best.pth", "last.pth", SHARDED)  # uploaded after every other file, in this order: a checkpoint never precedes
# its row
LAST_OF_FOLDER = "config.json"  # an output folder's file uploaded last: what its reader (timm's local-dir:) opens first
SMALL = 1 << 20  # a checkpoint's run-folder files copied beside it from a URL (config.yaml, val.txt; no .pth)
_live_tokens: set[str] = set()  # the lock objects this process holds now
_staged: dict[str, str] = {}  # staging folder -> the URL it mirrors (config.yaml names the URL)


def mirror_of(url: str, kind: str = "runs") -> Path:
    """The local folder that mirrors `url`."""
    parts = urlparse(url)
    return STAGING / kind / parts.scheme / parts.netloc / parts.path.strip("/")


def url_of(path: str | Path) -> str:
    """The URL a staging folder, or a file or folder in one, mirrors (`path` as it is when it is in none): what the
    run's lines name, as the user named output_dir."""
    text = str(path)
    for local, url in _staged.items():
        if text == local or text.startswith(f"{local}/"):
            return f"{url}{text[len(local):]}"
    return text


def running_here(pid: int) -> bool:
    """Whether process `pid` lives on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def beaten(err: OSError) -> bool:
    """Whether a conditional put failed because another writer's object was there first (S3's 412 or 409)."""
    response = getattr(err.__cause__, "response", None) or {}
    return isinstance(err, FileExistsError) or response.get("Error", {}).get("Code") in LOST


class LockObject:
    """`<url>/.lock`: one live run per URL, the owner's host and pid inside, refreshed by a daemon thread."""

    def __init__(self, url: str) -> None:
        self.url = join(url, LOCK)
        self.token = secrets.token_hex(8)
        self.fs, self.path = filesystem(self.url)
        self.conditional = urlparse(self.url).scheme in CONDITIONAL
        self.etag: str | None = None  # of this run's last put (S3): a refresh replaces only that object
        self.lost: dict | None = None  # the run that took the lock over (its contents), once a refresh found it
        self.stop = threading.Event()
        self.acquire()
        self.thread = threading.Thread(target=self.refresh, daemon=True, name="run-lock")
        self.thread.start()

    def owner(self) -> dict | None:
        """The lock object's contents (None: no lock)."""
        if not retrying("read", self.url, lambda: self.fs.exists(self.path)):
            return None
        try:
            return json.loads(read_bytes(self.url, "read the run lock"))
        except ValueError:
            return None  # cut short: no live run wrote it whole

    def acquire(self) -> None:
        """Take the lock, or refuse in one line while a live run holds it or another starter took it meanwhile. On S3
        a conditional put: created only where none is, a stale one replaced only while it is still the object judged
        stale (If-Match its ETag), so of two starters exactly one wins; elsewhere written, then read back."""
        if self.conditional:
            taken = self.put(mode="create") or self.take_over(*self.owner_and_etag())
        else:
            self.refuse_live(self.owner())
            self.write()
            taken = (self.owner() or {}).get("token") == self.token
        if not taken:
            raise UserError(f"output_dir {self.url.rsplit('/', 1)[0]} was locked by another run at the same moment; "
                            "wait for it to end, or choose another output_dir")
        _live_tokens.add(self.token)

    def refuse_live(self, held: dict | None) -> None:
        """One line while `held` (the lock object's contents) is a live run's."""
        if held is not None and not self.stale(held):
            raise UserError(f"output_dir {self.url.rsplit('/', 1)[0]} is in use by another run (process "
                            f"{held.get('pid')} on {held.get('host')}); wait for it to end, or choose another "
                            f"output_dir (a lock object not refreshed for {LOCK_STALE_S:.0f} s counts as stale)")
        if held is not None:
            log.info("output_dir: taking over the stale lock of process %s on %s", held.get("pid"), held.get("host"))

    def take_over(self, held: dict | None, etag: str | None) -> bool:
        """The lock object found by a failed create: replaced if stale and still that object (conditional put);
        created anew if it went meanwhile (its run ended)."""
        if etag is None:
            return self.put(mode="create")
        self.refuse_live(held)
        return self.put(IfMatch=etag)

    def owner_and_etag(self) -> tuple[dict | None, str | None]:
        """The lock object's contents and ETag ((None, None): none); a later change of it fails a put on the ETag."""
        def etag() -> str | None:
            self.fs.invalidate_cache(self.path)
            try:
                return self.fs.info(self.path)["ETag"]
            except FileNotFoundError:
                return None

        found = retrying("read", self.url, etag)
        return (self.owner(), found) if found is not None else (None, None)

    def put(self, **condition: str) -> bool:
        """The lock object written on S3's `condition` (s3fs's mode="create", IfMatch=<etag>): False when another
        writer's object beat it."""
        def call() -> bool:
            try:
                out = self.fs.pipe_file(self.path, self.record(), **condition)
            except OSError as err:
                if beaten(err):
                    return False
                raise
            self.etag = out.get("ETag") if isinstance(out, dict) else None
            return True

        return retrying("write", self.url, call)

    def stale(self, held: dict) -> bool:
        """A dead owner's: its process gone (this host), or this process's own from a run it no longer holds (one
        that lost the server), or not refreshed for LOCK_STALE_S (another host)."""
        if held.get("host") == socket.gethostname():
            pid = int(held.get("pid", 0))
            return not running_here(pid) or (pid == os.getpid() and held.get("token") not in _live_tokens)
        return time.time() - float(held.get("time", 0)) > LOCK_STALE_S

    def record(self) -> bytes:
        """The lock object's contents, with the time now."""
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
                           "token": self.token}).encode()

    def write(self) -> None:
        """The lock object, with the time now (its refresh)."""
        text = self.record()
        retrying("write", self.url, lambda: self.fs.pipe_file(self.path, text))

    def refresh(self) -> None:
        """Rewrite the lock every LOCK_REFRESH_S until released or lost: another host sees the run alive."""
        while not self.stop.wait(LOCK_REFRESH_S) and self.lost is None:
            try:
                self.beat()
            except UserError as err:
                log.warning("could not refresh the run lock: %s", err)

    def beat(self) -> None:
        """One refresh. On S3 a put on this run's last ETag: a run that took the lock over (this one's counted as
        stale) keeps it, and this run learns it lost the lock (`lost`) instead of writing over the other's."""
        if not (self.conditional and self.etag):
            self.write()
            return
        try:
            kept = self.put(IfMatch=self.etag)
        except UserError:  # S3 answers a put on the ETag of a removed object with NoSuchKey: created anew, if none is
            if self.owner_and_etag()[1] is not None:
                raise
            kept = self.put(mode="create")
        if not kept:
            self.lost = self.owner() or {}
            log.error("output_dir %s: process %s on %s took over this run's lock (not refreshed for %.0f s); this "
                      "run uploads nothing more", self.url.rsplit("/", 1)[0], self.lost.get("pid"),
                      self.lost.get("host"), LOCK_STALE_S)

    def release(self) -> None:
        """Remove the lock object if it is still this run's."""
        self.stop.set()
        self.thread.join()  # a refresh under way ends first: it cannot put the object back after its removal
        _live_tokens.discard(self.token)
        try:
            if (self.owner() or {}).get("token") == self.token:
                retrying("write", self.url, lambda: self.fs.rm_file(self.path))
        except UserError as err:
            log.warning("could not remove the run lock: %s", err)


def local_name(rel: str) -> bool:
    """Whether a staging file is the run's (not a lock, a probe or a temp file or folder of core/files or
    core/store)."""
    name = rel.rsplit("/", 1)[-1]
    return name != LOCK and not name.startswith(".shared-check") and TEMP_TAG not in name \
        and not any(TEMP.fullmatch(part) for part in rel.split("/"))


def staged_name(rel: str, whole: str) -> str | None:
    """The staging name of the URL's file `rel`: a sharded folder's files from `whole` (last.dcp or last.dcp.next,
    whichever is whole) land in last.dcp/, the other one's are skipped (None)."""
    top, _, rest = rel.partition("/")
    if top not in (SHARDED, SHARDED + NEXT):
        return rel
    return f"{SHARDED}/{rest}" if top == whole else None


class RunStore:
    """A run folder at a URL and the local folder mirroring it (rank 0's)."""

    def __init__(self, url: str, local: Path | None = None) -> None:
        self.url, self.local = url.rstrip("/"), local or mirror_of(url)
        self.fs, self.root = filesystem(self.url)
        self.sent: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) as on the URL
        self.broken = False  # an upload failed: the run's end does not try again
        self.lock: LockObject | None = None  # rank 0's, held for the run
        _staged[str(self.local)] = self.url

    def resume_path(self, resume: str) -> str:
        """resume=<URL>: a checkpoint of this run is its staging copy, another run's is fetched; else as given."""
        if not is_url(resume):
            return resume
        if resume.startswith(f"{self.url}/"):
            return str(self.local / resume[len(self.url) + 1:])
        return fetched(resume)

    def remote_files(self) -> list[str]:
        """The run's files at the URL, relative to it."""
        found = retrying("list", self.url, lambda: self.fs.find(self.root))
        rels = [path[len(self.root.rstrip("/")) + 1:] for path in found]
        return [rel for rel in rels if rel and local_name(rel)]

    def pull(self) -> None:
        """The staging folder made a copy of the URL's run (emptied first: the URL is the truth); of last.dcp and
        last.dcp.next (a put_folder cut short), the whole one, as last.dcp."""
        shutil.rmtree(self.local, ignore_errors=True)
        self.local.mkdir(parents=True, exist_ok=True)
        remote = self.remote_files()
        whole = SHARDED + NEXT if f"{SHARDED}{NEXT}/{METADATA}" in remote else SHARDED
        for rel in remote:
            name = staged_name(rel, whole)
            if name is None:
                continue
            target = self.local / name
            target.parent.mkdir(parents=True, exist_ok=True)
            download(join(self.url, rel), str(target))
            self.sent[name] = signature(target)
        log.info("output_dir %s: the run works in %s (%d file(s) copied from the URL)", self.url, self.local,
                 len(self.sent))

    def changed(self) -> list[str]:
        """The staging files that differ from the URL's, the checkpoints last; a sharded folder whose files differ
        is one entry (last.dcp), and one that is missing (a save cut short set it aside) none: the URL keeps its own."""
        files = {p.relative_to(self.local).as_posix(): p for p in self.local.rglob("*") if p.is_file()}
        new = {rel.split("/", 1)[0] if rel.startswith(f"{SHARDED}/") else rel for rel, path in files.items()
               if local_name(rel) and self.sent.get(rel) != signature(path)}
        if (self.local / SHARDED).is_dir() and any(rel.startswith(f"{SHARDED}/") and rel not in files
                                                    for rel in self.sent):
            new.add(SHARDED)
        return sorted(new, key=lambda rel: (LAST.index(rel) if rel in LAST else -1, rel))

    def push(self) -> None:
        """Upload what changed since the last push; remove from the URL what the run removed here. A run whose lock
        another took over uploads nothing: the URL is the other run's now."""
        if self.lock is not None and (taker := self.lock.lost) is not None:
            self.broken = True
            raise UserError(f"output_dir {self.url}: another run (process {taker.get('pid')} on {taker.get('host')}) "
                            f"took over this run's lock, which was not refreshed for {LOCK_STALE_S:.0f} s; this run "
                            "stops without uploading, so as not to overwrite that run's files")
        try:
            for rel in self.changed():
                path = self.local / rel
                if path.is_dir():
                    self.push_folder(rel)
                    continue
                sig = signature(path)
                upload(str(path), join(self.url, rel))
                self.sent[rel] = sig
            for rel in [rel for rel in self.sent if not rel.startswith(f"{SHARDED}/")
                        and not (self.local / rel).exists()]:
                retrying("remove", join(self.url, rel), lambda: self.fs.rm_file(f"{self.root}/{rel}"))
                del self.sent[rel]
        except UserError:
            self.broken = True
            raise

    def push_folder(self, rel: str) -> None:
        """The sharded folder `rel` to the URL whole (put_folder), its files recorded as sent."""
        sent = {f"{rel}/{path.name}": signature(path) for path in (self.local / rel).iterdir() if path.is_file()}
        put_folder(self.local / rel, join(self.url, rel))
        self.sent = {name: sig for name, sig in self.sent.items() if not name.startswith(f"{rel}/")} | sent


def put_folder(local: Path, url: str) -> None:
    """A sharded checkpoint folder put at `url` so that no reader loads a mix of two saves, killed anywhere (object
    storage renames no folder): uploaded to `<url>.next` (its .metadata last: whole once that is there), then copied
    over `url` on the server (swap_in). At every moment one of the two is whole, and a reader takes `<url>.next`
    while it is (whole_folder); a swap an earlier put_folder left unfinished is finished first (its `<url>.next` may
    be the only whole one)."""
    fs, path = filesystem(url)
    if whole_folder(url) != url:
        swap_in(url)
    remove_folder(f"{url}{NEXT}")  # what an upload cut short left
    names = sorted((p.name for p in local.iterdir() if p.is_file()), key=lambda name: (name == METADATA, name))
    for name in names:
        retrying("write", f"{url}{NEXT}", lambda: fs.put_file(str(local / name), f"{path}{NEXT}/{name}"))
    swap_in(url)


def swap_in(url: str) -> None:
    """The whole folder at `<url>.next` copied over `url` on the server (the old .metadata removed first, the new
    one copied last), then `<url>.next` removed (its .metadata first)."""
    fs, path = filesystem(url)
    fs.invalidate_cache(f"{path}{NEXT}")
    keys = sorted(retrying("list", f"{url}{NEXT}", lambda: fs.find(f"{path}{NEXT}")),
                  key=lambda key: (key.endswith(f"/{METADATA}"), key))
    remove_folder(url)
    for key in keys:
        retrying("write", url, lambda: fs.copy(key, f"{path}/{key.rsplit('/', 1)[1]}"))
    remove_folder(f"{url}{NEXT}")


def remove_folder(url: str) -> None:
    """The objects under `url` removed, a sharded folder's .metadata first (then it no longer reads as whole)."""
    fs, path = filesystem(url)
    fs.invalidate_cache(path)  # listed anew: what another process (an earlier run) left there counts
    found = sorted(retrying("list", url, lambda: fs.find(path)), key=lambda key: not key.endswith(f"/{METADATA}"))
    for key in found:
        retrying("remove", url, lambda: fs.rm_file(key))


def whole_folder(url: str) -> str:
    """The sharded folder to read for `url`: `<url>.next` when it is whole (a put_folder cut short after its
    upload), else `url` itself."""
    fs, path = filesystem(url)
    fs.invalidate_cache(f"{path}{NEXT}")  # asked anew: another process may have written it since a listing
    return f"{url}{NEXT}" if retrying("read", url, lambda: fs.exists(f"{path}{NEXT}/{METADATA}")) else url


def signature(path: Path) -> tuple[int, int]:
    """(size, mtime_ns): what tells a file rewritten since its upload."""
    found = path.stat()
    return found.st_size, found.st_mtime_ns


def fetched(checkpoint: str) -> str:
    """A checkpoint given as a URL, copied to its local mirror with its run folder's small files (config.yaml,
    val.txt, the pipeline copies): the local path read as any checkpoint. A local path is returned as it is."""
    if not is_url(checkpoint):
        return checkpoint
    url = checkpoint.rstrip("/")
    folder_url, name = url.rsplit("/", 1)
    fs, root = filesystem(folder_url)
    source = whole_folder(url)  # a sharded checkpoint being replaced (put_folder) may be there alone
    folder = source != url or retrying("read", checkpoint, lambda: fs.isdir(f"{root.rstrip('/')}/{name}"))
    local = fetched_folder(folder_url, lambda other, size: size <= SMALL and not other.endswith(".pth"))
    if folder:  # a sharded checkpoint (last.dcp/): its whole copy, every file
        pulled(source, local / name)
        return str(local / name)
    return download(checkpoint, str(local / name), "read checkpoint")


def fetched_folder(folder_url: str, wanted: Callable[[str, int], bool]) -> Path:
    """The files of a folder at a URL that `wanted(name, size)` picks, copied to its local mirror (returned)."""
    local = mirror_of(folder_url, "fetched")
    local.mkdir(parents=True, exist_ok=True)
    fs, root = filesystem(folder_url)
    listed = retrying("list", folder_url, lambda: fs.ls(root, detail=True))
    for entry in listed:
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if entry.get("type") == "file" and local_name(name) and wanted(name, entry.get("size") or 0):
            download(join(folder_url, name), str(local / name))
    return local


def beside(checkpoint: str, name: str) -> str:
    """The path or URL `name` in the folder of `checkpoint` (a path or a URL): where an output goes by default."""
    if is_url(checkpoint):
        return join(checkpoint.rstrip("/").rsplit("/", 1)[0], name)
    return str(Path(checkpoint).parent / name)


@contextlib.contextmanager
def output_at(target: str, main: bool = True) -> Iterator[Path]:
    """An output at a URL (export.py --output s3://..., evaluate.py and predict.py --output-dir): a local mirror for
    the command to write, holding the URL's earlier output first (so the command's checks of what it may replace
    apply to it), uploaded once the block ends well: file by file, each atomically, a folder's LAST_OF_FOLDER last,
    and the files the new output dropped removed from the URL; errors name the URL. The mirror goes afterwards. A
    local target is yielded as it is; so is the mirror to a process that is not `main` (another rank writing its
    part there: rank 0 alone copies, uploads and removes it)."""
    if not is_url(target):
        yield Path(target)
        return
    local = mirror_of(target, "outputs")
    if not main:
        yield local
        return
    try:
        earlier = pulled(target, local)
        try:
            yield local
        except UserError as err:
            raise UserError(str(err).replace(str(local), target)) from None
        pushed(local, target, earlier)
    finally:
        remove(local)


def pulled(url: str, local: Path) -> list[str]:
    """The object at `url`, or the folder of objects under it, copied to `local` (emptied first): the folder's files
    relative to it (["."] for one object, [] for none)."""
    remove(local)
    local.parent.mkdir(parents=True, exist_ok=True)
    fs, path = filesystem(url)
    found = retrying("list", url, lambda: fs.find(path))
    if found == [path]:
        download(url, str(local))
        return ["."]
    rels = [rel for rel in (key[len(path.rstrip("/")) + 1:] for key in found) if local_name(rel)]
    for rel in rels:
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        download(join(url, rel), str(local / rel))
    return rels


def pushed(local: Path, url: str, earlier: list[str]) -> None:
    """`local` (a file or a folder) uploaded to `url`; what `earlier` named there and `local` lacks, removed."""
    if local.is_file():
        upload(str(local), url)
        return
    rels = sorted((p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()),
                  key=lambda rel: (rel == LAST_OF_FOLDER, rel))
    for rel in rels:
        upload(str(local / rel), join(url, rel))
    fs, path = filesystem(url)
    for rel in sorted(set(earlier) - set(rels)):
        retrying("remove", join(url, rel), lambda: fs.rm_file(f"{path.rstrip('/')}/{rel}"))
