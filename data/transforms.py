"""The two albumentations presets (training, evaluation) and the normalization that follows them on the device.

The presets end in uint8 tensors; `DeviceNormalize` turns a batch into normalized float32 where the model
runs. Workers then ship uint8 (a quarter of float32's bytes, through shared memory and, on a GPU, host to
device) and skip the float conversion; the normalization is one elementwise pass on the device, as in
timm's prefetcher (docs/benchmarks.md measures the difference). Nothing else touches transforms.
"""

from __future__ import annotations

from collections.abc import Sequence

import albumentations as A
import cv2
import torch
from albumentations.pytorch import ToTensorV2

from engine.config import DataConfig

INTERPOLATION = {"bilinear": cv2.INTER_LINEAR, "bicubic": cv2.INTER_CUBIC, "nearest": cv2.INTER_NEAREST,
                 "area": cv2.INTER_AREA, "lanczos": cv2.INTER_LANCZOS4}  # data.interpolation -> OpenCV flag


def train_transform(cfg: DataConfig) -> A.Compose:
    """RandomResizedCrop + flip (+ colour jitter), as uint8; the eval preset when augment is off."""
    if not cfg.augment:
        return eval_transform(cfg)
    size = (cfg.img_size, cfg.img_size)
    steps: list[A.BasicTransform] = [
        A.RandomResizedCrop(size=size, scale=tuple(cfg.scale), ratio=tuple(cfg.ratio),
                            interpolation=INTERPOLATION[cfg.interpolation]),
        A.HorizontalFlip(p=cfg.hflip),
    ]
    if cfg.color_jitter > 0:
        strength = cfg.color_jitter
        steps.append(A.ColorJitter(brightness=strength, contrast=strength, saturation=strength, hue=0.0, p=0.8))
    return A.Compose([*steps, ToTensorV2()])


def eval_transform(cfg: DataConfig) -> A.Compose:
    """Resize the short side to img_size / crop_pct, centre crop img_size, as uint8."""
    resize_to = int(round(cfg.img_size / cfg.crop_pct))
    return A.Compose([
        A.SmallestMaxSize(max_size=resize_to, interpolation=INTERPOLATION[cfg.interpolation]),
        A.CenterCrop(height=cfg.img_size, width=cfg.img_size),
        ToTensorV2(),
    ])


class DeviceNormalize:
    """uint8 NCHW batch (NHWC in memory, from the loaders' collate) -> (x / 255 - mean) / std in float32."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], device: torch.device,
                 channels_last: bool) -> None:
        self.scale = torch.tensor([1 / (255 * s) for s in std], device=device)
        self.shift = torch.tensor([-m / s for m, s in zip(mean, std)], device=device)
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        pixels = images.permute(0, 2, 3, 1)  # channels last, so scale and shift broadcast per channel
        normalized = torch.addcmul(self.shift, pixels, self.scale).permute(0, 3, 1, 2)
        return normalized.contiguous(memory_format=self.memory_format)
