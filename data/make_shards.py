"""Convert an ImageFolder tree into WebDataset tar shards plus their index (read by data.name=wds).

    python -m data.make_shards <imagefolder root> <out> [--shard-size N] [--splits train val]
    python -m data.make_shards <list-file root> <out> --list [--multi-label]     # from <split>.csv list files

Writes <out>/<split>-gG-NNNNNN.tar (N samples each, the last one fewer) and <out>/<split>.json (see
data/shards.py). Samples keep ImageFolder's order and class list (every split is labelled with the
first split's classes), so a run on the shards sees the same sample at the same index, augmented the
same way. Images are copied byte for byte (never decoded).

A re-run never changes the set an index names: it writes generation G = the index's generation + 1 under new
names, reads each shard back (its .cls members must be the index's labels), replaces the index in one rename
and only then removes the old generation. A run killed at any point leaves the old index with all of its
shards (and unnamed files of the new generation, removed by the next run). The output folder is locked while
a run writes it, and an output inside a split folder it reads, or a <split>.json that is not a shard index, is refused
before anything is created.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import json
import logging
import os
import re
import sys
import tarfile
from pathlib import Path
from typing import Iterator

import numpy as np

from core.errors import UserError
from core.logs import setup_logging
from core.store import refuse_url
from data.datasets import AugmentedDataset, ImageFolderDataset, find_classes
from data.listfile import ListFileDataset
from data.shards import cls_text, label_mismatch, scan_tar

log = logging.getLogger("make_shards")


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """A regular file with fixed metadata, so the same images give the same shard bytes."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o444, 0
    tar.addfile(info, io.BytesIO(data))


def shard_name(split: str, generation: int, number: int) -> str:
    return f"{split}-g{generation}-{number:06d}.tar"


def generation_names(split: str) -> re.Pattern:
    """Our shard names for the split, of any generation (and their temp files)."""
    return re.compile(rf"\.?{re.escape(split)}-g\d+-\d{{6}}\.tar(\.tmp)?")


def first_names(split: str) -> re.Pattern:
    """Shard names before generations (<split>-NNNNNN.tar): ours only where our index names them."""
    return re.compile(rf"{re.escape(split)}-\d{{6}}\.tar")


def previous_index(out: Path, split: str) -> tuple[int, set[str]]:
    """The generation and shard names of the index a run replaces ((0, {}) for none); refuses a file that is not
    a shard index, which is not ours to replace."""
    path = out / f"{split}.json"
    if not path.exists() and not path.is_symlink():
        return 0, set()
    try:
        index = json.loads(path.read_text())
        index["classes"]  # (a shard index of this tool)
        return int(index.get("generation", 0)), {shard["url"] for shard in index["shardlist"]}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{path} exists and is not a shard index ({type(err).__name__}: {err}); move it away or "
                        "choose another output folder") from None


def sample_label(dataset: AugmentedDataset, i: int) -> int | list[int]:
    """A sample's label as the index stores it: a class index, or (multi-label) the list of its class indices."""
    label = dataset.labels[i]
    return [int(c) for c in np.flatnonzero(label)] if label.ndim else int(label)


def source_split(root: Path, split: str, classes: list[str] | None, listed: bool, multi_label: bool
                 ) -> AugmentedDataset:
    """The split to convert: an ImageFolder split folder, or (--list) the split's list file."""
    if listed:
        return ListFileDataset(root, split, transform=None, seed=0, classes=classes, multi_label=multi_label)
    return ImageFolderDataset(root / split, transform=None, seed=0, classes=classes)


def write_shard(tar_path: Path, dataset: AugmentedDataset, indices: range) -> None:
    """The samples `indices` of the dataset as one tar file, through a temp name."""
    tmp = tar_path.with_name(f".{tar_path.name}.tmp")
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in indices:
            path = dataset.path(i)
            try:
                data = Path(path).read_bytes()
            except OSError as err:
                raise UserError(f"cannot read image {path} ({err.strerror}); remove or replace it") from None
            key, ext = f"{i:08d}", Path(path).suffix.lower()
            add_member(tar, key + ext, data)
            add_member(tar, f"{key}.cls", cls_text(sample_label(dataset, i)).encode())
            add_member(tar, f"{key}.path", os.fsencode(path))
    os.replace(tmp, tar_path)


