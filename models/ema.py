"""An exponential moving average of the weights (timm's ModelEmaV3), kept when model.ema_decay > 0."""

from __future__ import annotations

from timm.utils import ModelEmaV3
from torch import nn


def create_ema(model: nn.Module, decay: float) -> ModelEmaV3 | None:
    """The EMA of `model` (placed and formatted like it), or None when decay is 0."""
    return ModelEmaV3(model, decay=decay) if decay > 0 else None
