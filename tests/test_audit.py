"""audit.py: k folds of the config's recipe, cleanlab on their out-of-fold probabilities, and the findings written.

One audit of a small class-coloured image folder (a planted label flip and a planted train/val copy) is made once
and read by several tests; the folds' own machinery (stratified, seeded, kept) is checked without training.
"""

from __future__ import annotations

import csv
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from core.cli import report_errors
from core.errors import UserError
from data.folds import fold_side, make_folds, read_folds
from tests.helpers import REPO, last_error, make_image_folder, read_jsonl, run_on_ranks, script_env, wait_for_file

CLASSES = {"a": 10, "b": 10, "c": 10}
# test_resnet at 24 px, fp32, 4 epochs: enough to learn the class colours; 2 folds.
RECIPE = ["--config", "dummy", "data.name=imagefolder", "model.name=test_resnet", "model.channels_last=false",
          "amp=off", "data.img_size=24", "data.augment=false", "data.mean=[0.5,0.5,0.5]", "data.std=[0.5,0.5,0.5]",
          "data.crop_pct=1.0", "data.num_workers=0", "optim.name=sgd", "optim.lr=0.05", "sched.warmup_epochs=0",
          "train.epochs=4", "logging.progress=false", "logging.curves=false", "--folds=2"]
BATCH = "train.batch_size=5"  # 15 training images per fold: 3 steps an epoch


def planted_folder(root: Path) -> tuple[Path, str, tuple[str, str]]:
    """An image folder with one class-a image moved into class b (a flip) and a val image copied into train."""
    make_image_folder(root, {"train": CLASSES, "val": {"a": 3, "b": 3, "c": 3}})
    flip = root / "train" / "b" / "flip_a_000.png"
    (root / "train" / "a" / "000.png").rename(flip)
    copy = root / "train" / "c" / "copy_of_val_c_001.png"
    shutil.copy(root / "val" / "c" / "001.png", copy)
    return root, str(flip), (str(root / "val" / "c" / "001.png"), str(copy))


def audit_here(*args: str) -> int:
    import audit

    return report_errors(audit.main, list(args))


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    """The audit made once: (audit folder, planted flip, planted copy pair)."""
    tmp = tmp_path_factory.mktemp("audit")
    root, flip, copy = planted_folder(tmp / "data")
    assert audit_here(*RECIPE, BATCH, f"data.root={root}", f"output_dir={tmp / 'run'}") == 0
    return tmp / "run" / "audit", flip, copy, root


def rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_folds_are_stratified_seeded_and_left_out_images_are_in_none():
    labels = np.repeat([0, 1, 2], [9, 6, 3])
    left_out = np.zeros(len(labels), bool)
    left_out[0] = True
    folds = make_folds(labels, [f"{i}.png" for i in range(len(labels))], 3, 7, ["x", "y", "z"], left_out)
    fold = np.asarray(folds.fold)
    assert fold[0] == -1 and set(fold[1:]) == {0, 1, 2}
    for label in range(3):  # each class spread evenly: counts per fold differ by at most one
        counts = np.bincount(fold[1:][labels[1:] == label], minlength=3)
        assert counts.max() - counts.min() <= 1, (label, counts)
    assert make_folds(labels, folds.paths, 3, 7, ["x", "y", "z"], left_out) == folds
    assert make_folds(labels, folds.paths, 3, 8, ["x", "y", "z"], left_out) != folds
    with pytest.raises(UserError, match=r"--folds 4: class 'z' has 3 training image\(s\).*use --folds 3"):
        make_folds(labels, folds.paths, 4, 7, ["x", "y", "z"], np.zeros(len(labels), bool))


