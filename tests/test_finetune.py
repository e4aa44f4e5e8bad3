"""Fine-tuning from local weights through timm's own loading: head reset, ViT position embeddings resampled,
in_chans adapted, Hugging Face model folders; the weights' preprocessing; nothing downloaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.layers import resample_abs_pos_embed

import train
from assembly.run import build_run
from core.cli import report_errors
from tests.helpers import TINY, read_jsonl, start_from, train_here


@pytest.fixture(autouse=True)
def no_hub(monkeypatch):
    """Any attempt to reach the Hugging Face hub or a URL fails the test (nothing may be downloaded)."""
    import huggingface_hub
    import timm.models._builder as builder
    import timm.models._hub as timm_hub

    def refuse(*args, **kwargs):
        raise AssertionError(f"download attempted: {args} {kwargs}")

    for module, names in ((timm_hub, ("hf_hub_download", "snapshot_download")),
                          (huggingface_hub, ("hf_hub_download", "snapshot_download")),
                          (builder, ("load_state_dict_from_url", "load_state_dict_from_hf", "download_cached_file"))):
        for name in names:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")



def last_error(capsys, code: int) -> str:
    """The one error line the user sees (after the run's own INFO lines); no traceback, no per-key lines from timm."""
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "Missing keys" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: "), err
    return line


def test_vit_weights_saved_at_another_image_size_are_resampled(tmp_path, capsys):
    torch.manual_seed(0)
    source = timm.create_model("test_vit", img_size=64, num_classes=10)
    save_file(source.state_dict(), tmp_path / "vit64.safetensors")
    model = start_from(tmp_path / "vit64.safetensors", "test_vit", 5, img_size=32)
    assert source.pos_embed.shape == (1, 1 + 4 * 4, 64) and model.pos_embed.shape == (1, 1 + 2 * 2, 64)
    expected = resample_abs_pos_embed(source.pos_embed.detach(), (2, 2), num_prefix_tokens=1)
    assert torch.equal(model.pos_embed.detach(), expected)
    own, saved = model.state_dict(), source.state_dict()
    assert all(torch.equal(own[k], v) for k, v in saved.items() if k != "pos_embed" and not k.startswith("head."))
    assert own["head.weight"].shape == (5, 64)
    # The same through train.py (--dry-run builds the model with its starting weights and writes nothing).
    run = tmp_path / "run"
    argv = [*TINY, "model.name=test_vit", "model.kwargs.img_size=32", "data.img_size=32", "data.dummy_image_size=36",
            f"model.init_from={tmp_path / 'vit64.safetensors'}", f"output_dir={run}", "--dry-run"]
    assert report_errors(train.main, argv) == 0
    assert "dry run passed" in capsys.readouterr().out and not run.exists()


def test_in_chans_is_adapted_from_rgb_weights(tmp_path):
    torch.manual_seed(0)
    source = timm.create_model("test_resnet", num_classes=10)
    torch.save(source.state_dict(), tmp_path / "rgb.pth")
    model = start_from(tmp_path / "rgb.pth", "test_resnet", 10, in_chans=1)
    first = model.pretrained_cfg["first_conv"] + ".weight"
    assert model.state_dict()[first].shape[1] == 1
    assert torch.allclose(model.state_dict()[first], source.state_dict()[first].sum(dim=1, keepdim=True))
    assert torch.equal(model.state_dict()["fc.weight"], source.state_dict()["fc.weight"])  # same 10 classes: kept


def write_model_folder(folder: Path, model: torch.nn.Module, architecture: str, **pretrained_cfg) -> Path:
    folder.mkdir(parents=True)
    config = {"architecture": architecture, "num_classes": model.num_classes, "pretrained_cfg": pretrained_cfg}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(model.state_dict(), folder / "model.safetensors")
    return folder


def test_a_hugging_face_model_folder_starts_a_run(tmp_path, capsys):
    torch.manual_seed(0)
    source = timm.create_model("test_resnet", num_classes=3)
    folder = write_model_folder(tmp_path / "hf", source, "test_resnet")
    model = start_from(folder, "test_resnet", 10)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in source.state_dict().items() if not k.startswith("fc."))
    argv = [*TINY, "model.name=test_resnet", f"model.init_from={folder}", f"output_dir={tmp_path / 'run'}",
            "--dry-run"]
    assert report_errors(train.main, argv) == 0
    capsys.readouterr()


