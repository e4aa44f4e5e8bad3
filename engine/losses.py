"""The training loss for train.loss: cross-entropy (soft-target with mixup/cutmix) or binary cross-entropy.

With mixing the targets arrive as probabilities with label smoothing already folded in (data.mixing), so
the loss smooths nothing itself; evaluation always reports plain cross-entropy (val_loss).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from engine.config import TrainConfig

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_loss(cfg: TrainConfig, mixing: bool) -> Loss:
    """train.loss with train.label_smoothing applied once: on hard labels here, or in the mixed targets."""
    smoothing = 0.0 if mixing else cfg.label_smoothing
    if cfg.loss == "bce":
        return BinaryCrossEntropy(smoothing)
    return nn.CrossEntropyLoss(label_smoothing=smoothing)  # class indices, or probabilities (soft targets)


class BinaryCrossEntropy(nn.Module):
    """One sigmoid per class against (smoothed) one-hot or soft targets, mean over all elements (timm's
    BinaryCrossEntropy, as the "ResNet strikes back" recipes train)."""

    def __init__(self, smoothing: float) -> None:
        super().__init__()
        self.smoothing = smoothing

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not targets.is_floating_point():
            off = self.smoothing / logits.shape[1]
            targets = torch.full(logits.shape, off, device=logits.device).scatter_(1, targets[:, None],
                                                                                  1.0 - self.smoothing + off)
        # float32 targets; under autocast the loss runs in float32 (an autocast fp32 op), never on bf16 targets
        return nn.functional.binary_cross_entropy_with_logits(logits, targets.float())
