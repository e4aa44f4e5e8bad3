"""data.val_fraction: a validation split made from one ImageFolder of class folders, and kept in the run folder.

The split is a pure function of the sorted folder scan and data.split_seed (each class shuffled by its own seeded
generator, round(fraction x its images) of it to validation), so every process computes the same lists without a
collective. It is made in memory at start-up and written to the run folder as train.txt and val.txt at the run's
first write (RunRecord.start), never before: a run that fails to start leaves the folder as it was. A resumed run,
evaluate.py and the model card read the lists back from the checkpoint's folder; they are never recomputed, so
images added to data.root later change nothing, and a run resumed (or branched) with another data.val_fraction or
data.split_seed is refused: its new validation side would hold images the checkpoint trained on. A data.root that
holds train/ and val/ is a dataset split already (refused: its classes would be "train" and "val"), and a file name
holding a line break is refused (it would read back as two lines).

Each line is an image path relative to data.root, `<class>/<file>`: the ImageFolder's own form, where the class
is the folder, so no label is written that could disagree with it (a `path,label` list file would say it twice).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import albumentations as A
import numpy as np

from core.config import DataConfig
from core.errors import UserError
from data.datasets import (AugmentedDataset, ImageFolderDataset, PackedStrings, find_classes, scan_images,
                           shared_labels)
from data.mirror import errors_by_url, local_root

log = logging.getLogger(__name__)
FILES = {"train": "train.txt", "val": "val.txt"}


@dataclass(frozen=True)
class Split:
    """The images of each side, as paths relative to data.root (`<class>/<file>`), sorted."""

    train: list[str]
    val: list[str]
    folder: str = ""  # the run folder the lists were read from; "" = made at this start-up

    def files(self) -> dict[str, bytes]:
        """The two list files' names and contents, for the run folder."""
        return {FILES[side]: "".join(f"{path}\n" for path in getattr(self, side)).encode(
            "utf-8", "surrogateescape") for side in FILES}


SPLIT_FOLDERS = ("train", "val", "valid", "validation", "test")  # the folder names of a dataset split already


def make_split(root: Path, fraction: float, seed: int) -> Split:
    """Stratified: each class gives round(fraction x its images) to validation, at least one to each side, or the
    class is named."""
    classes = find_classes(root)
    check_not_split(root, classes, fraction)
    paths, labels = scan_images(root, classes)
    check_one_line_names(root, paths)
    train: list[str] = []
    val: list[str] = []
    for label, name in enumerate(classes):
        own = [paths[i] for i in np.flatnonzero(labels == label)]
        n_val = round(fraction * len(own))
        if n_val < 1 or n_val >= len(own):
            raise UserError(f"data.val_fraction={fraction}: class {name!r} has {len(own)} image(s) in {root}, which "
                            f"gives {n_val} to validation; every class needs at least one image on each side: add "
                            "images to it, change data.val_fraction, or remove the class")
        order = np.random.default_rng([seed, label]).permutation(len(own))
        val += [own[i] for i in order[:n_val]]
        train += [own[i] for i in order[n_val:]]
    return Split(sorted(train), sorted(val))


def check_not_split(root: Path, classes: list[str], fraction: float) -> None:
    """data.root holding train/ and val/ (a dataset split already) is not a root of class folders: split, it would
    train a model whose classes are "train" and "val"."""
    found = [name for name in SPLIT_FOLDERS if name in classes]
    if "train" in found and len(found) > 1:
        raise UserError(f"data.val_fraction={fraction}: data.root {root} holds {'/, '.join(found)}/, the splits of a "
                        f"dataset split already, which would become the classes; remove data.val_fraction to validate "
                        f"on its own {found[1]}/ (data.val_split={found[1]}), or set data.root={root / 'train'} to "
                        "split that folder's classes")


def check_one_line_names(root: Path, paths: list[str]) -> None:
    """Each image is one line of train.txt or val.txt: a name holding a line break would be read back as two
    (resume and evaluate.py would then fail)."""
    for path in paths:
        if "\n" in path:
            raise UserError(f"data.val_fraction: image {str(root / path)!r} has a line break in its name, and the "
                            "split is written one name a line (train.txt, val.txt); rename it")