@pytest.mark.parametrize("case, message", [
    ("missing", "model.init_from={tmp}/missing.safetensors: {tmp}/missing.safetensors does not exist"),
    ("no config", "model.init_from={tmp}/noconfig is a folder without config.json"),
    ("no weights", "model.init_from={tmp}/noweights holds no model.safetensors"),
    ("another architecture", "model.init_from={tmp}/vit holds a test_vit but model.name is test_resnet; "
                             "set model.name=test_vit"),
    ("damaged safetensors", "model.init_from={tmp}/bad.safetensors cannot be read as safetensors"),
    ("other tensors", "model.init_from={tmp}/other.safetensors does not fit model ResNet (missing: "),
])
def test_init_from_errors_are_one_line(case, message, tmp_path, capsys):
    (tmp_path / "noconfig").mkdir()
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text('{"architecture": "test_resnet", "num_classes": 3}')
    write_model_folder(tmp_path / "vit", timm.create_model("test_vit", img_size=32), "test_vit")
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    save_file({"fc.weight": torch.zeros(3, 96), "other.weight": torch.zeros(2)}, tmp_path / "other.safetensors")
    path = {"missing": "missing.safetensors", "no config": "noconfig", "no weights": "noweights",
            "another architecture": "vit", "damaged safetensors": "bad.safetensors",
            "other tensors": "other.safetensors"}[case]
    argv = [*TINY, "model.name=test_resnet", f"model.init_from={tmp_path / path}", f"output_dir={tmp_path / 'run'}"]
    line = last_error(capsys, report_errors(train.main, argv))
    assert message.format(tmp=tmp_path) in line, line
    assert not (tmp_path / "run").exists()


def digits_subset(source: Path, target: Path, classes: list[str]) -> Path:
    """An ImageFolder root holding only some digit classes of the digits export."""
    for split in ("train", "val"):
        for name in classes:
            shutil.copytree(source / split / name, target / split / name)
    return target


@pytest.mark.slow  # a short digits training, then a fine-tuning run on 5 of its classes
def test_finetune_from_a_safetensors_file_into_a_5_class_head(tmp_path):
    from core.config_load import load_config
    from core.dist import DistInfo

    base = tmp_path / "base"
    digits = tmp_path / "digits"
    train_here("--config", "digits", "model.name=test_resnet", "amp=off", f"data.root={digits}",
               "data.num_workers=0", "train.epochs=1", "logging.progress=false", f"output_dir={base}")
    trained = torch.load(base / "last.pth", weights_only=True)["model"]
    save_file({k: v.contiguous() for k, v in trained.items()}, tmp_path / "digits.safetensors")  # a plain state dict
    five = digits_subset(digits, tmp_path / "five", ["0", "1", "2", "3", "4"])
    overrides = ["model.name=test_resnet", "amp=off", "data.name=imagefolder", f"data.root={five}",
                 "data.num_workers=0", f"model.init_from={tmp_path / 'digits.safetensors'}", "train.epochs=1",
                 "train.batch_size=32", "optim.lr=0.05", "sched.warmup_epochs=0", "logging.progress=false"]

    # The model as the fine-tuning run starts it: the file's backbone, a fresh 5-class head.
    cfg = load_config("digits", [*overrides, f"output_dir={tmp_path / 'start'}"])
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    run = build_run(cfg, info, write=False)
    cfg, data, precision, model = run.cfg, run.data, run.precision, run.model
    own = model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in trained.items() if not k.startswith("fc."))
    assert own["fc.weight"].shape == (5, trained["fc.weight"].shape[1])
    assert not torch.equal(own["fc.weight"], trained["fc.weight"][:5])
    from data.transforms import DeviceNormalize
    from engine.evaluation import evaluate

    normalize = DeviceNormalize(cfg.data.mean, cfg.data.std, info.device, False)
    before = evaluate(model.float(), data.val, precision, info, normalize)["val_top1"]

    out = tmp_path / "finetuned"
    train_here("--config", "digits", *overrides, f"output_dir={out}")
    after = read_jsonl(out / "metrics.jsonl")[-1]["val_top1"]
    assert after > before + 20 and after >= 90, (before, after)


