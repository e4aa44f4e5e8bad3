"""Multi-label data (data.multi_label): list files with `a|b` labels, BCE on multi-hot targets, mixing of
multi-hot targets, mAP / F1 equal to scikit-learn's, and 1 vs 2 processes of evaluate.py giving the same files."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, f1_score
from timm.data.mixup import one_hot
from timm.loss import BinaryCrossEntropy

import evaluate
from core.cli import report_errors
from core.config import DataConfig, TrainConfig
from core.errors import UserError
from data.loader import build_datasets
from data.mixing import BatchMix, KIND, LAM, MIXUP, PARTNER, smooth_multi_hot
from engine.evaluation import best_thresholds, multilabel_metrics
from engine.losses import build_loss
from tests.helpers import (TINY, check_one_line, last_error, read_jsonl, run_on_ranks, run_ranks, run_script,
                           script_env, train_here)
from tests.wandb_reader import find_runs, read_run

CLASSES = ("cat", "dog", "owl")
ML = ["data.name=listfile", "data.multi_label=true", "train.loss=bce", "train.batch_size=4"]


def write_list(root: Path, split: str, rows: list[tuple[str, str]], header: str = "path,labels") -> None:
    """<root>/<split>.csv naming <root>/img/<split>/<i>.png (written: small noisy PNGs) with the given label cells."""
    (root / "img" / split).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(len(rows))
    for name, _ in rows:
        cv2.imwrite(str(root / name), rng.integers(0, 256, (20, 20, 3), dtype=np.uint8))
    (root / f"{split}.csv").write_text("\n".join([header, *(f"{name},{cell}" for name, cell in rows)]) + "\n")


def label_cells(n: int, seed: int) -> list[str]:
    """n label cells over CLASSES: every subset, the empty one ("no tags") included."""
    rng = np.random.default_rng(seed)
    return ["|".join(c for c in CLASSES if rng.random() < 0.5) for _ in range(n)]


@pytest.fixture(scope="module")
def lists(tmp_path_factory) -> Path:
    """root/good: a multi-label list-file set (24 train, 11 val images, empty label sets among them); root/unknown:
    a val row naming a class train lacks; root/malformed: a train row of three fields."""
    root = tmp_path_factory.mktemp("ml")
    for name in ("good", "unknown", "malformed"):
        for split, n in (("train", 24), ("val", 11)):
            write_list(root / name, split, [(f"img/{split}/{i}.png", cell)
                                            for i, cell in enumerate(label_cells(n, n))])
    text = (root / "unknown/val.csv").read_text().splitlines()
    text[3] = text[3].split(",")[0] + ",cat|emu"
    (root / "unknown/val.csv").write_text("\n".join(text) + "\n")
    text = (root / "malformed/train.csv").read_text().splitlines()
    text[5] = text[5].split(",")[0] + ",cat,dog"
    (root / "malformed/train.csv").write_text("\n".join(text) + "\n")
    return root


def test_list_file_labels_become_multi_hot_rows_with_empty_sets_allowed(lists):
    train, val = build_datasets(DataConfig(name="listfile", root=str(lists / "good"), multi_label=True), seed=0)
    assert train.classes == list(CLASSES) and val.classes == list(CLASSES)
    cells = label_cells(24, 24)
    expected = np.array([[c in cell.split("|") for c in CLASSES] for cell in cells], np.float32)
    assert "" in cells  # an image with no labels is a row of zeros
    got = torch.stack([train[i][1] for i in range(len(train))])
    assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(expected))


def test_metrics_equal_scikit_learn_with_ties_and_a_class_without_positives():
    rng = np.random.default_rng(0)
    targets = (rng.random((300, 6)) < 0.3).astype(np.float32)
    targets[:, 4] = 0  # no positive image: no AP, left out of the macro mean
    probs = np.round(rng.random((300, 6)), 1).astype(np.float32)  # many tied scores
    found = multilabel_metrics(targets, probs, 0.5)
    keep = targets.sum(0) > 0
    assert found["map"] == pytest.approx(100 * average_precision_score(targets[:, keep], probs[:, keep]), abs=1e-9)
    assert found["map_micro"] == pytest.approx(100 * average_precision_score(targets, probs, average="micro"),
                                               abs=1e-9)
    assert found["per_class_ap"][4] is None
    assert found["f1"] == pytest.approx(100 * f1_score(targets, probs >= 0.5, average="micro"), abs=1e-9)
    assert found["f1_macro"] == pytest.approx(100 * f1_score(targets, probs >= 0.5, average="macro",
                                                             zero_division=0), abs=1e-9)
    chosen = best_thresholds(targets, probs)
    for c in np.flatnonzero(keep):  # no threshold among the scores gives a class a higher F1
        best = max(f1_score(targets[:, c], probs[:, c] >= t) for t in np.unique(probs[:, c]))
        assert f1_score(targets[:, c], probs[:, c] >= chosen[c]) == pytest.approx(best)


def test_multi_hot_smoothing_and_bce_are_timms():
    """On a one-label row, the multi-hot smoothing gives timm's smoothed one-hot, and the BCE timm's loss."""
    labels, classes, smoothing = torch.tensor([2, 0, 1]), 4, 0.1
    hot = torch.nn.functional.one_hot(labels, classes).float()
    timm_rows = one_hot(labels, classes, on_value=1 - smoothing + smoothing / classes, off_value=smoothing / classes)
    torch.testing.assert_close(smooth_multi_hot(hot, smoothing, torch.float32), timm_rows, rtol=0, atol=0)
    logits = torch.randn(3, classes)
    ours = build_loss(TrainConfig(loss="bce", label_smoothing=smoothing), mixing=False)(logits, hot)
    torch.testing.assert_close(ours, BinaryCrossEntropy(smoothing)(logits, labels))


def test_mixing_mixes_the_multi_hot_rows():
    labels = torch.tensor([[1, 0, 1], [0, 1, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.float32)
    mix = torch.zeros(4, 7)
    mix[:, PARTNER] = torch.tensor([1, 0, 3, 2])
    mix[:, KIND], mix[:, LAM] = MIXUP, torch.tensor([0.7, 0.7, 0.25, 0.25])
    _, targets = BatchMix(3, smoothing=0.0)(torch.zeros(4, 3, 2, 2), labels, mix)
    lam = mix[:, LAM, None]
    torch.testing.assert_close(targets, lam * labels + (1 - lam) * labels[[1, 0, 3, 2]])


@pytest.fixture(scope="module")
def trained(lists, tmp_path_factory) -> Path:
    """One tiny multi-label training with mixup and label smoothing (the multi-hot targets mixed in the loop)."""
    out = tmp_path_factory.mktemp("mlrun") / "run"
    run_script("train.py", *TINY, *ML, f"data.root={lists / 'good'}", "data.mixup_alpha=0.4",
               "train.label_smoothing=0.1", "model.ema_decay=0.9", f"output_dir={out}")
    return out


def evaluate_on_rank(rank: int, world: int, root: str) -> dict[str, float]:
    """The per-epoch multi-label evaluation of a seeded tiny model on this rank's block of the val set."""
    from core.config import ModelConfig
    from core.dist import DistInfo
    from data.loader import build_eval_loader, build_val_dataset
    from data.transforms import DeviceNormalize
    from engine.evaluation import evaluate_multilabel
    from engine.precision import resolve_precision
    from models.factory import create_model

    cfg = DataConfig(name="listfile", root=root, multi_label=True, img_size=16, num_workers=0)
    dataset = build_val_dataset(cfg, seed=0, classes=list(CLASSES))
    info = DistInfo(rank, world, rank, world, torch.device("cpu"))
    torch.manual_seed(0)
    model = create_model(ModelConfig(name="test_resnet"), len(CLASSES))
    normalize = DeviceNormalize(cfg.mean, cfg.std, info.device, False)
    return evaluate_multilabel(model, build_eval_loader(dataset, cfg, 4, info), resolve_precision("off", info.device),
                               info, normalize, 0.5)


