"""The audit's checks of the data itself, with no model: near-duplicates and train/val leaks (data/duplicates.py), file
problems and class counts (data/file_checks.py), on image files; duplicates.csv written to the audit folder."""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from core.config import DataConfig
from data.datasets import AugmentedDataset
from data.duplicates import find_duplicates
from data.file_checks import check_files

log = logging.getLogger(__name__)

PAIR_COLUMNS = ("path_a", "path_b", "split_a", "split_b", "distance")
# The report's order of file findings: what stops a run or changes pixels first, what is only worth knowing last.
SEVERITY = ("unreadable", "truncated", "huge", "cmyk", "16-bit", "alpha", "exif-rotated", "aspect", "tiny",
            "imbalance", "greyscale")


@dataclass
class DataFindings:
    """What the checks found, as the report and audit.json take them."""

    duplicates: list[dict[str, Any]] = field(default_factory=list)
    files: list[dict[str, Any]] = field(default_factory=list)
    class_counts: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)


def data_findings(train: AugmentedDataset, val: AugmentedDataset | None, cfg: DataConfig,
                  write_csv: Callable[[Path, list[dict[str, Any]], tuple[str, ...]], None],
                  folder: Path) -> DataFindings:
    """Duplicates across and within the splits, each training image's file findings, the class counts."""
    splits = [("train", train)] + ([("val", val)] if val is not None else [])
    items = [(Path(dataset.path(i)), name) for name, dataset in splits for i in range(len(dataset))]
    if not all(os.path.isfile(path) for path, _ in items):  # shards, Parquet rows, synthetic images
        log.warning("audit: data.name=%s keeps its images in no files of their own: duplicates and file checks "
                    "skipped (the label findings stand)", cfg.name)
        pairs, files, threshold = [], [], None
        sizes = np.bincount(np.asarray(train.labels), minlength=len(train.classes))
        class_counts = dict(zip(train.classes, map(int, sizes)))
    else:
        found = find_duplicates(items)  # the near-copy threshold calibrated on these images
        pairs, threshold = [asdict(pair) for pair in found.pairs], found.threshold
        report = check_files([path for path, split in items if split == "train"], train.labels, train.classes,
                             max_pixels=cfg.max_image_pixels)
        files, class_counts = [asdict(finding) for finding in report.findings], report.class_counts
        if val is not None:
            files += [asdict(finding) for finding in check_files(
                [path for path, split in items if split == "val"], val.labels, val.classes,
                max_pixels=cfg.max_image_pixels).findings]
        if report.imbalance_remedy:
            files.append({"path": "(all classes)", "kind": "imbalance",
                          "detail": f"largest class / smallest class = {report.imbalance:.1f}",
                          "remedy": report.imbalance_remedy})
    files.sort(key=lambda row: SEVERITY.index(row["kind"]) if row["kind"] in SEVERITY else len(SEVERITY))
    write_csv(folder / "duplicates.csv", pairs, PAIR_COLUMNS)
    leaks = sum(pair["split_a"] != pair["split_b"] for pair in pairs)
    counts = {"duplicate_pairs": len(pairs), "leaks": leaks, "file_findings": len(files), "near_copy_bits": threshold}
    counts.update((f"files_{kind}", n) for kind, n in Counter(row["kind"] for row in files).items())
    return DataFindings(pairs, files, class_counts, counts)
