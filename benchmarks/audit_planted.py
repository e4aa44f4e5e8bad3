"""audit.py against planted problems in real images (scikit-learn's digits): how many it finds, how many it invents.

    python benchmarks/audit_planted.py                      # 5% and 20% label flips, copies across train/val, bad files
    python benchmarks/audit_planted.py --flips 0.05 --folds 5 --work /tmp/planted

For each flip rate: a copy of the digits export in which that share of the training images (stratified by class,
seeded) is moved to another class's folder, plus near-copies of validation images planted in train (resized 32 ->
36 -> 32 px, JPEG quality 75, 1-2 px cut off each side), plus unreadable files. Then `python audit.py --config
digits` on it as a user runs it (the quickstart's recipe, k folds) and the files it wrote are scored:
label_issues.csv against the flips (recall, precision), duplicates.csv's cross-split pairs against the planted
copies (recall, and false pairs per 100 validation images), the file findings against the bad files.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness import cpu_model  # noqa: E402
from data.digits import export_digits  # noqa: E402
from tests.helpers import script_env  # noqa: E402

COPIES = 20  # validation images planted in train, each in one of three near-copy forms
BAD_FILES = 3  # a truncated PNG, bytes that are no image, and an empty file


def plant(root: Path, flips: float, seed: int) -> dict[str, list]:
    """The digits export at `root` with flips, near-copies and bad files planted; what was planted."""
    export_digits(root)
    rng = np.random.default_rng(seed)
    classes = sorted(p.name for p in (root / "train").iterdir())
    flipped = []
    for name in classes:
        files = sorted(f for f in (root / "train" / name).glob("*.png") if not f.name.startswith("flip_"))
        for file in rng.choice(files, round(flips * len(files)), replace=False):
            other = classes[(classes.index(name) + int(rng.integers(1, len(classes)))) % len(classes)]
            target = root / "train" / other / f"flip_{name}_{file.name}"
            file.rename(target)
            flipped.append(str(target))
    copies = []
    val = sorted((root / "val").rglob("*.png"))
    for i, file in enumerate(rng.choice(val, COPIES, replace=False)):
        image = Image.open(file).convert("RGB")
        target = root / "train" / file.parent.name / f"copy_{i}_{file.stem}"
        if i % 3 == 0:
            copy = image.resize((36, 36), Image.BILINEAR).resize((32, 32), Image.BILINEAR)
            target = target.with_suffix(".png")
        elif i % 3 == 1:
            copy, target = image, target.with_suffix(".jpg")
        else:  # 1 or 2 px cut off each side: the loader's resize then sees the digit a little larger
            crop = 1 + i % 2
            copy, target = image.crop((crop, crop, image.width - crop, image.height - crop)), target.with_suffix(".png")
        copy.save(target, **({"quality": 75} if target.suffix == ".jpg" else {}))
        copies.append((str(file), str(target)))
    bad = []
    first = sorted((root / "train" / classes[0]).glob("*.png"))[0].read_bytes()
    for i, data in enumerate((first[:len(first) // 2], b"not an image", b"")):
        target = root / "train" / classes[i % len(classes)] / f"bad_{i}.png"
        target.write_bytes(data)
        bad.append(str(target))
    return {"flipped": flipped, "copies": copies, "bad": bad}


def audit(root: Path, out: Path, folds: int, extra: list[str]) -> float:
    """audit.py on the planted data, as a user runs it; its wall time."""
    began = time.monotonic()
    subprocess.run([sys.executable, "audit.py", "--config", "digits", f"data.root={root}", "data.skip_corrupt=true",
                    f"output_dir={out}", f"--folds={folds}", "logging.progress=false", *extra], cwd=REPO,
                   env=script_env(), check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - began


def score(planted: dict[str, list], folder: Path, val_images: int) -> dict[str, float]:
    """label_issues.csv, duplicates.csv and the file findings against what was planted."""
    with (folder / "label_issues.csv").open() as f:
        found = {row["path"] for row in csv.DictReader(f)}
    flipped = set(planted["flipped"])
    hits = len(found & flipped)
    result = {"flips": len(flipped), "flagged": len(found), "recall": hits / max(len(flipped), 1),
              "precision": hits / max(len(found), 1)}
    pairs_file = folder / "duplicates.csv"
    if pairs_file.exists():
        with pairs_file.open() as f:
            cross = {frozenset((row["path_a"], row["path_b"])) for row in csv.DictReader(f)
                     if row["split_a"] != row["split_b"]}
        planted_pairs = {frozenset(pair) for pair in planted["copies"]}
        result.update(copies=len(planted_pairs), copy_recall=len(cross & planted_pairs) / len(planted_pairs),
                      false_cross_pairs_per_100_val=100 * len(cross - planted_pairs) / val_images)
    counts = json.loads((folder / "audit.json").read_text())["counts"]
    result.update(near_copy_bits=counts.get("near_copy_bits"), bad_files=len(planted["bad"]),
                  unreadable_found=counts.get("files_unreadable", 0) + counts.get("files_truncated", 0))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flips", type=float, nargs="+", default=[0.05, 0.20])
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/audit_planted"))
    parser.add_argument("extra", nargs="*", help="more config overrides for audit.py")
    args = parser.parse_args()
    print(f"# {cpu_model()}; audit.py --config digits --folds {args.folds} {' '.join(args.extra)}")
    for flips in args.flips:
        work = args.work / f"flips_{flips}"
        shutil.rmtree(work, ignore_errors=True)
        planted = plant(work / "data", flips, args.seed)
        seconds = audit(work / "data", work / "run", args.folds, args.extra)
        val_images = len(list((work / "data" / "val").rglob("*.png")))
        print(json.dumps({"flip_rate": flips, "seconds": round(seconds, 1),
                          **{k: round(v, 4) if isinstance(v, float) else v
                             for k, v in score(planted, work / "run" / "audit", val_images).items()}}))


if __name__ == "__main__":
    main()