def test_a_fold_run_trains_on_the_other_folds_and_validates_on_its_own(audited):
    folder, *_ = audited
    folds = read_folds(folder / "fold_assignment.json")

    class Base:  # the training split as a dataset: its paths in order
        def __init__(self, paths):
            self.paths, self.transform, self.seed, self.tensor_transform = paths, None, 0, None
            self.classes, self.labels, self.skip_corrupt = ["a"], np.zeros(len(paths), np.int64), False

        def __len__(self):
            return len(self.paths)

        def path(self, i):
            return self.paths[i]

    base = Base(folds.paths)
    for k in range(folds.count):
        trained = {base.path(int(i)) for i in fold_side(base, folds, k, True, "f").indices}
        held = {base.path(int(i)) for i in fold_side(base, folds, k, False, "f").indices}
        assert not trained & held and trained | held == set(folds.paths)
        run = read_jsonl(folder / f"fold_{k}" / "metrics.jsonl")[-1]
        assert run["train_images"] <= len(trained) and len(held) == folds.fold.count(k)
    with pytest.raises(UserError, match="the data changed since the audit began"):
        fold_side(Base(folds.paths[1:]), folds, 0, True, "f")


def test_each_image_is_scored_by_the_fold_model_that_never_saw_it_as_evaluate_py_reads_it(audited, tmp_path):
    """probabilities.npy's rows of fold k: the top class and its probability evaluate.py gives on fold k's own
    checkpoint (which validates on fold k alone)."""
    folder, *_ = audited
    import evaluate

    folds = read_folds(folder / "fold_assignment.json")
    probs = np.load(folder / "probabilities.npy")
    for k in range(folds.count):
        out = tmp_path / f"eval{k}"
        assert report_errors(evaluate.main, [str(folder / f"fold_{k}" / "last.pth"), f"--output-dir={out}"]) == 0
        predicted = rows(out / "predictions.csv")
        held = np.flatnonzero(np.asarray(folds.fold) == k)
        assert [row["path"] for row in predicted] == [folds.paths[i] for i in held]
        for row, i in zip(predicted, held):
            assert int(row["pred"]) == int(probs[i].argmax())
            assert float(row["confidence"]) == pytest.approx(float(probs[i].max()), abs=1e-4)


def test_label_issues_are_cleanlabs_ranking_of_the_out_of_fold_probabilities(audited):
    """cleanlab's own find_label_issues on probabilities.npy gives label_issues.csv, in its order; the planted flip
    is among them, suggested back to its colour's class."""
    from cleanlab.filter import find_label_issues

    folder, flip, _, _ = audited
    folds = read_folds(folder / "fold_assignment.json")
    labels = np.asarray([["a", "b", "c"].index(Path(p).parent.name) for p in folds.paths])
    ranked = find_label_issues(labels, np.load(folder / "probabilities.npy").astype(np.float64),
                               filter_by="prune_by_class", return_indices_ranked_by="self_confidence")
    found = rows(folder / "label_issues.csv")
    assert [row["path"] for row in found] == [folds.paths[i] for i in ranked]
    assert {"path": flip, "given": "b", "suggested": "a"}.items() <= next(r for r in found if r["path"] == flip).items()


def test_the_planted_copy_is_a_leak_and_the_report_and_counts_are_written(audited):
    folder, _, copy, _ = audited
    pairs = rows(folder / "duplicates.csv")
    leak = {frozenset((row["path_a"], row["path_b"])) for row in pairs if row["split_a"] != row["split_b"]}
    assert frozenset(copy) in leak
    counts = json.loads((folder / "audit.json").read_text())["counts"]
    assert counts["leaks"] >= 1 and counts["label_issues"] == len(rows(folder / "label_issues.csv"))
    folds = json.loads((folder / "folds.json").read_text())
    assert [f["fold"] for f in folds["folds"]] == [0, 1]
    assert folds["mean"]["val_top1"] == pytest.approx(np.mean([f["val_top1"] for f in folds["folds"]]))
    page = (folder / "report.html").read_text()
    assert "copy_of_val_c_001.png" in page and "flip_a_000.png" in page


