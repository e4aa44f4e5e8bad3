"""The model card export.py writes into a model folder says what the exported weights are: the data they were trained
and validated on, where they started, the metrics of these weights (never the other set's), and no local path."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
import yaml

import export
from core.cli import report_errors
from core.files import save_atomic
from engine.checkpoint.inference import VALUE_KEYS, stored_number
from tests.helpers import TINY, make_image_folder, train_here

CLASSES = {"daisy": 6, "rose": 5, "tulip": 5}  # 16 training images
VAL = {"daisy": 2, "rose": 2, "tulip": 3}  # 7 validation images


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory, tiny_run) -> Path:
    """An ImageFolder run (3 classes) from model.init_from=tiny_run's last.pth, keeping best.pth on its EMA weights."""
    base = tmp_path_factory.mktemp("card")
    root = make_image_folder(base / "flowers", {"train": CLASSES, "val": VAL}, size=20)
    train_here(*TINY, "data.name=imagefolder", f"data.root={root}", f"model.init_from={tiny_run / 'last.pth'}",
               "model.ema_decay=0.9", "train.best_on_ema=true", f"output_dir={base / 'run'}")
    return base / "run"


def card_of(checkpoint: Path, out: Path, *flags: str) -> str:
    """export.py --format safetensors of `checkpoint` into `out`; its README.md."""
    assert report_errors(export.main, [str(checkpoint), "--format", "safetensors", "--output", str(out), *flags]) == 0
    return (out / "README.md").read_text()


def strings_in(value) -> list[str]:
    """Every string in a nested config."""
    if isinstance(value, dict):
        return [s for item in value.values() for s in strings_in(item)]
    if isinstance(value, list):
        return [s for item in value for s in strings_in(item)]
    return [value] if isinstance(value, str) else []


def test_card_names_the_data_its_sizes_classes_start_and_holds_no_local_path(ema_run, tiny_run, tmp_path,
                                                                              tmp_path_factory):
    card = card_of(ema_run / "best.pth", tmp_path / "out", "--ema")
    ckpt = torch.load(ema_run / "best.pth", weights_only=True, map_location="cpu")
    assert "# Model card for test_resnet fine-tuned on flowers (3 classes)\n" in card
    assert "**Data:** flowers: 16 training images (split train), 7 validation images (split val)" in card
    assert "**Classes:** 3: daisy, rose, tulip\n" in card
    assert f"  - ema_val_top1: {round(stored_number(ckpt, VALUE_KEYS), 4)}\n" in card  # --ema: what chose best.pth
    assert "also chose this checkpoint (best.pth" in card and "so they are optimistic" in card
    digest = hashlib.sha256((tiny_run / "last.pth").read_bytes()).hexdigest()
    assert f"**Started from:** the file last.pth (model.init_from, sha256 {digest})" in card
    assert "## Limitations\n" in card and "(7 images)" in card
    assert str(tmp_path_factory.getbasetemp()) not in card  # neither the run's folders nor init_from's
    config = yaml.safe_load(card.split("```yaml\n")[1].split("```")[0])
    assert config["output_dir"] == "run" and config["data"]["root"] == "flowers"
    assert config["model"]["init_from"] == "last.pth"
    assert [s for s in strings_in(config) if os.path.isabs(s)] == []
    absolute = [s for s in strings_in(ckpt["config"]) if os.path.isabs(s)]
    assert len(absolute) == 3 and not [s for s in absolute if s in card], absolute  # output_dir, root, init_from


def test_plain_export_of_an_ema_chosen_checkpoint_reports_its_own_metric_not_the_emas(ema_run, tmp_path):
    """best.pth chose on the EMA weights: exported without --ema, its plain weights' metric is not recorded, and the
    card says so instead of the EMA's. A checkpoint from before runs recorded their data and start says that too."""
    ckpt = torch.load(ema_run / "best.pth", weights_only=True, map_location="cpu")
    assert ckpt["best_metric"] == "ema_val_top1" and ckpt["data_sizes"] == {"train": 16, "val": 7}
    older = {k: v for k, v in ckpt.items() if k not in ("data_sizes", "started_from")}
    save_atomic(older, tmp_path / "best.pth")
    card = card_of(tmp_path / "best.pth", tmp_path / "out")
    assert ("  - val_top1: not recorded (the checkpoint records only its EMA weights' ema_val_top1, exported with "
            "--ema)\n") in card
    assert "ema_val_top1:" not in card  # the EMA's value, under its name, as the card listed it before
    assert "**Data:** flowers: images per split not recorded" in card
    assert "**Started from:** not recorded (a checkpoint written before runs recorded it); its config sets " \
           "model.init_from" in card


