"""The training loss for train.loss: cross-entropy (soft-target with mixup/cutmix) or binary cross-entropy.

With mixing the targets arrive as probabilities with label smoothing already folded in (data.mixing), so
the loss smooths nothing itself; evaluation always reports plain cross-entropy (val_loss).

Long-tailed data (train.class_weights, train.class_weights_from_epoch, train.logit_adjustment) trains with
ImbalancedCrossEntropy. Class weights w weight each image's whole (smoothed) cross-entropy by w[y_i] (soft
targets: sum_c w[c] p_ic, the target's mean weight), averaged over the N images of the batch: sum_i w_i l_i / N.
Not torch's CrossEntropyLoss(weight=w): its label smoothing weights each class's uniform term by w[c], which
moves every image's own optimum towards the heavy classes (at 142:1 and smoothing 0.1, a class-0 image's target
put 0.36 on class 9 and 0.23 on its own class). Not torch's weighted mean (divided by sum_i w[y_i]) either: that
denominator differs between the processes' batches, and DDP's average of per-process means would then differ
from one process's mean over the global batch; nor did it help: at 142:1 it diverged as the /N mean did.

Why sklearn's balanced weights diverge at 142:1 with lr 0.1 (docs/benchmarks.md 12b): the rarest class's weight
is n / (C x 1) = 36, so the batch holding its one image gives it 36/64 of the batch's mean loss, a step
36x an ordinary image's; the sampler (data.sampler=class_balanced) spreads the same expected gradient over 36
draws. Remedies: effective-number weights (Cui et al. 2019, normalised as the paper to sum to C, so the largest
is at most C and the loss scale drops to sum_c n_c w_c / n: with few images per class their ratios are
balanced's, so this is balanced at a smaller learning rate), deferred re-weighting (Cao et al. 2019: weights
from train.class_weights_from_epoch on, when the schedule's lr is small), or the logit-adjusted loss (Menon et al.
2021), which re-weights nothing: CE(logits + tau log prior, y), the prior from the global class counts.
"""

from __future__ import annotations

from typing import Callable

import torch
from timm.loss import BinaryCrossEntropy as TimmBinaryCrossEntropy
from torch import nn

from core.config import TrainConfig
from core.errors import UserError

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_loss(cfg: TrainConfig, mixing: bool, class_counts: list[int] | None = None,
               class_names: list[str] | None = None) -> Loss:
    """train.loss with train.label_smoothing applied once: on hard labels here, or in the mixed targets;
    `class_counts`: the training set's images per class (every rank reads the same), for the long-tail keys."""
    smoothing = 0.0 if mixing else cfg.label_smoothing
    if cfg.loss == "bce":  # multi-label (data.multi_label) trains with it; its targets are multi-hot rows
        return BinaryCrossEntropy(smoothing, cfg.bce_target_threshold, cfg.bce_pos_weight)
    if cfg.class_weights == "none" and not cfg.logit_adjustment:
        return nn.CrossEntropyLoss(label_smoothing=smoothing)  # class indices, or probabilities (soft targets)
    counts, names = class_counts or [], class_names or []
    weights = class_weights(cfg.class_weights, counts, names, cfg.class_weights_beta, cfg.class_weights_max)
    prior = log_prior(counts, names) * cfg.logit_adjustment if cfg.logit_adjustment else None
    return ImbalancedCrossEntropy(smoothing, weights, cfg.class_weights_from_epoch, prior)


def set_loss_epoch(loss: Loss, epoch: int) -> None:
    """Tells a loss that depends on the epoch (deferred re-weighting) which epoch trains next."""
    if isinstance(loss, ImbalancedCrossEntropy):
        loss.set_epoch(epoch)


HEAVY_SHARE = 0.25  # of a global batch's gradient, for one image: 7/64 trained well (20:1), 36/64 diverged (142:1)


def heavy_weight_warning(loss: Loss, class_names: list[str], global_batch: int) -> str | None:
    """A warning when one image of the heaviest class would take more than HEAVY_SHARE of its batch's gradient
    from the start (docs/benchmarks.md 12b); None otherwise, or when the weights are deferred."""
    if not isinstance(loss, ImbalancedCrossEntropy) or loss.weight is None or loss.from_epoch:
        return None
    heaviest = int(loss.weight.argmax())
    share = float(loss.weight[heaviest]) / global_batch
    if share <= HEAVY_SHARE:
        return None
    return (f"train.class_weights gives class {class_names[heaviest]} a weight of {float(loss.weight[heaviest]):.1f}: "
            f"one of its images takes {share:.0%} of a global batch of {global_batch}'s gradient, which diverged "
            "for epochs at 142:1 with lr 0.1 (docs/benchmarks.md 12b); consider train.class_weights=effective, "
            "train.class_weights_from_epoch or data.sampler=class_balanced")