def test_a_finished_run_is_audited_from_its_own_predictions_said_to_be_weaker(audited, tmp_path):
    """audit.py <checkpoint>: the run's model on its own training images (its data and config as stored); the
    report and audit.json say the evidence is in-sample."""
    from tests.helpers import train_here

    *_, root = audited
    recipe = [arg for arg in RECIPE if not arg.startswith("--folds")]
    train_here(*recipe, BATCH, "train.epochs=1", f"data.root={root}", f"output_dir={tmp_path / 'run'}")
    assert audit_here(str(tmp_path / "run" / "best.pth")) == 0
    folder = tmp_path / "run" / "audit"
    result = json.loads((folder / "audit.json").read_text())
    assert "in-sample" in result["evidence"] and "in-sample" in (folder / "report.html").read_text()
    probs = np.load(folder / "probabilities.npy")
    assert probs.shape == (31, 3) and np.allclose(probs.sum(axis=1), 1, atol=1e-5)
    assert result["counts"]["leaks"] >= 1 and not (folder / "folds.json").exists()


@pytest.mark.slow  # an audit stopped by SIGTERM in its second fold, then run again (two processes)
def test_an_interrupted_audit_continues_its_folds(tmp_path):
    root, *_ = planted_folder(tmp_path / "data")
    args = [sys.executable, str(REPO / "audit.py"), *RECIPE, BATCH, f"data.root={root}",
            f"output_dir={tmp_path / 'run'}"]
    folder = tmp_path / "run" / "audit"
    with subprocess.Popen(args, cwd=REPO, env=script_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL) as first:
        wait_for_file(folder / "fold_1" / "last.pth", first)  # fold 0 done, fold 1 one epoch in
        # (a stop between fold 1's first metrics.jsonl row and its first last.pth leaves a folder that no run
        # continues: a preemption during the epoch's end is issue 62's)
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=300)
    assert first.returncode != 0 and not (folder / "label_issues.csv").exists()
    assignment = (folder / "fold_assignment.json").read_bytes()
    fold_0 = (folder / "fold_0" / "metrics.jsonl").read_bytes()
    again = subprocess.run(args, cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (folder / "fold_assignment.json").read_bytes() == assignment  # the same folds, not new ones
    assert (folder / "fold_0" / "metrics.jsonl").read_bytes() == fold_0  # fold 0 not trained again
    assert len(read_jsonl(folder / "fold_1" / "metrics.jsonl")) == 4 and (folder / "label_issues.csv").exists()


@pytest.mark.slow  # the same audit on 1 and 2 processes (a real gloo group)
def test_folds_on_one_and_two_processes_give_the_same_findings(tmp_path):
    """Each fold's 12 training images make 2 whole global batches of 6 (3 per process): the same steps either way."""
    root = make_image_folder(tmp_path / "data", {"train": {"a": 8, "b": 8, "c": 8}, "val": {"a": 2, "b": 2}})
    same = ["model.sync_bn=true", "train.global_batch_size=6", "train.epochs=2"]
    assert audit_here(*RECIPE, *same, f"data.root={root}", f"output_dir={tmp_path / 'one'}") == 0
    run_on_ranks("audit.py", *RECIPE, *same, f"data.root={root}", f"output_dir={tmp_path / 'two'}", nproc=2)
    one, two = tmp_path / "one" / "audit", tmp_path / "two" / "audit"
    for name in ("fold_assignment.json", "duplicates.csv"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    np.testing.assert_allclose(np.load(one / "probabilities.npy"), np.load(two / "probabilities.npy"), atol=1e-4)
    assert {r["path"] for r in rows(one / "label_issues.csv")} == {r["path"] for r in rows(two / "label_issues.csv")}


def test_what_an_audit_cannot_start_from_is_one_line(tmp_path, capsys):
    root = make_image_folder(tmp_path / "data", {"train": {"a": 4, "b": 2}})
    base = [*RECIPE, BATCH, f"output_dir={tmp_path / 'run'}"]
    assert "data folder" in last_error(capsys, audit_here(*base, f"data.root={tmp_path / 'missing'}"))
    code = audit_here(*base, f"data.root={root}", "--folds=3")
    err = capsys.readouterr().err
    assert "no validation split" in err and "within the training images only" in err  # said, then audited on
    assert code == 2 and "--folds 3: class 'b' has 2 training image(s)" in err.strip().splitlines()[-1]
    (tmp_path / "empty_run").mkdir()
    line = last_error(capsys, audit_here(str(tmp_path / "empty_run")))
    assert line.startswith("error: ") and "empty_run" in line
