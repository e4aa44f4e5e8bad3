"""WebDataset tar shards read map-style: sample i is found through the shard index, never by streaming.

The index is wids' JSON shard list (`{"wids_version": 1, "shardlist": [{"url", "nsamples"}, ...]}`, shard
URLs relative to the index) plus what training needs before opening any shard: "classes" (names in label
order) and each shard's "labels". A sample is three tar members (written by `python -m data.make_shards`):
`<key>.<jpg|png|...>` (the image, still encoded; decode_image decodes it in the DataLoader workers),
`<key>.cls` (its label; a process that opens a shard checks them all against the index) and `<key>.path`
(the path it was converted from: predictions.csv's path column). Multi-label shards (made from a list file
with --multi-label) say "multi_label": true in the index; a sample's labels are a list of class indices there,
and its .cls member holds them separated by spaces (empty: no labels).

Why not wids.ShardListDataset itself: it copies every local shard into /tmp/_wids_cache before reading it
and prints to stderr whenever it is built. wids' parts are used instead: the index format and its URL
resolution (wids_specs) and the tar member index (wids_mmtar). Local shards are read in place; shards at a URL
(s3://, gs://, https://, file://: any fsspec URL, through core/store.py's retries and one-line errors; pipe: through
wids' downloader) are copied whole into data.shard_cache on first touch and read there, the least recently used
removed past data.shard_cache_gb; the next PREFETCH shards are copied in threads while one is read: in this rank's
order under data.shard_order=by_rank (data/shard_order.py: its first copies start when the loader is built), else
in index order where the split's shards all fit. One process copies a shard into a cache the others share (a lock
file per shard). Copied, not streamed: samples are read in a shuffled order, and a shard once local serves every
later epoch at disk speed (benchmarks/object_store.py measures both sides).
Each process indexes a shard on first touch into four int64 numbers per sample and then reads members
with os.pread, so fully random access (the EpochSampler's order) never re-parses a shard.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import struct
import tempfile
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator
from urllib.parse import quote

import albumentations as A
import numpy as np

from core.config import DataConfig
from core.errors import UserError
from core.files import TEMP
from core.store import download, is_url, read_bytes
from data.datasets import AugmentedDataset, IMAGE_EXTENSIONS, decode_image, multi_hot, shared_labels
from data.shard_order import SHUFFLE_SHARDS, ShardPlan

log = logging.getLogger(__name__)
PREFETCH = 4  # shards at a URL copied ahead of the one read, in threads (the network overlaps decoding), if all fit
OPEN_SHARDS = 64  # file descriptors each process keeps open (least recently used closed first)
REWRITE = "write them again with python -m data.make_shards"


def split_index(root: str, split: str) -> str:
    """`<root>/<split>.json`, for a local folder or a URL."""
    return f"{root.rstrip('/')}/{split}.json" if is_url(root) else str(Path(root) / f"{split}.json")


def read_index(index: str, cache_dir: str) -> dict:
    """The index with its shard URLs resolved; a missing or broken index is a one-line error."""
    from wids.wids_specs import resolve_dsdesc, urldir

    try:
        if index.startswith("pipe:"):
            with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
                text = Path(fetch(index, os.path.join(tmp, "index.json"))).read_text()
        elif is_url(index):
            text = read_bytes(index, "read shard index").decode()
        else:
            text = Path(index).read_text()
    except (OSError, AssertionError, ValueError) as err:
        reason = getattr(err, "strerror", None) or err
        raise UserError(f"cannot read shard index {index} ({reason}); check data.root and data.*_split") from None
    try:
        raw = json.loads(text)
        if is_url(index):  # shard URLs relative to the index's URL, as wids resolves them
            spec = resolve_dsdesc(raw, base=urldir(index))
        else:  # local: joined as paths (a URL parser would cut a path at '?' or '#')
            spec = resolve_dsdesc(raw)
            for shard in spec["shardlist"]:
                if not is_url(shard["url"]):
                    shard["url"] = str(Path(index).parent / shard["url"])
        classes, shards, multi = spec["classes"], spec["shardlist"], bool(raw.get("multi_label"))
        labels = [[sorted(map(int, sample)) for sample in shard["labels"]] if multi
                  else np.asarray(shard["labels"], dtype=np.int64).reshape(-1) for shard in shards]
        if any(len(lab) != shard["nsamples"] for lab, shard in zip(labels, shards)):
            raise ValueError("a shard's labels and nsamples differ")
        flat = [np.asarray([i for sample in lab for i in sample], np.int64) if multi else lab for lab in labels]
        if not all(isinstance(c, str) for c in classes) or any(((lab < 0) | (lab >= len(classes))).any()
                                                               for lab in flat):
            raise ValueError("labels outside the class list")
    except json.JSONDecodeError as err:
        raise UserError(f"shard index {index} is not valid JSON (line {err.lineno}: {err.msg}); {REWRITE}") from None
    except (AssertionError, KeyError, TypeError, ValueError) as err:
        what = f"no {err}" if isinstance(err, KeyError) else str(err) or "not a wids shard list"
        raise UserError(f"shard index {index} is broken ({what}); {REWRITE}") from None
    return {"classes": classes, "urls": [shard["url"] for shard in shards], "labels": labels,
            "sizes": [shard.get("filesize") for shard in shards], "multi_label": multi}


def fetch(url: str, local: str) -> str:
    """Copy url to local once (a later call finds the file): fsspec's URLs through core/store, pipe: through wids."""
    if os.path.exists(local):
        os.utime(local)  # used now: the cache removes the least recently used first
        return local
    if not url.startswith("pipe:"):
        return download(url, local, "read shard")
    from wids.wids_dl import download_and_open

    with download_and_open(url, local):
        return local


