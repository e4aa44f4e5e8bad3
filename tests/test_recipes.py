"""Every file in configs/ loads, documents its recipe, and trains two optimizer steps (dummy data, tiny model, CPU)."""

from __future__ import annotations

import re

import pytest
import torch

import train
from engine.cli import report_errors
from engine.config import CONFIG_DIR, load_config
from engine.optim import check_optimizer
from tests.helpers import REPO

CONFIGS = sorted(path.name for path in CONFIG_DIR.glob("*.yaml"))
RECIPES = [name for name in CONFIGS  # published ImageNet results
           if name not in ("digits.yaml", "dummy.yaml", "finetune_digits.yaml")]
SMALL = ["data.name=dummy", "data.img_size=32", "data.dummy_image_size=36", "data.dummy_train_size=32",
         "data.dummy_val_size=8", "data.dummy_num_classes=4", "data.num_workers=0", "train.batch_size=4",
         "train.max_steps=2", "amp=off", "model.init_from=", "model.sync_bn=false", "model.channels_last=false",
         "logging.progress=false"]


def tiny_model(name: str) -> list[str]:
    """timm's test-sized variant of the config's architecture (same family, a fraction of a million weights)."""
    if name.startswith(("vit", "deit")):
        return ["model.name=test_vit", "model.kwargs.img_size=32"]
    if name.startswith("convnext"):
        return ["model.name=test_convnext"]
    return ["model.name=test_resnet"]


@pytest.mark.parametrize("name", CONFIGS)
def test_config_loads_and_its_optimizer_options_fit(name):
    cfg = load_config(name)
    check_optimizer(cfg.optim)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_states_source_published_top1_and_global_batch(name):
    """The header says where the recipe comes from and what it reached, and the README's table lists it."""
    header = "".join(line for line in (CONFIG_DIR / name).read_text().splitlines(True) if line.startswith("#"))
    assert re.search(r"https://\S+", header) and re.search(r"\d+(\.\d+)?% top-1", header), header
    assert "global batch" in header and "Rescaling" in header, header
    assert f"[`{name}`](configs/{name})" in (REPO / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_config_trains_two_steps_on_dummy_data(name, tmp_path):
    cfg = load_config(name)
    argv = ["--config", name, *SMALL, *tiny_model(cfg.model.name), f"output_dir={tmp_path / 'run'}"]
    assert report_errors(train.main, argv) == 0
    assert torch.load(tmp_path / "run" / "last.pth", weights_only=True)["global_step"] == 2
