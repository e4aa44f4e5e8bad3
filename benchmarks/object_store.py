"""Benchmark 23: the digits as WebDataset shards read from a local S3 server against the same shards on local disk,
and a checkpoint saved to each (target: the S3 side reads at >= 0.8 of the disk side's images per second).

The S3 server is moto's (tests/helpers.s3_server: a real HTTP server in a subprocess on 127.0.0.1, reached through
AWS_ENDPOINT_URL as any S3 endpoint is). The digits (data/digits.export_digits: 1,437 training images of 8x8
pixels as PNG) are written as shards of --shard-size images (python -m data.make_shards) and uploaded to a bucket.
Read: passes over the training split in a shuffled order, each image decoded and put through the eval preset at 32 px,
collated in batches of 64, in this process (one DataLoader worker's work), in both of data.shard_order's orders:
global (a permutation of all images, as the EpochSampler gives it) and by_rank (data/shard_order.py for one process:
shard after shard, shuffled within about 2 shards, the first copies started as the loader starts them);
each round opens the split anew, the S3 side into an empty data.shard_cache, so its time includes reading the
index and copying every shard. Two tables: one pass (a cold start alone: what the first epoch of a run costs) and
--passes (8: the digits config's epochs, the later ones reading the cached copies). Wall-clock images per second:
the copy waits on the network, which CPU time would not count.
Save: a resnet50 checkpoint (weights and SGD momentum, ~200 MB) written as the run writes it: core/files.save_atomic
on disk; on S3 the same local write into the staging folder, then core/store.upload (a temporary key, a copy to
last.pth, the temporary key removed). Sides alternate every round (benchmarks/harness.py).

    python benchmarks/object_store.py [--repeats 3] [--shard-size 256]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import tempfile
import time
from pathlib import Path

import harness  # noqa: F401  (puts the repo on sys.path)
from harness import alternate, machine_line, print_table, ratio_line

ORDERS = ("global", "by_rank")  # data.shard_order's two orders
S3 = "s3 (moto, cold cache)"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shard-size", type=int, default=256, help="images per tar shard")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--model", default="resnet50", help="the timm model whose checkpoint is saved")
    parser.add_argument("--passes", type=int, default=8, help="passes of the second table (the digits config's epochs)")
    return parser.parse_args()


def read_passes(root: str, cache: Path | None, batch_size: int, passes: int, order: str = "global") -> float:
    """Images per wall-clock second of `passes` shuffled passes over the training split at `root` (opened anew, into
    an empty cache: the first pass is a cold one), in data.shard_order `order`'s order for one process: global (a
    permutation of all images, as the EpochSampler's) or by_rank (data/shard_order.py: shard after shard, the first
    copies started when the order is given, as the loader does)."""
    import numpy as np
    from torch.utils.data import default_collate

    from core.config import DataConfig
    from data.loader import build_split
    from data.shard_order import ShardPlan
    from data.transforms import eval_transform

    start = time.perf_counter()
    cfg = DataConfig(name="wds", root=root, img_size=32, crop_pct=1.0, shard_cache=str(cache or ""))
    dataset = build_split(cfg, "train", eval_transform(cfg), seed=0)
    plan = ShardPlan(np.diff(dataset.starts), seed=0, rank=0, world=1) if order == "by_rank" else None
    if plan is not None:
        dataset.follow(plan)
    for epoch in range(passes):
        indices = plan.order(epoch) if plan is not None else np.random.default_rng(epoch).permutation(len(dataset))
        for first in range(0, len(indices), batch_size):
            default_collate([dataset[(epoch, int(i))] for i in indices[first:first + batch_size]])
    return passes * len(dataset) / (time.perf_counter() - start)


def checkpoint(model: str) -> dict:
    """A training checkpoint's bulk: the model's weights and one momentum buffer per parameter."""
    import timm
    import torch

    weights = timm.create_model(model).state_dict()
    momentum = {name: torch.zeros_like(value) for name, value in weights.items() if value.is_floating_point()}
    return {"model": weights, "optimizer": momentum}


def save_seconds(ckpt: dict, folder: Path, url: str | None) -> float:
    """Seconds to write last.pth as the run does: on disk, or on disk then uploaded to `url`."""
    from core.files import save_atomic
    from core.store import upload

    start = time.perf_counter()
    save_atomic(ckpt, folder / "last.pth")
    if url is not None:
        upload(str(folder / "last.pth"), url)
    return time.perf_counter() - start


def main() -> None:
    args = parse_args()
    import cv2
    import torch

    from core.cli import report_errors
    from data import make_shards
    from data.digits import export_digits
    from tests.helpers import s3_server

    torch.set_num_threads(1)  # what a DataLoader worker gets
    cv2.setNumThreads(1)
    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp, s3_server() as env:
        os.environ.update(env)
        import s3fs

        root = Path(tmp)
        export_digits(root / "digits")
        assert report_errors(make_shards.main, [str(root / "digits"), str(root / "shards"), "--shard-size",
                                                str(args.shard_size), "--splits", "train"]) == 0
        fs = s3fs.S3FileSystem()
        fs.mkdir("bench")
        fs.put(str(root / "shards"), "bench/shards", recursive=True)
        shards = len(list((root / "shards").glob("*.tar")))
        rounds = iter(range(10 ** 6))

        def s3_side(passes: int, order: str) -> float:
            cache = root / f"cache{next(rounds)}"  # empty each round: every shard copied again
            try:
                return read_passes("s3://bench/shards", cache, args.batch_size, passes, order)
            finally:
                shutil.rmtree(cache, ignore_errors=True)

        def disk_side(passes: int, order: str) -> float:
            return read_passes(str(root / "shards"), None, args.batch_size, passes, order)

        for passes in (1, args.passes):
            reads = alternate({f"{side} {order}": functools.partial(run, passes, order)
                               for order in ORDERS for side, run in (("disk", disk_side), (S3, s3_side))},
                              args.repeats, warmup=1)
            print_table(f"Reading the digits' {shards} shards of {args.shard_size}: {passes} shuffled pass(es), eval "
                        f"preset 32 px, batches of {args.batch_size}, one process, data.shard_order global and "
                        "by_rank", reads, "images per wall-clock second, higher is better")
            for order in ORDERS:
                ratio_line(reads, f"{S3} {order}", f"disk {order}", target=0.8)
            ratio_line(reads, f"{S3} by_rank", "disk global", target=0.8)
        ckpt = checkpoint(args.model)
        size = sum(t.numel() * t.element_size() for part in ckpt.values() for t in part.values()) / 1e6
        (root / "disk").mkdir()
        (root / "staging").mkdir()
        saves = alternate({"disk": lambda: save_seconds(ckpt, root / "disk", None),
                           "s3 (moto)": lambda: save_seconds(ckpt, root / "staging", "s3://bench/run/last.pth")},
                          args.repeats, warmup=1)
        print_table(f"Saving last.pth ({args.model} weights + momentum, {size:.0f} MB)", saves,
                    "seconds, lower is better")
        ratio_line(saves, "s3 (moto)", "disk", higher_is_better=False)
        with contextlib.suppress(Exception):
            fs.rm("bench", recursive=True)
    print(machine_line())


if __name__ == "__main__":
    main()
