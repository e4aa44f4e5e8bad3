"""The training loss for train.loss: cross-entropy (soft-target with mixup/cutmix) or binary cross-entropy.

With mixing the targets arrive as probabilities with label smoothing already folded in (data.mixing), so
the loss smooths nothing itself; evaluation always reports plain cross-entropy (val_loss).

train.class_weights w are torch's CrossEntropyLoss `weight`, per image (reduction="none"), averaged over the
N images of the batch: hard labels give sum_i w[y_i] l_i / N (label smoothing's uniform term weights each class c
by w[c]), soft targets (mixing) sum_i sum_c w[c] p_ic (-log q_ic) / N. Not torch's weighted mean (divided by
sum_i w[y_i]): that denominator differs between the processes' batches, and DDP's average of per-process means
would then differ from one process's mean over the global batch. Balanced weights average 1 over the training
set, so the loss keeps its scale.
"""

from __future__ import annotations

from typing import Callable

import torch
from timm.loss import BinaryCrossEntropy as TimmBinaryCrossEntropy
from torch import nn

from core.config import TrainConfig
from core.errors import UserError

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_loss(cfg: TrainConfig, mixing: bool, class_weights: torch.Tensor | None = None) -> Loss:
    """train.loss with train.label_smoothing applied once: on hard labels here, or in the mixed targets;
    `class_weights`: one per class for cross-entropy (see class_weights())."""
    smoothing = 0.0 if mixing else cfg.label_smoothing
    if cfg.loss == "bce":  # multi-label (data.multi_label) trains with it; its targets are multi-hot rows
        return BinaryCrossEntropy(smoothing, cfg.bce_target_threshold, cfg.bce_pos_weight)
    if class_weights is not None:
        return WeightedCrossEntropy(class_weights, smoothing)
    return nn.CrossEntropyLoss(label_smoothing=smoothing)  # class indices, or probabilities (soft targets)


def class_weights(setting: str | list[float], class_counts: list[int], class_names: list[str]) -> torch.Tensor | None:
    """train.class_weights as a float32 tensor (None: none), from the training labels' class counts, which every
    rank reads alike. balanced is scikit-learn's: n_samples / (n_classes x count of the class)."""
    if setting == "none":
        return None
    if setting == "balanced":
        empty = [name for name, n in zip(class_names, class_counts) if n == 0]
        if empty:
            raise UserError(f"train.class_weights=balanced: the training set has no images of class(es) "
                            f"{', '.join(empty[:10])}, whose weight would be infinite; add images of them, remove "
                            "their folders, or give train.class_weights as a list")
        counts = torch.tensor(class_counts, dtype=torch.float64)
        return (counts.sum() / (len(counts) * counts)).float()
    if len(setting) != len(class_names):
        raise UserError(f"train.class_weights has {len(setting)} weights but the data has {len(class_names)} "
                        f"classes ({', '.join(class_names[:5])}{', ...' if len(class_names) > 5 else ''}); give one "
                        "weight per class, in class order")
    return torch.tensor(setting, dtype=torch.float32)


class WeightedCrossEntropy(nn.Module):
    """torch's CrossEntropyLoss with class weights per image, averaged over the images (see the module's
    docstring), on float32 logits and targets (as BinaryCrossEntropy); the weights move to the logits' device
    on the first call (the loss is built before the device is known)."""

    def __init__(self, weight: torch.Tensor, smoothing: float) -> None:
        super().__init__()
        self.ce = nn.CrossEntropyLoss(weight=weight, label_smoothing=smoothing, reduction="none")

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.ce.weight.device != logits.device:
            self.ce.to(logits.device)
        return self.ce(logits.float(), targets.float() if targets.is_floating_point() else targets).mean()


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
