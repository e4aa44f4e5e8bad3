"""Benchmark 21: the training sampler's per-epoch build at ImageNet size (issue 62 item 3).

Every epoch each rank's `EpochSampler` builds the epoch's global order before the loader can hand out its first
batch: time that is in no step's `input_wait` (the first step is left out of it). Two sides, each over 1.28M
images dealt to 8 ranks, each rank's sampler timed in turn from `iter()` to its first key ("first key", the wait
before the first batch) and over all of its 160k keys ("all keys", what the loader's main process spends on the
sampler over the epoch):
- before: the pure-Python build (a list and a tuple per sample), kept as the reference in
  tests/test_sampler_order.py;
- after: data.loader.EpochSampler (array operations).
Both with the garbage collector's objects frozen, as the app's loader does before its workers fork
(`gc.freeze()`; `--no-freeze` leaves them to the collector). Layouts: plain (configs/resnet50.yaml) and mixed pairs
with 3 repeats (the DeiT and ViT recipes: mixup/cutmix with data.aug_repeats=3).

    python benchmarks/sampler_build.py [--images 1281167] [--ranks 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import time

import harness  # noqa: F401  (puts the repo on sys.path)
from harness import machine_line

LAYOUTS = {"plain": {}, "pairs + 3 repeats": {"unit": 2, "repeats": 3}}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1_281_167, help="training images (ImageNet-1k's)")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="rounds, sides alternating")
    parser.add_argument("--no-freeze", action="store_true", help="leave gc.freeze() out")
    return parser.parse_args()


def rank_times(side: str, images: int, ranks: int, options: dict) -> tuple[float, float]:
    """(largest first-key time, largest all-keys time) over the ranks' samplers of one epoch, in seconds."""
    from data.loader import EpochSampler
    from tests.test_sampler_order import reference_keys

    first, whole = [], []
    for rank in range(ranks):
        sampler = EpochSampler(range(images), num_replicas=ranks, rank=rank, shuffle=True, seed=0, drop_last=True,
                               **options)
        sampler.set_epoch(1)
        start = time.perf_counter()
        keys = reference_keys(sampler) if side == "before" else iter(sampler)
        next(keys)
        first.append(time.perf_counter() - start)
        for _ in keys:
            pass
        whole.append(time.perf_counter() - start)
    return max(first), max(whole)


def main() -> None:
    args = parse_args()
    print(machine_line())
    print(f"{args.images:,} images, {args.ranks} ranks, {args.repeats} rounds, "
          f"gc.freeze(): {'no' if args.no_freeze else 'yes'}\n")
    print("| layout | side | first key, s (min / median / max) | all keys, s (median) |")
    print("| --- | --- | --- | --- |")
    for layout, options in LAYOUTS.items():
        for side in ("before", "after"):  # untimed warm-up of each side's code paths (first calls into torch)
            rank_times(side, 10_000, args.ranks, options)
        results: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
        for round_, side in itertools.product(range(args.repeats), ("before", "after")):
            side = side if round_ % 2 == 0 else {"before": "after", "after": "before"}[side]
            gc.collect()
            if not args.no_freeze:
                gc.freeze()
            results[side].append(rank_times(side, args.images, args.ranks, options))
            gc.unfreeze()
        for side, times in results.items():
            firsts = sorted(t[0] for t in times)
            print(f"| {layout} | {side} | {firsts[0]:.3f} / {statistics.median(firsts):.3f} / {firsts[-1]:.3f} | "
                  f"{statistics.median(t[1] for t in times):.3f} |")


if __name__ == "__main__":
    main()