def test_a_fine_tune_of_timms_weights_is_carded_as_one_and_its_folder_keeps_the_runs_eval_amp(tiny_run, tmp_path):
    """A run from timm's pretrained weights is described as fine-tuned; the card names the amp it trained with
    (amp=off here), and the folder's config.json the eval_amp its validation computed in (bf16), which a model folder
    is then read back with, so that predict.py on the folder computes as on the checkpoint."""
    from timm.models import get_pretrained_cfg

    from assembly.export import export_model_folder
    from engine.checkpoint.inference import inference_config, load_model_folder, load_trained
    from models.factory import create_model, hub_origin

    trained = load_trained(tiny_run / "last.pth")
    trained.config.update(amp="off", eval_amp="bf16")
    trained.started_from = hub_origin("test_resnet", get_pretrained_cfg("test_resnet").to_dict())
    cfg = inference_config(trained)
    folder = tmp_path / "folder"
    export_model_folder(create_model(cfg.model, len(trained.class_names)), cfg, trained, folder, "folder")
    card = (folder / "README.md").read_text()
    assert "# Model card for test_resnet fine-tuned on synthetic dummy data (" in card
    assert "**Started from:** timm's pretrained weights test_resnet.r160_in1k (Hugging Face" in card
    assert "- fp32 weights, trained with amp=off;" in card
    assert json.loads((folder / "config.json").read_text())["eval_amp"] == "bf16"
    assert inference_config(load_model_folder(folder)).amp == "bf16"


def test_card_of_a_pipeline_file_run_says_what_the_file_did_not_the_replaced_preset(tmp_path):
    """Issue 61: a run trained with data.train_transform: the card lists the file's transforms as albumentations
    serializes them (from the run folder's copy), and its training config leaves out the preset's scale, ratio,
    hflip and color_jitter, which the file replaced."""
    import albumentations as A
    import timm

    from assembly.model_card import model_card
    from core.config import Config, to_dict
    from data.pipeline import file_sha256
    from engine.checkpoint.inference import Trained

    run = tmp_path / "run"
    run.mkdir()
    A.save(A.Compose([A.RandomCrop(16, 16), A.HorizontalFlip(p=0.25)]), str(run / "train_transform.yaml"),
           data_format="yaml")
    config = to_dict(Config())
    config["data"].update(train_transform=str(tmp_path / "gone" / "aug.yaml"),  # moved since: the run's copy counts
                          train_transform_sha256=file_sha256(str(run / "train_transform.yaml"), "data.train_transform"))
    trained = Trained(config=config, weights={}, class_names=["cat", "dog"], source=f"checkpoint {run / 'best.pth'}")
    card = model_card(Config(), trained, timm.create_model("test_resnet", num_classes=2), "flowers")
    augmentation = card.split("## Training augmentation\n", 1)[1].split("## Training config", 1)[0]
    assert augmentation.startswith("\nThe albumentations pipeline file `aug.yaml` (data.train_transform, sha256 "
                                   f"{config['data']['train_transform_sha256']}) replaced the preset's `data.scale`, "
                                   "`data.ratio`, `data.hflip`, `data.color_jitter`, left out of the config below.")
    steps = yaml.safe_load(augmentation.split("```yaml\n", 1)[1].split("```", 1)[0])["transforms"]
    assert [(step["__class_fullname__"], step["p"]) for step in steps] == [("RandomCrop", 1.0),
                                                                           ("HorizontalFlip", 0.25)]
    assert (steps[0]["height"], steps[0]["width"]) == (16, 16)
    shown = yaml.safe_load(card.split("## Training config", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0])
    assert shown["data"]["train_transform"] == "aug.yaml"
    assert not {"scale", "ratio", "hflip", "color_jitter"} & set(shown["data"])
