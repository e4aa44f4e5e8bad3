"""data.val_fraction: the split made from one folder of class folders (data/split.py), kept in the run folder."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from core.errors import UserError
from data.split import make_split
from tests.helpers import TINY, make_image_folder, read_jsonl, run_on_ranks, train_here

COUNTS = {"a": 16, "b": 15, "c": 12}


def class_folders(root: Path) -> Path:
    """root/<class>/*.png and no val split: make_image_folder's one split, as data.root."""
    return make_image_folder(root, {"photos": COUNTS}, size=20) / "photos"


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_split_is_disjoint_stratified_and_refuses_a_class_too_small(tmp_path):
    root = class_folders(tmp_path)
    split = make_split(root, 0.3, seed=5)
    assert not set(split.train) & set(split.val)
    assert sorted(split.train + split.val) == sorted(f"{c}/{i:03d}.png" for c, n in COUNTS.items() for i in range(n))
    for name, n in COUNTS.items():
        val = sum(path.startswith(f"{name}/") for path in split.val)
        assert abs(val - 0.3 * n) <= 1 and 0 < val < n, name
    assert make_split(root, 0.3, seed=6) != split  # the seed chooses the images
    (root / "tiny").mkdir()
    (root / "a" / "000.png").rename(root / "tiny" / "000.png")
    with pytest.raises(UserError, match="class 'tiny' has 1 image"):
        make_split(root, 0.3, seed=5)


@pytest.mark.slow
def test_split_kept_by_resume_two_ranks_and_evaluate(tmp_path):
    import evaluate
    from core.cli import report_errors

    root = class_folders(tmp_path / "data")
    args = [*TINY, "data.name=imagefolder", f"data.root={root}", "data.val_fraction=0.25", "data.split_seed=3",
            "train.epochs=2"]
    one, two = tmp_path / "one", tmp_path / "two"
    train_here(*args, f"output_dir={one}")
    train, val = lines(one / "train.txt"), lines(one / "val.txt")
    assert len(val) == 4 + 4 + 3 and len(train) == sum(COUNTS.values()) - len(val)
    run_on_ranks("train.py", *args, f"output_dir={two}", nproc=2)
    assert (lines(two / "train.txt"), lines(two / "val.txt")) == (train, val)  # 2 ranks: the 1-rank split

    make_image_folder(tmp_path / "more", {"x": {"a": 3}}, size=20, seed=1)  # new images: a recomputed split differs
    for i in range(3):
        (tmp_path / "more" / "x" / "a" / f"{i:03d}.png").rename(root / "a" / f"new{i}.png")
    assert make_split(root, 0.25, seed=3).val != val
    train_here(*args[:-1], "train.epochs=3", f"output_dir={one}")  # resume=auto reads the lists back
    assert (lines(one / "train.txt"), lines(one / "val.txt")) == (train, val)
    assert len(read_jsonl(one / "metrics.jsonl")) == 3
    import train as train_py
    assert report_errors(train_py.main, [*args, "data.val_fraction=0.3", "train.epochs=4", f"output_dir={one}"]) == 2
    assert lines(one / "val.txt") == val and len(read_jsonl(one / "metrics.jsonl")) == 3  # refused: nothing written

    out = tmp_path / "eval"
    assert report_errors(evaluate.main, [str(one / "best.pth"), "--output-dir", str(out)]) == 0
    result = json.loads((out / "eval.json").read_text())
    best = max(read_jsonl(one / "metrics.jsonl"), key=lambda row: row["val_top1"])
    assert result["n"] == len(val) and result["top1"] == pytest.approx(best["val_top1"], abs=1e-9)
    with open(out / "predictions.csv") as f:
        assert sorted(Path(row["path"]).relative_to(root).as_posix() for row in csv.DictReader(f)) == sorted(val)


def test_an_image_removed_from_a_resumed_split_names_its_list(tmp_path):
    """val.txt still names an image removed since the split was made: the line says so and what works (it said
    "cannot read image ...; remove or replace it", and a removed image is still listed)."""
    from core.config import DataConfig
    from data.loader import side_of
    from data.split import read_split
    from data.transforms import eval_transform

    root, run = class_folders(tmp_path), tmp_path / "run"
    run.mkdir()
    for name, data in make_split(root, 0.25, seed=0).files().items():
        (run / name).write_bytes(data)
    split = read_split(run)
    (root / split.val[0]).unlink()
    cfg = DataConfig(name="imagefolder", root=str(root), val_fraction=0.25, img_size=16)
    val = side_of(cfg, False, eval_transform(cfg), 0, None, split, skip_corrupt=False)
    with pytest.raises(UserError, match=f"^image {root / split.val[0]} is listed in {run}/val.txt "
                                        r"\(data.val_fraction's split\) but no longer exists; put it back, or remove "
                                        f"its line from {run}/val.txt$"):
        val.load_image(0)
    assert val.load_image(1).shape[2] == 3  # the others read as before
