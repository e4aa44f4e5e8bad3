"""Random erasing filled as timm fills it: N(0, 1) in normalized units, unbounded (data.random_erase_fill=normalized).

timm's RandomErasing runs after ToTensor + Normalize (in the transform, or on the device in its prefetcher): mode
pixel fills each erased value with N(0, 1), rand one N(0, 1) per channel, const 0. The workers here hold uint8,
where such a fill is rounded and clipped (std 0.971, within [-2.12, 2.64] at ImageNet's mean/std: TimmErasing's
uint8 fill). With data.random_erase_fill=normalized the workers draw only the boxes (`TimmErasing.draw`: the same
boxes as the uint8 fill, from the sample's seeded RNG) and a seed per box; `EraseCollate` ships them beside the
uint8 batch, and `NormalizedFill` fills them after DeviceNormalize and before mixing (timm erases in the
transform, before Mixup), each box from a generator on the device seeded with its seed.

A box's fill is so a pure function of its sample's key (seed, epoch, index[, repeat]): the same for any world
size, number of workers or batch, and on resume, on one device type (CPU and CUDA generators draw different
numbers from one seed, as their dropout does). The boxes travel as a list, not a tensor: the fill slices the
images with them on the host, and a tensor moved to the device would have to be read back, waiting for it.
"""

from __future__ import annotations

from typing import Callable

import torch

Box = tuple[int, int, int, int, int, int]  # (row of the batch, y0, y1, x0, x1, seed of the fill)


class EraseCollate:
    """Wraps a collate (collate_readable, MixCollate) of samples that carry their boxes third (data.datasets):
    the wrapped collate's batch, then the list of every box of its rows, (row, y0, y1, x0, x1, seed)."""

    def __init__(self, collate: Callable[[list], tuple]) -> None:
        self.collate = collate

    def __call__(self, samples: list) -> tuple:
        batch = self.collate([sample and sample[:2] + sample[3:] for sample in samples])
        kept = [sample for sample in samples if sample is not None]  # the rows collate_readable keeps
        boxes: list[Box] = [(row, *box) for row, sample in enumerate(kept) for box in sample[2]]
        return (*batch, boxes)


class NormalizedFill:
    """(normalized images, boxes) -> the images with each box filled as timm's RandomErasing `mode` does after
    normalization: pixel N(0, 1) per value, rand N(0, 1) per channel, const 0 (in place)."""

    def __init__(self, mode: str, device: torch.device) -> None:
        self.mode = mode
        self.generator = torch.Generator(device)

    def __call__(self, images: torch.Tensor, boxes: list[Box]) -> torch.Tensor:
        channels = images.shape[1]
        for row, y0, y1, x0, x1, seed in boxes:
            region = images[row, :, y0:y1, x0:x1]
            if self.mode == "const":
                region.zero_()
                continue
            shape = (channels, y1 - y0, x1 - x0) if self.mode == "pixel" else (channels, 1, 1)
            self.generator.manual_seed(seed)
            region.copy_(torch.randn(shape, generator=self.generator, device=images.device, dtype=images.dtype))
        return images
