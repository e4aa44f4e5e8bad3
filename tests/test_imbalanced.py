"""Imbalanced single-label data (issue 26): class weights, the class-balanced sampler, the metrics that judge
imbalance (against scikit-learn's), train.best_metric and early stopping."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import evaluate
import train
from core.cli import report_errors
from core.config import TrainConfig
from core.config_load import load_config
from core.errors import UserError
from data.loader import EpochSampler
from engine.checkpoint.formats import load_checkpoint
from engine.losses import build_loss, class_weights
from engine.metrics import (PER_CLASS_RECALL_MAX, add_class_counts, class_metrics, class_report, confusion_counts,
                            metric_names)
from engine.state import TrainState, best_metric
from tests.compare import allow_best_of_the_stop, assert_same, rows_without_timing
from tests.helpers import TINY, Batches, make_image_folder, read_jsonl, run_on_ranks, train_here

# 100 : 10 : 5 : 1 images: a class-balanced draw must still give each class a quarter of an epoch.
LABELS = np.repeat(np.arange(4), [100, 10, 5, 1])


class Labelled:
    """What EpochSampler reads of a dataset: its labels, its classes, its length."""

    def __init__(self, labels: np.ndarray, classes: int) -> None:
        self.labels, self.classes = labels, [f"c{i}" for i in range(classes)]

    def __len__(self) -> int:
        return len(self.labels)


def dealt(world: int, epoch: int = 3, start: int = 0, **kwargs) -> list[list[tuple]]:
    """Each rank's keys of `epoch` for a class-balanced EpochSampler over LABELS."""
    ranks = []
    for rank in range(world):
        sampler = EpochSampler(Labelled(LABELS, 4), num_replicas=world, rank=rank, shuffle=True, seed=7,
                               drop_last=True, balanced=True, **kwargs)
        sampler.set_epoch(epoch, start)
        ranks.append(list(sampler))
    return ranks


@pytest.mark.parametrize("kwargs", [{}, {"repeats": 3}, {"unit": 2}, {"unit": 2, "repeats": 2}])
def test_class_balanced_sampler_deals_one_global_order_to_any_world_size(kwargs):
    """Batch j of W ranks x B images == images [j B W, (j+1) B W) of the one-process order, as EpochSampler deals."""
    unit = kwargs.get("unit", 1)
    (single,) = dealt(1, **kwargs)
    for world in (2, 3):
        ranks = dealt(world, **kwargs)
        merged = [key for block in zip(*[[r[i:i + unit] for i in range(0, len(r), unit)] for r in ranks])
                  for part in block for key in part]
        assert merged == single[:len(merged)]
        assert min(len(r) for r in ranks) == len(single) // unit // world * unit
    assert single != dealt(1, epoch=4, **kwargs)[0]  # a new draw every epoch
    assert dealt(2, start=5, **kwargs)[1] == dealt(2, **kwargs)[1][5:]  # a mid-epoch resume skips what was read


def test_class_balanced_sampler_draws_every_class_alike():
    """Over many epochs each class gets a quarter of the draws though its images are 86% to 1% of the set; an
    image's chance is 1 / (classes x its class's count)."""
    draws = np.array([index for epoch in range(200) for _, index in dealt(1, epoch=epoch)[0]])
    share = np.bincount(LABELS[draws], minlength=4) / len(draws)
    assert np.allclose(share, 0.25, atol=0.01), share
    lone = np.flatnonzero(LABELS == 3)[0]
    assert math.isclose(np.mean(draws == lone), 0.25, abs_tol=0.01)
    assert len(dealt(1)[0]) == len(LABELS)  # an epoch keeps the dataset's length


def test_class_balanced_sampler_refuses_a_class_without_images():
    with pytest.raises(UserError, match="no images of class.*c2"):
        EpochSampler(Labelled(np.array([0, 0, 1, 3]), 4), num_replicas=1, rank=0, balanced=True)


def test_balanced_class_weights_are_scikit_learns():
    from sklearn.utils.class_weight import compute_class_weight

    counts = np.bincount(LABELS).tolist()
    expected = compute_class_weight("balanced", classes=np.arange(4), y=LABELS)
    assert torch.allclose(class_weights("balanced", counts, ["a", "b", "c", "d"]),
                          torch.tensor(expected, dtype=torch.float32))
    assert class_weights("none", counts, ["a", "b", "c", "d"]) is None
    assert class_weights([1, 2, 3, 4], counts, ["a", "b", "c", "d"]).tolist() == [1, 2, 3, 4]
    with pytest.raises(UserError, match="has 3 weights but the data has 4 classes"):
        class_weights([1, 2, 3], counts, ["a", "b", "c", "d"])
    with pytest.raises(UserError, match="no images of class.*c"):
        class_weights("balanced", [3, 1, 0, 2], ["a", "b", "c", "d"])