def capped_note(cfg: TrainConfig, class_counts: list[int], class_names: list[str]) -> str | None:
    """The start-up line naming the classes whose balanced weight train.class_weights_max capped (None: none were),
    so that the weights a user asked for are never replaced without a word."""
    if cfg.class_weights != "balanced" or not cfg.class_weights_max or not class_counts or min(class_counts) == 0:
        return None
    whole = class_weights("balanced", class_counts, class_names)
    capped = [f"{name} {float(w):.1f}" for name, w in zip(class_names, whole) if w > cfg.class_weights_max]
    if not capped:
        return None
    more = f", and {len(capped) - 10} more" if len(capped) > 10 else ""
    return (f"train.class_weights=balanced: {len(capped)} class(es) weighted {cfg.class_weights_max:g} "
            f"(train.class_weights_max) instead of scikit-learn's {', '.join(capped[:10])}{more}; "
            "train.class_weights_max=0 keeps them (docs/data.md says why they are capped)")


def empty_classes(setting: str, class_counts: list[int], class_names: list[str],
                  what: str = "weight would be infinite", other: str = ", or give train.class_weights as a list") -> None:
    """A class without training images has an infinite weight (or a log prior of -inf): refused in one line."""
    empty = [name for name, n in zip(class_names, class_counts) if n == 0]
    if empty:
        raise UserError(f"{setting}: the training set has no images of class(es) {', '.join(empty[:10])}, whose "
                        f"{what}; add images of them, remove their folders{other}")


def class_weights(setting: str | list[float], class_counts: list[int], class_names: list[str],
                  beta: float = 0.9999, cap: float = 0.0) -> torch.Tensor | None:
    """train.class_weights as a float32 tensor (None: none), from the training labels' class counts, which every
    rank reads alike. balanced is scikit-learn's, n_samples / (n_classes x count of the class), each at most `cap`
    (train.class_weights_max; 0 = none); effective is Cui et al.'s (1 - beta) / (1 - beta^count), scaled to sum to
    the class count as their paper does."""
    if setting == "none":
        return None
    if setting in ("balanced", "effective"):
        empty_classes(f"train.class_weights={setting}", class_counts, class_names)
        counts = torch.tensor(class_counts, dtype=torch.float64)
        if setting == "balanced":
            weights = counts.sum() / (len(counts) * counts)
            return (weights.clamp(max=cap) if cap else weights).float()
        inverse = (1 - beta) / (1 - beta ** counts)
        return (inverse * len(counts) / inverse.sum()).float()
    if len(setting) != len(class_names):
        raise UserError(f"train.class_weights has {len(setting)} weights but the data has {len(class_names)} "
                        f"classes ({', '.join(class_names[:5])}{', ...' if len(class_names) > 5 else ''}); give one "
                        "weight per class, in class order")
    return torch.tensor(setting, dtype=torch.float32)


def log_prior(class_counts: list[int], class_names: list[str]) -> torch.Tensor:
    """log(count_c / n) of the training set's global class counts, float32, for train.logit_adjustment."""
    empty_classes("train.logit_adjustment", class_counts, class_names, "log prior would be -inf",
                  ", or set train.logit_adjustment=0")
    counts = torch.tensor(class_counts, dtype=torch.float64)
    return (counts / counts.sum()).log().float()


class ImbalancedCrossEntropy(nn.Module):
    """Cross-entropy with per-image class weights (from epoch `from_epoch` on: set_epoch) and/or logit
    adjustment (`adjust` = tau x log prior, added to the logits), in float32 (see the module's docstring);
    its tensors move to the logits' device on the first call (the loss is built before the device is known)."""

    def __init__(self, smoothing: float, weight: torch.Tensor | None, from_epoch: int = 0,
                 adjust: torch.Tensor | None = None) -> None:
        super().__init__()
        self.smoothing, self.from_epoch, self.weighted = smoothing, from_epoch, from_epoch == 0
        self.weight, self.adjust = weight, adjust

    def set_epoch(self, epoch: int) -> None:
        """Deferred re-weighting: the weights apply from from_epoch on, a function of the epoch alone (a resumed
        run sets its epoch as the uninterrupted run did)."""
        self.weighted = epoch >= self.from_epoch

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.adjust is not None:
            self.adjust = self.adjust.to(logits.device)
            logits = logits + self.adjust
        soft = targets.is_floating_point()
        per_image = nn.functional.cross_entropy(logits, targets.float() if soft else targets,
                                                label_smoothing=self.smoothing, reduction="none")
        if self.weight is None or not self.weighted:
            return per_image.mean()
        self.weight = self.weight.to(logits.device)
        image_weight = targets.float() @ self.weight if soft else self.weight[targets]
        return (image_weight * per_image).mean()


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