@contextlib.contextmanager
def copy_lock(local: str) -> Iterator[None]:
    """Held while `local` is copied: one process (loader worker, rank of the node) copies a shard into a shared cache,
    the others wait for it and read its copy (a lock file in the cache's .locks folder, flock'ed)."""
    folder = os.path.join(os.path.dirname(local), ".locks")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, os.path.basename(local)), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def trim_cache(folder: str, limit_bytes: float, keep: str) -> None:
    """Remove the least recently used shards copied from URLs (names holding a quoted '://'; copies under way, under
    core/files.temp_name's names, stay) from `folder` until they fit in `limit_bytes`, never `keep` (the one in use). A process reading a removed
    shard keeps its open descriptor; the next to open it copies it again."""
    shards = []
    for entry in os.scandir(folder):
        ours = "%3A%2F%2F" in entry.name and not TEMP.fullmatch(entry.name)
        if ours and entry.is_file() and entry.path != keep:
            stat = entry.stat()
            shards.append((stat.st_mtime, stat.st_size, entry.path))
    total = sum(size for _, size, _ in shards) + os.path.getsize(keep)
    for _, size, path in sorted(shards):
        if total <= limit_bytes:
            break
        with contextlib.suppress(FileNotFoundError):  # another worker removed it first
            os.unlink(path)
        total -= size