@pytest.mark.parametrize("smoothing, soft", [(0.0, False), (0.1, False), (0.1, True)])
def test_weighted_cross_entropy_semantics(smoothing, soft):
    """What train.class_weights computes, in float64 by hand: the mean over the N images of w[y_i] x the image's
    smoothed cross-entropy (soft targets: the target's mean weight sum_c w_c p_c x its cross-entropy). Not torch's
    weight=, which weights smoothing's uniform term per class and so moves each image's optimum towards the heavy
    classes; not torch's weighted mean (divided by sum w[y]): DDP would average per-process denominators."""
    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(16, 4, generator=gen), torch.randint(4, (16,), generator=gen)
    weights = torch.tensor([0.5, 2.0, 3.0, 10.0])
    cfg = TrainConfig(label_smoothing=smoothing, class_weights=weights.tolist())
    loss_fn = build_loss(cfg, mixing=soft, class_counts=[4, 4, 4, 4], class_names=list("abcd"))
    log_q, w = torch.log_softmax(logits.double(), 1), weights.double()
    if soft:  # mixed targets arrive with smoothing folded in; the loss smooths nothing itself
        targets = torch.softmax(torch.randn(16, 4, generator=gen), 1)
        expected = ((targets.double() @ w) * -(targets.double() * log_q).sum(1)).mean()
        actual = loss_fn(logits, targets)
    else:
        target = torch.nn.functional.one_hot(labels, 4).double() * (1 - smoothing) + smoothing / 4
        expected = (w[labels] * -(target * log_q).sum(1)).mean()
        actual = loss_fn(logits, labels)
    assert torch.allclose(actual.double(), expected, rtol=1e-6)


def test_effective_number_weights_are_cui_et_als():
    """(1 - beta) / (1 - beta^n_c), scaled to sum to C (Cui et al. 2019, eq. 5 and their normalisation), in
    float64; beta = 0 weights nothing, beta towards 1 approaches balanced's ratios."""
    counts, names = [500, 50, 5, 1], list("abcd")
    for beta in (0.9, 0.999, 0.9999):
        n = np.array(counts, dtype=np.float64)
        inverse = (1 - beta) / (1 - beta ** n)
        expected = inverse / inverse.sum() * 4
        assert np.allclose(class_weights("effective", counts, names, beta).numpy(), expected, rtol=1e-6)
    assert class_weights("effective", counts, names, 0.0).tolist() == [1.0] * 4
    near_one = class_weights("effective", counts, names, 1 - 1e-9)
    assert math.isclose(near_one[3] / near_one[0], 500, rel_tol=1e-3)
    with pytest.raises(UserError, match="train.class_weights=effective: the training set has no images of class"):
        class_weights("effective", [3, 0, 1, 1], names)


@pytest.mark.parametrize("smoothing, soft", [(0.1, False), (0.0, True)])
def test_logit_adjusted_loss_is_menon_et_als(smoothing, soft):
    """train.logit_adjustment=tau: cross-entropy of logits + tau x log(prior), the prior from the global class
    counts (Menon et al. 2021, eq. 10), with label smoothing or soft (mixed) targets alike."""
    gen = torch.Generator().manual_seed(1)
    logits, labels = torch.randn(16, 4, generator=gen), torch.randint(4, (16,), generator=gen)
    targets = torch.softmax(torch.randn(16, 4, generator=gen), 1) if soft else labels
    counts, tau = [700, 200, 90, 10], 1.5
    prior = torch.tensor(counts, dtype=torch.float64) / sum(counts)
    loss_fn = build_loss(TrainConfig(label_smoothing=smoothing, logit_adjustment=tau), mixing=soft,
                         class_counts=counts, class_names=list("abcd"))
    expected = torch.nn.functional.cross_entropy(logits.double() + tau * prior.log(), targets.double() if soft
                                                 else targets, label_smoothing=smoothing)
    before = logits.clone()
    assert torch.allclose(loss_fn(logits, targets).double(), expected, rtol=1e-6)
    assert torch.equal(logits, before)  # the prior is never added in place: train_top1 scores the raw logits
    with pytest.raises(UserError, match="train.logit_adjustment: the training set has no images of class"):
        build_loss(TrainConfig(logit_adjustment=1.0), False, [3, 0, 1, 1], list("abcd"))


def test_deferred_class_weights_follow_the_epoch():
    """train.class_weights_from_epoch=2 (DRW): plain cross-entropy in epochs 0-1, weighted from epoch 2 on, decided
    by the epoch alone (set again after a resume; the trained proof is the balanced runs' mid-epoch resume)."""
    from engine.losses import set_loss_epoch

    gen = torch.Generator().manual_seed(2)
    logits, labels = torch.randn(16, 4, generator=gen), torch.randint(4, (16,), generator=gen)
    cfg = TrainConfig(class_weights=[0.5, 2.0, 3.0, 10.0], class_weights_from_epoch=2)
    loss_fn = build_loss(cfg, False, [4] * 4, list("abcd"))
    weighted = build_loss(TrainConfig(class_weights=cfg.class_weights), False, [4] * 4, list("abcd"))
    plain = torch.nn.functional.cross_entropy(logits, labels)
    assert torch.allclose(loss_fn(logits, labels), plain)  # built for epoch 0
    for epoch, expected in ((1, plain), (2, weighted(logits, labels)), (5, weighted(logits, labels)), (0, plain)):
        set_loss_epoch(loss_fn, epoch)
        assert torch.allclose(loss_fn(logits, labels), expected), epoch