@pytest.mark.slow
def test_epoch_evaluation_is_identical_on_1_and_2_ranks(lists, tmp_path):
    """The val_map/val_f1/val_loss train.py logs: probabilities gathered over a real 2-process gloo group."""
    one = run_ranks(evaluate_on_rank, 1, tmp_path, str(lists / "good"))
    two = run_ranks(evaluate_on_rank, 2, tmp_path, str(lists / "good"))
    assert one[0] == two[0] == two[1] and one[0]["val_count"] == 11 and one[0]["val_map"] > 0


def evaluate_run(checkpoint: Path, out: Path, nproc: int, *args: str, env: dict | None = None) -> list[str]:
    """evaluate.py with per-class thresholds on nproc processes; the texts of its three files."""
    run_on_ranks("evaluate.py", str(checkpoint), "--output-dir", str(out), "--batch-size", "4", "--tune-thresholds",
                 *args, nproc=nproc, env=env)
    return [(out / name).read_text() for name in ("eval.json", "predictions.csv", "per_class.csv")]


@pytest.fixture(scope="module")
def evaluated(trained, tmp_path_factory) -> Path:
    """evaluate.py's output folder for the trained run's best.pth (one process)."""
    out = tmp_path_factory.mktemp("mleval") / "eval"
    evaluate_run(trained / "best.pth", out, 1)
    return out


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_training_on_one_process_equals_two_ranks(lists, tmp_path):
    """Multi-hot targets mixed (mixup and cutmix) and smoothed under BCE: 1 process and 2 ranks train on the same
    global batches, so their weights agree within fp32 rounding, and so do their val mAPs."""
    from tests.compare import assert_same_model
    from tests.helpers import NO_BN_MODEL

    args = (*TINY, *ML, NO_BN_MODEL, f"data.root={lists / 'good'}", "data.mixup_alpha=0.4", "data.cutmix_alpha=1.0",
            "train.label_smoothing=0.1", "train.epochs=2")
    train_here(*args, "train.batch_size=8", f"output_dir={tmp_path / 'one'}")
    run_on_ranks("train.py", *args, "train.batch_size=4", f"output_dir={tmp_path / 'two'}", nproc=2)
    assert_same_model(tmp_path / "one", tmp_path / "two", steps=6)  # 24 images, global batch 8, 2 epochs
    one, two = (read_jsonl(tmp_path / run / "metrics.jsonl") for run in ("one", "two"))
    assert [r["val_map"] for r in one] == pytest.approx([r["val_map"] for r in two], abs=1e-3)


