"""Every file in configs/ loads, documents its recipe, and trains two optimizer steps (dummy data, tiny model, CPU)."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import numpy as np
import pytest
import torch

import train
from core.cli import report_errors
from core.config_load import CONFIG_DIR, load_config
from engine.optim import check_optimizer
from tests.helpers import REPO, SMALL, recipe_test_model

CONFIGS = sorted(path.name for path in CONFIG_DIR.glob("*.yaml") if not path.name.startswith("sweep_"))
SWEEPS = sorted(path.name for path in CONFIG_DIR.glob("sweep_*.yaml"))  # W&B sweep files (docs/sweeps.md)
RECIPES = [name for name in CONFIGS  # published ImageNet results
           if name not in ("digits.yaml", "digits_fast.yaml", "dummy.yaml", "finetune.yaml", "finetune_digits.yaml")]


@pytest.mark.parametrize("name", CONFIGS)
def test_config_loads_and_its_optimizer_options_fit(name):
    cfg = load_config(name)
    check_optimizer(cfg.optim)


@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_file_runs_train_py_under_torchrun_with_config_keys(name):
    """Every parameter the sweep varies is a config key that takes each of its values, on top of the command's
    --config; the agent's arguments (${args}) follow train.py under torchrun."""
    import yaml

    sweep = yaml.safe_load((CONFIG_DIR / name).read_text())
    command = sweep["command"]
    assert command[0] == "torchrun" and sweep["program"] == "train.py" and command[-1] == "${args}"
    base = command[command.index("--config") + 1]
    for key, spec in sweep["parameters"].items():
        section, leaf = key.split(".")
        for value in spec.get("values") or [spec["min"], spec["max"]]:
            assert getattr(getattr(load_config(base, [f"{key}={value}"]), section), leaf) == value
    assert sweep["metric"]["name"] == "best_val_top1"  # what the run summary holds (docs/sweeps.md)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_states_source_published_top1_and_global_batch(name):
    """The header says where the recipe comes from and what it reached, and docs/recipes.md's table lists it."""
    header = "".join(line for line in (CONFIG_DIR / name).read_text().splitlines(True) if line.startswith("#"))
    assert re.search(r"https://\S+", header) and re.search(r"\d+(\.\d+)?% top-1", header), header
    assert "global batch" in header and "Rescaling" in header, header
    assert f"[`{name}`](../configs/{name})" in (REPO / "docs" / "recipes.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_config_trains_two_steps_on_dummy_data(name, tmp_path):
    cfg = load_config(name)
    argv = ["--config", name, *SMALL, *recipe_test_model(cfg.model.name), f"output_dir={tmp_path / 'run'}"]
    if cfg.data.size_schedule:  # SMALL's 32 px is where it must end
        argv.append("data.size_schedule=[[0, 24], [1, 32]]")
    if cfg.distill.teacher_name:  # the recipe's teacher is required: a tiny one, made here
        from timm import create_model

        torch.save(create_model("test_resnet", num_classes=4).state_dict(), tmp_path / "teacher.pth")
        argv += ["distill.teacher_name=test_resnet", f"distill.teacher_weights={tmp_path / 'teacher.pth'}"]
    assert report_errors(train.main, argv) == 0
    assert torch.load(tmp_path / "run" / "last.pth", weights_only=True)["global_step"] == 2


# ---- fidelity to the sources: schedule, init, and the table in docs/correctness.md (issue 31) ---------------

SOURCE_BATCH = {"resnet50.yaml": 2048, "convnext_tiny.yaml": 4096, "deit_small.yaml": 1024,
                "deit_small_distilled.yaml": 1024, "resnet50_rsb_a3.yaml": 2048, "resnet50_torchvision.yaml": 1024,
                "vit_large_mae_finetune.yaml": 1024}  # the global batch each published


def source_lr(cfg, name: str) -> float:
    ratio = SOURCE_BATCH[name] / cfg.optim.lr_base_size
    return cfg.optim.lr_base * (ratio ** 0.5 if cfg.optim.lr_base_scale == "sqrt" else ratio)


def timm_epoch_lrs(cfg, lr: float, deit: bool = False) -> list[float]:
    """timm's scheduler built from the recipe's settings, one value per epoch, driven as timm's train.py (RSB) drives
    it (step(epoch) before epoch `epoch`'s updates, as its step(epoch + 1) after the previous one), or (deit) as
    DeiT's main.py does: step(epoch) after epoch `epoch`, so epoch e >= 1 trains at the value for e - 1."""
    from timm.scheduler import create_scheduler_v2

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler, _ = create_scheduler_v2(optimizer, "cosine", num_epochs=cfg.train.epochs, min_lr=cfg.sched.min_lr,
                                       warmup_lr=cfg.sched.warmup_lr, warmup_epochs=cfg.sched.warmup_epochs)
    lrs = []
    for epoch in range(cfg.train.epochs):
        if not deit:
            scheduler.step(epoch)
        lrs.append(optimizer.param_groups[0]["lr"])
        if deit:
            scheduler.step(epoch)
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


MAE_ARGS = {"epochs": 50, "warmup_epochs": 5, "min_lr": 1e-6}  # main_finetune.py: the ViT-L script and defaults


def mae_step_lrs(lr: float, per_epoch: int) -> list[float]:
    """MAE util/lr_sched.py adjust_learning_rate (formula as the source writes it), called before every iteration
    with the fractional epoch data_iter_step / len(data_loader) + epoch (engine_finetune.py)."""
    epochs, warmup, min_lr = MAE_ARGS["epochs"], MAE_ARGS["warmup_epochs"], MAE_ARGS["min_lr"]
    lrs = []
    for step in range(epochs * per_epoch):
        epoch = step % per_epoch / per_epoch + step // per_epoch
        if epoch < warmup:
            lrs.append(lr * epoch / warmup)
        else:
            lrs.append(min_lr + (lr - min_lr) * 0.5 * (1. + math.cos(math.pi * (epoch - warmup) / (epochs - warmup))))
    return lrs


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_schedule_is_its_sources(name):
    """The lr of every step of the recipe (2 steps per epoch) from the config, against the source's own
    scheduler (torch's for torchvision, timm's for DeiT and RSB, each driven as its script drives it: DeiT's steps
    after each epoch) or its formula (NVIDIA, ConvNeXt)."""
    from engine.optim import build_scheduler
    from tests.compare import nvidia_cosine_lr

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
    if name == "vit_large_mae_finetune.yaml":
        assert got == pytest.approx(mae_step_lrs(lr, per_epoch), rel=1e-12, abs=1e-18)
        return
    if name == "resnet50.yaml":
        epochs = [nvidia_cosine_lr(lr, cfg.sched.warmup_epochs, cfg.train.epochs, e) for e in range(cfg.train.epochs)]
    elif name == "resnet50_torchvision.yaml":
        epochs = torchvision_epoch_lrs(cfg, lr)
    else:
        epochs = timm_epoch_lrs(cfg, lr, deit=name.startswith("deit_"))
    assert got == pytest.approx([v for v in epochs for _ in range(per_epoch)], rel=1e-9, abs=1e-15)


def mae_param_groups(model: torch.nn.Module, weight_decay: float, layer_decay: float) -> dict[str, tuple]:
    """MAE util/lr_decay.py param_groups_lrd with get_layer_id_for_vit (as the source writes them):
    (lr_scale, weight_decay) per parameter name."""
    num_layers = len(model.blocks) + 1
    layer_scales = list(layer_decay ** (num_layers - i) for i in range(num_layers + 1))
    no_weight_decay_list = model.no_weight_decay()
    groups = {}
    for name, param in model.named_parameters():
        if name in ["cls_token", "pos_embed"] or name.startswith("patch_embed"):
            layer_id = 0
        elif name.startswith("blocks"):
            layer_id = int(name.split(".")[1]) + 1
        else:
            layer_id = num_layers
        decay = 0. if param.ndim == 1 or name in no_weight_decay_list else weight_decay
        groups[name] = (layer_scales[layer_id], decay)
    return groups


def narrow_vit_large() -> tuple:
    """(the MAE recipe's config, its ViT-L/16 narrowed to 16 wide at 32 px: ViT-L's 24 blocks and tensor names)."""
    from models.factory import create_model

    cfg = load_config("vit_large_mae_finetune", ["model.init_from=", "model.kwargs.embed_dim=16",
                                                 "model.kwargs.num_heads=2", "model.kwargs.img_size=32"])
    return cfg, create_model(cfg.model, 10)


def test_global_pool_is_maes_models_vit():
    """model.kwargs.global_pool=avg: the logits are MAE's models_vit.py forward_features with --global_pool (the mean
    of the patch tokens without the class token, then fc_norm; no final norm) and head, on the model's own layers."""
    _, model = narrow_vit_large()
    model.eval()
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    x = model.patch_embed(images)
    x = torch.cat((model.cls_token.expand(2, -1, -1), x), dim=1) + model.pos_embed
    for block in model.blocks:
        x = block(x)
    expected = model.head(model.fc_norm(x[:, 1:, :].mean(dim=1)))
    torch.testing.assert_close(model(images), expected, rtol=0, atol=0)


def test_layer_decay_and_weight_decay_are_maes_for_its_vit():
    """optim.layer_decay (timm's param_groups_layer_decay) gives every tensor of the recipe's ViT (24 blocks, global
    pooling: fc_norm and no final norm) MAE's lr scale and weight decay. (With the class token's final norm, timm
    would scale that norm by 0.75 where MAE's --cls_token keeps 1.)"""
    from engine.optim import build_optimizer

    cfg, model = narrow_vit_large()
    names = {id(param): name for name, param in model.named_parameters()}
    ours = {names[id(param)]: (group["lr_scale"], group["weight_decay"])
            for group in build_optimizer(model, cfg.optim).param_groups for param in group["params"]}
    theirs = mae_param_groups(model, cfg.optim.weight_decay, cfg.optim.layer_decay)
    assert len(model.blocks) == 24 and "fc_norm.weight" in theirs and "norm.weight" not in theirs
    assert ours == theirs


def test_mae_weights_converted_as_the_header_says_start_the_recipes_model(tmp_path, capsys):
    """MAE's pre-trained file ({"model": the class-token encoder, norm.* and no fc_norm}) is refused in one line by the
    global-pool ViT; the header's conversion, run here as written, makes it fit: every tensor from the file, fc_norm at
    ones and zeros (main_finetune.py's fresh LayerNorm), the class token's final norm dropped."""
    import subprocess
    import sys

    from timm import create_model as timm_create_model

    from engine.checkpoint.weights import check_pretrained, read_pretrained
    from models.factory import create_model

    name = "vit_large_mae_finetune.yaml"
    overrides = [*(arg for arg in SMALL if not arg.startswith("model.init_from")), *recipe_test_model("vit"),
                 f"output_dir={tmp_path / 'run'}"]
    encoder = timm_create_model("test_vit", img_size=32, num_classes=0)  # the pre-trained encoder: no head
    torch.save({"model": encoder.state_dict()}, tmp_path / "mae_pretrain_vit_large.pth")
    argv = ["--dry-run", "--config", name, *overrides]
    assert report_errors(train.main, [*argv, f"model.init_from={tmp_path / 'mae_pretrain_vit_large.pth'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "missing: fc_norm.weight, fc_norm.bias; unexpected: norm.weight, norm.bias" in err, err

    command = next(line for line in (CONFIG_DIR / name).read_text().splitlines() if 'python -c "' in line)
    subprocess.run(command.lstrip("# ").replace("python", sys.executable, 1), shell=True, cwd=tmp_path, check=True)
    converted = tmp_path / "mae_vit_large_avgpool.pth"
    assert report_errors(train.main, [*argv, f"model.init_from={converted}"]) == 0

    pretrained = read_pretrained(converted)
    model = create_model(load_config(name, overrides).model, 4, pretrained.state_dict, pretrained.source)
    check_pretrained(model, pretrained)
    state = model.state_dict()
    assert torch.equal(state["fc_norm.weight"], torch.ones(64)) and torch.equal(state["fc_norm.bias"], torch.zeros(64))
    for key, tensor in encoder.state_dict().items():
        if not key.startswith("norm."):
            assert torch.equal(state[key], tensor), key


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


def test_nvidia_conv_init_is_its_layer_builders():
    """configs/resnet50.yaml draws every convolution as NVIDIA's LayerBuilder.conv (image_classification/models/
    common.py): nn.init.kaiming_normal_(conv.weight, mode=self.config.conv_init, nonlinearity="relu"), conv_init
    "fan_in" (ResNet.Params); timm's fan_out would give the stem std sqrt(2 / 3136) = 0.025, fan_in sqrt(2 / 147)."""
    from models.factory import create_model

    cfg = load_config("resnet50.yaml").model
    torch.manual_seed(0)
    timms = create_model(dataclasses.replace(cfg, conv_init=""), 10)  # its RNG state then feeds the redraw
    convs = [m for m in timms.modules() if isinstance(m, torch.nn.Conv2d)]
    expected = [torch.nn.init.kaiming_normal_(torch.empty_like(c.weight), mode="fan_in", nonlinearity="relu")
                for c in convs]
    torch.manual_seed(0)
    ours = [m for m in create_model(cfg, 10).modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(ours) == 53 and all(torch.equal(c.weight, e) for c, e in zip(ours, expected))
    assert abs(ours[0].weight.std() - math.sqrt(2 / 147)) < 0.005 and abs(convs[0].weight.std() - 0.025) < 0.002


def test_nvidia_weight_decay_skips_only_names_with_bn():
    """configs/resnet50.yaml decays as NVIDIA's get_sgd_optimizer (image_classification/optimizers.py): bn_params
    = [v for n, v in parameters if "bn" in n] at weight_decay 0, the rest decayed. Its 4 downsample BatchNorms
    (downsample.1, weight and bias) and fc.bias are decayed there: 9 tensors where timm's 1-D rule differs."""
    from engine.optim import build_optimizer
    from models.factory import create_model

    cfg = load_config("resnet50.yaml")
    model = create_model(cfg.model, 10)
    parameters = list(model.named_parameters())
    bn_params = [v for n, v in parameters if "bn" in n]  # NVIDIA's, as written
    rest_params = [v for n, v in parameters if not "bn" in n]  # noqa: E713
    expected = {id(v): 0 for v in bn_params} | {id(v): cfg.optim.weight_decay for v in rest_params}

    def decay_of(optimizer) -> dict[int, float]:
        return {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}

    ours = decay_of(build_optimizer(model, cfg.optim))
    timms = decay_of(build_optimizer(model, dataclasses.replace(cfg.optim, no_decay_match="")))
    assert ours == expected
    differ = [n for n, v in parameters if timms[id(v)] != ours[id(v)]]
    assert len(differ) == 9 and "fc.bias" in differ and all("downsample.1" in n for n in differ if n != "fc.bias")


def test_torchvision_weight_decay_skips_only_norm_layers():
    """resnet50_torchvision.yaml: torchvision's set_weight_decay with --norm-weight-decay 0 (its
    split_normalization_params, run here on the same model) decays fc.bias, which timm's 1-D rule would not."""
    from torchvision.ops._utils import split_normalization_params

    from engine.optim import build_optimizer
    from models.factory import create_model

    cfg = load_config("resnet50_torchvision.yaml")
    model = create_model(cfg.model, 10)
    norm, _ = split_normalization_params(model)
    expected = {id(p): 0.0 if any(p is q for q in norm) else cfg.optim.weight_decay for p in model.parameters()}
    optimizer = build_optimizer(model, cfg.optim)
    ours = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    assert ours == expected and ours[id(model.fc.bias)] == cfg.optim.weight_decay


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


# The sources' precision: DeiT main.py (--amp default, torch.cuda.amp + NativeScaler: a default GradScaler), timm
# train.py --amp for RSB A3 (native AMP, a default GradScaler), NVIDIA's --amp --static-loss-scale 128, ConvNeXt
# main.py (--use_amp false by default) and torchvision's recipe command (no --amp): fp32.
SOURCE_PRECISION = {"deit_small.yaml": ("fp16", 0.0), "deit_small_distilled.yaml": ("fp16", 0.0),
                    "resnet50_rsb_a3.yaml": ("fp16", 0.0), "resnet50.yaml": ("fp16", 128.0),
                    "convnext_tiny.yaml": ("off", 0.0), "resnet50_torchvision.yaml": ("off", 0.0)}


def scales(scaler: torch.amp.GradScaler, overflow_at: set[int], steps: int = 2100) -> list[float]:
    """The scale after each of `steps` optimizer steps of a one-weight model, with inf gradients at `overflow_at`."""
    weight = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    found = []
    for step in range(steps):
        loss = weight.sum() * (float("inf") if step in overflow_at else 1.0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        found.append(scaler.get_scale())
    return found


@pytest.mark.parametrize("name", sorted(SOURCE_PRECISION))
def test_recipe_precision_is_its_sources(name):
    """Each recipe trains in its source's precision; fp16's GradScaler behaves as the source builds it (NVIDIA:
    GradScaler(init_scale=128, growth_factor=2, backoff_factor=0.5, growth_interval=1000000000), image_classification
    /training.py; the others torch's default), stepped side by side through overflows and 2,100 good steps."""
    cfg = load_config(name)
    mode, scale = SOURCE_PRECISION[name]
    assert (cfg.amp, cfg.loss_scale) == (mode, scale)
    if mode != "fp16":
        return
    ours, theirs = scaler_runs(cfg.loss_scale)
    assert ours == theirs
    assert (ours[-1] == 16.0) if scale else (ours[-1] > ours[100])  # static: only halved; dynamic: grown again


@functools.lru_cache
def scaler_runs(loss_scale: float) -> tuple[list[float], list[float]]:
    """The app's GradScaler for `loss_scale` and the source's, through the same overflows (once per scale)."""
    from engine.precision import grad_scaler

    theirs = (torch.amp.GradScaler("cpu", init_scale=128, growth_factor=2, backoff_factor=0.5,
                                   growth_interval=1000000000) if loss_scale else torch.amp.GradScaler("cpu"))
    overflows = {3, 40, 41}
    return scales(grad_scaler("cpu", loss_scale), overflows), scales(theirs, overflows)
