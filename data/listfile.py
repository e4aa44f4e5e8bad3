"""List files: `<data.root>/<split>.csv` (or `.tsv`), one `path,label` row per image, paths relative to data.root.

The first line is the header `path,label` (`path<TAB>label` in a .tsv): without it a first image row could
not be told from a header naming other columns. A UTF-8 byte order mark (Excel's "CSV UTF-8") is dropped.
A label is a class name, or an index into the class list when `<data.root>/classes.txt` (one class name a
line, in label order) exists. Without classes.txt the classes are the split's label names, sorted (as
numbers when every label is an integer). A path listed twice counts twice, with a warning naming its lines.

Multi-label (data.multi_label=true): the header may read `path,labels`, and a row's labels are separated by
`|` (`img.jpg,dog|cat`); an empty cell is an image with no labels (`img.jpg,`), which counts as a negative
for every class.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import albumentations as A
import numpy as np

from core.config import DataConfig
from core.errors import UserError
from data.datasets import AugmentedDataset, PackedStrings, multi_hot, read_image, shared_labels

CLASS_FILE = "classes.txt"
LABEL_SEPARATOR = "|"  # between the labels of one multi-label row
log = logging.getLogger(__name__)


def find_list(root: Path, split: str) -> Path:
    """<root>/<split>.csv or <root>/<split>.tsv, whichever exists."""
    for suffix in (".csv", ".tsv"):
        if (root / f"{split}{suffix}").is_file():
            return root / f"{split}{suffix}"
    raise UserError(f"list file {root / split}.csv (or .tsv) does not exist; write the header path,label and one "
                    "path,label row per image, or set data.root and the split names")


def read_rows(file: Path, split: str, multi_label: bool = False) -> list[tuple[int, str, str]]:
    """(line number, path, label) of each row after the header; a row that is not two fields is named by its line
    (multi-label: the label field may be empty)."""
    try:
        text = file.read_text(encoding="utf-8-sig", errors="surrogateescape")  # paths are bytes on Linux
    except OSError as err:
        raise UserError(f"cannot read list file {file} ({err.strerror})") from None
    delimiter = "\t" if file.suffix == ".tsv" else ","
    lines = csv.reader(text.splitlines(), delimiter=delimiter)
    header = next(lines, [])
    if [cell.strip().lower() for cell in header] not in (["path", "label"], ["path", "labels"]):
        shown = "path<tab>label" if delimiter == "\t" else "path,label"
        raise UserError(f"list file {file}: line 1 must be the header {shown}, found the columns "
                        f"{', '.join(header) or '(none)'}; add that header (or rename its columns)")
    rows = []
    for number, row in enumerate(lines, 2):
        if not row:
            continue
        if len(row) == 2 and row[0].strip() and not row[1].strip() and not multi_label:
            raise UserError(f"{file} line {number}: the label of {row[0].strip()!r} is empty; an image without labels "
                            "is a row of a multi-label list: set data.multi_label=true, or give the image its class")
        if len(row) != 2 or not row[0].strip():
            raise UserError(f"{file} line {number}: expected two fields, path{delimiter}label, got {row!r}")
        rows.append((number, row[0].strip(), row[1].strip()))
    if not rows:
        raise UserError(f"list file {file} has no rows: split {split!r} is empty; add one path,label row per image "
                        "after the header")
    warn_duplicates(file, rows)
    return rows


def warn_duplicates(file: Path, rows: list[tuple[int, str, str]]) -> None:
    """Name the paths listed more than once: each row is a sample (and counts in metrics), which is rarely meant."""
    lines: dict[str, list[int]] = {}
    for number, path, _ in rows:
        lines.setdefault(path, []).append(number)
    twice = {path: numbers for path, numbers in lines.items() if len(numbers) > 1}
    if twice:
        shown = "; ".join(f"{path} on lines {', '.join(map(str, numbers))}"
                          for path, numbers in list(twice.items())[:5])
        more = f"; and {len(twice) - 5} more" if len(twice) > 5 else ""
        log.warning("list file %s names %d image(s) more than once (each row counts): %s%s", file, len(twice), shown,
                    more)


def read_classes(root: Path) -> list[str] | None:
    """The names in <root>/classes.txt (None without that file)."""
    file = root / CLASS_FILE
    if not file.is_file():
        return None
    names = [line.strip() for line in file.read_text(encoding="utf-8", errors="surrogateescape").splitlines()]
    names = [name for name in names if name]
    if len(set(names)) != len(names) or not names:
        raise UserError(f"{file} must list each class name once, one a line")
    return names


def label_index(file: Path, number: int, label: str, position: dict[str, int]) -> int:
    """A label as an index: a class name, or an integer within the class list."""
    if label in position:
        return position[label]
    if label.isdigit() and int(label) < len(position):
        return int(label)
    raise UserError(f"{file} line {number}: label {label!r} is neither a class of {CLASS_FILE} nor an index "
                    f"below {len(position)}")


def split_labels(cell: str) -> list[str]:
    """The labels of one multi-label cell, `a|b|c`; an empty cell is the empty set."""
    return sorted({label.strip() for label in cell.split(LABEL_SEPARATOR) if label.strip()})


def check_known(file: Path, cells: list[tuple[int, list[str]]], indices: list[list[int]], own: list[str],
                classes: list[str]) -> None:
    """A multi-label row naming a class the training classes lack is named by its line and label."""
    known = set(classes)
    for (number, labels), row in zip(cells, indices):
        for label, i in zip(labels, row):
            if own[i] not in known:
                raise UserError(f"{file} line {number}: label {label!r} is not one of the {len(classes)} training "
                                "classes; fix the row, or add the class to the training split (or classes.txt)")


class ListFileDataset(AugmentedDataset):
    """The images a list file names, in its row order."""

    def __init__(self, root: str | Path, split: str, transform: A.Compose, seed: int,
                 classes: list[str] | None = None, *, skip_corrupt: bool = False,
                 max_pixels: int = DataConfig.max_image_pixels, multi_label: bool = False) -> None:
        super().__init__(transform, seed)
        self.root, self.skip_corrupt, self.max_pixels = Path(root), skip_corrupt, max_pixels
        file = find_list(self.root, split)
        rows = read_rows(file, split, multi_label)
        cells = [(number, split_labels(label) if multi_label else [label]) for number, _, label in rows]
        if not multi_label and any(LABEL_SEPARATOR in label for _, _, label in rows):
            log.warning("list file %s has labels holding %r, read as single class names; for several labels per "
                        "image set data.multi_label=true", file, LABEL_SEPARATOR)
        own = read_classes(self.root)
        if own is None:
            names = {label for _, labels in cells for label in labels}
            numeric = all(name.isdigit() for name in names)
            own = sorted(names, key=int) if numeric else sorted(names)
        position = {name: i for i, name in enumerate(own)}
        indices = [[label_index(file, number, label, position) for label in labels] for number, labels in cells]
        self.classes = classes if classes is not None else own
        if multi_label:
            check_known(file, cells, indices, own, self.classes)
            self.labels = multi_hot(indices, own, self.classes, str(file))
        else:
            self.labels = shared_labels(np.asarray([i for i, in indices], np.int64), own, self.classes, str(file))
        self.paths = PackedStrings([path for _, path, _ in rows])

    def path(self, index: int) -> str:
        return str(self.root / self.paths[index])

    def load_image(self, index: int) -> np.ndarray:
        return read_image(self.path(index), self.max_pixels)
