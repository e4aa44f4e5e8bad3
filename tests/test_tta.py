"""Evaluation at the test resolution (data.val_img_size / val_crop_pct) and test-time augmentation (--tta-flip,
--tta-crops 5) in evaluate.py and predict.py, on the session's tiny run; one slow test trains on the digits."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import evaluate
import predict
from core.cli import report_errors
from core.config import DataConfig, ModelConfig
from core.config_load import config_from_dict
from data.loader import build_datasets, build_val_dataset
from data.transforms import DeviceNormalize, eval_size, eval_transform, resize, short_side_size, train_transform
from engine.checkpoint.formats import load_checkpoint
from engine.checkpoint.weights import load_weights
from models.factory import create_model
from models.tta import TTAModel
from tests.helpers import make_image_folder, read_jsonl, run_on_ranks, run_script


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def hand_crops(image: np.ndarray, size: int, crop_pct: float, interpolation: str) -> list[np.ndarray]:
    """Centre, top-left, top-right, bottom-left, bottom-right size x size crops of the eval preset's resize,
    sliced here by hand (the centre with torchvision's rounding of the offsets)."""
    height, width = short_side_size(*image.shape[:2], math.floor(size / crop_pct))
    resized = resize(image, height, width, interpolation)
    top, left = int(round((height - size) / 2.0)), int(round((width - size) / 2.0))
    return [resized[top:top + size, left:left + size], resized[:size, :size], resized[:size, width - size:],
            resized[height - size:, :size], resized[height - size:, width - size:]]


def hand_tta(model: torch.nn.Module, crops: list[np.ndarray], cfg: DataConfig, flip: bool) -> torch.Tensor:
    """Mean (float64) of the model's softmax probabilities over the crops and, with flip, their mirrors."""
    normalize = DeviceNormalize(cfg.mean, cfg.std, torch.device("cpu"), channels_last=False)
    probs = []
    for crop in crops:
        x = normalize(torch.from_numpy(np.ascontiguousarray(crop)).permute(2, 0, 1)[None])
        for view in ([x, x.flip(3)] if flip else [x]):
            with torch.no_grad():
                probs.append(model(view).double().softmax(dim=1)[0])
    return torch.stack(probs).mean(dim=0)


def trained_model(checkpoint: Path) -> tuple[torch.nn.Module, dict]:
    ckpt = load_checkpoint(checkpoint)
    cfg = config_from_dict(ckpt["config"])
    model = create_model(cfg.model, len(ckpt["class_names"]))
    load_weights(model, ckpt["model"], str(checkpoint))
    return model.eval(), ckpt


def test_five_crops_are_the_centre_and_corners_of_the_eval_resize():
    image = np.random.default_rng(0).integers(0, 256, (37, 29, 3), dtype=np.uint8)  # odd, not square
    cfg = DataConfig(img_size=16, crop_pct=0.8, interpolation="bicubic")
    stacked = eval_transform(cfg, crops=5)(image=image)["image"]
    assert stacked.shape == (3, 5 * 16, 16)
    expected = hand_crops(image, 16, 0.8, "bicubic")
    for band, crop in zip(stacked.chunk(5, dim=1), expected):
        assert torch.equal(band.permute(1, 2, 0), torch.from_numpy(np.ascontiguousarray(crop)))
    assert torch.equal(stacked[:, :16], eval_transform(cfg)(image=image)["image"])  # band 0: the plain preset


def test_flip_averaging_is_symmetric():
    torch.manual_seed(0)
    model = create_model(ModelConfig(name="test_resnet"), 4).eval()
    tta = TTAModel(model, flip=True, crops=1)
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(tta(x), tta(x.flip(3)))


def test_evaluate_tta_equals_the_hand_computed_average(tiny_run, tmp_path, capsys):
    checkpoint = tiny_run / "best.pth"
    out = tmp_path / "tta"
    test_size = ["data.val_img_size=14", "data.val_crop_pct=0.7"]  # resize 20: five different crops
    argv = [str(checkpoint), "--output-dir", str(out), "--tta-flip", "--tta-crops", "5", *test_size]
    assert report_errors(evaluate.main, argv) == 0
    result = json.loads((out / "eval.json").read_text())
    assert result["tta"] == {"flip": True, "crops": 5, "views": 10, "average": "softmax probabilities"}
    assert (result["img_size"], result["crop_pct"]) == (14, 0.7)
    rows = read_rows(out / "predictions.csv")
    model, ckpt = trained_model(checkpoint)
    cfg = config_from_dict(ckpt["config"]).data
    size, crop_pct = 14, 0.7
    dataset = build_val_dataset(cfg, ckpt["config"]["seed"])
    losses = []
    for i in range(4):
        probs = hand_tta(model, hand_crops(dataset.load_image(i), size, crop_pct, cfg.interpolation), cfg, True)
        row = rows[i]
        assert int(row["pred"]) == int(probs.argmax())
        assert float(row["confidence"]) == pytest.approx(float(probs.max()), abs=2e-6)
        assert float(row["loss"]) == pytest.approx(-math.log(float(probs[int(row["label"])])), rel=1e-5)
        losses.append(float(row["loss"]))
    # Without TTA the same images give other losses: the views were used.
    plain = tmp_path / "plain"
    assert report_errors(evaluate.main, [str(checkpoint), "--output-dir", str(plain), *test_size]) == 0
    assert [float(r["loss"]) for r in read_rows(plain / "predictions.csv")[:4]] != losses
    assert json.loads((plain / "eval.json").read_text())["tta"]["views"] == 1


def test_predict_tta_equals_the_hand_computed_average(tiny_run, tmp_path, capsys):
    import cv2

    images = make_image_folder(tmp_path / "images", {"x": {"a": 3}}, size=23)
    files = sorted((images / "x" / "a").iterdir())
    out = tmp_path / "pred"
    argv = [str(tiny_run / "best.pth"), str(images), "--output-dir", str(out), "--tta-flip", "--topk", "1"]
    assert report_errors(predict.main, argv) == 0
    result = json.loads((out / "predictions.json").read_text())
    assert result["tta"]["views"] == 2
    model, ckpt = trained_model(tiny_run / "best.pth")
    cfg = config_from_dict(ckpt["config"]).data
    for entry, file in zip(result["predictions"], files):
        image = cv2.cvtColor(cv2.imread(str(file)), cv2.COLOR_BGR2RGB)
        probs = hand_tta(model, hand_crops(image, *eval_size(cfg), cfg.interpolation)[:1], cfg, True)
        assert entry["path"].endswith(file.name)
        assert entry["top"][0]["class"] == ckpt["class_names"][int(probs.argmax())]
        assert entry["top"][0]["prob"] == pytest.approx(float(probs.max()), abs=2e-6)


@pytest.mark.parametrize("tool", [evaluate, predict])
def test_bad_tta_crops_is_one_line(tiny_run, tmp_path, capsys, tool):
    inputs = [str(make_image_folder(tmp_path / "images", {"x": {"a": 1}}))] if tool is predict else []
    argv = [str(tiny_run / "best.pth"), *inputs, "--output-dir", str(tmp_path / "out"), "--tta-crops", "3"]
    assert report_errors(tool.main, argv) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "--tta-crops must be 1 (centre crop) or 5 (centre and four corners), got 3" in error


def test_val_img_size_and_crop_pct_make_the_eval_pipeline_only():
    cfg = DataConfig(name="dummy", img_size=16, crop_pct=0.875, val_img_size=24, val_crop_pct=1.0,
                     dummy_image_size=30, dummy_train_size=4, dummy_val_size=2)
    train, val = build_datasets(cfg, seed=0)  # what training builds: its per-epoch evaluation and best.pth use val
    assert train[0][0].shape == (3, 16, 16) and val[0][0].shape == (3, 24, 24)
    [expected] = hand_crops(val.load_image(0), 24, 1.0, "bilinear")[:1]
    assert torch.equal(val[0][0].permute(1, 2, 0), torch.from_numpy(np.ascontiguousarray(expected)))
    no_augment = train_transform(dataclasses.replace(cfg, augment=False))(image=val.load_image(0))["image"]
    assert no_augment.shape == (3, 16, 16)  # training without augmentation stays at the training size


def test_a_checkpoint_without_the_keys_evaluates_at_its_training_size(tiny_run):
    stored = load_checkpoint(tiny_run / "best.pth")["config"]
    assert "val_img_size" in stored["data"]  # written by this version
    older = {**stored, "data": {k: v for k, v in stored["data"].items() if not k.startswith("val_")
                                or k == "val_split"}}
    cfg = config_from_dict(older).data
    assert eval_size(cfg) == (stored["data"]["img_size"], stored["data"]["crop_pct"]) == (16, 1.0)


def test_export_metadata_gives_the_test_resolution(tiny_run):
    from assembly.export import metadata
    from engine.checkpoint.inference import inference_config, load_trained

    trained = load_trained(tiny_run / "best.pth")
    cfg = inference_config(trained, [("data.val_img_size", 24), ("data.val_crop_pct", 0.8)])
    meta = metadata(cfg, trained)
    assert (meta["input_size"], meta["crop_pct"]) == ([3, 24, 24], 0.8)
    assert metadata(inference_config(trained), trained)["input_size"] == [3, 16, 16]  # unset: the training size


@pytest.mark.parametrize("key, value, message", [
    ("data.val_img_size", -1, "config key 'data.val_img_size' must be >= 0, got -1"),
    ("data.val_crop_pct", 1.5, "config key 'data.val_crop_pct' must be in (0, 1] (0 = data.crop_pct), got 1.5"),
])
def test_bad_val_keys_are_one_line(key, value, message):
    from core.config_load import set_dotted
    from core.errors import UserError

    raw: dict = {}
    set_dotted(raw, key, value)
    with pytest.raises(UserError) as err:
        config_from_dict(raw)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_evaluate_with_tta_is_identical_on_1_and_2_processes(tiny_run, tmp_path):
    outputs = []
    for nproc in (1, 2):
        out = tmp_path / f"eval{nproc}"
        run_on_ranks("evaluate.py", str(tiny_run / "best.pth"), "--output-dir", str(out), "--batch-size", "3",
                     "--tta-flip", "--tta-crops", "5", "data.val_img_size=14", nproc=nproc)
        outputs.append(((out / "eval.json").read_text(), (out / "predictions.csv").read_text()))
    assert outputs[0] == outputs[1]  # byte for byte
    result = json.loads(outputs[0][0])
    assert result["img_size"] == 14 and result["tta"]["views"] == 10 and result["n"] == 10


@pytest.mark.slow
def test_training_evaluates_and_chooses_best_at_val_img_size(tmp_path):
    """Issue 27's acceptance, at its cheapest: train at 24 px on the digits, evaluate at data.val_img_size=32.
    metrics.jsonl's val_top1 is exactly evaluate.py's top-1 on best.pth (at 32 px, from the stored config) and is
    not what an evaluation at the training size gives."""
    out = tmp_path / "run"
    run_script("train.py", "--config", "digits", "model.name=test_resnet", "data.img_size=24", "data.val_img_size=32",
               "train.epochs=1", "data.num_workers=0", "amp=off", "logging.progress=false", f"output_dir={out}")
    [row] = read_jsonl(out / "metrics.jsonl")
    results = {}
    for size in (32, 24):
        run_script("evaluate.py", str(out / "best.pth"), "--output-dir", str(tmp_path / f"eval{size}"),
                   *([f"data.val_img_size={size}"] if size == 24 else []))
        results[size] = json.loads((tmp_path / f"eval{size}" / "eval.json").read_text())
    assert results[32]["img_size"] == 32 and results[24]["img_size"] == 24
    assert row["val_top1"] == results[32]["top1"]  # exactly: the same images, crops and counts
    assert (results[24]["top1"], results[24]["loss"]) != (results[32]["top1"], results[32]["loss"])
    print(f"val_top1 {row['val_top1']:.2f} = evaluate.py at 32 px {results[32]['top1']:.2f}; at 24 px "
          f"{results[24]['top1']:.2f}")