def test_balanced_weights_are_capped_at_class_weights_max_and_say_so():
    """At 142:1 scikit-learn's balanced weights reach 35.7 (its loss spiked for epochs at lr 0.1; docs/benchmarks.md
    12b): train.class_weights_max (default 10) caps them, the start-up line names the capped classes with the weights
    they would have had, and 0 keeps scikit-learn's."""
    from sklearn.utils.class_weight import compute_class_weight

    from engine.losses import capped_note

    long_tail, names = [142, 88, 52, 31, 19, 11, 7, 4, 2, 1], [str(c) for c in range(10)]
    labels = np.repeat(np.arange(10), long_tail)
    sklearn = torch.tensor(compute_class_weight("balanced", classes=np.arange(10), y=labels), dtype=torch.float32)
    capped = build_loss(TrainConfig(class_weights="balanced"), False, long_tail, names).weight
    assert torch.allclose(capped, sklearn.clamp(max=10.0)) and capped.max() == 10.0 and sklearn[9] > 35
    assert torch.allclose(build_loss(TrainConfig(class_weights="balanced", class_weights_max=0), False, long_tail,
                                     names).weight, sklearn)
    note = capped_note(TrainConfig(class_weights="balanced"), long_tail, names)
    assert note.startswith("train.class_weights=balanced: 2 class(es) weighted 10 (train.class_weights_max) instead "
                           "of scikit-learn's 8 17.9, 9 35.7; train.class_weights_max=0 keeps them"), note
    twenty = [142, 105, 75, 54, 39, 28, 20, 14, 10, 7]  # the 20:1 cut: the largest weight 7.1, nothing capped
    assert capped_note(TrainConfig(class_weights="balanced"), twenty, names) is None
    assert capped_note(TrainConfig(class_weights="balanced", class_weights_max=0), long_tail, names) is None


def test_heavy_class_weights_are_warned_of():
    """The 142:1 cut's uncapped balanced weights (the rarest 35.7, 56% of a batch of 64) are warned of, the 20:1
    cut's (7.1, 11%), capped, deferred or effective ones are not."""
    from engine.losses import heavy_weight_warning

    long_tail, names = [142, 88, 52, 31, 19, 11, 7, 4, 2, 1], [str(c) for c in range(10)]
    uncapped = TrainConfig(class_weights="balanced", class_weights_max=0)
    warning = heavy_weight_warning(build_loss(uncapped, False, long_tail, names), names, 64)
    assert "class 9 a weight of 35.7: one of its images takes 56% of a global batch of 64" in warning
    twenty = [142, 105, 75, 54, 39, 28, 20, 14, 10, 7]
    for cfg, counts in ((TrainConfig(class_weights="balanced"), twenty), (TrainConfig(class_weights="balanced"), long_tail),
                        (TrainConfig(class_weights="balanced", class_weights_from_epoch=5), long_tail),
                        (TrainConfig(class_weights="effective"), long_tail), (TrainConfig(), long_tail)):
        assert heavy_weight_warning(build_loss(cfg, False, counts, names), names, 64) is None


def test_class_metrics_are_scikit_learns():
    """A class absent from y_true (only predicted), one never predicted, one in neither: sklearn's definitions."""
    from sklearn.metrics import balanced_accuracy_score, f1_score, recall_score

    rng = np.random.default_rng(0)
    y_true = rng.choice([0, 1, 2, 4], 300, p=[0.7, 0.2, 0.08, 0.02])
    y_pred = np.where(rng.random(300) < 0.6, y_true, rng.choice([0, 1, 3], 300))
    y_pred[y_pred == 4] = 0  # class 4 is never predicted, class 3 never true, class 5 neither
    confusion = torch.from_numpy(np.bincount(y_true * 6 + y_pred, minlength=36).reshape(6, 6))
    counts = torch.zeros((3, 6), dtype=torch.int64)  # as evaluation counts them, batch by batch, on the device
    for part in np.array_split(np.arange(300), 7):
        add_class_counts(counts, torch.from_numpy(y_true[part]), torch.from_numpy(y_pred[part]))
    assert torch.equal(counts, confusion_counts(confusion))
    names = ["chat-noir_猫", "dog/puppy", "dog puppy", "never true", "v1.0", "neither"]  # "/" and " " collide
    metrics = class_metrics(counts, names)
    with pytest.warns(UserWarning):  # sklearn warns that class 3 is predicted but never true
        assert math.isclose(metrics["val_balanced_acc"], 100 * balanced_accuracy_score(y_true, y_pred), rel_tol=1e-12)
    assert math.isclose(metrics["val_macro_f1"], 100 * f1_score(y_true, y_pred, average="macro"), rel_tol=1e-12)
    recalls = recall_score(y_true, y_pred, labels=[0, 1, 2, 4], average=None)
    recall_keys = ["val_recall/chat-noir_猫", "val_recall/dog_puppy", "val_recall/dog_puppy_2", "val_recall/v1_0"]
    assert [metrics[key] for key in recall_keys] == pytest.approx(100 * recalls, rel=1e-12)
    assert [k for k in metrics if k.startswith("val_recall")] == recall_keys  # no true images (3, 5): no recall
    many = PER_CLASS_RECALL_MAX + 1
    identity = confusion_counts(torch.eye(many, dtype=torch.int64))
    assert not any(k.startswith("val_recall") for k in class_metrics(identity, [str(c) for c in range(many)]))


