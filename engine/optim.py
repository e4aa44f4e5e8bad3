"""Optimizer and LR schedule from timm, configured by the optim and sched sections."""

from __future__ import annotations

import dataclasses
import inspect

import torch
from timm.optim import create_optimizer_v2, get_optimizer_class, get_optimizer_info
from timm.scheduler import create_scheduler_v2
from timm.scheduler.scheduler import Scheduler
from torch import nn

from engine.config import Config, OptimConfig, SchedConfig
from engine.errors import UserError


# torch optimizers with a fused step on both CPU and CUDA (one kernel per step instead of one per tensor).
FUSED_CLASSES = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def fused_kwargs(name: str, grad_scaler: bool = False) -> dict:
    """{"fused": True} when timm maps `name` to a torch optimizer with a fused step, else {}.

    It is the same arithmetic, rounded differently in the last bits (not bitwise equal to the per-tensor
    step), and faster (benchmarks/optimizer_step.py). Never fused SGD under a GradScaler: the fused kernel
    takes the scaler's found_inf flag instead of being skipped, and on a skipped first step it keeps momentum
    buffers made with empty_like, uninitialised (fused Adam/AdamW zero theirs: tests/test_gpu_path.py).
    """
    try:
        cls = get_optimizer_class(name, bind_defaults=False)
    except Exception:  # unknown name, or an optimizer needing CUDA libraries: timm's own error comes later
        return {}
    if cls is torch.optim.SGD and grad_scaler:
        return {}
    return {"fused": True} if cls in FUSED_CLASSES else {}


def check_optimizer(cfg: OptimConfig) -> None:
    """Refuse an unknown optimizer, or betas/eps/nesterov it does not take, at start-up (also under --dry-run)."""
    try:
        info = get_optimizer_info(cfg.name)
    except ValueError as err:
        raise UserError(f"optim.name {cfg.name!r} is not a timm optimizer ({err})") from None
    if cfg.betas and not info.has_betas:
        raise UserError(f"optim.betas: optimizer {cfg.name!r} has no betas; remove optim.betas or use an "
                        "Adam-family optimizer (adamw, lamb, ...)")
    if cfg.eps is not None and not info.has_eps:
        raise UserError(f"optim.eps: optimizer {cfg.name!r} has no eps; remove optim.eps")
    if cfg.nesterov is not None:
        try:
            takes_it = "nesterov" in inspect.signature(get_optimizer_class(cfg.name, bind_defaults=False)).parameters
        except Exception:  # an optimizer needing CUDA libraries: building it reports that
            takes_it = True
        if not takes_it:
            raise UserError(f"optim.nesterov: optimizer {cfg.name!r} has no Nesterov option; remove optim.nesterov "
                            "(SGD-family optimizers take it: sgd, momentum, sgdw, lars)")


def with_scaled_lr(cfg: Config, world_size: int) -> Config:
    """cfg with optim.lr computed from optim.lr_base for the global batch (timm's train.py rule), if lr_base is set.

    The computed lr replaces optim.lr, so config.yaml and the checkpoints show the lr the run used.
    """
    optim = cfg.optim
    if not optim.lr_base:
        return cfg
    ratio = cfg.train.batch_size * world_size * cfg.train.accum_steps / optim.lr_base_size
    lr = optim.lr_base * (ratio ** 0.5 if optim.lr_base_scale == "sqrt" else ratio)
    return dataclasses.replace(cfg, optim=dataclasses.replace(optim, lr=lr))


def scaled_lr_note(cfg: Config, world_size: int) -> str:
    """How with_scaled_lr got optim.lr, for the start-up log."""
    global_batch = cfg.train.batch_size * world_size * cfg.train.accum_steps
    return (f"optim.lr {cfg.optim.lr:g} = optim.lr_base {cfg.optim.lr_base:g} x global batch {global_batch} / "
            f"{cfg.optim.lr_base_size} ({cfg.optim.lr_base_scale})")


def build_optimizer(model: nn.Module, cfg: OptimConfig, grad_scaler: bool = False) -> torch.optim.Optimizer:
    """timm optimizer (fused when that is safe); norm weights and biases get no weight decay if no_decay_norm_bias.

    `grad_scaler`: the run steps through a GradScaler (fp16), which rules out fused SGD.
    """
    knobs = {"betas": tuple(cfg.betas) if cfg.betas else None, "eps": cfg.eps, "nesterov": cfg.nesterov}
    knobs = {key: value for key, value in knobs.items() if value is not None}  # unset: the optimizer's default
    try:
        return create_optimizer_v2(model, opt=cfg.name, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                   momentum=cfg.momentum, filter_bias_and_bn=cfg.no_decay_norm_bias,
                                   layer_decay=cfg.layer_decay or None,
                                   **{**fused_kwargs(cfg.name, grad_scaler), **knobs, **cfg.kwargs})
    except (AssertionError, ValueError) as err:
        raise UserError(f"optim.name {cfg.name!r} is not a timm optimizer ({err})") from None
    except TypeError as err:  # an optim.kwargs entry this optimizer does not take
        raise UserError(f"optimizer {cfg.name!r} rejected optim.kwargs {cfg.kwargs} ({err}); "
                        "remove or rename the option") from None


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedConfig, epochs: int,
                    updates_per_epoch: int) -> Scheduler:
    """timm scheduler stepped every optimizer update (`step_update`), so warmup is smooth.

    Every length is converted to optimizer updates here, in one place (timm then counts in updates:
    updates_per_epoch=1), which lets warmup be given in steps as well as in epochs.
    """
    per_epoch = updates_per_epoch
    # timm applies a multistep milestone m at update m - 1 (its convention, kept for old recipes): + 1 starts
    # the decay with epoch m's first update, as torch's MultiStepLR does.
    milestones = [m * per_epoch + 1 for m in cfg.decay_milestones]
    decay = cfg.decay_epochs
    if not (cfg.name in ("wsd", "rsqrt") and 0 < decay < 1):  # wsd/rsqrt: a decay below 1 is a fraction
        decay = decay * per_epoch or None  # None: timm's default (wsd/rsqrt only: step needs decay_epochs)
    try:
        scheduler, _ = create_scheduler_v2(optimizer, sched=cfg.name,
                                           num_epochs=(epochs - cfg.cooldown_epochs) * per_epoch,
                                           warmup_epochs=cfg.warmup_steps or cfg.warmup_epochs * per_epoch,
                                           warmup_lr=cfg.warmup_lr, min_lr=cfg.min_lr, decay_epochs=decay,
                                           decay_milestones=milestones,
                                           decay_rate=cfg.decay_rate, step_on_epochs=False, updates_per_epoch=1)
    except (AssertionError, ValueError) as err:
        raise UserError(f"sched.name {cfg.name!r} is not usable ({err})") from None
    if scheduler is None:
        raise UserError(f"sched.name {cfg.name!r} is not a timm scheduler; try cosine, step or multistep")
    return scheduler


def check_scheduler(cfg: SchedConfig, epochs: int, updates_per_epoch: int) -> None:
    """Build the schedule once over a stand-in parameter, so start-up (and --dry-run) meets any error timm raises."""
    build_scheduler(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), cfg, epochs, updates_per_epoch)
