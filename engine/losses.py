"""The training loss for train.loss: cross-entropy (soft-target with mixup/cutmix) or binary cross-entropy.

With mixing the targets arrive as probabilities with label smoothing already folded in (data.mixing), so
the loss smooths nothing itself; evaluation always reports plain cross-entropy (val_loss).
"""

from __future__ import annotations

from typing import Callable

import torch
from timm.loss import BinaryCrossEntropy as TimmBinaryCrossEntropy
from torch import nn

from engine.config import TrainConfig

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_loss(cfg: TrainConfig, mixing: bool) -> Loss:
    """train.loss with train.label_smoothing applied once: on hard labels here, or in the mixed targets."""
    smoothing = 0.0 if mixing else cfg.label_smoothing
    if cfg.loss == "bce":  # multi-label (data.multi_label) trains with it; its targets are multi-hot rows
        return BinaryCrossEntropy(smoothing, cfg.bce_target_threshold, cfg.bce_pos_weight)
    return nn.CrossEntropyLoss(label_smoothing=smoothing)  # class indices, or probabilities (soft targets)


class BinaryCrossEntropy(nn.Module):
    """timm's BinaryCrossEntropy (one sigmoid per class, as the "ResNet strikes back" recipes train) on float32
    logits and targets: under autocast timm would build its one-hot targets in bf16/fp16."""

    def __init__(self, smoothing: float, target_threshold: float | None = None,
                 pos_weight: float | None = None) -> None:
        super().__init__()
        self.smoothing = smoothing
        self.bce = TimmBinaryCrossEntropy(smoothing, target_threshold=target_threshold, pos_weight=pos_weight)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.bce.pos_weight is not None and self.bce.pos_weight.device != logits.device:
            self.bce.to(logits.device)  # once: the loss is built before the device is known
        if targets.is_floating_point() and self.smoothing:  # multi-hot rows: timm smooths class indices only;
            # its values (data.mixing.smooth_multi_hot): smoothing / C off, 1 - smoothing + smoothing / C on
            off = self.smoothing / targets.shape[1]
            targets = torch.where(targets > 0, 1.0 - self.smoothing + off, off).float()
        return self.bce(logits.float(), targets.float() if targets.is_floating_point() else targets)