def test_class_report_is_scikit_learns():
    """Per-class precision, recall, F1 and support and their macro and weighted means are classification_report's
    on the same predictions: a class only predicted (3), one never predicted (4), one in neither (5). Undefined
    per-class values are None (sklearn's zero_division=nan); the means count them as 0 (sklearn's default)."""
    from sklearn.exceptions import UndefinedMetricWarning
    from sklearn.metrics import precision_recall_fscore_support

    rng = np.random.default_rng(1)
    y_true = rng.choice([0, 1, 2, 4], 300, p=[0.7, 0.2, 0.08, 0.02])
    y_pred = np.where(rng.random(300) < 0.6, y_true, rng.choice([0, 1, 3], 300))
    y_pred[y_pred == 4] = 0
    counts = torch.zeros((3, 6), dtype=torch.int64)
    add_class_counts(counts, torch.from_numpy(y_true), torch.from_numpy(y_pred))
    per_class, means = class_report(counts.numpy(), list("abcdef"))
    expected = precision_recall_fscore_support(y_true, y_pred, labels=range(6), zero_division=np.nan)
    for key, values in zip(("precision", "recall", "f1"), expected[:3]):
        found = [np.nan if c[key] is None else c[key] for c in per_class]  # None exactly where sklearn has nan
        assert found == pytest.approx(100 * values, rel=1e-12, nan_ok=True), key
    assert [c["support"] for c in per_class] == expected[3].tolist() == [213, 59, 24, 0, 4, 0]
    assert per_class[4]["precision"] is None and per_class[4]["f1"] == 0.0  # true but never predicted
    for average in ("macro", "weighted"):
        with pytest.warns(UndefinedMetricWarning):
            found = precision_recall_fscore_support(y_true, y_pred, average=average)
        for key, value in zip(("precision", "recall", "f1"), found[:3]):
            assert math.isclose(means[f"{average}_{key}"], 100 * value, rel_tol=1e-12), (average, key)
    assert means["macro_f1"] == class_metrics(counts, list("abcdef"))["val_macro_f1"]


def test_metric_names_are_safe_and_unique_in_class_order():
    """Only letters, digits, "_" and "-" survive; a taken name gets "_<class index>" until it is free, so a name
    that a suffix produced is not taken twice either."""
    names = ["a b", "a_b", "a_b_1", "x.y/z", "é,ü", ""]
    assert metric_names(names) == ["a_b", "a_b_1", "a_b_1_2", "x_y_z", "é_ü", "_"]


