"""An exponential moving average of the weights (timm's ModelEmaV3), kept when model.ema_decay > 0."""

from __future__ import annotations

from timm.utils import ModelEmaV3
from torch import nn


def create_ema(model: nn.Module, decay: float, warmup: bool = False) -> ModelEmaV3 | None:
    """The EMA of `model` (placed and formatted like it), or None when decay is 0.

    `warmup`: the decay grows with the global step passed to update() (1 - (1 + step)^(-2/3), capped at
    `decay`), so early weights, far from the trained ones, fade quickly; it needs no state of its own to resume.
    """
    return ModelEmaV3(model, decay=decay, use_warmup=warmup) if decay > 0 else None
