"""Benchmark 7: the data formats against ImageFolder on the same images (target: shards no slower than files).

The benchmark writes ImageNet-sized JPEGs (data_pipeline.write_jpegs) into a temp folder and stores the
same bytes in each format: ImageFolder (loose files), WebDataset shards (python -m data.make_shards,
--shard-size images each), a list file (train.csv) and a Hugging Face dataset (save_to_disk, the JPEG
bytes in an Image column). Two measurements:
- per-worker speed: one DataLoader worker's work (one thread, samples fetched in a shuffled order as
  the EpochSampler gives them, decoded, RandomResizedCrop 224 + flip, collated in batches of 32) in
  images per CPU-second, the sides alternated as benchmarks/harness.py does;
- worker memory: one epoch through the app's train loader (data.loader.build_train_loader, 2 persistent
  forked workers) per format, then each worker's USS and RSS (/proc/<pid>/smaps_rollup, as
  index_memory.py reads them). Shards and Arrow files are memory-mapped or read with pread: pages of a
  file mapped by one process count as its private (clean) memory, and the kernel can drop them.

    python benchmarks/loader_formats.py [--images 256] [--repeats 5] [--shard-size 64]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path

import harness  # noqa: F401  (puts the repo on sys.path)
from data_pipeline import epoch_img_per_s, write_jpegs
from harness import alternate, machine_line, print_table, ratio_line
from index_memory import child_pids, smaps_mb


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--shard-size", type=int, default=64, help="images per tar shard")
    return parser.parse_args()


def write_formats(root: Path, shard_size: int) -> dict[str, dict]:
    """The ImageFolder tree root/train/<class>/*.jpg in every other format; data.name -> DataConfig fields."""
    import datasets

    from data import make_shards
    from data.datasets import ImageFolderDataset

    folder = ImageFolderDataset(root / "train", transform=None, seed=0)
    relative = [str(Path(folder.path(i)).relative_to(root)) for i in range(len(folder))]
    (root / "train.csv").write_text("path,label\n" + "".join(f"{p},{folder.classes[label]}\n"
                                                            for p, label in zip(relative, folder.labels)))
    make_shards.main([str(root), str(root / "wds"), "--shard-size", str(shard_size), "--splits", "train"])
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=folder.classes)})
    rows = {"image": [{"bytes": Path(folder.path(i)).read_bytes(), "path": None} for i in range(len(folder))],
            "label": folder.labels.tolist()}
    datasets.disable_progress_bars()
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows, features=features)}).save_to_disk(
        str(root / "hf"))
    return {"imagefolder": dict(root=str(root)), "wds": dict(root=str(root / "wds")),
            "listfile": dict(root=str(root)), "hf": dict(root=str(root / "hf"))}


def worker_memory(cfg, batch_size: int) -> tuple[float, float]:
    """Mean USS and RSS (MB) of the train loader's workers after one epoch."""
    import torch

    from core.dist import DistInfo
    from data.loader import build_datasets, build_train_loader

    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    loader = build_train_loader(build_datasets(cfg, seed=0)[0], cfg, batch_size, seed=0, info=info)
    loader.sampler.set_epoch(0)
    for _ in loader:
        pass
    pids = child_pids()
    usage = [smaps_mb(pid) for pid in pids]
    del loader
    gc.collect()
    return sum(u["uss"] for u in usage) / len(usage), sum(u["rss"] for u in usage) / len(usage)


def main() -> None:
    args = parse_args()
    import cv2
    import numpy as np
    import torch

    from core.config import DataConfig
    from data.loader import build_datasets, collate_channels_last

    torch.set_num_threads(1)  # what a DataLoader worker gets
    cv2.setNumThreads(1)
    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="bench-formats-") as tmp:
        root = Path(tmp)
        kb = write_jpegs(root, args.images)
        roots = write_formats(root, args.shard_size)
        # build_datasets also opens a validation split: the training one serves (it is not timed)
        configs = {name: DataConfig(name=name, img_size=224, num_workers=2, val_split="train", **fields)
                   for name, fields in roots.items()}
        order = np.random.default_rng(0).permutation(args.images)  # the shuffled access of an epoch
        sides, wall = {}, {}
        for name, cfg in configs.items():
            dataset = build_datasets(cfg, seed=0)[0]
            wall[name] = []
            sides[name] = epoch_img_per_s(lambda i, d=dataset: d[(0, int(order[i]))], args.images, args.batch_size,
                                          wall[name], collate_channels_last)
        results = alternate(sides, args.repeats, warmup=1)
        title = (f"Formats: decode + RandomResizedCrop 224 + flip + collate in shuffled order, {args.images} JPEGs "
                 f"(mean {kb:.0f} KB), shards of {args.shard_size}, one worker")
        print_table(title, results, "images per CPU-second of the worker, higher is better")
        for name in ("wds", "listfile", "hf"):
            ratio_line(results, name, "imagefolder", target=1.0 if name == "wds" else None)
        print_table(title + ", wall clock", {n: v[1:] for n, v in wall.items()},
                    "images per second of wall-clock time (shared machine: noisier)")
        print(f"\n### Worker memory after one epoch (train loader, 2 forked workers, batch {args.batch_size})\n")
        print("| format | USS MB per worker | RSS MB per worker |")
        print("| --- | ---: | ---: |")
        for name, cfg in configs.items():
            uss, rss = worker_memory(cfg, args.batch_size)
            print(f"| {name} | {uss:.1f} | {rss:.1f} |")
    print(machine_line())


if __name__ == "__main__":
    main()