def refuse_large_allocations(limit: int):
    """A dispatch mode that fails a factory op (zeros, empty, full) asked for more than `limit` elements, before it
    allocates: a C x C matrix at 21,841 classes would take 3.8 GB here."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Refuse(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            size = args[1] if name.startswith("new_") else args[0] if name in ("zeros", "empty", "full") else None
            if isinstance(size, (list, tuple)):
                assert math.prod(size) <= limit, f"{name} of {math.prod(size):,} elements"
            return func(*args, **(kwargs or {}))

    return Refuse()


def test_evaluation_at_21841_classes_allocates_no_class_by_class_matrix():
    """ImageNet-21k's class count: the per-class metrics come from 3 x C counts, never a C x C tensor on the device
    (477M int64, 3.8 GB, ~11 GB transient with its float64 copies, and a 3.8 GB all-reduce per validation)."""
    from core.dist import DistInfo
    from data.transforms import DeviceNormalize
    from engine.evaluation import evaluate
    from engine.precision import Precision

    classes, cpu = 21_841, torch.device("cpu")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, classes))
    generator = torch.Generator().manual_seed(0)
    loader = Batches([(torch.randint(0, 256, (4, 3, 4, 4), dtype=torch.uint8, generator=generator),
                       torch.randint(0, classes, (4,), generator=generator)) for _ in range(2)], classes)
    with refuse_large_allocations(limit=10 * classes):
        metrics = evaluate(model, loader, Precision("cpu", None), DistInfo(0, 1, 0, 1, cpu),
                           DeviceNormalize([0.5] * 3, [0.5] * 3, cpu, False))
    assert metrics["val_count"] == 8 and 0 <= metrics["val_balanced_acc"] <= 100


def test_best_metric_direction_and_ema_column():
    cfg = load_config("configs/digits.yaml", ["train.best_metric=val_loss", "model.ema_decay=0.9"])
    assert best_metric(cfg) == "ema_val_loss"
    state = TrainState()
    assert [state.update_best(v, lower_is_better=True) for v in (2.0, 2.0, 1.5, 1.7, float("nan"))] == \
        [True, False, True, False, False]
    assert (state.best_value, state.best_epoch) == (1.5, 0)
    state = TrainState()
    assert [state.update_best(v) for v in (50.0, 50.0, 60.0)] == [True, False, True]
    state.finish_epoch()  # a new best since the last counted validation (at any evaluation) resets the count
    assert state.validations_without_best == 0 and state.update_best(55.0) is False
    state.finish_epoch()
    assert state.validations_without_best == 1
    state.count_validation()  # train.val_every_steps: each validation inside an epoch counts as well
    assert state.validations_without_best == 2


@pytest.mark.parametrize("override, message", [
    ("train.class_weights=[1,-2]", "'train.class_weights' must be one weight >= 0 per class"),
    ("train.class_weights=heavy", "'train.class_weights' is 'heavy'; use none, balanced, effective or a list"),
    ("train.class_weights_beta=1", "'train.class_weights_beta' must be in [0, 1)"),
    ("train.class_weights_from_epoch=3", "train.class_weights_from_epoch defers class weights, and "
                                         "train.class_weights is none"),
    ("train.class_weights=balanced train.class_weights_from_epoch=1 train.epochs=1",  # never weighted (issue 51)
     "train.class_weights_from_epoch=1 starts the class weights after the last epoch (train.epochs=1"),
    ("train.logit_adjustment=-1", "'train.logit_adjustment' must be >= 0"),
    ("train.logit_adjustment=1 train.loss=bce", "train.logit_adjustment applies to softmax cross-entropy"),
    ("train.logit_adjustment=1 data.sampler=class_balanced", "data.sampler=class_balanced already draws every"),
    ("train.best_metric=val_map", "train.best_metric=val_map needs multi-label data"),
    ("train.best_metric=val_f1", "'train.best_metric' is 'val_f1'; choose one of val_top1, val_balanced_acc"),
    ("train.early_stop_patience=-1", "'train.early_stop_patience' must be >= 0"),
])
def test_bad_imbalance_settings_are_one_line(override, message, tmp_path, capsys):
    assert report_errors(train.main, [*TINY, *override.split(), f"output_dir={tmp_path}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err.strip().splitlines()[-1], err


@pytest.fixture(scope="module")
def empty_class(tmp_path_factory) -> Path:
    """Training images of a and b, and a class folder c with none."""
    root = tmp_path_factory.mktemp("empty_class")
    make_image_folder(root, {"train": {"a": 8, "b": 8}, "val": {"a": 2, "b": 2}}, size=20)
    (root / "train/c").mkdir()
    return root


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("override, message", [
    ("data.sampler=class_balanced", "data.sampler=class_balanced: the training set has no images of class(es) c;"),
    ("train.class_weights=balanced", "train.class_weights=balanced: the training set has no images of class(es) c,"),
    ("train.class_weights=[1,2]", "train.class_weights has 2 weights but the data has 3 classes (a, b, c)"),
])
def test_class_settings_that_do_not_fit_the_data_are_one_line(override, message, workers, empty_class, tmp_path,
                                                              capsys):
    args = [*TINY, "data.name=imagefolder", f"data.root={empty_class}", "train.batch_size=4",
            f"data.num_workers={workers}", override, f"output_dir={tmp_path / 'run'}"]
    extra = ["--dry-run"] if workers == 0 else []  # the dry run makes the run's checks; a run writes nothing
    assert report_errors(train.main, [*args, *extra]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err.strip().splitlines()[-1], err
    assert not (tmp_path / "run").exists()


def test_evaluate_writes_the_class_metrics_of_its_predictions(tiny_run, tmp_path):
    """eval.json's balanced accuracy and macro-F1 are scikit-learn's on predictions.csv, and the training run's
    last evaluation of the same weights wrote the same values to metrics.jsonl."""
    import csv

    from sklearn.metrics import balanced_accuracy_score, f1_score

    assert report_errors(evaluate.main, [str(tiny_run / "last.pth"), "--output-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    with open(tmp_path / "predictions.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    y_true, y_pred = [int(r["label"]) for r in rows], [int(r["pred"]) for r in rows]
    assert math.isclose(result["balanced_acc"], 100 * balanced_accuracy_score(y_true, y_pred), rel_tol=1e-12)
    assert math.isclose(result["macro_f1"], 100 * f1_score(y_true, y_pred, average="macro"), rel_tol=1e-12)
    row = read_jsonl(tiny_run / "metrics.jsonl")[-1]
    assert (row["val_balanced_acc"], row["val_macro_f1"]) == (result["balanced_acc"], result["macro_f1"])
    names = metric_names([c["class"] for c in result["per_class"]])
    assert [row.get(f"val_recall/{name}") for name in names] == [c["top1"] for c in result["per_class"]]


# ---- trained runs (slow): the sampler under DDP and across a resume, early stopping across a resume ----

# test_correctness's dummy set and model without BatchNorm at 3 classes (50 images: 17, 17, 16), so balanced
# class weights differ from 1; 2 epochs of 4 steps with a global batch of 12. The weights apply from epoch 1
# (DRW), so the run resumed in epoch 1 must switch them on as the uninterrupted run did.
BALANCED = ("data.dummy_num_classes=3", "data.sampler=class_balanced", "train.class_weights=balanced",
            "train.class_weights_from_epoch=1")


@pytest.fixture(scope="module")
def balanced_runs(tmp_path_factory) -> dict[str, Path]:
    from tests.helpers import COMMON, NO_BN_MODEL

    root = tmp_path_factory.mktemp("balanced")
    one = (*COMMON, NO_BN_MODEL, *BALANCED, "train.batch_size=12")
    train_here(*one, f"output_dir={root / 'one'}")
    run_on_ranks("train.py", *COMMON, NO_BN_MODEL, *BALANCED, "train.batch_size=6", f"output_dir={root / 'two'}",
                 nproc=2)
    train_here(*one, f"output_dir={root / 'resumed'}", "train.max_steps=6")  # stops mid-epoch 1
    assert load_checkpoint(root / "resumed/last.pth")["epoch_step"] == 2
    partial = read_jsonl(root / "resumed/metrics.jsonl")[-1]["val_top1"]  # the evaluation at the stop
    train_here(*one, f"output_dir={root / 'resumed'}")
    return {"one": root / "one", "two": root / "two", "resumed": root / "resumed", "partial_top1": partial}


@pytest.mark.slow
def test_class_balanced_sampler_one_process_equals_two_ranks(balanced_runs):
    """The same global batches (and weighted loss) on 1 and 2 processes: the same weights within fp32 rounding."""
    from tests.compare import assert_same_model

    assert_same_model(balanced_runs["one"], balanced_runs["two"])
    one, two = read_jsonl(balanced_runs["one"] / "metrics.jsonl"), read_jsonl(balanced_runs["two"] / "metrics.jsonl")
    assert [r["train_top1"] for r in one] == [r["train_top1"] for r in two]  # the same images, classified alike


@pytest.mark.slow
def test_class_balanced_sampler_resumes_mid_epoch_bitwise(balanced_runs):
    """Stopped after step 2 of epoch 1 and resumed: the checkpoint and metrics equal the uninterrupted run's."""
    expected, resumed = load_checkpoint(balanced_runs["one"] / "last.pth"), load_checkpoint(
        balanced_runs["resumed"] / "last.pth")
    # The evaluation at the stop (epoch 1) counts as the epoch's improvement, as in the straight run.
    allow_best_of_the_stop(expected, resumed, balanced_runs["partial_top1"], 1)
    assert_same(expected, resumed)
    assert rows_without_timing(balanced_runs["resumed"]) == rows_without_timing(balanced_runs["one"])


