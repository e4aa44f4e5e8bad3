"""Test-time augmentation: a model's softmax probabilities averaged over views of each image.

The views are the image (or, with 5 crops, each of the five crops that data.transforms.ResizeFiveCrop stacks top
to bottom) and, with flip, its horizontal mirror. The wrapper returns log(mean of the views' probabilities), so
cross-entropy, top-k and softmax downstream read the averaged probabilities as they read logits. Each image's
result depends only on its own views, in a fixed order: the same for any batch split or number of processes.
"""

from __future__ import annotations

import math

import torch
from torch import nn

CROPS = (1, 5)  # centre crop; centre + four corners


class TTAModel(nn.Module):
    """`model` applied to every view of the batch; returns the log of the views' mean softmax probabilities."""

    def __init__(self, model: nn.Module, flip: bool, crops: int) -> None:
        super().__init__()
        if crops not in CROPS:
            raise ValueError(f"crops must be one of {CROPS}, got {crops}")
        self.model, self.flip, self.crops = model, flip, crops

    def views(self, images: torch.Tensor) -> list[torch.Tensor]:
        """Each crop (a horizontal band of the stacked image), then, with flip, each crop mirrored."""
        crops = list(images.chunk(self.crops, dim=2)) if self.crops > 1 else [images]
        return crops + [crop.flip(3) for crop in crops] if self.flip else crops

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        log_probs = torch.stack([self.model(view).float().log_softmax(dim=1) for view in self.views(images)])
        return log_probs.logsumexp(dim=0) - math.log(len(log_probs))  # log mean exp: no underflow to log(0)


def describe(flip: bool, crops: int) -> dict[str, object]:
    """What eval.json / predictions.json record of the test-time augmentation in use."""
    return {"flip": flip, "crops": crops, "views": crops * (2 if flip else 1),
            "average": "softmax probabilities" if flip or crops > 1 else "none (one view)"}
