"""export.py on a trained resnet18: ONNX in onnxruntime, TorchScript, and a timm model folder, each equal to PyTorch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import evaluate
import export
import predict
from assembly.export import check_sources, preprocessed
from core.cli import report_errors
from tests.helpers import last_error, make_image_folder, train_here

pytestmark = [pytest.mark.slow,  # trains a resnet18 for a few steps, then exports it three ways
              pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")]


@pytest.fixture(scope="module")
def resnet18_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "run"
    train_here("--config", "dummy", "model.name=resnet18", "data.img_size=32", "data.dummy_image_size=36",
               "data.dummy_train_size=64", "data.dummy_val_size=16", "train.batch_size=16", "train.max_steps=3",
               "logging.progress=false", f"output_dir={out}")
    return out


@pytest.fixture
def no_hub(monkeypatch):
    """Any attempt to reach the Hugging Face hub fails the test (nothing may be downloaded)."""
    import huggingface_hub
    import timm.models._hub as timm_hub

    def refuse(*args, **kwargs):
        raise AssertionError(f"hub call: {args} {kwargs}")

    for module in (timm_hub, huggingface_hub):
        for name in ("hf_hub_download", "snapshot_download"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def trained_model_and_batch(run: Path) -> tuple[torch.nn.Module, torch.Tensor]:
    """The checkpoint's model (fp32, eval) and its 16 preprocessed validation images."""
    from engine.checkpoint.inference import inference_config, load_trained
    from engine.checkpoint.weights import load_weights
    from models.factory import create_model

    trained = load_trained(run / "best.pth")
    cfg = inference_config(trained)
    model = create_model(cfg.model, len(trained.class_names))
    load_weights(model, trained.weights, "best.pth")
    return model.eval(), preprocessed(cfg, check_sources(cfg, None, 16, None)[0])


def test_onnx_and_torchscript_match_pytorch_for_batches_of_1_and_7(resnet18_run, tmp_path, capsys, no_hub):
    import onnxruntime

    ckpt = str(resnet18_run / "best.pth")
    assert report_errors(export.main, [ckpt, "--format", "onnx", "--check-batch", "7"]) == 0
    printed = capsys.readouterr().out
    assert "max abs difference of the logits, onnx vs PyTorch, batches of 1 and 7" in printed
    onnx_file = resnet18_run / "best.onnx"
    model, batch = trained_model_and_batch(resnet18_run)
    session = onnxruntime.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape[0] == "batch"  # a dynamic batch axis
    meta = session.get_modelmeta().custom_metadata_map
    assert json.loads(meta["label_names"]) == [f"class_{i}" for i in range(10)]
    assert json.loads(meta["mean"]) == [0.485, 0.456, 0.406] and json.loads(meta["input_size"]) == [3, 32, 32]
    for size in (1, 7):
        x = batch[:size]
        with torch.no_grad():
            expected = model(x).numpy()
        got = session.run(None, {"input": x.numpy()})[0]
        assert got.shape == (size, 10)
        assert np.abs(got - expected).max() <= 1e-4, (size, np.abs(got - expected).max())

    out = tmp_path / "model.ts"
    assert report_errors(export.main, [ckpt, "--format", "torchscript", "--output", str(out)]) == 0
    loaded = torch.jit.load(str(out))
    with torch.no_grad():
        assert (loaded(batch[:7]) - model(batch[:7])).abs().max() <= 1e-4

    # A mismatch is an error and leaves the earlier export in place (here: any difference fails --atol -1).
    before = onnx_file.read_bytes()
    assert report_errors(export.main, [ckpt, "--format", "onnx", "--atol", "-1"]) == 2
    assert "was not written" in capsys.readouterr().err
    assert onnx_file.read_bytes() == before and sorted(p.name for p in resnet18_run.glob(".*")) == []


