"""Error analysis: calibration (ECE, Guo et al. 2017) against a direct computation; a run's curves.png and
samples.png; evaluate.py's most-confused pairs and top losses against fastai's definitions."""

from __future__ import annotations

import logging
import math
import shutil

import matplotlib.image
import numpy as np
import pytest

from core.cli import report_errors
from assembly.evaluate import TOP_LOSSES, top_loss_rows
from assembly.run import SAMPLES, show_samples
from core.config import LoggingConfig
from core.config_load import load_config
from data.datasets import augmented_samples
from data.loader import build_datasets
from engine import curves
from engine.label_issues import most_confused
from engine.tracking import WandbTracker
from engine.metrics import calibration_bins, expected_calibration_error
from tests.compare import direct_ece, fastai_most_confused


def test_ece_is_the_direct_computation_on_fixed_probabilities():
    """Softmax probabilities of 10 classes, some top-1 confidences exactly on bin edges (they belong to the lower
    bin), and a hand-computed case."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1000, 10)) * rng.uniform(0.5, 4.0, size=(1000, 1))
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    labels = np.where(rng.random(1000) < 0.6, probs.argmax(1), rng.integers(0, 10, 1000))
    confidence, correct = probs.max(1), probs.argmax(1) == labels
    confidence[:40] = np.linspace(0.0, 1.0, 16)[np.arange(40) % 15 + 1]  # on the edges 1/15 .. 1
    assert math.isclose(expected_calibration_error(confidence, correct), direct_ece(confidence, correct),
                        rel_tol=1e-12)
    assert calibration_bins(confidence, correct)[0].sum() == 1000
    # 0.9 twice (one right: |0.5 - 0.9| x 2/4) and 0.7 twice (both right: |1 - 0.7| x 2/4): 0.2 + 0.15
    hand = expected_calibration_error(np.array([0.9, 0.9, 0.7, 0.7]), np.array([True, False, True, True]))
    assert hand == pytest.approx(35.0, rel=1e-12)
    assert expected_calibration_error(np.array([1.0, 0.5]), np.array([True, False])) == pytest.approx(25.0)


def test_a_confidence_on_a_bin_edge_belongs_to_the_lower_bin():
    """Bins are ((m-1)/M, m/M]: each edge m/15 is counted in bin m-1, and a wrong image at 2/15 and a right one at 0.14
    are two bins of |0 - 2/15| and |1 - 0.14| (one bin of both would give |1 - (2/15 + 0.14)|)."""
    edges = np.linspace(0.0, 1.0, 16)
    assert calibration_bins(edges[1:], np.ones(15))[0].tolist() == [1.0] * 15
    ece = expected_calibration_error(np.array([edges[2], 0.14]), np.array([False, True]))
    assert ece == pytest.approx(100 * (edges[2] + 0.86) / 2, rel=1e-12)


def test_confusion_matrix_rows_are_the_true_class_columns_the_predicted():
    """As scikit-learn's confusion_matrix (confusion_matrix.png and TensorBoard's val/confusion draw it so)."""
    from sklearn.metrics import confusion_matrix as sklearn_confusion

    from engine.metrics import confusion_matrix

    labels, predicted = np.array([0, 0, 0, 1, 2, 2]), np.array([1, 1, 0, 1, 1, 2])
    assert confusion_matrix(labels, predicted, 3).tolist() == [[1, 2, 0], [0, 1, 0], [0, 1, 1]]
    assert np.array_equal(confusion_matrix(labels, predicted, 3), sklearn_confusion(labels, predicted, labels=range(3)))


def test_a_run_draws_curves_png_and_the_redraw_command_draws_the_same(tiny_run, tmp_path, capsys):
    """The Curves hook wrote curves.png after the run's validations; `python -m engine.curves` on a copy of the
    folder's metrics.jsonl and config.yaml draws the same bytes; a folder without rows is a one-line error."""
    drawn = (tiny_run / "curves.png").read_bytes()
    assert drawn.startswith(b"\x89PNG\r\n\x1a\n") and matplotlib.image.imread(tiny_run / "curves.png").shape[1] >= 1000
    for name in ("metrics.jsonl", "config.yaml"):
        shutil.copy(tiny_run / name, tmp_path / name)
    assert report_errors(curves.main, [str(tmp_path)]) == 0
    assert (tmp_path / "curves.png").read_bytes() == drawn
    assert report_errors(curves.main, [str(tmp_path / "empty")]) == 2
    assert "has no metrics.jsonl rows to draw" in capsys.readouterr().err.strip().splitlines()[-1]


def test_most_confused_is_fastais_with_its_tie_order():
    """Pairs by count, most first; equal counts keep the confusion matrix's row-major order (fastai's stable sort)."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 7, 500)
    predicted = np.where(rng.random(500) < 0.5, labels, rng.integers(0, 7, 500))
    assert most_confused(labels, predicted, 7) == fastai_most_confused(labels, predicted, 7)
    assert most_confused(np.array([2, 2, 0, 1]), np.array([0, 0, 2, 0]), 3) == [(2, 0, 2), (0, 2, 1), (1, 0, 1)]


def test_top_losses_are_the_largest_losses_of_predictions_csv_ties_in_index_order():
    rows = [{"index": str(i), "path": f"p{i}.png", "label": str(i % 2), "pred": "1", "confidence": "0.5",
             "loss": repr(float(loss))} for i, loss in enumerate([0.1, 3.0, 2.0, 3.0] + [0.0] * 20)]
    top = top_loss_rows(rows, ["a", "b"])
    assert [e["index"] for e in top[:4]] == [1, 3, 2, 0] and len(top) == TOP_LOSSES
    assert top[0] == {"index": 1, "path": "p1.png", "actual": "b", "predicted": "b", "confidence": 0.5, "loss": 3.0}


def test_a_fresh_run_draws_samples_png_of_its_first_augmented_images(tiny_run, tmp_path, caplog):
    """samples.png: logging.samples images, each epoch 0's augmentation of its sample (what W&B's train_samples
    table holds); a samples.png of the user's own (not a PNG) is kept, with a warning."""
    assert (tiny_run / SAMPLES).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert matplotlib.image.imread(tiny_run / SAMPLES).shape[1] >= 4 * 150
    cfg = load_config(str(tiny_run / "config.yaml"))
    train_set, _ = build_datasets(cfg.data, seed=cfg.seed)
    shown = augmented_samples(train_set, 6)
    assert [s.index for s in shown] == [0, 6, 12, 19, 25, 31]  # spread over the 32 images
    for s in shown:
        image, label = train_set[(0, s.index)]
        assert (s.image == image.permute(1, 2, 0).numpy()).all() and (s.label, s.name) == (label, f"class_{label}")
    (tmp_path / SAMPLES).write_text("my notes")
    with caplog.at_level(logging.WARNING):
        show_samples(train_set, LoggingConfig(samples=2), WandbTracker(LoggingConfig(), False), tmp_path)
    assert (tmp_path / SAMPLES).read_text() == "my notes" and "samples.png not written" in caplog.text
