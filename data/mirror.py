"""data.root at a URL (s3://, gs://, az://, hf://, https://: any fsspec URL) for an image folder (data.val_fraction's
split too), list files and the images they name, or Hugging Face Parquet and save_to_disk files: copied into a local
mirror, then read there by the same code as a local folder.

Why a mirror, not streaming: these formats scan folders (the classes, the auto split) and read images in random
order, every epoch; a local copy serves them at disk speed and leaves the local code as it is. A data set too large
for the cache is what WebDataset shards are for (python -m data.make_shards; data/shards.py copies them shard by
shard, within data.shard_cache_gb): a data.root holding more than data.shard_cache_gb is refused before anything is
copied. datasets' own fsspec reading (load_dataset with storage_options) is not used: data/hf.py reads offline
(HF_DATASETS_OFFLINE), where datasets refuses every remote file, and its copies would bypass core/store's retries,
one-line errors and this bound.

The mirror of data.root=<scheme>://<bucket>/<prefix> is `<data.shard_cache>/mirror/<scheme>/<bucket>/<prefix>`
(data.shard_cache "" = $WIDS_CACHE or /tmp/_wids_cache, as for shards). Each node's local rank 0 copies (the cache
is node-local: nodes need not share a disk) while the node's other ranks wait; an error is every rank's, in one line
naming the URL. The URL is the truth, listed at each start: a file already in the mirror with the size and the stamp
(ETag, or the modification time: whichever the backend lists) the URL lists is not copied again, where MANIFEST
recorded them at its copy (a list file relabelled at the same length is copied anew); one the URL no longer holds is
removed; each copy is atomic and retried (core/store.download). Messages name the URL, not the mirror (`shown`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Iterator, TypeVar
from urllib.parse import urlparse

from core.config import DataConfig
from core.dist import all_gather_object, is_main
from core.errors import UserError
from core.files import TEMP, atomic_file
from core.store import TEMP_TAG, download, filesystem, is_url, join, retrying

log = logging.getLogger(__name__)
T = TypeVar("T")
MIRRORED = ("imagefolder", "listfile", "hf")  # the formats read from a local mirror of data.root at a URL
STAMPS = ("ETag", "etag", "md5Hash", "LastModified", "last_modified", "updated", "mtime")  # fsspec backends' info keys
MANIFEST = ".mirror.json"  # in the mirror: each copied file's [size, stamp] as the URL listed them


def is_mirrored(cfg: DataConfig) -> bool:
    """Whether data.root is a URL this module copies (not a Hub name, which data/hf.py reads through its cache)."""
    from data.hf import HUB_PREFIXES

    return cfg.name in MIRRORED and is_url(cfg.root) and not cfg.root.startswith(HUB_PREFIXES)


def mirror_folder(cfg: DataConfig) -> Path:
    """The local folder that mirrors data.root's URL."""
    parts = urlparse(cfg.root)
    cache = cfg.shard_cache or os.environ.get("WIDS_CACHE", "/tmp/_wids_cache")
    return Path(cache) / "mirror" / parts.scheme / parts.netloc / parts.path.strip("/")


def local_root(cfg: DataConfig) -> str:
    """data.root as the datasets read it: its mirror for a URL, else itself."""
    return str(mirror_folder(cfg)) if is_mirrored(cfg) else cfg.root


def shown(text: str, cfg: DataConfig) -> str:
    """A message with the mirror's paths written as data.root's URL."""
    return text.replace(str(mirror_folder(cfg)), cfg.root.rstrip("/")) if is_mirrored(cfg) else text


@contextlib.contextmanager
def errors_by_url(cfg: DataConfig) -> Iterator[None]:
    """A UserError raised inside, from data read in data.root's mirror, said with the URL in place of the mirror."""
    try:
        yield
    except UserError as err:
        if not is_mirrored(cfg):
            raise
        raise UserError(shown(str(err), cfg)) from None


def named_by_url(dataset: T, cfg: DataConfig) -> T:
    """`dataset` (read from data.root's mirror) naming its images by the URL in its errors."""
    if is_mirrored(cfg):
        dataset.mirror = (str(mirror_folder(cfg)), cfg.root.rstrip("/"))
    return dataset


def prepare_mirror(cfg: DataConfig, local_rank: int) -> None:
    """data.root at a URL: each node's local rank 0 brings the mirror up to date, the node's other ranks wait (a
    barrier); a UserError of any copying rank is every rank's."""
    if not is_mirrored(cfg):
        return
    problem = None
    if local_rank == 0:
        try:
            sync(cfg.root, mirror_folder(cfg), cfg.shard_cache_gb)
        except UserError as err:
            problem = str(err)
    problems = [found for found in all_gather_object(problem) if found]
    if problems:
        raise UserError(problems[0], all_ranks=True)


def listing(url: str) -> dict[str, list]:
    """The files under `url` (relative path -> [size, stamp]), without upload temporaries (core/store.upload's)."""
    fs, root = filesystem(url)
    found = retrying("list", url, lambda: fs.find(root, detail=True))
    base = root.rstrip("/")
    files = {path[len(base) + 1:]: [int(info.get("size") or 0), stamp(info)] for path, info in found.items()
             if info.get("type", "file") == "file" and path.startswith(f"{base}/")}
    return {rel: entry for rel, entry in files.items() if rel and not rel.endswith("/") and TEMP_TAG not in rel}


def stamp(info: dict) -> str:
    """What tells a rewritten object from the one copied: its ETag or modification time, as the backend lists it."""
    return next((str(info[key]) for key in STAMPS if info.get(key) is not None), "")


def recorded(folder: Path) -> dict[str, list]:
    """MANIFEST's entries ({} where there is none, or none whole)."""
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def sync(url: str, folder: Path, limit_gb: float) -> None:
    """Make `folder` a copy of the files under `url`: those missing or listed otherwise than at their copy copied, the
    others kept, those the URL lacks removed; refused in one line when the URL holds none, or more than `limit_gb`."""
    files = listing(url)
    if not files:
        raise UserError(f"data.root {url} holds no files; check the URL (a folder of the bucket) and data.name")
    total = sum(size for size, _ in files.values())
    if total > limit_gb * 1e9:
        raise UserError(f"data.root {url} holds {total / 1e9:.3g} GB, more than data.shard_cache_gb={limit_gb} "
                        "lets its local copy hold; write it as WebDataset shards (python -m data.make_shards <folder> "
                        "<out>; data.name=wds reads them shard by shard), or raise data.shard_cache_gb")
    folder.mkdir(parents=True, exist_ok=True)
    remove_others(folder, {*files, MANIFEST})
    before, copied = recorded(folder), 0
    for rel, entry in sorted(files.items()):
        target = folder / rel
        if target.is_file() and target.stat().st_size == entry[0] and before.get(rel) == entry:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        download(join(url, rel), str(target), "read")
        copied += 1
    with atomic_file(folder / MANIFEST) as out:
        out.write(json.dumps(files).encode())
    if is_main():
        log.info("data.root %s: %d file(s) (%.1f MB) mirrored in %s, %d copied now", url, len(files), total / 1e6,
                 folder, copied)


def remove_others(folder: Path, keep: set[str]) -> None:
    """Remove the mirror's files the URL no longer holds (never a copy under way: core/files.temp_name's names), and
    the folders left empty (an ImageFolder would read an empty class folder as a class)."""
    for path in sorted(folder.rglob("*"), reverse=True):  # a folder's files before the folder
        if path.is_file() and not TEMP.fullmatch(path.name) and path.relative_to(folder).as_posix() not in keep:
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