def write_split(dataset: AugmentedDataset, out: Path, split: str, classes: list[str], shard_size: int,
                multi_label: bool = False) -> int:
    """Write one split's shards as a new generation, switch its index to them, remove the old generation;
    returns its number of samples."""
    generation, old = previous_index(out, split)
    generation += 1
    while any(name.startswith(f"{split}-g{generation}-") for name in old):
        generation += 1  # (a hand-edited index naming the next generation's files)
    shards = []
    for first in range(0, len(dataset), shard_size):
        name = shard_name(split, generation, len(shards))
        indices = range(first, min(first + shard_size, len(dataset)))
        write_shard(out / name, dataset, indices)
        labels = [sample_label(dataset, i) for i in indices]
        size = (out / name).stat().st_size
        _, keys, cls = scan_tar(str(out / name), str(out / name), size)  # read back: the index says what it holds
        if wrong := label_mismatch(keys, cls, labels):
            raise UserError(f"shard {out / name} as written disagrees with its index ({wrong}); {out / split}.json "
                            "was left as it was: check the disk and run again")
        shards.append({"url": name, "nsamples": len(indices), "filesize": size, "labels": labels})
    index = {"wids_version": 1, "name": split, "generation": generation, "classes": classes, "shardlist": shards,
             **({"multi_label": True} if multi_label else {})}
    tmp = out / f".{split}.json.tmp"
    tmp.write_text(json.dumps(index) + "\n")
    os.replace(tmp, out / f"{split}.json")  # the switch: the old generation is now unused
    remove_unused(out, split, old, {shard["url"] for shard in shards})
    log.info("%s: %d images in %d shard(s), index %s", split, len(dataset), len(shards), out / f"{split}.json")
    return len(dataset)


def remove_unused(out: Path, split: str, old: set[str], kept: set[str]) -> None:
    """Remove the shards of earlier generations: those the previous index named and those no index names (an
    interrupted run's). Files of other names are left alone, even where an index names them."""
    ours, first = generation_names(split), first_names(split)
    for entry in os.scandir(out):
        if entry.name in kept or not entry.is_file():
            continue
        if ours.fullmatch(entry.name) or (entry.name in old and first.fullmatch(entry.name)):
            os.unlink(entry.path)


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on the output folder (released by the kernel if the process dies)."""
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another make_shards is writing {out}; wait for it to finish") from None
        yield
    finally:
        os.close(fd)


def check_outside(root: Path, splits: list[str], out: Path) -> None:
    """An output inside a split folder would add files (a class folder) to the images being converted."""
    inside = out.resolve()
    for split in splits:
        folder = (root / split).resolve()
        if inside == folder or folder in inside.parents:
            raise UserError(f"output folder {out} is inside {root / split}, which make_shards reads; choose a folder "
                            f"outside it (e.g. {root}/shards)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", help="an ImageFolder root holding <split>/<class>/* (with --list: <split>.csv files)")
    parser.add_argument("out", help="folder for the shards and <split>.json indexes")
    parser.add_argument("--shard-size", type=int, default=1000, help="samples per shard (default 1000)")
    parser.add_argument("--splits", nargs="+", default=["train", "val"],
                        help="splits to convert; the first one's class folders are the class list (default: train val)")
    parser.add_argument("--list", action="store_true", help="root holds list files (data.name=listfile) to convert")
    parser.add_argument("--multi-label", action="store_true", help="with --list: rows hold sets of labels (a|b)")
    args = parser.parse_args(argv)
    setup_logging(0, "INFO")
    if args.multi_label and not args.list:
        raise UserError("--multi-label converts list files (path,labels rows with a|b); add --list")
    if args.shard_size <= 0:
        raise UserError(f"--shard-size must be > 0, got {args.shard_size}")
    refuse_url(args.root, "the image folder", "copy it here first")
    refuse_url(args.out, "the output folder", "write the shards to a local folder, then copy it to the URL (e.g. aws "
                                              "s3 cp --recursive), where data.name=wds data.root=<URL> reads them")
    root, out = Path(args.root), Path(args.out)
    check_outside(root, args.splits, out)
    first = source_split(root, args.splits[0], None, args.list, args.multi_label) if args.list else None
    classes = first.classes if first is not None else find_classes(root / args.splits[0])
    for split in args.splits:  # before creating anything; read again under the lock
        previous_index(out, split)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create {out} ({err.strerror}); choose another output folder") from None
    with locked(out):
        for split in args.splits:
            dataset = source_split(root, split, classes, args.list, args.multi_label)
            write_split(dataset, out, split, classes, args.shard_size, args.multi_label)
    return 0


def run(argv: list[str]) -> int:
    """main with core.cli's error contract (one `error: ...` line, exit 2); data/ may not import core.cli."""
    try:
        return main(argv)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
