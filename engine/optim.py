"""Optimizer and LR schedule from timm, configured by the optim and sched sections."""

from __future__ import annotations

import torch
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.scheduler.scheduler import Scheduler
from torch import nn

from engine.config import OptimConfig, SchedConfig
from engine.errors import UserError


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """timm optimizer; norm weights and biases get no weight decay when no_decay_norm_bias is set."""
    try:
        return create_optimizer_v2(model, opt=cfg.name, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                   momentum=cfg.momentum, filter_bias_and_bn=cfg.no_decay_norm_bias)
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
