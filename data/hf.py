"""Hugging Face datasets on disk, read map-style from memory-mapped Arrow files, offline.

data.root is a folder written by `save_to_disk` (a DatasetDict whose keys are the splits, or one
Dataset folder per split), or a folder of Parquet files (`<split>.parquet`, `<split>-*.parquet` or
`<split>/*.parquet`, which datasets converts once into its Arrow cache, HF_DATASETS_CACHE).
data.image_column holds the encoded image (an Image feature stored with its bytes, or a binary
column), decoded by decode_image in the DataLoader workers; data.label_column is a ClassLabel (its
names are the classes), integers, or strings (the classes are their sorted names); data.path_column
names each image in predictions.csv (default: the file name an Image feature stored, else `<split>[i]`).
Rows are read one at a time from the memory-mapped table: forked workers share its pages and turn
only the row they read into Python objects.
"""

from __future__ import annotations

import os
from pathlib import Path

import albumentations as A
import numpy as np

from data.datasets import AugmentedDataset, decode_image, read_image, shared_labels
from engine.config import DataConfig
from engine.errors import UserError


def open_split(root: Path, split: str):
    """The split's datasets.Dataset, never from the network."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets reads its config
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    for folder in (root, root / split):
        if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
            loaded = datasets.load_from_disk(str(folder))
            if not isinstance(loaded, datasets.DatasetDict):
                return loaded
            if split not in loaded:
                raise UserError(f"Hugging Face dataset {folder} has no split {split!r} (it has "
                                f"{', '.join(loaded)}); set data.train_split / data.val_split")
            return loaded[split]
    files = sorted({*root.glob(f"{split}.parquet"), *root.glob(f"{split}-*.parquet"), *root.glob(f"{split}/*.parquet")})
    if not files:
        raise UserError(f"no Hugging Face dataset for split {split!r} in {root}: expected a save_to_disk folder "
                        f"(dataset_dict.json) or {split}.parquet files; set data.root and the split names")
    try:
        return datasets.load_dataset("parquet", data_files={split: [str(f) for f in files]}, split=split)
    except Exception as err:  # pyarrow and datasets raise many types for a file that is not Parquet
        raise UserError(f"cannot read the Parquet files of split {split!r} in {root} ({err}); check them") from None


def class_labels(column: np.ndarray, feature, where: str) -> tuple[list[str], np.ndarray]:
    """(class names, label indices) from a label column: ClassLabel names, integers, or strings."""
    names = getattr(feature, "names", None)
    if names:
        return list(names), column.astype(np.int64)
    if column.dtype.kind in "iu":
        if len(column) and column.min() < 0:
            raise UserError(f"{where}: labels must be >= 0, found {column.min()}")
        return [str(i) for i in range(int(column.max()) + 1 if len(column) else 0)], column.astype(np.int64)
    if column.dtype.kind in "OU":
        names = sorted({str(v) for v in column})
        position = {name: i for i, name in enumerate(names)}
        return names, np.asarray([position[str(v)] for v in column], dtype=np.int64)
    raise UserError(f"{where}: the label column holds {column.dtype}; use class names, integers or a ClassLabel")


class HFDataset(AugmentedDataset):
    """One split of a Hugging Face dataset on disk, in its row order."""

    def __init__(self, root: str | Path, split: str, transform: A.Compose, seed: int,
                 classes: list[str] | None = None, *, image_column: str = "image", label_column: str = "label",
                 path_column: str = "", skip_corrupt: bool = False,
                 max_pixels: int = DataConfig.max_image_pixels) -> None:
        super().__init__(transform, seed)
        import datasets

        self.split, self.skip_corrupt, self.max_pixels = split, skip_corrupt, max_pixels
        self.where = f"Hugging Face dataset {root} split {split}"
        ds = open_split(Path(root), split)
        for key, column in (("image", image_column), ("label", label_column), ("path", path_column)):
            if column and column not in ds.column_names:
                raise UserError(f"{self.where} has no column {column!r} (data.{key}_column); it has "
                                f"{', '.join(ds.column_names)}")
        column = np.asarray(ds.with_format("numpy")[label_column])
        own, labels = class_labels(column, ds.features[label_column], self.where)
        self.classes = classes if classes is not None else own
        self.labels = shared_labels(labels, own, self.classes, self.where)
        keep = [image_column] + ([path_column] if path_column else [])
        ds = ds.select_columns(keep)
        if isinstance(ds.features[image_column], datasets.Image):
            ds = ds.cast_column(image_column, datasets.Image(decode=False))  # bytes, not PIL images
        self.ds, self.image_column, self.path_column = ds, image_column, path_column

    def stored(self, index: int) -> tuple[bytes | None, str | None]:
        """The image's bytes (None: only a file path was stored) and its stored file name."""
        value = self.ds[index][self.image_column]
        if isinstance(value, dict):
            return value.get("bytes"), value.get("path")
        return value, None

    def load_image(self, index: int) -> np.ndarray:
        data, path = self.stored(index)
        if data is None and path:
            return read_image(path, self.max_pixels)
        return decode_image(data or b"", f"{self.path(index)} ({self.where} row {index})", self.max_pixels)

    def path(self, index: int) -> str:
        if self.path_column:
            return str(self.ds[index][self.path_column])
        return self.stored(index)[1] or f"{self.split}[{index}]"
