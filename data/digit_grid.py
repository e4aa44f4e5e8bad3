"""A real multi-label set from the digits: 2x2 grids of digit images, labelled with the set of digits shown.

    python -m data.digit_grid .cache/digit_grid
    python train.py --config digits data.name=listfile data.root=.cache/digit_grid data.multi_label=true \
        train.loss=bce train.label_smoothing=0 "data.scale=[0.85,1.0]" "data.ratio=[0.9,1.1]" \
        output_dir=runs/digits_multilabel        # docs/benchmarks.md: its val mAP

Each 32x32 image holds four 16x16 slots; each slot shows a digit image with probability 1/2, else stays
black, so an image has 0 to 4 labels (about 1 in 16 has none: the empty set, "no tags"). Train grids use
only the digits export's train images, val grids only its val images. Written as a list file
(data.name=listfile, data.multi_label=true): <root>/train.csv, val.csv (`path,labels` with `a|b`),
classes.txt and the PNGs under images/. The grids are a pure function of the seed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cv2
import numpy as np

from core.errors import UserError
from data.digits import export_digits

SLOT = 16  # side of one digit in the grid
SIZES = {"train": 3000, "val": 600}


def source_images(digits_root: Path, split: str) -> tuple[list[np.ndarray], list[int]]:
    """The digits export's images of one split, shrunk to SLOT x SLOT, and their digits."""
    images, labels = [], []
    for folder in sorted((digits_root / split).iterdir(), key=lambda p: int(p.name)):
        for file in sorted(folder.glob("*.png")):
            image = cv2.imread(str(file), cv2.IMREAD_GRAYSCALE)
            images.append(cv2.resize(image, (SLOT, SLOT), interpolation=cv2.INTER_AREA))
            labels.append(int(folder.name))
    return images, labels


def write_digit_grid(root: Path, digits_root: Path, sizes: dict[str, int] = SIZES, seed: int = 0) -> Path:
    """Write the list-file dataset under root (a new or empty folder); the digits export is made if missing."""
    root = Path(root)
    if root.is_dir() and any(root.iterdir()):
        raise UserError(f"{root} is not empty; choose a new or empty folder for the digit grid")
    export_digits(digits_root)
    (root / "classes.txt").parent.mkdir(parents=True, exist_ok=True)
    (root / "classes.txt").write_text("".join(f"{d}\n" for d in range(10)))
    for s, (split, size) in enumerate(sizes.items()):
        images, digits = source_images(Path(digits_root), split)
        rng = np.random.default_rng([seed, s])
        (root / "images" / split).mkdir(parents=True)
        rows = ["path,labels"]
        for i in range(size):
            grid = np.zeros((2 * SLOT, 2 * SLOT), np.uint8)
            shown = set()
            for slot in range(4):
                if rng.random() < 0.5:
                    pick = int(rng.integers(len(images)))
                    y, x = divmod(slot, 2)
                    grid[y * SLOT:(y + 1) * SLOT, x * SLOT:(x + 1) * SLOT] = images[pick]
                    shown.add(digits[pick])
            path = f"images/{split}/{i:05d}.png"
            cv2.imwrite(str(root / path), grid)
            rows.append(f"{path},{'|'.join(map(str, sorted(shown)))}")
        (root / f"{split}.csv").write_text("\n".join(rows) + "\n")
    return root


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", help="a new or empty folder for the list-file dataset")
    parser.add_argument("--digits-root", default=".cache/digits", help="the digits export (made if missing)")
    args = parser.parse_args(argv)
    try:
        write_digit_grid(Path(args.root), Path(args.digits_root))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {SIZES['train']} train / {SIZES['val']} val grids to {args.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
