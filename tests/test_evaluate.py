"""evaluate.py as users run it: real checkpoints, 1, 2 and 3 real processes, identical outputs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from sklearn.metrics import classification_report, precision_recall_fscore_support

import evaluate
from core.cli import report_errors
from engine.checkpoint.formats import load_checkpoint
from tests.compare import direct_ece, fastai_most_confused
from tests.helpers import make_image_folder, run_on_ranks, train_here
from tests.wandb_reader import find_runs, read_run

pytestmark = pytest.mark.slow  # the module's checkpoint is trained, then evaluated on 1-3 processes

VAL_SIZE = 101  # divisible by neither 2 nor 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A briefly trained model on synthetic data with 101 validation images."""
    out = tmp_path_factory.mktemp("trained") / "run"
    train_here("--config", "configs/dummy.yaml", "model.name=test_resnet", "data.img_size=32",
               "data.dummy_image_size=40", "data.dummy_train_size=96", f"data.dummy_val_size={VAL_SIZE}",
               "train.batch_size=8", "train.max_steps=4", "logging.progress=false", f"output_dir={out}",
               "amp=bf16")  # trained in bf16 on any CPU; validated in eval_amp's fp32, as evaluate.py computes
    return out / "best.pth"


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_evaluate_is_identical_for_1_2_3_processes(checkpoint, tmp_path):
    outputs = {}
    wandb_dir = tmp_path / "wandb"
    wandb_dir.mkdir()
    for nproc in (1, 2, 3):
        out = tmp_path / f"eval{nproc}"
        tracking = ["logging.wandb=true"] if nproc == 2 else []  # one run also goes to W&B (offline)
        proc = run_on_ranks("evaluate.py", str(checkpoint), "--output-dir", str(out), "--batch-size", "8", *tracking,
                            nproc=nproc, env={"WANDB_DIR": str(wandb_dir)})
        assert f"n {VAL_SIZE}" in proc.stdout
        assert sorted(p.name for p in out.iterdir()) == ["confusion_matrix.png", "eval.json", "predictions.csv",
                                                          "reliability.png", "top_losses.png"]
        outputs[nproc] = ((out / "eval.json").read_text(), (out / "predictions.csv").read_text())
    assert outputs[1] == outputs[2] == outputs[3]  # byte for byte

    out = tmp_path / "eval3"
    rows = read_rows(out / "predictions.csv")
    assert [int(r["index"]) for r in rows] == list(range(VAL_SIZE))  # one row per image, sorted
    assert [r["path"] for r in rows] == [f"dummy:{i}" for i in range(VAL_SIZE)]
    result = json.loads((out / "eval.json").read_text())
    assert result["n"] == VAL_SIZE and sum(c["n"] for c in result["per_class"]) == VAL_SIZE
    correct = sum(r["label"] == r["pred"] for r in rows)
    assert result["top1"] == 100.0 * correct / VAL_SIZE
    assert result["top5"] >= result["top1"]
    assert all(r["pred"] == r["top5"].split()[0] for r in rows)
    for c in result["per_class"]:
        mine = [r for r in rows if r["label_name"] == c["class"]]
        assert c["top1"] == 100.0 * sum(r["label"] == r["pred"] for r in mine) / len(mine)
    # Per-class precision/recall/F1/support and their means are scikit-learn's on the same predictions (for 1, 2
    # and 3 processes: eval.json is the same bytes); undefined per-class values are null, counted as 0 in the means
    y_true, y_pred = [int(r["label"]) for r in rows], [int(r["pred"]) for r in rows]
    found = precision_recall_fscore_support(y_true, y_pred, labels=range(len(result["per_class"])),
                                            zero_division=np.nan)
    for key, values in zip(("precision", "recall", "f1", "support"), found):
        mine = [np.nan if c[key] is None else c[key] for c in result["per_class"]]
        assert mine == pytest.approx(values * (1 if key == "support" else 100), rel=1e-12, nan_ok=True), key
    report = classification_report(y_true, y_pred, output_dict=True, zero_division=0)
    for average in ("macro", "weighted"):
        for key in ("precision", "recall", "f1"):
            expected = 100 * report[f"{average} avg"][key if key != "f1" else "f1-score"]
            assert result[f"{average}_{key}"] == pytest.approx(expected, rel=1e-12), (average, key)
    image = matplotlib.image.imread(out / "confusion_matrix.png")
    assert image.shape[0] >= 400 and image.shape[1] >= 400
    # ECE: Guo et al.'s loop on predictions.csv's confidences; the reliability diagram is a PNG
    confidence = np.array([float(r["confidence"]) for r in rows])
    correct = np.array([r["label"] == r["pred"] for r in rows])
    assert result["ece"] == pytest.approx(direct_ece(confidence, correct), rel=1e-12) and result["ece_bins"] == 15
    assert matplotlib.image.imread(out / "reliability.png").shape[0] >= 400
    # fastai's most_confused and plot_top_losses, from predictions.csv's own columns
    names = [c["class"] for c in result["per_class"]]
    assert [(names.index(c["actual"]), names.index(c["predicted"]), c["images"]) for c in result["most_confused"]] \
        == fastai_most_confused(np.array(y_true), np.array(y_pred), len(names))[:20]
    by_loss = sorted(rows, key=lambda r: -float(r["loss"]))[:16]
    assert [(e["index"], e["path"], e["loss"]) for e in result["top_losses"]] == \
        [(int(r["index"]), r["path"], float(r["loss"])) for r in by_loss]
    assert matplotlib.image.imread(out / "top_losses.png").shape[0] >= 4 * 250
    # The training run evaluated the same weights on the same batches in the same precision: the same top-1, though
    # it trained in bf16 (issue 46: its validation followed amp then, and differed).
    assert result["top1"] == load_checkpoint(checkpoint)["metric_value"]
    [row] = [json.loads(line) for line in (checkpoint.parent / "metrics.jsonl").read_text().splitlines()]
    assert (result["loss"], result["top1"], result["precision"]) == (row["val_loss"], row["val_top1"], "fp32")

    [path] = find_runs(wandb_dir)  # one W&B run, from rank 0 of the 2-process evaluation
    run = read_run(path)
    assert run.run.job_type == "eval" and run.summary["eval/top1"] == result["top1"]
    assert run.summary["eval/per_class"] == {c["class"]: c["top1"] for c in result["per_class"]}
    [logged] = [h for h in run.history if "eval/predictions" in h]
    table = json.loads((path.parent / "files" / logged["eval/predictions"]["path"]).read_text())
    # predictions.csv's cells, numbers as numbers: W&B sorts confidence and loss numerically, not as text
    numbers = {"index": int, "label": int, "pred": int, "confidence": float, "loss": float}
    assert table["columns"] == list(rows[0])
    assert table["data"] == [[numbers.get(c, str)(row[c]) for c in table["columns"]] for row in rows]
    assert all(type(cell) is numbers.get(c, str) for line in table["data"] for c, cell in zip(table["columns"], line))


