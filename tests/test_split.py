"""data.val_fraction: the split made from one folder of class folders (data/split.py), kept in the run folder."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from core.config import DataConfig
from core.errors import UserError
from data.split import make_split, read_split, run_split
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


def test_a_root_split_already_is_refused_and_a_class_named_train_is_not(tmp_path):
    """data.root with train/ and val/ trained a 2-class model whose classes were "train" and "val"."""
    split = make_image_folder(tmp_path / "split", {"train": {"a": 4, "b": 4}, "val": {"a": 2, "b": 2}}, size=8)
    with pytest.raises(UserError, match=f"data.root {split} holds train/, val/, the splits of a dataset split already.*"
                                        f"set data.root={split / 'train'}"):
        make_split(split, 0.3, seed=0)
    vehicles = make_image_folder(tmp_path / "vehicles", {"all": {"train": 4, "bus": 4}}, size=8) / "all"
    assert len(make_split(vehicles, 0.25, seed=0).val) == 2  # CIFAR-100 has a class "train"


def test_names_holding_line_breaks_are_refused_at_the_split_or_read_back_whole(tmp_path):
    """A file name holding a newline split in val.txt, and the run could no longer resume; \\r, \\x85 and \\u2028,
    which str.splitlines also splits at, read back whole."""
    root = class_folders(tmp_path / "data")
    for i, odd in enumerate(("\r", "\x85", "\u2028")):
        (root / "a" / f"{i:03d}.png").rename(root / "a" / f"odd{odd}{i}.png")
    split = make_split(root, 0.5, seed=0)
    for name, data in split.files().items():
        (tmp_path / name).write_bytes(data)
    read = read_split(tmp_path)
    assert (read.train, read.val, read.folder) == (split.train, split.val, str(tmp_path))
    (root / "b" / "000.png").rename(root / "b" / "two\nlines.png")
    with pytest.raises(UserError, match=r"image '.*/b/two\\nlines.png' has a line break in its name.*rename it"):
        make_split(root, 0.5, seed=0)


def test_a_branch_keeps_the_resumed_runs_split_or_refuses_another(tmp_path):
    """resume=<old>/last.pth output_dir=<new> with another data.val_fraction made a new split: a third of its
    validation images had been trained on. The same split is read back from the old run's folder."""
    root = class_folders(tmp_path / "data")
    old = tmp_path / "old"
    old.mkdir()
    kept = make_split(root, 0.2, seed=0)
    for name, data in kept.files().items():
        (old / name).write_bytes(data)
    (root / "a" / "000.png").rename(root / "a" / "moved.png")  # a recomputed split would differ
    resumed = {"name": "imagefolder", "root": str(root), "val_fraction": 0.2, "split_seed": 0}
    data = DataConfig(name="imagefolder", root=str(root), val_fraction=0.2)
    assert run_split(data, old / "last.pth", resumed, is_main=False) == dataclasses.replace(kept, folder=str(old))
    for change in ({"val_fraction": 0.3}, {"split_seed": 1}):
        with pytest.raises(UserError, match=f"resume={old / 'last.pth'}: that run split {root}.*"
                                            f"data.{next(iter(change))} .* -> .* would split again and validate on "
                                            "images it trained on; keep data.val_fraction=0.2 data.split_seed=0"):
            run_split(DataConfig(**{**resumed, **change}), old / "last.pth", resumed, is_main=False)


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
    added to data.root since change nothing); another data.split_seed would split anew, and is refused."""
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
    assert run_split(cfg, run / "last.pth", recorded, is_main=False) == dataclasses.replace(written, folder=str(run))
    reseeded = DataConfig(name="imagefolder", root=str(root), val_fraction=0.25, split_seed=4)
    with pytest.raises(UserError, match="data.split_seed 3 -> 4 would split again"):
        run_split(reseeded, run / "last.pth", recorded, is_main=False)


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


def test_evaluate_data_dir_scores_that_folders_images_whatever_split_the_run_used(split_pipeline_run, tmp_path,
                                                                                  capsys):
    """Issue 61's trap: on a data.val_fraction run, `evaluate.py best.pth --data-dir other/` scored only the files
    named in the run's val.txt looked up in other/ (camera names repeat across classes and folders: here 000.png in
    every class), and failed on a folder lacking one. It scores the folder's own images, whatever split the run used:
    every image of a folder of class folders, the val/ split of a folder with train/ and val/, and says which."""
    import evaluate
    from core.cli import report_errors

    best = str(split_pipeline_run / "best.pth")
    photos = make_image_folder(tmp_path / "other", {"photos": COUNTS}, size=20, seed=1) / "photos"  # val.txt's names too
    split = make_image_folder(tmp_path / "split", {"train": {"a": 2, "b": 2}, "val": {"a": 3, "b": 2, "c": 1}}, size=20)
    for folder, scored, where in ((photos, photos, f"every image under {photos}'s class folders (it has no val/ split "
                                   "folder)"), (split, split / "val", f"{split / 'val'} (the val split of --data-dir)")):
        out = tmp_path / f"eval-{folder.name}"
        assert report_errors(evaluate.main, [best, "--data-dir", str(folder), "--output-dir", str(out)]) == 0
        images = sorted(str(path) for path in scored.rglob("*.png"))
        assert f"scored {len(images)} images: {where}" in capsys.readouterr().out
        with open(out / "predictions.csv") as f:
            assert sorted(row["path"] for row in csv.DictReader(f)) == images
        assert json.loads((out / "eval.json").read_text())["scored"] == where


def test_export_of_a_val_fraction_run_checks_on_the_runs_validation_images(split_pipeline_run, tmp_path, capsys):
    """Issue 61: export.py on a data.val_fraction run said "the run's val.txt was not given; evaluate the run's
    checkpoint in its folder" (it was in its folder) and checked the export on random pixels; it reads val.txt beside
    the checkpoint and checks on those images."""
    import export
    from core.cli import report_errors

    best = split_pipeline_run / "best.pth"
    assert report_errors(export.main, [str(best), "--format", "safetensors", "--output", str(tmp_path / "hf")]) == 0
    captured = capsys.readouterr()
    assert "random pixels" not in captured.err and "val.txt was not given" not in captured.err, captured.err
    root = split_pipeline_run.parent / "data" / "photos"
    assert f"(validation images of the run's val.txt beside {best}, in {root}): 0" in captured.out
    from assembly.export import check_sources
    from assembly.inference import open_trained
    from data.datasets import read_image

    _, cfg = open_trained(best, False)
    raw, _ = check_sources(cfg, None, 8, str(best))
    listed = lines(split_pipeline_run / "val.txt")[:8]
    assert all(np.array_equal(image, read_image(str(root / path))) for image, path in zip(raw, listed, strict=True))


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