def test_safetensors_folder_loads_in_timm_and_predict(resnet18_run, tmp_path, capsys, no_hub):
    import timm

    folder = tmp_path / "hf"
    ckpt = str(resnet18_run / "best.pth")
    assert report_errors(export.main, [ckpt, "--format", "safetensors", "--output", str(folder)]) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] == "resnet18" and config["num_classes"] == 10
    assert config["label_names"] == [f"class_{i}" for i in range(10)]
    pretrained = config["pretrained_cfg"]
    assert pretrained["input_size"] == [3, 32, 32] and pretrained["crop_pct"] == 1.0
    assert pretrained["mean"] == [0.485, 0.456, 0.406] and pretrained["interpolation"] == "bilinear"
    assert "tag" not in pretrained and "hf_hub_id" not in pretrained  # not timm's default weights

    model, batch = trained_model_and_batch(resnet18_run)
    loaded = timm.create_model("resnet18", pretrained=True, num_classes=10, pretrained_cfg_overlay=dict(
        file=str(folder / "model.safetensors"), num_classes=10)).eval()
    with torch.no_grad():
        assert torch.equal(loaded(batch), model(batch))

    # predict.py takes the folder as it takes the checkpoint: the same rows.
    images = tmp_path / "images"
    images.mkdir()
    import cv2

    for i in range(3):
        cv2.imwrite(str(images / f"{i}.png"), np.random.default_rng(i).integers(0, 256, (40, 40, 3), np.uint8))
    # By default, byte for byte (issue 42), though the run trained in bf16: both compute in its eval_amp, fp32.
    from core.files import save_atomic

    stored = torch.load(ckpt, weights_only=True, map_location="cpu")
    stored["config"]["amp"] = "bf16"
    save_atomic(stored, tmp_path / "bf16.pth")
    capsys.readouterr()
    for source, out in ((str(tmp_path / "bf16.pth"), tmp_path / "p-ckpt"), (str(folder), tmp_path / "p-folder")):
        assert report_errors(predict.main, [source, str(images), "--output-dir", str(out)]) == 0
        assert "computing in fp32, as the run's validation did (its eval_amp=off)" in capsys.readouterr().err
        assert json.loads((out / "predictions.json").read_text())["precision"] == "fp32"
    assert (tmp_path / "p-ckpt/predictions.csv").read_bytes() == (tmp_path / "p-folder/predictions.csv").read_bytes()
    assert report_errors(predict.main, [ckpt, str(images), "--output-dir", str(tmp_path / "p-bf16"), "amp=bf16"]) == 0
    assert "computing in bf16 (amp=bf16); the run's validation computed with eval_amp=off" in capsys.readouterr().err
    assert json.loads((tmp_path / "p-bf16/predictions.json").read_text())["precision"] == "bf16"
    # A run that validated in bf16 (eval_amp=bf16): its checkpoint and its exported folder both predict in bf16.
    stored["config"]["eval_amp"] = "bf16"
    save_atomic(stored, tmp_path / "bf16-eval.pth")
    assert report_errors(export.main, [str(tmp_path / "bf16-eval.pth"), "--format", "safetensors", "--output",
                                       str(tmp_path / "hf-bf16")]) == 0
    assert json.loads((tmp_path / "hf-bf16/config.json").read_text())["eval_amp"] == "bf16"
    for source, out in ((tmp_path / "bf16-eval.pth", tmp_path / "q-ckpt"), (tmp_path / "hf-bf16", tmp_path / "q-dir")):
        assert report_errors(predict.main, [str(source), str(images), "--output-dir", str(out)]) == 0
        assert json.loads((out / "predictions.json").read_text())["precision"] == "bf16"
    assert (tmp_path / "q-ckpt/predictions.csv").read_bytes() == (tmp_path / "q-dir/predictions.csv").read_bytes()
    assert (tmp_path / "q-ckpt/predictions.csv").read_bytes() == (tmp_path / "p-bf16/predictions.csv").read_bytes()

    # evaluate.py opens the exported folder as it opens the checkpoint (one path, issue 47): the same results.
    labelled = make_image_folder(tmp_path / "labelled", {"val": {"class_0": 3, "class_3": 2}}, size=36)
    for source, out in ((ckpt, "e-ckpt"), (str(folder), "e-dir")):
        assert report_errors(evaluate.main, [source, "--data-dir", str(labelled), "--output-dir",
                                             str(tmp_path / out)]) == 0
    assert (tmp_path / "e-ckpt/predictions.csv").read_bytes() == (tmp_path / "e-dir/predictions.csv").read_bytes()
    results = [json.loads((tmp_path / out / "eval.json").read_text()) for out in ("e-ckpt", "e-dir")]
    assert [{k: v for k, v in r.items() if k != "checkpoint"} for r in results][0] == \
        {k: v for k, v in results[1].items() if k != "checkpoint"} and results[1]["n"] == 5
    capsys.readouterr()
    assert report_errors(evaluate.main, [str(folder), "--output-dir", str(tmp_path / "e-none")]) == 2
    assert "records no data set; give --data-dir" in capsys.readouterr().err