@pytest.mark.slow
def test_training_reports_map_and_evaluate_matches_sklearn_on_1_and_2_processes(trained, evaluated, tmp_path):
    row = read_jsonl(trained / "metrics.jsonl")[-1]
    assert "train_top1" not in row and "val_top1" not in row
    assert {"val_map", "val_map_micro", "val_f1", "val_loss", "ema_val_map"} <= set(row) and row["val_count"] == 11
    assert torch.load(trained / "best.pth", weights_only=True)["best_metric"] == "ema_val_map"
    one = [(evaluated / name).read_text() for name in ("eval.json", "predictions.csv", "per_class.csv")]
    wandb_dir = tmp_path / "wandb"
    wandb_dir.mkdir()  # the 2-process evaluation also goes to W&B (offline)
    assert evaluate_run(trained / "best.pth", tmp_path / "eval2", 2, "logging.wandb=true",
                        env=script_env(WANDB_DIR=str(wandb_dir))) == one
    result = json.loads(one[0])
    [path] = find_runs(wandb_dir)
    logged = read_run(path)
    assert logged.summary["eval/map"] == result["map"]
    assert logged.summary["eval/per_class"] == {c["class"]: c["ap"] for c in result["per_class"]}
    rows = read_csv(evaluated / "predictions.csv")
    targets = np.array([[str(c) in row["labels"].split() for c in range(3)] for row in rows], np.float64)
    probs = np.array([row["probs"].split() for row in rows], np.float64)
    keep = targets.sum(0) > 0
    assert result["map"] == pytest.approx(100 * average_precision_score(targets[:, keep], probs[:, keep]), abs=1e-9)
    assert result["map_micro"] == pytest.approx(100 * average_precision_score(targets, probs, average="micro"),
                                                abs=1e-9)
    # The epoch's val_map (gathered over ranks during training) is evaluate.py's, on the same weights.
    assert result["map"] == pytest.approx(row["val_map"], abs=1e-9)
    assert [entry["class"] for entry in result["per_class"]] == list(CLASSES)