def test_evaluate_errors_are_one_line(checkpoint, tmp_path, capsys):
    cases = [
        ([str(checkpoint), "model.name=resnet18"], "is a test_resnet; it cannot be evaluated as model.name=resnet18"),
        ([str(checkpoint), "--ema"], "holds no EMA weights"),  # trained without model.ema_decay
        ([str(tmp_path / "missing.pth")], "missing.pth does not exist"),
        ([str(checkpoint), "--data-dir", str(make_image_folder(tmp_path / "cats", {"val": {"cat": 2, "dog": 2}}))],
         "val has classes that are not among the 10 training classes (cat, dog)"),
    ]
    for argv, message in cases:
        assert report_errors(evaluate.main, [*argv, "--output-dir", str(tmp_path / "out")]) == 2
        error = capsys.readouterr().err.strip()
        assert "\n" not in error and error.startswith("error: ") and message in error, error


def test_the_console_summary_shows_balanced_accuracy_and_macro_f1():
    """Issue 61: evaluate.py's console gives eval.json's balanced accuracy and macro-F1 beside top-1 (imbalanced
    classes hide behind top-1)."""
    from assembly.evaluate import summary_lines

    result = {"top1": 90.0, "top5": 100.0, "balanced_acc": 61.0, "macro_f1": 55.5, "loss": 0.3, "ece": 2.0, "n": 425,
              "per_class": [{"class": "owl", "top1": 20.0}, {"class": "cat", "top1": 99.0}], "output_dir": "out",
              "most_confused": [{"actual": "owl", "predicted": "cat", "images": 8}], "scored": "the run's val.txt"}
    assert summary_lines(result) == [
        "top1 90.00%  top5 100.00%  balanced acc 61.00%  macro F1 55.50%  loss 0.3000  ECE 2.00%  n 425",
        "lowest per-class top1: owl 20.0%, cat 99.0%",
        "most confused (actual -> predicted): owl -> cat 8",
        "scored 425 images: the run's val.txt",
        "wrote eval.json, predictions.csv, confusion_matrix.png, reliability.png, top_losses.png to out"]


def test_the_reliability_legend_covers_no_bar():
    """Issue 61: the legend sat inside the diagram's upper left, over a calibrated model's tall bars; now below both
    panels, it overlaps no bar of a diagram whose every bin is filled to the top."""
    from engine.plots import reliability_figure

    count = np.full(10, 50.0)
    bins = np.stack([count, count * (np.arange(10) + 0.5) / 10, count])  # every bin: all right
    fig = reliability_figure(bins, "reliability")
    fig.canvas.draw()
    legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert len(legends) == 1
    box = legends[0].get_window_extent()
    bars = [patch.get_window_extent() for ax in fig.axes for patch in ax.patches]
    assert len(bars) == 20 and not [bar for bar in bars if box.overlaps(bar)]
    assert not [ax for ax in fig.axes if box.overlaps(ax.get_window_extent())]