def test_the_model_folder_holds_a_model_card_by_timms_writer(resnet18_run, tmp_path, capsys, monkeypatch, no_hub):
    """README.md (timm's generate_readme): the model, its classes, the metrics its checkpoint records, the training
    config (its one absolute path, output_dir, cut: tests/test_model_card.py) and preprocessing, and usage code that runs; an export written before the card is replaced, a README.md
    of the user's is refused and kept."""
    import re

    import cv2
    import yaml

    ckpt_file = resnet18_run / "best.pth"
    ckpt = torch.load(ckpt_file, weights_only=True, map_location="cpu")
    folder = tmp_path / "my-model"
    folder.mkdir()  # what export.py wrote before it wrote a card: replaced
    (folder / "config.json").write_text(json.dumps({"architecture": "resnet18", "num_classes": 10}))
    (folder / "model.safetensors").write_bytes(b"earlier weights")
    assert report_errors(export.main, [str(ckpt_file), "--format", "safetensors", "--output", str(folder)]) == 0
    card = (folder / "README.md").read_text()
    header = yaml.safe_load(card.split("---\n")[1])
    assert header["library_name"] == "timm" and header["pipeline_tag"] == "image-classification", header
    assert header["license"] == "other" and "set the license of these weights" in card  # not a claimed license
    assert "# Model card for resnet18 trained from scratch on synthetic dummy data (10 classes)" in card
    assert "**Architecture:** timm resnet18" in card and "**Started from:** random initialisation" in card
    assert f"**Classes:** 10: {', '.join(ckpt['class_names'])}" in card
    assert f"  - {ckpt['best_metric']}: {round(ckpt['metric_value'], 4)}\n" in card
    assert f"  - optimizer steps: {ckpt['global_step']}\n" in card
    data = ckpt["config"]["data"]
    assert f"normalize: mean {data['mean']}, std {data['std']}" in card and f"({data['interpolation']})" in card
    assert yaml.safe_load(card.split("```yaml\n")[1].split("```")[0]) == {**ckpt["config"], "output_dir": "run"}

    monkeypatch.chdir(tmp_path)  # the card's usage code, on the folder (local-dir: where the Hub id would be)
    cv2.imwrite("photo.jpg", np.random.default_rng(0).integers(0, 256, (40, 40, 3), np.uint8))
    code = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    scope: dict = {}
    exec(code.replace('"hf-hub:<user>/my-model"', '"local-dir:my-model"'), scope)
    assert scope["labels"] == ckpt["class_names"] and scope["scores"].shape == (1, 10)

    (folder / "README.md").write_text("my own card\n")  # edited away from export.py's: no longer its output
    capsys.readouterr()
    assert report_errors(export.main, [str(ckpt_file), "--format", "safetensors", "--output", str(folder)]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"error: {folder} is a folder (README.md, config.json, model.safetensors), not a model "
                           "folder export.py wrote") and "choose another --output" in line, line
    assert (folder / "README.md").read_text() == "my own card\n"


def test_a_config_override_given_to_export_is_one_line_saying_why(tmp_path, capsys):
    """Issue 51 item 19: docs/inference.md named export.py among the tools that take `amp`, and `export.py ...
    amp=bf16` was argparse's `unrecognized arguments`. It is refused before the checkpoint is read."""
    for override in ("amp=bf16", "--amp=bf16"):
        line = last_error(capsys, report_errors(export.main, [str(tmp_path / "x.pth"), "--format", "onnx", override]))
        assert line == (f"error: export.py takes no config overrides ({override}): it exports and checks the fp32 "
                        "model on the CPU and records the run's eval_amp for predict.py; give amp=... to evaluate.py "
                        "or predict.py"), line
    assert "`export.py` compute" not in (Path(__file__).parents[1] / "docs" / "inference.md").read_text()
