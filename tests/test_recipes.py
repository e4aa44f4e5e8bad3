"""Every file in configs/ loads, documents its recipe, and trains two optimizer steps (dummy data, tiny model, CPU)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import train
from engine.cli import report_errors
from engine.config_load import CONFIG_DIR, load_config
from engine.optim import check_optimizer
from tests.helpers import REPO

CONFIGS = sorted(path.name for path in CONFIG_DIR.glob("*.yaml"))
RECIPES = [name for name in CONFIGS  # published ImageNet results
           if name not in ("digits.yaml", "dummy.yaml", "finetune_digits.yaml")]
SMALL = ["data.name=dummy", "data.img_size=32", "data.dummy_image_size=36", "data.dummy_train_size=32",
         "data.dummy_val_size=8", "data.dummy_num_classes=4", "data.num_workers=0", "train.batch_size=4",
         "train.max_steps=2", "amp=off", "model.init_from=", "model.sync_bn=false", "model.channels_last=false",
         "logging.progress=false", "dist.backend=auto"]  # resnet50.yaml asks for nccl; here: the CPU


def tiny_model(name: str) -> list[str]:
    """timm's test-sized variant of the config's architecture (same family, a fraction of a million weights)."""
    if name.startswith("deit") and "distilled" in name:  # timm has no test variant: one block, 32 wide
        return ["model.name=deit_tiny_distilled_patch16_224",
                "model.kwargs={img_size: 32, patch_size: 8, embed_dim: 32, depth: 1, num_heads: 2}"]
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
    if cfg.distill.teacher_name:  # the recipe's teacher is required: a tiny one, made here
        from timm import create_model

        torch.save(create_model("test_resnet", num_classes=4).state_dict(), tmp_path / "teacher.pth")
        argv += ["distill.teacher_name=test_resnet", f"distill.teacher_weights={tmp_path / 'teacher.pth'}"]
    assert report_errors(train.main, argv) == 0
    assert torch.load(tmp_path / "run" / "last.pth", weights_only=True)["global_step"] == 2


# ---- fidelity to the sources: schedule, init, and the table in docs/correctness.md (issue 31) ---------------

SOURCE_BATCH = {"resnet50.yaml": 2048, "convnext_tiny.yaml": 4096, "deit_small.yaml": 1024,
                "deit_small_distilled.yaml": 1024, "resnet50_rsb_a3.yaml": 2048, "resnet50_torchvision.yaml": 1024}  # the global batch each published


def source_lr(cfg, name: str) -> float:
    ratio = SOURCE_BATCH[name] / cfg.optim.lr_base_size
    return cfg.optim.lr_base * (ratio ** 0.5 if cfg.optim.lr_base_scale == "sqrt" else ratio)


def timm_epoch_lrs(cfg, lr: float) -> list[float]:
    """timm's scheduler as timm's train.py (RSB) builds it from the recipe's settings, one value per epoch."""
    from timm.scheduler import create_scheduler_v2

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler, _ = create_scheduler_v2(optimizer, "cosine", num_epochs=cfg.train.epochs, min_lr=cfg.sched.min_lr,
                                       warmup_lr=cfg.sched.warmup_lr, warmup_epochs=cfg.sched.warmup_epochs)
    lrs = []
    for epoch in range(cfg.train.epochs):
        scheduler.step(epoch)
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def torchvision_epoch_lrs(cfg, lr: float) -> list[float]:
    """references/classification/train.py: LinearLR warmup then CosineAnnealingLR, SequentialLR, step() per epoch."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    warmup = cfg.sched.warmup_epochs
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.train.epochs - warmup, eta_min=0.0)],
        milestones=[warmup])
    lrs = []
    for _ in range(cfg.train.epochs):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()  # (no gradient: nothing changes; torch expects it before the scheduler's step)
        scheduler.step()
    return lrs


def convnext_step_lrs(cfg, lr: float, per_epoch: int) -> list[float]:
    """ConvNeXt utils.py cosine_scheduler (formula as the source writes it): linspace warmup, cosine after it."""
    warmup_iters = cfg.sched.warmup_epochs * per_epoch
    warmup = np.linspace(0.0, lr, warmup_iters)
    iters = np.arange(cfg.train.epochs * per_epoch - warmup_iters)
    final = cfg.sched.min_lr
    cosine = [final + 0.5 * (lr - final) * (1 + math.cos(math.pi * i / len(iters))) for i in iters]
    return [float(v) for v in np.concatenate((warmup, cosine))]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_schedule_is_its_sources(name):
    """The lr of every step of the recipe (2 steps per epoch) from the config, against the source's own
    scheduler (torch's for torchvision, timm's for DeiT and RSB) or its formula (NVIDIA, ConvNeXt)."""
    from engine.optim import build_scheduler
    from tests.test_schedule import nvidia_cosine_lr

    cfg, per_epoch = load_config(name), 2
    lr = source_lr(cfg, name)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = build_scheduler(optimizer, cfg.sched, cfg.train.epochs, per_epoch)
    got = []
    for step in range(cfg.train.epochs * per_epoch):
        got.append(optimizer.param_groups[0]["lr"])
        scheduler.step_update(num_updates=step + 1)
    if name == "convnext_tiny.yaml":
        expected = convnext_step_lrs(cfg, lr, per_epoch)
        warmup_iters = cfg.sched.warmup_epochs * per_epoch
        ramp = (warmup_iters - 1) / warmup_iters  # the known difference: timm's ramp over linspace's
        assert got[:warmup_iters] == pytest.approx([v * ramp for v in expected[:warmup_iters]], rel=1e-12)
        assert got[warmup_iters:] == pytest.approx(expected[warmup_iters:], rel=1e-12)
        return
    if name == "resnet50.yaml":
        epochs = [nvidia_cosine_lr(lr, cfg.sched.warmup_epochs, cfg.train.epochs, e) for e in range(cfg.train.epochs)]
    elif name == "resnet50_torchvision.yaml":
        epochs = torchvision_epoch_lrs(cfg, lr)
    else:
        epochs = timm_epoch_lrs(cfg, lr)
    assert got == pytest.approx([v for v in epochs for _ in range(per_epoch)], rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("name, zero", [("resnet50.yaml", False), ("resnet50_torchvision.yaml", False),
                                        ("resnet50_rsb_a3.yaml", True)])
def test_last_bn_init_is_the_sources(name, zero):
    """NVIDIA's and torchvision's ResNet-50 start each block's last BN at 1 (torchvision's resnet50() built here
    shows it); timm's default, which RSB trains with, starts it at 0."""
    import torchvision

    from models.factory import create_model

    model = create_model(load_config(name).model, 10)
    reference = torchvision.models.resnet50() if not zero else None
    for block in (m for m in model.modules() if type(m).__name__ == "Bottleneck"):
        expected = torch.zeros_like(block.bn3.weight) if zero else reference.layer1[0].bn3.weight.detach()
        assert torch.equal(block.bn3.weight.detach()[:len(expected)], expected[:len(block.bn3.weight)])


def test_fidelity_table_in_docs_is_generated_from_the_rows():
    """docs/correctness.md holds tests/fidelity.py's table as generated; every row names a recipe config and,
    unless it is a known difference, a test that exists."""
    from tests.fidelity import ROWS, fidelity_markdown

    assert fidelity_markdown() in (REPO / "docs" / "correctness.md").read_text(), (
        "docs/correctness.md's fidelity table is stale; regenerate it with python -m tests.fidelity")
    assert {row.config for row in ROWS} == set(RECIPES)
    for row in ROWS:
        assert row.test or row.note.startswith("not expressible"), row
        if row.test:
            path, test = row.test.split("::")
            assert f"def {test}(" in (REPO / path).read_text(), row.test