def scan_tar(path: str, url: str, filesize: int | None) -> tuple[np.ndarray, list[str], list[bytes | None]]:
    """Where each sample's image and path members lie in the shard (wids' memory-mapped tar index: four int64
    numbers per sample), with the samples' keys and the contents of their .cls members (None: no such member)."""
    from wids.wids import group_by_key, splitname
    from wids.wids_mmtar import MMIndexedTar

    try:
        tar = MMIndexedTar(path)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as err:
        raise UserError(f"shard {url} is not a readable tar file ({err}); {REWRITE}") from None
    try:
        entries, data = tar.by_index, tar.mmapped_file
        end = max((offset + 512 + length for _, offset, length in entries), default=0)
        if end > len(data) or filesize not in (None, len(data)):
            need = max(end, filesize or 0)
            raise UserError(f"shard {url} is cut short or replaced ({len(data)} bytes, {need} expected); {REWRITE}")
        rows, keys, cls = [], [], []
        for group in group_by_key([name for name, _, _ in entries]):
            found = {splitname(entries[i][0])[1]: entries[i] for i in group}
            key = splitname(entries[group[0]][0])[0]
            image = next((v for k, v in found.items() if k.lower() in IMAGE_EXTENSIONS), None)
            if image is None or ".path" not in found:
                raise UserError(f"sample {key} in shard {url} has no image or no .path member; {REWRITE}")
            rows.append((image[1] + 512, image[2], found[".path"][1] + 512, found[".path"][2]))
            label = found.get(".cls")
            keys.append(key)
            cls.append(None if label is None else bytes(data[label[1] + 512:label[1] + 512 + label[2]]))
    finally:
        tar.close()
    return np.asarray(rows, dtype=np.int64).reshape(-1, 4), keys, cls


def cls_text(label: int | list[int]) -> str:
    """A sample's .cls member: its class index, or (multi-label) its class indices separated by spaces."""
    return " ".join(map(str, label)) if isinstance(label, list) else str(int(label))


def label_mismatch(keys: list[str], cls: list[bytes | None], labels: list) -> str:
    """The first sample whose .cls member (where it has one) is not its label in `labels`, in words ("": none)."""
    for key, member, label in zip(keys, cls, labels):
        if isinstance(label, list):
            words = member.split() if member is not None else []
            if member is not None and not (all(w.isdigit() for w in words) and sorted(map(int, words)) == label):
                return f"sample {key} has {member.strip().decode(errors='replace')!r} in its .cls member, the " \
                       f"index {label}"
            continue
        if member is not None and not (member.strip().isdigit() and int(member) == label):
            return f"sample {key} has {member.strip().decode(errors='replace')!r} in its .cls member, the index {label}"
    return ""