@pytest.mark.slow
def test_long_tail_losses_one_process_equals_two_ranks(tmp_path):
    """Logit adjustment (the prior from the global counts 30:14:6) with effective-number weights deferred to
    epoch 1, on 1 process (batch 12) and 2 gloo ranks (batch 6 each): the same weights within fp32 rounding; the
    weights come on at epoch 1 (a run deferring them to epoch 2 trains epoch 0 alike, epoch 1 not)."""
    from tests.compare import assert_same_model
    from tests.helpers import COMMON, NO_BN_MODEL

    root = make_image_folder(tmp_path / "data", {"train": {"a": 30, "b": 14, "c": 6}, "val": {"a": 4, "b": 4, "c": 3}},
                             size=16)
    keys = (*COMMON, NO_BN_MODEL, "data.name=imagefolder", f"data.root={root}", "train.logit_adjustment=1",
            "train.class_weights=effective", "train.class_weights_beta=0.9", "train.class_weights_from_epoch=1",
            "train.epochs=3")  # 3: a deferral to epoch 2 must lie inside the run (train.epochs refuses it otherwise)
    train_here(*keys, "train.batch_size=12", f"output_dir={tmp_path / 'one'}")
    run_on_ranks("train.py", *keys, "train.batch_size=6", f"output_dir={tmp_path / 'two'}", nproc=2)
    assert_same_model(tmp_path / "one", tmp_path / "two", steps=3 * (50 // 12))
    train_here(*keys, "train.batch_size=12", "train.class_weights_from_epoch=2", f"output_dir={tmp_path / 'later'}")
    weighted, later = read_jsonl(tmp_path / "one/metrics.jsonl"), read_jsonl(tmp_path / "later/metrics.jsonl")
    assert weighted[0]["train_loss"] == later[0]["train_loss"]  # epoch 0 unweighted in both
    assert weighted[1]["train_loss"] != later[1]["train_loss"]  # the weights came on at epoch 1


# lr 0 on a model without BatchNorm: val_loss is the same every epoch, so epoch 0 is the best one and every later
# epoch is one without improvement; patience 2 stops the run after epoch 2 of 6. 16 images: 2 steps an epoch.
STOPS = [*TINY, "model.name=test_efficientnet_gn", "data.dummy_train_size=16", "optim.lr=0", "train.epochs=6",
         "train.best_metric=val_loss", "train.early_stop_patience=2"]


@pytest.mark.slow
def test_early_stopping_stops_at_the_same_epoch_when_resumed(tmp_path, capsys):
    """A run stopped after epoch 1 (one epoch without improvement, kept in last.pth) and resumed stops before
    epoch 3 as the uninterrupted run does; without the kept count it would run epoch 3 too."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_here(*STOPS, f"output_dir={straight}")
    assert "stopping early after epoch 2 (global step 6): val_loss has not improved for 2 validations" in capsys.readouterr().err
    train_here(*STOPS, f"output_dir={resumed}", "train.max_steps=4")  # the end of epoch 1
    assert load_checkpoint(resumed / "last.pth")["validations_without_best"] == 1
    train_here(*STOPS, f"output_dir={resumed}")
    for run in (straight, resumed):
        ckpt = load_checkpoint(run / "last.pth")
        assert (ckpt["epoch"], ckpt["validations_without_best"]) == (3, 2)
        assert [r["epoch"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1, 2]
        assert load_checkpoint(run / "best.pth")["epoch"] == 1  # chosen after epoch 0
    capsys.readouterr()
    train_here(*STOPS, f"output_dir={straight}")  # a finished, stopped run stays stopped
    assert "stopping early after epoch 2" in capsys.readouterr().err
    assert len(read_jsonl(straight / "metrics.jsonl")) == 3


@pytest.mark.slow
def test_early_stopping_counts_validations_inside_epochs(tmp_path, capsys):
    """train.val_every_steps=1 on 2 steps an epoch: validations at step 1, step 2 (the epoch's) and step 3; none
    after the first improves, so patience 2 stops the run inside epoch 1, right after step 3's validation."""
    train_here(*STOPS, "train.val_every_steps=1", f"output_dir={tmp_path}")
    assert "stopping early after step 1 of epoch 1 (global step 3): val_loss has not improved for 2 validations" in capsys.readouterr().err
    assert [(r["epoch"], r["step"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [(0, 1), (0, 2), (1, 3)]
    ckpt = load_checkpoint(tmp_path / "last.pth")
    assert (ckpt["global_step"], ckpt["validations_without_best"]) == (3, 2)


def test_validations_inside_epochs_count_for_early_stopping_and_stop_the_run_at_once():
    """The rules of engine/hooks.ValidateEvery, in-process on a model that does not learn (the same val_loss every
    time): train.val_every_steps=1 on 3 steps an epoch, train.early_stop_patience=3. Steps 1 and 2 are validated
    inside epoch 0 and counted (0, then 1 without improvement); step 3 ends the epoch, whose own validation covers it
    (no step validated twice); step 4's validation is the third without improvement and stops the run right there."""
    import time

    from core.config import DataConfig, LoggingConfig
    from core.dist import DistInfo
    from data.transforms import DeviceNormalize
    from engine.hooks import CloseEpoch, Hook, StopRules, StopRun, ValidateEvery
    from engine.precision import Precision
    from engine.tracking import WandbTracker
    from engine.validation import Validation

    class Validated(Hook):
        """Each validation's (global step, inside the epoch), as the hooks after it see them."""

        def __init__(self) -> None:
            self.seen: list[tuple[int, bool]] = []

        def after_epoch(self, state: TrainState, end) -> None:
            self.seen.append((state.global_step, end.mid_epoch))

    cpu = torch.device("cpu")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 3))
    generator = torch.Generator().manual_seed(0)
    loader = Batches([(torch.randint(0, 256, (4, 3, 4, 4), dtype=torch.uint8, generator=generator),
                       torch.tensor([0, 1, 2, 0]))], 3)
    validation = Validation(model, None, loader, Precision("cpu", None), DistInfo(0, 1, 0, 1, cpu),
                            DeviceNormalize([0.5] * 3, [0.5] * 3, cpu, False), DataConfig(),
                            torch.optim.SGD(model.parameters(), lr=0.0), "val_loss", gather_outcomes=False)
    validated = Validated()
    after = [CloseEpoch(), validated]  # the run's hooks that see a validation, as assembly/run.hooks_of orders them
    stop_rules = StopRules(TrainConfig(early_stop_patience=3, best_metric="val_loss"), "val_loss",
                           WandbTracker(LoggingConfig(), True))
    every = ValidateEvery(1, 3, validation, after, stop_rules, model, False, time.monotonic)
    state = TrainState()

    def step() -> None:  # as engine/trainer.py ends each optimizer step
        state.step_done(0.0)
        every.after_step(state)

    state.start_epoch(cpu, True)
    for _ in range(3):
        step()
    assert validated.seen == [(1, True), (2, True)] and state.validations_without_best == 1
    end = validation(state, {"train_loss": 0.0}, finished=True)  # the finished epoch's own, as assembly/fit.py
    for hook in after:
        hook.after_epoch(state, end)
    assert validated.seen[-1] == (3, False) and state.validations_without_best == 2
    stop_rules.before_epoch(state)  # two without improvement: epoch 1 starts
    state.start_epoch(cpu, True)
    with pytest.raises(StopRun):
        step()
    assert validated.seen[-1] == (4, True) and state.validations_without_best == 3


def test_multi_label_data_takes_val_map_and_refuses_single_label_settings():
    """data.multi_label (issue 26 items 1-2): best.pth follows val_map unless told otherwise; the single-label
    metrics and the one-class-per-image sampler are refused in one line."""
    multi = ["data.name=listfile", "data.multi_label=true", "train.loss=bce"]
    assert best_metric(load_config("configs/digits.yaml", multi)) == "val_map"
    assert best_metric(load_config("configs/digits.yaml", [*multi, "train.best_metric=val_loss"])) == "val_loss"
    for override, message in (("train.best_metric=val_macro_f1", "is a single-label metric"),
                              ("data.sampler=class_balanced", "multi-label images have several")):
        with pytest.raises(UserError, match=message):
            load_config("configs/digits.yaml", [*multi, override])


def test_the_start_up_block_shows_the_classes_in_order_the_sampler_weights_and_augmentation(caplog):
    """Issue 61: rank 0 says the classes in their index order (the order a train.class_weights list follows) with
    their training images, the sampler, the loss's class weights and whether an albumentations file replaces the
    preset; many classes are cut to 20 with the fewest and the most."""
    from assembly.parts import augmentation_said, data_lines, run_loss
    from core.config_load import load_config
    from core.dist import DistInfo
    from data.loader import DataBundle

    names, counts = ["cat", "dog", "fox", "owl", "yak"], [200, 120, 60, 25, 20]
    data = DataBundle(train=None, val=None, num_classes=5, class_names=names, class_counts=counts)
    cfg = load_config(None, ["data.sampler=class_balanced", "train.class_weights=[1, 1, 2, 4, 4]",
                             "data.train_transform=aug.yaml"])
    info = DistInfo(0, 1, 0, 1, torch.device("cpu"))
    with caplog.at_level("INFO", logger="assembly.parts"):
        loss = run_loss(cfg, data, info)
    weights = ", ".join(f"{name} {float(w):.3g}" for name, w in zip(names, loss.weight))
    assert [r.getMessage() for r in caplog.records][:3] == data_lines(cfg, data, loss) == [
        "classes (5, in index order, with their training images): cat 200, dog 120, fox 60, owl 25, yak 20",
        "sampling: data.sampler=class_balanced: each class drawn equally often (with replacement); loss: class "
        f"weights (train.class_weights=[1.0, 1.0, 2.0, 4.0, 4.0]): {weights}",
        "augmentation: the albumentations file data.train_transform=aug.yaml, in place of the preset's data.scale, "
        "data.ratio, data.hflip, data.color_jitter"]
    many = DataBundle(None, None, 25, [f"c{i:02d}" for i in range(25)], [100 - i for i in range(25)])
    lines = data_lines(load_config(None), many, run_loss(load_config(None), many, DistInfo(1, 2, 1, 2, info.device)))
    assert lines[0].endswith("c19 81, ... and 5 more (fewest: c24 76, most: c00 100)")
    assert lines[1] == "sampling: data.sampler=uniform: each image once an epoch; loss: no class weights"
    assert lines[2].startswith("augmentation: the preset: random resized crop scale [0.08, 1.0] ratio [0.75, 1.33")
    strong = load_config("configs/digits_fast.yaml").data  # issue 64: RandAugment, erasing and mixing were unsaid
    assert augmentation_said(strong) == ("the preset: random resized crop scale [0.5, 1.0] ratio [0.8, 1.25], hflip 0; "
                                         "data.auto_augment rand-m9-mstd0.5; data.random_erase 0.25; "
                                         "data.mixup_alpha 0.2; data.cutmix_alpha 1")
    assert augmentation_said(load_config("configs/digits_fast.yaml", ["data.augment=false"]).data) == (
        "none (data.augment=false: the eval preset's resize and centre crop); data.mixup_alpha 0.2; "
        "data.cutmix_alpha 1")
