"""scikit-learn's bundled handwritten digits, exported once as an ImageFolder tree.

The quickstart dataset: real images, no download. 1,797 8x8 images are upscaled to 32x32 PNGs
and split (stratified, fixed) into 1,436 train and 361 val images; 361 is divisible by neither 2
nor 3, so an evaluation that pads or drops samples across ranks would show it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import cv2
import numpy as np

from core.errors import UserError

log = logging.getLogger(__name__)

VAL_SIZE = 361
IMAGE_SIZE = 32
COMPLETE_MARKER = ".complete"


def export_digits(root: str | os.PathLike, size: int = IMAGE_SIZE) -> Path:
    """Write root/{train,val}/<digit>/<n>.png (size x size) unless a complete export is already there; another size
    than the quickstart's 32 px is for benchmarks/time_to_accuracy.py (images where resolution costs time)."""
    root = Path(root)
    if (root / COMPLETE_MARKER).exists():
        if (there := export_size(root)) != size:
            raise UserError(f"data.root {root} holds the digits exported at {there} px, not {size} px; choose "
                            f"another folder for {size} px (or use that export at its size)")
        return root
    if root.is_dir() and any(root.iterdir()):  # never write into (or delete) a folder we did not make
        raise UserError(f"data.root {root} is not empty and holds no digits export; for data.name=digits "
                        "choose a new or empty folder (for your own images use data.name=imagefolder)")
    check_creatable(root)
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images * (255.0 / 16.0)).astype(np.uint8)
    indices = np.arange(len(images))
    train_idx, val_idx = train_test_split(indices, test_size=VAL_SIZE, stratify=digits.target, random_state=0)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
        try:
            for split, split_idx in (("train", train_idx), ("val", val_idx)):
                for i in sorted(split_idx):
                    folder = staging / split / str(digits.target[i])
                    folder.mkdir(parents=True, exist_ok=True)
                    big = cv2.resize(images[i], (size, size), interpolation=cv2.INTER_CUBIC)
                    if not cv2.imwrite(str(folder / f"{i:04d}.png"), big):  # False, not an exception, on failure
                        raise OSError(f"cannot write {folder / f'{i:04d}.png'}")
            (staging / COMPLETE_MARKER).touch()
            _publish(staging, root)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # ours: never left beside the user's files (published: gone)
    except OSError as err:
        raise UserError(f"cannot write the digits export to data.root {root} ({err.strerror or err}); free disk "
                        "space or choose another data.root") from None
    log.info("exported %d train / %d val digits images to %s", len(train_idx), len(val_idx), root)
    return root


def export_size(root: Path) -> int:
    """The side of a complete export's images, read from its first training image."""
    first = min((root / "train" / "0").glob("*.png"))
    return cv2.imread(str(first), cv2.IMREAD_UNCHANGED).shape[0]


def check_creatable(root: Path) -> None:
    """data.root, or a folder above it, is a file: refused before anything is written (a 7 MB staging folder was
    left beside the user's file, even by --dry-run)."""
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == root else f"is under {existing}, which is a file"
        raise UserError(f"data.root {root} {where}; for data.name=digits choose a new or empty folder")


def _publish(staging: Path, root: Path) -> None:
    """Move the finished export into place; if another node won the race, keep theirs."""
    if root.is_dir() and not any(root.iterdir()):
        root.rmdir()  # os.replace cannot replace a directory, even an empty one
    try:
        os.replace(staging, root)
    except OSError:
        if not (root / COMPLETE_MARKER).exists():
            raise
        shutil.rmtree(staging, ignore_errors=True)