BAD = {  # name: (arguments after TINY + ML, text the last line must contain)
    "unknown label in a row": (["data.root={root}/unknown"],
                               "{root}/unknown/val.csv line 4: label 'emu' is not one of the 3 training classes"),
    "malformed row": (["data.root={root}/malformed"], "{root}/malformed/train.csv line 6: expected two fields"),
    "an empty label cell without data.multi_label": (["data.root={root}/good", "data.multi_label=false",
                                                      "train.loss=ce"],
                                                     "is empty; an image without labels is a row of a multi-label "
                                                     "list: set data.multi_label=true"),
    "ImageFolder cannot hold label sets": (["data.root={root}/good", "data.name=imagefolder"],
                                           "data.multi_label=true needs data.name listfile, hf, wds"),
    "cross-entropy on multi-label data": (["data.root={root}/good", "train.loss=ce"],
                                          "data.multi_label=true trains one sigmoid per class: set train.loss=bce"),
}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name", BAD)
def test_bad_multi_label_input_is_one_line(name, workers, lists, tmp_path, capsys, monkeypatch):
    args, expected = BAD[name]
    check_one_line([*ML, f"data.num_workers={workers}", *args], expected, lists, tmp_path, capsys, monkeypatch)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # (the trained fixture)
def test_tta_on_a_multi_label_checkpoint_is_one_line(trained, tmp_path, capsys):
    code = report_errors(evaluate.main, [str(trained / "best.pth"), "--output-dir", str(tmp_path), "--tta-flip"])
    assert "is multi-label: --tta-flip and --tta-crops" in last_error(capsys, code)


def test_hugging_face_label_lists_are_the_list_files_labels(lists, tmp_path):
    """A Sequence(ClassLabel) column holding the list files' label sets gives the same multi-hot rows."""
    import datasets

    features = datasets.Features({"path": datasets.Value("string"),
                                  "labels": datasets.Sequence(datasets.ClassLabel(names=list(CLASSES)))})
    splits = {}
    for split, n in (("train", 24), ("val", 11)):
        sets = [[CLASSES.index(c) for c in cell.split("|") if c] for cell in label_cells(n, n)]
        paths = [str(lists / "good" / f"img/{split}/{i}.png") for i in range(n)]
        splits[split] = datasets.Dataset.from_dict({"path": paths, "labels": sets}, features=features)
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "hf"))
    hf = build_datasets(DataConfig(name="hf", root=str(tmp_path / "hf"), image_column="path", label_column="labels",
                                   multi_label=True), seed=0)
    listed = build_datasets(DataConfig(name="listfile", root=str(lists / "good"), multi_label=True), seed=0)
    for ours, theirs in zip(hf, listed):
        assert ours.classes == theirs.classes and np.array_equal(ours.labels, theirs.labels)
        assert torch.equal(ours[3][0], theirs[3][0])
    with pytest.raises(UserError, match="data.multi_label=false needs one label per row; set data.multi_label=true"):
        build_datasets(DataConfig(name="hf", root=str(tmp_path / "hf"), image_column="path", label_column="labels"),
                       seed=0)


@pytest.mark.slow
def test_predict_and_the_exported_folder_give_the_sigmoid_and_the_labels_above_threshold(trained, evaluated, lists,
                                                                                        tmp_path):
    """predict.py's probabilities are evaluate.py's; its labels are the classes at or above the per-class
    thresholds of eval.json; the exported model folder says multi-label and predicts the same."""
    reference = {Path(row["path"]).name: np.array(row["probs"].split(), np.float64)
                 for row in read_csv(evaluated / "predictions.csv")}
    thresholds = [entry["threshold"] for entry in json.loads((evaluated / "eval.json").read_text())["per_class"]]
    images = str(lists / "good/img/val")
    run_script("predict.py", str(trained / "best.pth"), images, "--output-dir", str(tmp_path / "ckpt"),
               "--thresholds", str(evaluated / "eval.json"))
    rows = read_csv(tmp_path / "ckpt/predictions.csv")
    assert len(rows) == 11
    assert list(json.loads((tmp_path / "ckpt/predictions.json").read_text())["thresholds"].values()) == \
        pytest.approx(thresholds)
    for row in rows:
        probs = np.array(row["probs"].split(), np.float64)
        np.testing.assert_allclose(probs, reference[Path(row["path"]).name], atol=2e-6)  # printed to 6 decimals
        labels = row["labels"].split("|") if row["labels"] else []
        for name, p, t in zip(CLASSES, probs, thresholds):
            if abs(p - t) > 1e-5:  # a threshold is some image's probability: equal ones are a rounding apart here
                assert (name in labels) == (p >= t), (row, thresholds)
    run_script("export.py", str(trained / "best.pth"), "--format", "safetensors", "--output", str(tmp_path / "model"))
    meta = json.loads((tmp_path / "model/config.json").read_text())
    assert meta["multi_label"] is True and meta["multi_label_threshold"] == 0.5
    run_script("predict.py", str(tmp_path / "model"), images, "--output-dir", str(tmp_path / "folder"),
               "--thresholds", str(evaluated / "eval.json"))
    assert read_csv(tmp_path / "folder/predictions.csv") == rows