def stored_data(run: Path) -> dict:
    return torch.load(run / "last.pth", weights_only=True)["config"]["data"]


@pytest.mark.slow  # two short training runs (the second resumes the first)
def test_preprocessing_comes_from_the_weights_unless_the_config_sets_it(tmp_path, capsys):
    torch.manual_seed(0)
    folder = write_model_folder(tmp_path / "hf", timm.create_model("test_resnet", num_classes=10), "test_resnet",
                                mean=[0.1, 0.2, 0.3], std=[0.4, 0.5, 0.6], interpolation="bicubic", crop_pct=0.8)
    run = tmp_path / "run"
    assert report_errors(train.main, [*TINY, "model.name=test_resnet", f"model.init_from={folder}",
                                      f"output_dir={run}"]) == 0
    log = capsys.readouterr().err
    data = stored_data(run)  # what evaluate.py, predict.py and export.py will use
    assert (data["mean"], data["std"], data["interpolation"]) == ([0.1, 0.2, 0.3], [0.4, 0.5, 0.6], "bicubic")
    assert data["crop_pct"] == 1.0  # configs/dummy.yaml sets it: the config wins
    assert f"data.interpolation bicubic (the weights' config, {folder})" in log
    assert "data.crop_pct 1.0 (config)" in log

    # A resumed run keeps the values its checkpoint stored (model.init_from is not read again).
    assert report_errors(train.main, [*TINY, "model.name=test_resnet", f"model.init_from={folder}",
                                      f"output_dir={run}", "train.epochs=2"]) == 0
    assert stored_data(run) == data
    assert "data.mean [0.1, 0.2, 0.3] (the resumed checkpoint)" in capsys.readouterr().err

    # A bare state dict says nothing: timm's pretrained_cfg for model.name; an override still wins.
    torch.save(timm.create_model("test_resnet").state_dict(), tmp_path / "bare.pth")
    assert report_errors(train.main, [*TINY, "model.name=test_resnet", f"model.init_from={tmp_path / 'bare.pth'}",
                                      f"output_dir={tmp_path / 'bare-run'}", "data.std=[0.3,0.3,0.3]",
                                      "--dry-run"]) == 0
    timm_cfg = timm.models.get_pretrained_cfg("test_resnet")
    log = capsys.readouterr().err
    assert f"data.mean {list(timm_cfg.mean)} (timm's pretrained_cfg of test_resnet.{timm_cfg.tag}" in log
    assert f"data.interpolation {timm_cfg.interpolation} (timm's" in log and "data.std [0.3, 0.3, 0.3] (config)" in log


def test_interpolation_reaches_both_pipelines():
    import cv2
    import numpy as np

    from core.config import DataConfig
    from data.transforms import eval_transform, train_transform

    image = np.random.default_rng(0).integers(0, 256, (20, 20, 3), dtype=np.uint8)
    for name, flag in (("nearest", cv2.INTER_NEAREST), ("area", cv2.INTER_AREA)):  # bilinear, bicubic: test_pixels
        cfg = DataConfig(img_size=8, crop_pct=0.5, interpolation=name)
        out = eval_transform(cfg)(image=image)["image"].permute(1, 2, 0).numpy()
        expected = cv2.resize(image, (16, 16), interpolation=flag)[4:12, 4:12]
        assert np.array_equal(out, expected), name
    for name in ("nearest", "bicubic", "area"):
        assert train_transform(DataConfig(interpolation=name)).transforms[0].resample == name


def test_finetune_digits_config_leaves_the_preprocessing_to_the_weights():
    from core.config_load import load_config

    cfg = load_config("finetune_digits")
    assert cfg.model.init_from == "runs/digits/best-hf" and cfg.data.name == "imagefolder"
    assert not {"data.mean", "data.std", "data.interpolation", "data.crop_pct"} & cfg.given
