"""model.freeze=backbone: only the classifier trains, for the whole run or (model.freeze_epochs) its first epochs.

Frozen parameters get requires_grad=False, so they have no gradient and every optimizer step skips them (weight
decay and momentum included); frozen BatchNorm layers stay in eval mode whatever model.train() says: they
normalize with the weights' running statistics and never update them, so the backbone is a fixed feature
extractor (bitwise, buffers included) and the classifier learns on stable features.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.utils.hooks import RemovableHandle

from core.errors import UserError

log = logging.getLogger(__name__)


class Frozen:
    """The backbone of `model` frozen; `release()` makes the whole model trainable again (model.freeze_epochs)."""

    def __init__(self, model: nn.Module, handles: list[RemovableHandle]) -> None:
        self.model, self.handles = model, handles

    def release(self) -> None:
        """Every parameter trainable, every BatchNorm following model.train() again."""
        for param in self.model.parameters():
            param.requires_grad_(True)
        for handle in self.handles:
            handle.remove()
        self.handles = []


def freeze_backbone(model: nn.Module, epochs: int = 0) -> Frozen:
    """Linear probing: only the classifier (timm's get_classifier()) trains; `epochs` > 0 says in the log that it
    lasts that many epochs (model.freeze_epochs), 0 the whole run."""
    head = model.get_classifier()
    trainable = {id(p) for p in head.parameters()}
    if not trainable:
        raise UserError(f"model.freeze=backbone: {type(model).__name__} has no classifier parameters to train")
    for param in model.parameters():
        param.requires_grad_(id(param) in trainable)
    head_modules = set(head.modules())
    handles = [module.register_forward_pre_hook(stay_in_eval) for module in model.modules()
               if isinstance(module, nn.modules.batchnorm._BatchNorm) and module not in head_modules]
    until = f"for the first {epochs} epoch(s) (model.freeze_epochs), then the whole model" if epochs else "(the classifier)"
    log.info("model.freeze=backbone: training %d of %d parameter tensors %s", len(trainable),
             len(list(model.parameters())), until)
    return Frozen(model, handles)


def stay_in_eval(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook of a frozen BatchNorm layer: running statistics, never batch statistics or updates."""
    module.train(False)
