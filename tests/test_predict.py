"""predict.py as users run it: unlabelled images from a folder, a list file or one path; 1 and 2 real processes."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
from pathlib import Path

import cv2
import numpy as np
import pytest

import evaluate
import predict
from assembly.predict import class_thresholds
from core.cli import report_errors
from core.errors import UserError
from data.datasets import list_images
from engine.checkpoint.inference import Trained
from tests.helpers import run_script, train_here


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def write_images(folder: Path, names: list[str], size: int = 24) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(path), rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
        paths.append(path)
    return paths


def test_predict_folder_skips_an_unreadable_image_and_writes_the_others(tiny_run, tmp_path, capsys):
    images = tmp_path / "images"
    good = write_images(images, ["b.png", "sub/a.png", "sub/deeper/c.jpg"])
    (images / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    (images / "notes.txt").write_text("not an image")
    out = tmp_path / "out"
    assert report_errors(predict.main, [str(tiny_run / "best.pth"), str(images), "--output-dir", str(out),
                                        "--topk", "3"]) == 0
    captured = capsys.readouterr()
    assert f"skipped: cannot read image {images / 'broken.png'}" in captured.err
    assert "predicted 3 image(s), 1 unreadable skipped" in captured.out
    rows = read_rows(out / "predictions.csv")
    assert [r["path"] for r in rows] == [str(p) for p in sorted(good)]  # sorted, at any depth, broken one left out
    assert list(rows[0]) == ["index", "path", "class_1", "prob_1", "class_2", "prob_2", "class_3", "prob_3"]
    for row in rows:
        probs = [float(row[f"prob_{i}"]) for i in (1, 2, 3)]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0 + 1e-5
        assert row["class_1"].startswith("class_")
    result = json.loads((out / "predictions.json").read_text())
    assert result["n"] == 3 and [u["path"] for u in result["unreadable"]] == [str(images / "broken.png")]
    assert [p["path"] for p in result["predictions"]] == [r["path"] for r in rows]
    assert result["predictions"][0]["top"][0] == {"class": rows[0]["class_1"], "prob": float(rows[0]["prob_1"])}
    assert sorted(p.name for p in out.iterdir()) == ["predictions.csv", "predictions.json"]  # parts removed

    # The same images named in a list file (relative to it), and one image alone: the same predictions.
    listing = images / "list.txt"
    listing.write_text("# three images\nsub/a.png\n\nb.png\nsub/deeper/c.jpg\n")
    assert report_errors(predict.main, [str(tiny_run / "best.pth"), str(listing), "--output-dir",
                                        str(tmp_path / "listed"), "--topk", "3"]) == 0
    listed = {Path(r["path"]).resolve(): r["class_1"] for r in read_rows(tmp_path / "listed" / "predictions.csv")}
    assert listed == {Path(r["path"]).resolve(): r["class_1"] for r in rows}
    assert report_errors(predict.main, [str(tiny_run / "best.pth"), str(good[0]), "--output-dir",
                                        str(tmp_path / "one")]) == 0
    [one] = read_rows(tmp_path / "one" / "predictions.csv")
    assert one["path"] == str(good[0]) and "class_5" in one


@pytest.mark.parametrize("make_input, message", [
    (lambda tmp: tmp / "missing", "missing does not exist; give an image, a folder of images or a text file"),
    (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "holds no images"),
    (lambda tmp: (tmp / "blank.txt").write_text("\n# nothing\n") and tmp / "blank.txt", "names no images"),
    (lambda tmp: (tmp / "bin.dat").write_bytes(b"\xff\xfe\x00") and tmp / "bin.dat", "nor a UTF-8 text file"),
])
def test_predict_input_errors_are_one_line(tiny_run, tmp_path, capsys, make_input, message):
    argv = [str(tiny_run / "best.pth"), str(make_input(tmp_path)), "--output-dir", str(tmp_path / "out")]
    assert report_errors(predict.main, argv) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("error: ") and message in error, error
    assert not (tmp_path / "out" / "predictions.csv").exists()


def within(seconds: int, fn, *args):
    """fn(*args), or a failure when it has not returned after `seconds` (a hang, not a speed check)."""
    def hung(signum, frame):
        raise AssertionError(f"{fn.__name__} did not return within {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        return fn(*args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_folder_walk_ends_on_symbolic_link_loops_and_lists_each_folder_once(tmp_path, caplog):
    """Two links to `..` made the walk follow 2**40 paths; a second link to a folder listed its images twice."""
    images = tmp_path / "images"
    write_images(images, ["a.png", "sub/b.png", "sub/deeper/c.png"])
    os.symlink("..", images / "sub" / "up")
    os.symlink("..", images / "sub" / "up2")
    os.symlink("sub", images / "again")  # sorts before sub: the folder keeps its own path all the same
    found = within(30, list_images, images)
    assert found == [str(images / "a.png"), str(images / "sub/b.png"), str(images / "sub/deeper/c.png")]
    assert sorted(r.getMessage() for r in caplog.records) == [
        f"{images}/again is folder {images}/sub again (a symbolic link loop, or a second link to that folder); "
        f"its images are listed once, under {images}/sub",
        f"{images}/sub/up is folder {images} again (a symbolic link loop, or a second link to that folder); "
        f"its images are listed once, under {images}",
        f"{images}/sub/up2 is folder {images} again (a symbolic link loop, or a second link to that folder); "
        f"its images are listed once, under {images}"]


def test_predict_on_a_folder_with_a_link_loop_predicts_each_image_once(tiny_run, tmp_path, capsys):
    """`sub/loop -> ..` made predict.py predict `sub/loop/sub/loop/.../a.png` 40 times over (82 images, not 2)."""
    images = tmp_path / "images"
    write_images(images, ["a.png", "sub/b.png"])
    os.symlink("..", images / "sub" / "loop")
    out = tmp_path / "out"
    assert report_errors(predict.main, [str(tiny_run / "best.pth"), str(images), "--output-dir", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"{images}/sub/loop is folder {images} again (a symbolic link loop" in captured.err
    assert "predicted 2 image(s), 0 unreadable skipped" in captured.out
    assert [r["path"] for r in read_rows(out / "predictions.csv")] == [str(images / "a.png"), str(images / "sub/b.png")]


@pytest.mark.slow  # a short digits training, evaluate.py, then predict.py on 1 and 2 processes
def test_predict_matches_evaluate_on_1_and_2_processes(tmp_path):
    run = tmp_path / "run"
    train_here("--config", "configs/digits.yaml", "model.name=test_resnet", "amp=off",
               f"data.root={tmp_path / 'digits'}", "data.num_workers=0", "train.max_steps=8",
               "logging.progress=false", f"output_dir={run}")
    assert report_errors(evaluate.main, [str(run / "best.pth"), "--output-dir", str(tmp_path / "eval")]) == 0
    evaluated = read_rows(tmp_path / "eval" / "predictions.csv")
    flat = tmp_path / "flat"  # the validation images with no class folders: <class>_<file>
    flat.mkdir()
    expected = {}
    for row in evaluated:
        source = Path(row["path"])
        name = f"{source.parent.name}_{source.name}"
        shutil.copy(source, flat / name)
        expected[name] = (row["pred_name"], row["confidence"])
    (flat / "~corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))  # sorts last: batches stay evaluate's
    outputs = {}
    for nproc in (1, 2):
        out = tmp_path / f"predict{nproc}"
        proc = run_script("predict.py", str(run / "best.pth"), str(flat), "--output-dir", str(out), "--topk", "3",
                          nproc=nproc)
        assert f"predicted {len(evaluated)} image(s), 1 unreadable skipped" in proc.stdout
        assert f"skipped: cannot read image {flat / '~corrupt.png'}" in proc.stderr
        rows = read_rows(out / "predictions.csv")
        assert {Path(r["path"]).name: (r["class_1"], r["prob_1"]) for r in rows} == expected
        assert [r["path"] for r in rows] == sorted(r["path"] for r in rows)
        outputs[nproc] = ((out / "predictions.csv").read_text(), (out / "predictions.json").read_text())
    assert outputs[1] == outputs[2]  # byte for byte


def test_a_checkpoint_chosen_on_its_ema_says_to_use_ema(tiny_run, tmp_path, capsys):
    """best.pth chosen on ema_val_top1 (train.best_on_ema) holds other weights under "model": predict says so."""
    import torch

    from core.files import save_atomic

    ckpt = torch.load(tiny_run / "best.pth", weights_only=True, map_location="cpu")
    ckpt.update(ema=ckpt["model"], best_metric="ema_val_top1")
    save_atomic(ckpt, tmp_path / "ema_best.pth")
    images = write_images(tmp_path / "images", ["a.png"])
    assert report_errors(predict.main, [str(tmp_path / "ema_best.pth"), str(images[0])]) == 0
    assert "chosen on its EMA weights' val_top1 (train.best_on_ema); add --ema" in capsys.readouterr().err
    assert report_errors(predict.main, [str(tmp_path / "ema_best.pth"), str(images[0]), "--ema"]) == 0
    assert "add --ema" not in capsys.readouterr().err


@pytest.mark.parametrize("tuned, shown", [(float("nan"), "nan"), (5.0, "5.0"), (0.0, "0.0")])
def test_per_class_thresholds_get_the_range_check_of_threshold(tuned, shown, tmp_path):
    """--thresholds eval.json once took NaN or 5 (no label ever predicted) while --threshold 5 was refused; a tuned
    threshold of 1.0 (a probability saturated in float32) is one some image reached, and is kept."""
    trained = Trained(config={}, weights={}, class_names=["cat", "dog"], source="checkpoint x.pth", multi_label=True)
    tuned_file = tmp_path / "eval.json"
    tuned_file.write_text(json.dumps({"per_class": [{"class": "cat", "threshold": 1.0},
                                                    {"class": "dog", "threshold": tuned}]}))
    with pytest.raises(UserError, match=rf"^--thresholds {tuned_file}: class 'dog''s threshold must be in \(0, 1\], "
                                        rf"got {shown}$"):
        class_thresholds(predict.parse_args(["x.pth", "in", "--thresholds", str(tuned_file)]), trained)
    with pytest.raises(UserError, match=rf"^--threshold must be in \(0, 1\], got {shown}$"):
        class_thresholds(predict.parse_args(["x.pth", "in", "--threshold", shown]), trained)
    tuned_file.write_text(json.dumps({"per_class": [{"class": "cat", "threshold": 1.0},
                                                    {"class": "dog", "threshold": 0.25}]}))
    chosen = class_thresholds(predict.parse_args(["x.pth", "in", "--thresholds", str(tuned_file)]), trained)
    assert chosen.tolist() == [1.0, 0.25]
