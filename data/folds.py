"""k-fold cross-validation of the training set (audit.py): a stratified, seeded fold for each training image, kept in
a file so that a rerun reuses it; a fold's run (data.folds_file, data.fold) trains on the other folds and validates
on its own, in any data format, because both sides are subsets of the one training split."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.errors import UserError
from data.datasets import AugmentedDataset


@dataclass(frozen=True)
class Folds:
    """Each training image's fold (in the training split's order; -1: left out, unreadable), with the seed and the
    paths they were made for."""

    count: int
    seed: int
    fold: list[int]
    paths: list[str]

    def to_json(self) -> bytes:
        return json.dumps({"folds": self.count, "seed": self.seed, "fold": self.fold, "paths": self.paths}).encode()


def make_folds(labels: np.ndarray, paths: list[str], count: int, seed: int, class_names: list[str],
               left_out: np.ndarray) -> Folds:
    """Stratified (each class spread evenly over the folds) and seeded (sklearn's StratifiedKFold, shuffled); the
    images `left_out` marks (unreadable) are in no fold."""
    from sklearn.model_selection import StratifiedKFold

    kept = np.flatnonzero(~left_out)
    sizes = np.bincount(labels[kept], minlength=len(class_names))
    smallest = int(np.argmin(np.where(sizes > 0, sizes, sizes.max() + 1)))
    if count < 2 or sizes[smallest] < count:
        raise UserError(f"--folds {count}: class {class_names[smallest]!r} has {sizes[smallest]} training image(s); "
                        f"every class needs at least one image in each fold: use --folds {max(2, sizes[smallest])} "
                        "or fewer (at least 2), or add images to that class")
    fold = np.full(len(labels), -1, dtype=np.int64)
    splitter = StratifiedKFold(n_splits=count, shuffle=True, random_state=seed)
    for k, (_, held) in enumerate(splitter.split(np.zeros(len(kept)), labels[kept])):
        fold[kept[held]] = k
    return Folds(count, seed, fold.tolist(), list(paths))


def read_folds(path: str | os.PathLike) -> Folds:
    """A fold file audit.py wrote; anything else is named in one line."""
    try:
        raw = json.loads(Path(path).read_bytes())
        return Folds(int(raw["folds"]), int(raw["seed"]), [int(k) for k in raw["fold"]], [str(p) for p in raw["paths"]])
    except OSError as err:
        raise UserError(f"data.folds_file: cannot read {path} ({err.strerror}); run audit.py, which writes it") \
            from None
    except (ValueError, KeyError, TypeError):
        raise UserError(f"data.folds_file: {path} is not a fold file written by audit.py; run audit.py with a new "
                        "--out") from None


def fold_side(base: AugmentedDataset, folds: Folds, fold: int, train: bool, where: str) -> FoldSubset:
    """All of `base` (the training split) but fold `fold` and the images left out (train), or that fold alone;
    refused when the training split is no longer the one the folds were made for."""
    ends = (0, len(base) - 1) if len(base) == len(folds.paths) else ()  # a cheap check of the same images
    if len(base) != len(folds.paths) or any(base.path(i) != folds.paths[i] for i in ends):
        raise UserError(f"data.folds_file {where} was made for {len(folds.fold)} training images, and the training "
                        f"split now has {len(base)} (or others): the data changed since the audit began; run audit.py "
                        "with a new --out")
    if not 0 <= fold < folds.count:
        raise UserError(f"data.fold={fold}: {where} has folds 0 to {folds.count - 1}")
    assigned = np.asarray(folds.fold)
    return FoldSubset(base, np.flatnonzero((assigned != fold) & (assigned >= 0) if train else assigned == fold))


class FoldSubset(AugmentedDataset):
    """Some images of a dataset, in its order: each keeps its label, path and pixels; augmentation is seeded by the
    position here, as in any dataset."""

    def __init__(self, base: AugmentedDataset, indices: np.ndarray) -> None:
        AugmentedDataset.__init__(self, base.transform, base.seed, base.tensor_transform)
        self.base, self.indices = base, np.asarray(indices, dtype=np.int64)
        self.classes, self.labels, self.skip_corrupt = base.classes, base.labels[self.indices], base.skip_corrupt

    def load_image(self, index: int) -> np.ndarray:
        return self.base.load_image(int(self.indices[index]))

    def path(self, index: int) -> str:
        return self.base.path(int(self.indices[index]))
