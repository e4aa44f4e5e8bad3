"""Imbalanced digits (issues 26, 40): plain cross-entropy against the long-tail remedies.

    python benchmarks/imbalanced_digits.py                 # 20:1, 8 epochs, the issue-26 variants, seed 0
    python benchmarks/imbalanced_digits.py --ratio 100 --epochs 30 --seeds 0 1 2 --only "plain cross-entropy" \
        train.class_weights=balanced train.class_weights=effective DRW "logit adjustment" \
        "logit adjustment tau=0.5" data.sampler=class_balanced  # the 100:1 (CIFAR-10-LT profile) table
    python benchmarks/imbalanced_digits.py --ratio 100 --epochs 30 --seeds 0 1 2 --only "plain cross-entropy" \
        train.class_weights=balanced "balanced uncapped" "balanced max=5"  # issue 65: the cap on balanced

The training split of scikit-learn's digits (data/digits.py: about 143 images per class) is cut so class c
keeps max(1, round(largest x ratio^(-c / 9))) images: class 0 all of them, class 9 a twentieth (ratio 20) or one
image (ratio 100: 142 of the largest class, so the realised ratio is 142:1). The validation split stays as
exported, balanced (36-37 images per class). The cut is a list file (data.name=listfile) whose paths point into
the digits export: no image is copied. Each variant trains configs/digits.yaml (resnet10t, 32 px, SGD lr 0.1,
batch 64, label smoothing 0.1; 8 epochs unless --epochs) on it; DRW applies the effective-number weights from
the last quarter of the epochs (Cao et al.: epoch 160 of 200). The table gives the last epoch's validation
metrics from metrics.jsonl. docs/benchmarks.md holds the measured tables and their commands.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/x.py` puts benchmarks/, not the repo, on the path
    sys.path.insert(0, str(REPO))

from benchmarks.harness import machine_line  # noqa: E402
from data.digits import export_digits  # noqa: E402
from tests.helpers import run_script  # noqa: E402

VARIANTS = {  # {from}: the epoch DRW's weights start at (the last quarter of --epochs)
    "plain cross-entropy": [],
    "train.class_weights=balanced": ["train.class_weights=balanced"],  # capped at train.class_weights_max=10
    "balanced uncapped": ["train.class_weights=balanced", "train.class_weights_max=0"],  # scikit-learn's
    "balanced max=5": ["train.class_weights=balanced", "train.class_weights_max=5"],
    "train.class_weights=effective": ["train.class_weights=effective"],
    "DRW": ["train.class_weights=effective", "train.class_weights_from_epoch={from}"],
    "logit adjustment": ["train.logit_adjustment=1"],
    "logit adjustment tau=0.5": ["train.logit_adjustment=0.5"],
    "data.sampler=class_balanced": ["data.sampler=class_balanced"],
}


def write_imbalanced(digits: Path, out: Path, ratio: float, seed: int = 0) -> list[int]:
    """out/train.csv (class c cut to largest x ratio^(-c/9), images picked with `seed`) and out/val.csv (all of
    val), paths relative to out; returns the training images per class."""
    rng = np.random.default_rng(seed)
    classes = sorted((p.name for p in (digits / "train").iterdir()), key=int)
    files = {c: sorted((digits / "train" / c).glob("*.png")) for c in classes}
    largest = max(len(f) for f in files.values())
    out.mkdir(parents=True, exist_ok=True)
    counts, rows = [], ["path,label"]
    for i, c in enumerate(classes):
        keep = min(len(files[c]), max(1, round(largest * ratio ** (-i / (len(classes) - 1)))))
        chosen = sorted(rng.choice(len(files[c]), keep, replace=False))
        rows += [f"../{digits.name}/train/{c}/{files[c][j].name},{c}" for j in chosen]
        counts.append(keep)
    (out / "train.csv").write_text("\n".join(rows) + "\n")
    val = ["path,label"] + [f"../{digits.name}/val/{c}/{p.name},{c}" for c in classes
                            for p in sorted((digits / "val" / c).glob("*.png"))]
    (out / "val.csv").write_text("\n".join(val) + "\n")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=".cache/digits_imbalanced", help="where the list files go")
    parser.add_argument("--ratio", type=float, default=20.0, help="largest class / smallest class")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds (the cut uses seed 0)")
    parser.add_argument("--epochs", type=int, default=8, help="train.epochs of every run (configs/digits.yaml: 8)")
    parser.add_argument("--runs", default="runs/imbalanced_digits", help="output folders of the runs")
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), metavar="VARIANT",
                        help="run these variants only (default: all)")
    args = parser.parse_args()
    digits = export_digits(REPO / ".cache/digits")
    root = REPO / args.root
    counts = write_imbalanced(digits, root, args.ratio)
    print(machine_line())
    print(f"training images per class: {counts} (ratio {max(counts) / min(counts):.1f}); val 361, balanced; "
          f"{args.epochs} epochs")
    print("| variant | seed | val balanced acc | val macro-F1 | val top-1 | val_recall of class 9 | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    runs = REPO / args.runs / time.strftime("%Y%m%d-%H%M%S")  # new folders: resume=none never meets an old run
    for name, overrides in VARIANTS.items():
        if name not in args.only:
            continue
        for seed in args.seeds:
            out = runs / f"{name.split('=')[-1].replace(' ', '_')}_seed{seed}"
            keys = [key.format(**{"from": args.epochs - args.epochs // 4}) for key in overrides]
            began = time.perf_counter()
            run_script("train.py", "--config", "configs/digits.yaml", "data.name=listfile", f"data.root={root}",
                       f"seed={seed}", "resume=none", f"output_dir={out}", "logging.progress=false",
                       f"train.epochs={args.epochs}", *keys)
            seconds = time.perf_counter() - began
            last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
            print(f"| {name} | {seed} | {last['val_balanced_acc']:.2f} | {last['val_macro_f1']:.2f} | "
                  f"{last['val_top1']:.2f} | {last.get('val_recall/9', float('nan')):.1f} | {seconds:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