def test_shards_made_from_a_multi_label_list_file_hold_its_labels(lists, tmp_path, capsys):
    from data.make_shards import run as make_shards

    assert make_shards([str(lists / "good"), str(tmp_path / "shards"), "--list", "--multi-label",
                        "--shard-size", "10"]) == 0
    index = json.loads((tmp_path / "shards/val.json").read_text())
    assert index["multi_label"] is True and index["shardlist"][0]["labels"][0] == \
        [CLASSES.index(c) for c in label_cells(11, 11)[0].split("|") if c]
    shards = build_datasets(DataConfig(name="wds", root=str(tmp_path / "shards"), multi_label=True), seed=0)
    listed = build_datasets(DataConfig(name="listfile", root=str(lists / "good"), multi_label=True), seed=0)
    for ours, theirs in zip(shards, listed):
        assert ours.classes == theirs.classes and np.array_equal(ours.labels, theirs.labels)
        for i in (0, len(ours) - 1):  # reading a sample checks its shard's .cls members against the index
            assert torch.equal(ours[i][0], theirs[i][0]) and torch.equal(ours[i][1], theirs[i][1])
    with pytest.raises(UserError, match="was made from a list file with --multi-label; set data.multi_label=true"):
        build_datasets(DataConfig(name="wds", root=str(tmp_path / "shards")), seed=0)
    assert make_shards([str(lists / "good"), str(tmp_path / "other"), "--multi-label"]) == 2
    assert "--multi-label converts list files" in capsys.readouterr().err


def test_single_label_list_with_separators_gets_a_hint(tmp_path, caplog):
    from data.listfile import ListFileDataset

    (tmp_path / "train.csv").write_text("path,label\na.png,cat|dog\nb.png,owl\n")
    ListFileDataset(tmp_path, "train", transform=None, seed=0)
    assert "set data.multi_label=true" in caplog.text


def multilabel_evaluation_on_ranks(rank: int, world: int) -> dict:
    """evaluate_multilabel of one tiny model on this rank's block of 10 images (5 classes; rank 0 has more), with the
    collectives it ran; one process evaluates all 10."""
    import types

    from core.dist import DistInfo
    from data.transforms import DeviceNormalize
    from engine.evaluation import evaluate_multilabel
    from engine.precision import Precision
    from tests.helpers import op_counter

    cpu, generator = torch.device("cpu"), torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 5))
    images = torch.randint(0, 256, (10, 3, 4, 4), dtype=torch.uint8, generator=generator)
    labels = (torch.rand(10, 5, generator=generator) < 0.4).float()
    blocks = [range(0, 6), range(6, 10)] if world == 2 else [range(10)]
    batches = [(images[list(block)], labels[list(block)]) for block in blocks[rank:rank + 1]]
    loader = type("Batches", (list,), {})(batches)
    loader.dataset = types.SimpleNamespace(labels=labels.numpy())
    with op_counter() as counter:
        metrics = evaluate_multilabel(model, loader, Precision("cpu", None), DistInfo(rank, world, rank, world, cpu),
                                      DeviceNormalize([0.5] * 3, [0.5] * 3, cpu, False), 0.5)
    return {"metrics": metrics, "ops": dict(counter.ops)}


@pytest.mark.slow
def test_multilabel_evaluation_gathers_tensors_to_rank_0_with_no_object_collective(tmp_path):
    """The probabilities of every image reach rank 0 as padded tensors (gather, not all_gather_object: pickled
    arrays sent to every rank, ~10 GB per rank per epoch at 10k classes x 125k images); rank 0's metrics reach the
    others as one float64 tensor; 2 ranks with uneven blocks give one process's numbers exactly."""
    single = multilabel_evaluation_on_ranks(0, 1)["metrics"]
    for found in run_ranks(multilabel_evaluation_on_ranks, 2, tmp_path):
        assert found["metrics"] == single
        assert found["ops"].get("allgather_", 0) == 0 and found["ops"]["gather_"] == 3, found["ops"]
