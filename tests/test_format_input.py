"""Mistakes in list files and Parquet / Hugging Face data: one line naming the file, row and column, or a warning.

The datasets are built directly (no model, no training); a mistake that shows only when an image is read is
read through 0 and 2 DataLoader workers.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from core.config import DataConfig
from core.dist import DistInfo
from core.errors import UserError
from data.datasets import ImageFolderDataset
from data.loader import build_datasets, build_eval_loader, build_split
from data.transforms import eval_transform
from tests.helpers import make_image_folder

COUNTS = {"train": {"a": 3, "b": 3}, "val": {"a": 2, "b": 2}}
ONE_PROCESS = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("folder") / "data", COUNTS, size=20)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> None:
    """datasets converts Parquet files into its Arrow cache: a fresh one per test."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")


def config(name: str, root: Path, **kw) -> DataConfig:
    return DataConfig(name=name, root=str(root), img_size=16, **{"num_workers": 0, **kw})


def rows(folder: Path, split: str) -> list[str]:
    """`<absolute path>,<class>` of each image of the folder's split, in the folder's order."""
    images = ImageFolderDataset(folder / split, transform=None, seed=0)
    return [f"{images.path(i)},{images.classes[label]}" for i, label in enumerate(images.labels)]


def write_lists(root: Path, train: str, val: str, encoding: str = "utf-8") -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.csv").write_text(train, encoding=encoding)
    (root / "val.csv").write_text(val, encoding=encoding)


def header_and(lines: list[str]) -> str:
    return "path,label\n" + "\n".join(lines) + "\n"


def test_list_file_with_a_utf8_bom_has_a_header_not_a_class_named_label(folder, tmp_path):
    """Excel's "CSV UTF-8" starts the file with a BOM: the header was read as an image `\\ufeffpath` of class label."""
    write_lists(tmp_path, header_and(rows(folder, "train")), header_and(rows(folder, "val")), encoding="utf-8-sig")
    assert (tmp_path / "train.csv").read_bytes().startswith(b"\xef\xbb\xbfpath,label\n")
    train, val = build_datasets(config("listfile", tmp_path, skip_corrupt=True), seed=0)
    assert train.classes == ["a", "b"] and len(train) == 6 and len(val) == 4
    assert [train.path(i) for i in range(6)] == [row.split(",")[0] for row in rows(folder, "train")]


@pytest.mark.parametrize("first, columns", [("filename,class", "filename, class"),
                                            ("{image},a", "{image}, a")])  # no header at all
def test_list_file_without_the_path_label_header_names_the_columns_it_found(folder, tmp_path, first, columns):
    """The first row was taken as an image when it was not `path,label` (a class named "class")."""
    image = rows(folder, "train")[0].split(",")[0]
    write_lists(tmp_path, "\n".join([first.format(image=image), *rows(folder, "train")]) + "\n",
                header_and(rows(folder, "val")))
    with pytest.raises(UserError) as error:
        build_datasets(config("listfile", tmp_path), seed=0)
    assert str(error.value) == (f"list file {tmp_path}/train.csv: line 1 must be the header path,label, found the "
                                f"columns {columns.format(image=image)}; add that header (or rename its columns)")


def test_tsv_list_file_has_a_tab_separated_header(folder, tmp_path):
    tabbed = "\n".join(row.replace(",", "\t") for row in rows(folder, "train"))
    (tmp_path / "train.tsv").write_text("path\tlabel\n" + tabbed)
    (tmp_path / "val.csv").write_text(header_and(rows(folder, "val")))
    assert [len(split) for split in build_datasets(config("listfile", tmp_path), seed=0)] == [6, 4]
    (tmp_path / "train.tsv").write_text("path,label\n" + tabbed)
    with pytest.raises(UserError, match="train.tsv: line 1 must be the header path<tab>label, found the columns "
                                        "path,label; "):
        build_datasets(config("listfile", tmp_path), seed=0)


def test_duplicate_rows_in_a_split_are_named_in_a_warning(folder, tmp_path, caplog):
    val = rows(folder, "val")
    write_lists(tmp_path, header_and(rows(folder, "train")), header_and([val[0], val[1], val[0], val[2], val[0]]))
    with caplog.at_level(logging.WARNING):
        train, val_set = build_datasets(config("listfile", tmp_path), seed=0)
    assert len(val_set) == 5  # each row still counts: the warning says so
    warnings = [r.getMessage() for r in caplog.records if "more than once" in r.getMessage()]
    path = val[0].split(",")[0]
    assert warnings == [f"list file {tmp_path}/val.csv names 1 image(s) more than once (each row counts): "
                        f"{path} on lines 2, 4, 6"]


def test_a_list_file_with_only_its_header_names_the_empty_split(folder, tmp_path):
    """It was "the validation set has 0 images, fewer than the 1 processes; use fewer processes"."""
    write_lists(tmp_path, header_and(rows(folder, "train")), "path,label\n")
    with pytest.raises(UserError) as error:
        build_datasets(config("listfile", tmp_path), seed=0)
    assert str(error.value) == (f"list file {tmp_path}/val.csv has no rows: split 'val' is empty; "
                                "add one path,label row per image after the header")


# Parquet files as users write them with pyarrow: an image column and a label column.


def images_and_labels(folder: Path, split: str) -> tuple[list[bytes], list[str]]:
    images = ImageFolderDataset(folder / split, transform=None, seed=0)
    return ([Path(images.path(i)).read_bytes() for i in range(len(images))],
            [images.classes[label] for label in images.labels])


def write_parquet(root: Path, split: str, **columns: pa.Array) -> None:
    root.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), root / f"{split}.parquet")