class ShardDataset(AugmentedDataset):
    """The samples of one split's shards, in index order (the converter keeps ImageFolder's order)."""

    def __init__(self, index: str, transform: A.Compose, seed: int, classes: list[str] | None = None, *,
                 skip_corrupt: bool = False, max_pixels: int = DataConfig.max_image_pixels,
                 cache_dir: str = "", multi_label: bool = False, cache_gb: float = DataConfig.shard_cache_gb) -> None:
        super().__init__(transform, seed)
        self.index, self.skip_corrupt, self.max_pixels = index, skip_corrupt, max_pixels
        self.cache_bytes = cache_gb * 1e9
        self.cache_dir = cache_dir or os.environ.get("WIDS_CACHE", "/tmp/_wids_cache")
        if is_url(index):
            os.makedirs(self.cache_dir, exist_ok=True)
        spec = read_index(index, self.cache_dir)
        self.urls: list[str] = spec["urls"]
        self.sizes: list[int | None] = spec["sizes"]
        if spec["multi_label"] != multi_label:
            made = "from a list file with --multi-label" if spec["multi_label"] else "with one label per image"
            raise UserError(f"shard index {index} was made {made}; set data.multi_label="
                            f"{str(spec['multi_label']).lower()}")
        self.classes = classes if classes is not None else spec["classes"]
        if multi_label:
            self.labels = multi_hot([s for lab in spec["labels"] for s in lab], spec["classes"], self.classes, index)
        else:
            labels = np.concatenate(spec["labels"]) if spec["labels"] else np.zeros(0, np.int64)
            self.labels = shared_labels(labels, spec["classes"], self.classes, index)
        self.starts = np.concatenate([[0], np.cumsum([len(lab) for lab in spec["labels"]])])
        self.shard_labels: list = spec["labels"]  # as the index says, for the shards' .cls members
        missing = [url for url in self.urls if not is_url(url) and not os.path.isfile(url)]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise UserError(f"shard {missing[0]}{more} of index {index} does not exist; {REWRITE}, or fix the index")
        self.members: dict[int, np.ndarray] = {}  # shard -> per-sample (image offset, size, path offset, size)
        self.files: OrderedDict[int, int] = OrderedDict()  # shard -> open file descriptor
        self.pid = os.getpid()
        self.copies: tuple[int, ThreadPoolExecutor, dict[int, Future]] | None = None  # (pid, threads, shard -> copy)
        self.plan: ShardPlan | None = None  # data.shard_order=by_rank: this rank's shards, copied in its order
        self.epoch = 0  # of the sample read last (the plan's order is the epoch's)
        self.block = range(len(self.urls))  # the shards this process reads in index order (evaluation: its block)

    def __getitem__(self, key: int | tuple[int, ...]) -> tuple:
        if isinstance(key, tuple):
            self.epoch = key[0]
        return super().__getitem__(key)

    def keep_to(self, start: int, stop: int) -> None:
        """Copy ahead only the shards of samples [start, stop): the block this process evaluates."""
        self.block = range(self.locate(start)[0], self.locate(stop - 1)[0] + 1) if stop > start else range(0)

    def follow(self, plan: ShardPlan) -> None:
        """Copy shards at URLs in `plan`'s order from now on, the first epoch's first ones starting at once."""
        self.plan = plan
        self.warm(0, 0)

    def warm(self, epoch: int, start: int) -> None:
        """Start copying (in threads) the first shard this rank's reading of `epoch` from sample `start` on may need
        and the PREFETCH after it: a run's first copies overlap its start-up instead of waiting for the first batch."""
        if self.plan is not None and self.urls and is_url(self.urls[0]) and start < self.plan.num_samples:
            self.epoch = epoch
            first = self.plan.first_shard(epoch, start)
            self.copy_ahead(first, {first})

    def __getstate__(self) -> dict:
        return {**self.__dict__, "files": OrderedDict(), "copies": None}  # descriptors and threads stay here

    def locate(self, index: int) -> tuple[int, int]:
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        return shard, index - int(self.starts[shard])

    def local_path(self, shard: int) -> str:
        """The shard's file: itself, or (a URL) its copy in the cache, the next PREFETCH shards copied meanwhile."""
        if not is_url(self.urls[shard]):
            return self.urls[shard]
        pending = self.copy_ahead(shard)
        if (copying := pending.pop(shard, None)) is not None:
            copying.result()  # its error, if any, is this sample's
        return self.copy(shard)  # (again, if the cache removed it meanwhile)

    def copy_ahead(self, shard: int, also: set[int] = frozenset()) -> dict[int, Future]:
        """Start copying, in threads, the shards read after `shard` (and `also`) not yet in the cache; the copies
        under way, by shard."""
        if self.copies is None or self.copies[0] != os.getpid():  # threads do not survive a fork
            self.copies = (os.getpid(), ThreadPoolExecutor(PREFETCH, thread_name_prefix="shard-copy"), {})
        _, pool, pending = self.copies
        for ahead in [*also, *self.ahead(shard)]:
            if ahead not in pending and not os.path.exists(self.cached(ahead)):
                pending[ahead] = pool.submit(self.copy, ahead)
        return pending

    def ahead(self, shard: int) -> list[int]:
        """The shards to copy ahead of `shard`: the PREFETCH read after it. In index order, where every shard fits in
        the cache (in a random order a copy ahead could push out one still to be read: else each is copied when read);
        with a ShardPlan in this rank's order of the epoch, where the shards read at once (SHUFFLE_SHARDS mixed, the
        PREFETCH ahead) fit."""
        if None in self.sizes:
            return []
        if self.plan is None:
            fits = sum(self.sizes) <= self.cache_bytes
            ahead = [(shard + step) % len(self.urls) for step in range(1, PREFETCH + 1) if step < len(self.urls)]
            return [other for other in ahead if other in self.block] if fits else []
        order = self.plan.shards(self.epoch)
        if shard not in order or sum(sorted(self.sizes)[-(PREFETCH + SHUFFLE_SHARDS + 1):]) > self.cache_bytes:
            return []
        at = order.index(shard)
        return order[at + 1:at + 1 + PREFETCH]

    def cached(self, shard: int) -> str:
        return os.path.join(self.cache_dir, quote(self.urls[shard], safe="+-"))

    def copy(self, shard: int) -> str:
        """The shard at a URL copied into the cache (once), the cache trimmed to its bound after a new copy."""
        url, local = self.urls[shard], self.cached(shard)
        fresh = not os.path.exists(local)
        try:
            if not fresh:
                return fetch(url, local)
            with copy_lock(local):  # another process copying it: wait for its copy
                fresh = not os.path.exists(local)
                fetch(url, local)
        except (OSError, AssertionError, ValueError) as err:
            raise UserError(f"cannot fetch shard {url} ({getattr(err, 'strerror', None) or err}); "
                            "check the URL and its credentials") from None
        if fresh:
            trim_cache(self.cache_dir, self.cache_bytes, local)
        return local

    def file(self, shard: int) -> int:
        """An open descriptor of the shard (a forked worker opens its own: offsets are not shared, pread is)."""
        if os.getpid() != self.pid:
            self.files, self.pid = OrderedDict(), os.getpid()
        if shard in self.files:
            self.files.move_to_end(shard)
            return self.files[shard]
        path = self.local_path(shard)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as err:
            raise UserError(f"cannot read shard {self.urls[shard]} ({err.strerror}); {REWRITE}") from None
        self.files[shard] = fd
        if len(self.files) > OPEN_SHARDS:
            os.close(self.files.popitem(last=False)[1])
        if shard not in self.members:
            self.members[shard] = self.scan(shard, path)
        return fd

    def scan(self, shard: int, path: str) -> np.ndarray:
        """Where each sample's image and path members lie in the shard; its .cls members must be the index's
        labels (a shard of another run, or an edited index, would otherwise train on wrong labels)."""
        url, expected = self.urls[shard], int(self.starts[shard + 1] - self.starts[shard])
        rows, keys, cls = scan_tar(path, url, self.sizes[shard])
        if len(rows) != expected:
            raise UserError(f"shard {url} holds {len(rows)} samples but index {self.index} says {expected} "
                            f"(a cut-short or replaced shard); {REWRITE}")
        labels = self.shard_labels[shard]
        if wrong := label_mismatch(keys, cls, labels.tolist() if isinstance(labels, np.ndarray) else labels):
            raise UserError(f"shard {url} disagrees with its index {self.index} ({wrong}); {REWRITE}")
        return rows

    def member(self, index: int, which: int) -> bytes:
        shard, inner = self.locate(index)
        fd = self.file(shard)
        offset, size = self.members[shard][inner, 2 * which:2 * which + 2]
        data = os.pread(fd, int(size), int(offset))
        if len(data) != size:
            raise UserError(f"shard {self.urls[shard]} is shorter than its index says; {REWRITE}")
        return data

    def member_name(self, index: int) -> str:
        """`<key>.<ext> in shard <url>`: the image member's name, read from its tar header."""
        shard, inner = self.locate(index)
        header = os.pread(self.file(shard), 100, int(self.members[shard][inner, 0]) - 512)
        return f"{header.rstrip(bytes(1)).decode('utf-8', 'replace')} in shard {self.urls[shard]}"

    def load_image(self, index: int) -> np.ndarray:
        return decode_image(self.member(index, 0), self.member_name(index), self.max_pixels)

    def path(self, index: int) -> str:
        return os.fsdecode(self.member(index, 1))
