"""Benchmark 5: DataLoader worker memory with a 1,000,000-image ImageFolder index and 4 workers.

Target: a worker's unique memory (USS = Private_Clean + Private_Dirty in /proc/<pid>/smaps_rollup) grows
by no more than 50 MB over an epoch. Two sides, each a full epoch through the app's own train loader
(data.loader.build_train_loader: EpochSampler, 4 persistent forked workers, gc.freeze() before the fork):
- ours: ImageFolderDataset's index as data.datasets.PackedStrings (two numpy arrays);
- list of str: the same dataset with the paths in a Python list, as torchvision's ImageFolder keeps them.
The index is synthetic (ImageNet-like relative paths, 1000 classes) and "decoding" returns one pixel
without touching the disk, so the epoch exercises exactly the index lookups, the per-sample seeding
and the albumentations call of the real `__getitem__`. USS is read once every worker has delivered a
batch and again at the end of the epoch (persistent workers are still alive then).

    python benchmarks/index_memory.py [--size 1000000] [--workers 4]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import harness  # noqa: F401  (puts the repo on sys.path)
from harness import machine_line

MB = 1024 * 1024


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1_000_000, help="entries in the index")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=500)
    return parser.parse_args()


def smaps_mb(pid: int) -> dict[str, float]:
    """USS (private pages) and RSS of a process, in MB, from /proc/<pid>/smaps_rollup."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) * 1024
    return {"uss": (fields["Private_Clean"] + fields["Private_Dirty"]) / MB, "rss": fields["Rss"] / MB}


def peak_rss_mb(pid: int) -> float:
    """VmHWM: the process's peak resident set size."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / MB
    return float("nan")


def child_pids() -> list[int]:
    """PIDs whose parent is this process (the DataLoader workers)."""
    me, pids = os.getpid(), []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                pids.append(int(entry.name))
    return sorted(pids)


def make_dataset(size: int, packed: bool):
    """ImageFolderDataset over a synthetic index of `size` ImageNet-like paths; decoding returns one pixel."""
    import albumentations as A
    import numpy as np
    from albumentations.pytorch import ToTensorV2

    from data.datasets import ImageFolderDataset, PackedStrings

    pixel = np.zeros((1, 1, 3), np.uint8)

    class IndexOnlyDataset(ImageFolderDataset):
        def __init__(self) -> None:  # the index is built directly instead of scanning 1M files
            super(ImageFolderDataset, self).__init__(A.Compose([ToTensorV2()]), seed=0)
            self.root = Path("/nonexistent/train")
            self.classes = [f"n{c:08d}" for c in range(1000)]
            self.labels = np.arange(size, dtype=np.int64) % 1000
            paths = [f"n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG" for i in range(size)]
            self.paths = PackedStrings(paths) if packed else paths

        def load_image(self, index: int) -> np.ndarray:
            self.path(index)  # the same index lookup a real read makes
            return pixel

    return IndexOnlyDataset()


def run_epoch(size: int, packed: bool, workers: int, batch_size: int) -> dict:
    """One epoch through the app's train loader; worker USS after warm-up and at the end, peak RSS."""
    import gc

    import torch

    from core.config import DataConfig
    from core.dist import DistInfo
    from core.startup import keep_freed_memory
    from data.loader import build_train_loader

    keep_freed_memory()  # as tune_cpu_process does on CPU before the app builds its loaders
    dataset = make_dataset(size, packed)
    gc.collect()
    info = DistInfo(0, 1, 0, 1, torch.device("cpu"))
    loader = build_train_loader(dataset, DataConfig(num_workers=workers, persistent_workers=True), batch_size,
                                seed=0, info=info)
    loader.sampler.set_epoch(0)
    start = time.perf_counter()
    iterator = iter(loader)
    for _ in range(workers):  # batches come round-robin: now every worker has delivered one
        next(iterator)
    pids = child_pids()
    before = {pid: smaps_mb(pid) for pid in pids}
    seen = workers
    for _ in iterator:
        seen += 1
    after = {pid: smaps_mb(pid) for pid in pids}
    result = {
        "seconds": time.perf_counter() - start, "batches": seen,
        "growth": [after[p]["uss"] - before[p]["uss"] for p in pids],
        "uss_end": [after[p]["uss"] for p in pids],
        "worker_peak_rss": [peak_rss_mb(p) for p in pids],
        "main_rss": smaps_mb(os.getpid())["rss"], "main_peak_rss": peak_rss_mb(os.getpid()),
    }
    del iterator, loader
    return result


def main() -> None:
    args = parse_args()
    print(machine_line())
    sides = {"ours (PackedStrings)": True, "list of str": False}
    results = {name: run_epoch(args.size, packed, args.workers, args.batch_size) for name, packed in sides.items()}
    print(f"\n### Index memory: {args.size:,} entries, {args.workers} workers, batch {args.batch_size}, "
          "one epoch\n")
    print("| side | worker USS growth min / median / max (MB) | worker USS at end (MB) | worker peak RSS (MB) "
          "| main process RSS / peak (MB) | epoch (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        growth = sorted(r["growth"])
        print(f"| {name} | {growth[0]:.1f} / {growth[len(growth) // 2]:.1f} / {growth[-1]:.1f} "
              f"| {max(r['uss_end']):.1f} | {max(r['worker_peak_rss']):.0f} "
              f"| {r['main_rss']:.0f} / {r['main_peak_rss']:.0f} | {r['seconds']:.0f} |")
    worst = max(results["ours (PackedStrings)"]["growth"])
    print(f"\n- ours: largest worker USS growth {worst:.1f} MB; target <= 50 MB: {'met' if worst <= 50 else 'MISSED'}")
    print(f"- list of str: largest worker USS growth {max(results['list of str']['growth']):.1f} MB "
          "(reference counts written into the parent's pages copy them into every worker)")
    print(machine_line())


if __name__ == "__main__":
    main()