@pytest.mark.parametrize("labels, feature", [(["a", "b", None, "a", "b", "b"], "string"),
                                             ([0, 1, None, 0, 1, 1], "int64"),
                                             ([0, 1, -1, 0, 1, 1], "ClassLabel")])  # datasets' "no label"
def test_a_row_without_a_label_is_named(folder, tmp_path, hf_cache, labels, feature):
    """A null string label was a class named "None"; a null integer: "the label column holds float64"; -1 in a
    ClassLabel: a numpy traceback."""
    import datasets

    images, _ = images_and_labels(folder, "train")
    kind = datasets.ClassLabel(names=["a", "b"]) if feature == "ClassLabel" else datasets.Value(feature)
    datasets.Dataset.from_dict({"image": images, "label": labels},
                               features=datasets.Features({"image": datasets.Value("binary"), "label": kind})
                               ).to_parquet(str(tmp_path / "train.parquet"))
    cfg = config("hf", tmp_path)
    with pytest.raises(UserError) as error:
        build_split(cfg, "train", eval_transform(cfg), seed=0)
    assert str(error.value) == (f"Hugging Face dataset {tmp_path} split train row 2 has no label (null, or -1 in a "
                                "ClassLabel) in column 'label'; give it its label, or remove it "
                                "(data.skip_corrupt=true skips rows without a label in training)")


@pytest.mark.parametrize("as_index", [False, True])
def test_rows_without_a_label_are_skipped_and_counted_with_skip_corrupt(folder, tmp_path, hf_cache, caplog,
                                                                        as_index):
    images, names = images_and_labels(folder, "train")
    labels = [None if i in (1, 4) else int(name == "b") if as_index else name for i, name in enumerate(names)]
    paths = [f"image{i}" for i in range(len(images))]
    write_parquet(tmp_path, "train", image=pa.array(images), label=pa.array(labels), file=pa.array(paths))
    cfg = config("hf", tmp_path, path_column="file")
    with caplog.at_level(logging.WARNING):
        train = build_split(cfg, "train", eval_transform(cfg), seed=0, skip_corrupt=True)
    assert f"data.skip_corrupt: Hugging Face dataset {tmp_path} split train: 2 row(s) without a label skipped " \
           "(rows 1, 4)" in caplog.text
    kept = [0, 2, 3, 5]
    assert len(train) == 4 and train.classes == (["0", "1"] if as_index else ["a", "b"])
    assert [names[i] for i in kept] == [["a", "b"][label] for label in train.labels]
    assert [train.path(i) for i in range(4)] == [paths[i] for i in kept]
    reference = ImageFolderDataset(folder / "train", eval_transform(cfg), seed=0)
    for i, row in enumerate(kept):
        assert torch.equal(train[i][0], reference[row][0])


@pytest.mark.parametrize("column, kind", [("image", "binary"), ("img", "Image")])
def test_a_label_column_that_holds_no_labels_names_its_type(folder, tmp_path, hf_cache, column, kind):
    """data.label_column=image was `ValueError: object too deep`."""
    import datasets

    images, names = images_and_labels(folder, "train")
    features = datasets.Features({"image": datasets.Value("binary"), "label": datasets.Value("string"),
                                  "img": datasets.Image()})
    datasets.Dataset.from_dict({"image": images, "label": names, "img": [{"bytes": b, "path": None} for b in images]},
                               features=features).to_parquet(str(tmp_path / "train.parquet"))
    cfg = config("hf", tmp_path, label_column=column)
    with pytest.raises(UserError) as error:
        build_split(cfg, "train", eval_transform(cfg), seed=0)
    assert str(error.value) == (f"Hugging Face dataset {tmp_path} split train: data.label_column={column} names a "
                                f"column of {kind}, not labels; name a column of class names, integers or a "
                                "ClassLabel (columns: image binary, label string, img Image)")


@pytest.mark.parametrize("workers", [0, 2])
def test_an_image_column_of_paths_is_read_relative_to_the_data_root(folder, tmp_path, hf_cache, workers):
    """A string image column was `TypeError: a bytes-like object is required` from the decoder (in a worker)."""
    root = tmp_path / "parquet"
    root.mkdir()
    (root / "images").symlink_to(folder)
    _, names = images_and_labels(folder, "val")
    paths = [row.split(",")[0].replace(str(folder), "images") for row in rows(folder, "val")]
    write_parquet(root, "val", image=pa.array(paths), label=pa.array(names))
    cfg, reference = config("hf", root, num_workers=workers), config("imagefolder", folder)
    batches = [list(build_eval_loader(build_split(c, "val", eval_transform(c), seed=0), c, 3, ONE_PROCESS))
               for c in (reference, cfg)]
    for (a, la), (b, lb) in zip(*batches, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
    val = build_split(cfg, "val", eval_transform(cfg), seed=0)
    assert [val.path(i) for i in range(len(val))] == [str(root / p) for p in paths]  # predictions.csv names them
    # A path that leads nowhere is the one-line error of any unreadable image, also from a worker.
    other = tmp_path / "gone"  # a new root: datasets caches a Parquet file it has read once
    write_parquet(other, "val", image=pa.array([*paths[:3], "images/val/a/gone.png"]), label=pa.array(names))
    (other / "images").symlink_to(folder)
    cfg = config("hf", other, num_workers=workers)
    with pytest.raises(UserError) as error:
        list(build_eval_loader(build_split(cfg, "val", eval_transform(cfg), seed=0), cfg, 3, ONE_PROCESS))
    assert str(error.value) == (f"cannot read image {other}/images/val/a/gone.png (No such file or directory); "
                                "remove or replace it")
