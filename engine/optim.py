"""Optimizer and LR schedule from timm, configured by the optim and sched sections."""

from __future__ import annotations

import torch
from timm.optim import create_optimizer_v2, get_optimizer_class
from timm.scheduler import create_scheduler_v2
from timm.scheduler.scheduler import Scheduler
from torch import nn

from engine.config import OptimConfig, SchedConfig
from engine.errors import UserError


# torch optimizers with a fused step on both CPU and CUDA (one kernel per step instead of one per tensor).
FUSED_CLASSES = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def fused_kwargs(name: str) -> dict:
    """{"fused": True} when timm maps `name` to a torch optimizer with a fused step, else {}.

    It is the same arithmetic, rounded differently in the last bits (not bitwise equal to the per-tensor
    step); on this CPU it is 2-3x faster (benchmarks/optimizer_step.py).
    """
    try:
        cls = get_optimizer_class(name, bind_defaults=False)
    except Exception:  # unknown name, or an optimizer needing CUDA libraries: timm's own error comes later
        return {}
    return {"fused": True} if cls in FUSED_CLASSES else {}


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """timm optimizer (fused when torch has it); norm weights and biases get no weight decay if no_decay_norm_bias."""
    try:
        return create_optimizer_v2(model, opt=cfg.name, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                   momentum=cfg.momentum, filter_bias_and_bn=cfg.no_decay_norm_bias,
                                   **fused_kwargs(cfg.name))
    except (AssertionError, ValueError) as err:
        raise UserError(f"optim.name {cfg.name!r} is not a timm optimizer ({err})") from None


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedConfig, epochs: int,
                    updates_per_epoch: int) -> Scheduler:
    """timm scheduler stepped every optimizer update (`step_update`), so warmup is smooth."""
    try:
        scheduler, _ = create_scheduler_v2(optimizer, sched=cfg.name, num_epochs=epochs,
                                           warmup_epochs=cfg.warmup_epochs, warmup_lr=cfg.warmup_lr,
                                           min_lr=cfg.min_lr, step_on_epochs=False,
                                           updates_per_epoch=updates_per_epoch)
    except (AssertionError, ValueError) as err:
        raise UserError(f"sched.name {cfg.name!r} is not usable ({err})") from None
    if scheduler is None:
        raise UserError(f"sched.name {cfg.name!r} is not a timm scheduler; try cosine, step or multistep")
    return scheduler