def read_split(folder: Path) -> Split:
    """The lists a run wrote to its folder; a missing one is named."""
    sides = {}
    for side, name in FILES.items():
        file = folder / name
        try:
            text = file.read_bytes().decode("utf-8", "surrogateescape")
        except OSError as err:
            raise UserError(f"data.val_fraction: cannot read {file} ({err.strerror}), the run's {side} list; keep "
                            "train.txt and val.txt beside the checkpoint, or set data.val_fraction=0 and name a "
                            "data.val_split") from None
        sides[side] = [line for line in text.split("\n") if line]  # not splitlines(): \r, \x85 may be in a name
    return Split(sides["train"], sides["val"], str(folder))


def run_split(cfg: DataConfig, resumed_from: str | os.PathLike | None, resumed_data: dict | None,
              is_main: bool) -> Split | None:
    """The run's split: None without data.val_fraction; read back from the resumed checkpoint's folder when that run
    split the same way (`resumed_data`: its data config); else made from data.root (and said on rank 0)."""
    if not cfg.val_fraction:
        return None
    if cfg.name != "imagefolder":
        raise UserError(f"data.val_fraction splits an ImageFolder of class folders; data.name={cfg.name} has its own "
                        "validation split: set data.val_fraction=0, or data.name=imagefolder")
    if resumed_from is not None and resumed_data is not None and resumed_data.get("val_fraction") \
            and resumed_data.get("root") == cfg.root:
        check_same_split(cfg, resumed_from, resumed_data)
        return read_split(Path(resumed_from).parent)
    with errors_by_url(cfg):
        split = make_split(Path(local_root(cfg)), cfg.val_fraction, cfg.split_seed)  # a URL: its mirror (prepare_data)
    if is_main:
        log.info("data.val_fraction=%s: %d images of %s split by class (data.split_seed=%d): %d to train, %d to "
                 "validation; the lists are written to the run folder as train.txt and val.txt", cfg.val_fraction,
                 len(split.train) + len(split.val), cfg.root, cfg.split_seed, len(split.train), len(split.val))
    return split


def check_same_split(cfg: DataConfig, resumed_from: str | os.PathLike, resumed_data: dict) -> None:
    """A run resumed (or branched) from one that split the same data.root keeps that split: another would validate
    on images the checkpoint trained on."""
    changed = [f"data.{key} {resumed_data.get(key)} -> {getattr(cfg, key)}" for key in ("val_fraction", "split_seed")
               if resumed_data.get(key, 0) != getattr(cfg, key)]
    if changed:
        kept = " ".join(f"data.{key}={resumed_data.get(key, 0)}" for key in ("val_fraction", "split_seed"))
        raise UserError(f"resume={resumed_from}: that run split {cfg.root} into the train.txt and val.txt beside it "
                        f"and trained on the first; {', '.join(changed)} would split again and validate on images "
                        f"it trained on; keep {kept} (the run's lists are kept), or train a new model without its "
                        "weights")


class SplitDataset(ImageFolderDataset):
    """One side of a Split: the listed images under data.root, their class the folder each is in."""

    def __init__(self, root: str | Path, listed: list[str], transform: A.Compose, seed: int,
                 classes: list[str] | None = None, *, skip_corrupt: bool = False,
                 max_pixels: int = DataConfig.max_image_pixels, list_file: str = "the run's list") -> None:
        AugmentedDataset.__init__(self, transform, seed)
        self.root, self.skip_corrupt, self.max_pixels = Path(root), skip_corrupt, max_pixels
        self.list_file = list_file
        folders = [path.split("/", 1)[0] for path in listed]
        own = sorted(set(folders))
        position = {name: i for i, name in enumerate(own)}
        self.classes = classes if classes is not None else own
        self.labels = shared_labels(np.asarray([position[f] for f in folders], np.int64), own, self.classes,
                                    f"{root} (data.val_fraction's list)")
        self.paths = PackedStrings(listed)

    def load_image(self, index: int) -> np.ndarray:
        """The listed image; one removed since the split was made is named with the list that still holds it
        ("remove or replace it" would not do: the list would still name it)."""
        try:
            return super().load_image(index)
        except UserError:
            if os.path.lexists(path := self.path(index)):
                raise
            raise UserError(f"image {path} is listed in {self.list_file} (data.val_fraction's split) but no longer "
                            f"exists; put it back, or remove its line from {self.list_file}") from None


def saved_split(cfg: DataConfig, checkpoint: str | os.PathLike) -> Split | None:
    """evaluate.py: with data.val_fraction, the lists of the run that wrote `checkpoint` (in its folder)."""
    return read_split(Path(checkpoint).parent) if cfg.val_fraction else None
