"""Convert an ImageFolder tree into WebDataset tar shards plus their index (read by data.name=wds).

    python -m data.make_shards <imagefolder root> <out> [--shard-size N] [--splits train val]

Writes <out>/<split>-NNNNNN.tar (N samples each, the last one fewer) and <out>/<split>.json (see
data/shards.py). Samples keep ImageFolder's order and class list (every split is labelled with the
first split's classes), so a run on the shards sees the same sample at the same index, augmented the
same way. Images are copied byte for byte (never decoded); the index is written last, so an interrupted
conversion leaves no index that points at missing shards.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import sys
import tarfile
from pathlib import Path

from data.datasets import ImageFolderDataset, find_classes
from engine.errors import UserError
from engine.logs import setup_logging
from engine.outputs import check_replaceable, starts_with

log = logging.getLogger("make_shards")
INDEX = starts_with(b'{"wids_version": ')  # an index as write_split writes it


def is_tar(path: Path) -> bool:
    """A file make_shards may replace where a shard goes: a tar file (an earlier shard), nothing else."""
    return path.is_file() and tarfile.is_tarfile(path)


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """A regular file with fixed metadata, so the same images give the same shard bytes."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o444, 0
    tar.addfile(info, io.BytesIO(data))


def write_split(split_dir: Path, out: Path, split: str, classes: list[str], shard_size: int) -> int:
    """Write one split's shards and index; returns its number of samples."""
    dataset = ImageFolderDataset(split_dir, transform=None, seed=0, classes=classes)
    shards = []
    for first in range(0, len(dataset), shard_size):
        name = f"{split}-{len(shards):06d}.tar"
        tmp = out / f".{name}.tmp"
        indices = range(first, min(first + shard_size, len(dataset)))
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in indices:
                path = dataset.path(i)
                try:
                    data = Path(path).read_bytes()
                except OSError as err:
                    raise UserError(f"cannot read image {path} ({err.strerror}); remove or replace it") from None
                key, ext = f"{i:08d}", Path(path).suffix.lower()
                add_member(tar, key + ext, data)
                add_member(tar, f"{key}.cls", str(int(dataset.labels[i])).encode())
                add_member(tar, f"{key}.path", os.fsencode(path))
        os.replace(tmp, out / name)
        shards.append({"url": name, "nsamples": len(indices), "filesize": (out / name).stat().st_size,
                       "labels": [int(label) for label in dataset.labels[indices.start:indices.stop]]})
    index = {"wids_version": 1, "name": split, "classes": classes, "shardlist": shards}
    tmp = out / f".{split}.json.tmp"
    tmp.write_text(json.dumps(index) + "\n")
    os.replace(tmp, out / f"{split}.json")
    log.info("%s: %d images in %d shard(s), index %s", split, len(dataset), len(shards), out / f"{split}.json")
    return len(dataset)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", help="an ImageFolder root holding <split>/<class>/*")
    parser.add_argument("out", help="folder for the shards and <split>.json indexes")
    parser.add_argument("--shard-size", type=int, default=1000, help="samples per shard (default 1000)")
    parser.add_argument("--splits", nargs="+", default=["train", "val"],
                        help="splits to convert; the first one's class folders are the class list (default: train val)")
    args = parser.parse_args(argv)
    setup_logging(0, "INFO")
    if args.shard_size <= 0:
        raise UserError(f"--shard-size must be > 0, got {args.shard_size}")
    root, out = Path(args.root), Path(args.out)
    classes = find_classes(root / args.splits[0])
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create {out} ({err.strerror}); choose another output folder") from None
    for split in args.splits:  # only earlier shards and indexes are replaced, nothing else of the user's
        check_replaceable(out / f"{split}.json", INDEX, "an earlier shard index of make_shards", "output folder")
        for shard in sorted(out.glob(f"{split}-[0-9][0-9][0-9][0-9][0-9][0-9].tar")):
            check_replaceable(shard, is_tar, "an earlier shard of make_shards (a tar file)", "output folder")
    for split in args.splits:
        write_split(root / split, out, split, classes, args.shard_size)
    return 0


def run(argv: list[str]) -> int:
    """main with engine.cli's error contract (one `error: ...` line, exit 2); data/ may not import engine.cli."""
    try:
        return main(argv)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
