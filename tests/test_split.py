"""data.val_fraction: the split made from one folder of class folders (data/split.py), kept in the run folder."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from core.config import DataConfig
from core.errors import UserError
from data.split import make_split, run_split
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


def empty_images(root: Path, counts: dict[str, int]) -> Path:
    """root/<class>/000.png... as empty files: a split lists files, it never opens them."""
    for name, n in counts.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            (root / name / f"{i:03d}.png").touch()
    return root


def test_each_class_is_shuffled_by_its_own_generator(tmp_path):
    """docs/data.md: class c's images are shuffled by a generator seeded with (data.split_seed, c), so classes of one
    size do not all send the same positions to validation (one generator seeded with the seed alone would)."""
    split = make_split(empty_images(tmp_path, {"a": 20, "b": 20, "c": 20}), 0.25, seed=0)
    picks = [frozenset(path.split("/")[1] for path in split.val if path.startswith(f"{c}/")) for c in "abc"]
    assert [len(p) for p in picks] == [5, 5, 5] and len(set(picks)) == 3, picks


def test_a_resume_reads_the_split_back_from_the_run_folder(tmp_path):
    """The resumed checkpoint's folder holds the run's lists: a resume that splits the same way reads them (images
    added to data.root since change nothing); another data.split_seed splits anew."""
    root = empty_images(tmp_path / "photos", {"a": 8, "b": 8})
    run = tmp_path / "run"
    run.mkdir()
    written = make_split(root, 0.25, seed=3)
    for name, content in written.files().items():
        (run / name).write_bytes(content)
    empty_images(root, {"a": 12})  # four more images of class a
    cfg = DataConfig(name="imagefolder", root=str(root), val_fraction=0.25, split_seed=3)
    recorded = {"name": "imagefolder", "root": str(root), "val_fraction": 0.25, "split_seed": 3}
    assert make_split(root, 0.25, seed=3) != written
    assert run_split(cfg, run / "last.pth", recorded, is_main=False) == written
    reseeded = DataConfig(name="imagefolder", root=str(root), val_fraction=0.25, split_seed=4)
    assert run_split(reseeded, run / "last.pth", recorded, is_main=False) == make_split(root, 0.25, seed=4)


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
