"""The two albumentations presets (training, evaluation), the torchvision policies after them, and the
normalization that follows them on the device.

The presets end in uint8 tensors; `DeviceNormalize` turns a batch into normalized float32 where the model
runs. Workers then ship uint8 (a quarter of float32's bytes, through shared memory and, on a GPU, host to
device) and skip the float conversion; the normalization is one elementwise pass on the device, as in
timm's prefetcher (docs/benchmarks.md measures the difference). Nothing else touches transforms.

RandAugment, TrivialAugmentWide, AugMix, AutoAugment and random erasing (`tensor_augment`) come from
torchvision.transforms.v2 and run on the uint8 CHW tensor after the albumentations crop and flip
(albumentations 2.0.8, its last MIT release, has no RandAugment). They draw from torch's global RNG, which
data.datasets seeds per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import albumentations as A
import cv2
import torch
from albumentations.pytorch import ToTensorV2
from torchvision.transforms import v2

from engine.config import DataConfig, parse_auto_augment

TensorTransform = Callable[[torch.Tensor], torch.Tensor]  # uint8 CHW -> uint8 CHW


def train_transform(cfg: DataConfig) -> A.Compose:
    """RandomResizedCrop + flip (+ colour jitter), as uint8; the eval preset when augment is off."""
    if not cfg.augment:
        return eval_transform(cfg)
    size = (cfg.img_size, cfg.img_size)
    steps: list[A.BasicTransform] = [
        A.RandomResizedCrop(size=size, scale=tuple(cfg.scale), ratio=tuple(cfg.ratio),
                            interpolation=cv2.INTER_LINEAR),
        A.HorizontalFlip(p=cfg.hflip),
    ]
    if cfg.color_jitter > 0:
        strength = cfg.color_jitter
        steps.append(A.ColorJitter(brightness=strength, contrast=strength, saturation=strength, hue=0.0, p=0.8))
    return A.Compose([*steps, ToTensorV2()])


def tensor_augment(cfg: DataConfig) -> TensorTransform | None:
    """data.auto_augment's policy, then random erasing, on uint8 CHW tensors; None when both are off."""
    if not cfg.augment:
        return None
    steps: list[TensorTransform] = []
    policy, options = parse_auto_augment(cfg.auto_augment)
    if policy == "rand":
        steps.append(TimmRandAugment(int(options["n"]), options["m"], options["mstd"]))
    elif policy == "trivialaugment":
        steps.append(v2.TrivialAugmentWide())
    elif policy == "augmix":
        steps.append(v2.AugMix(severity=int(options["m"]), mixture_width=int(options["w"]),
                               chain_depth=int(options["d"])))
    elif policy == "autoaugment":
        steps.append(v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET))
    if cfg.random_erase > 0:
        steps.append(PixelErasing(cfg.random_erase, cfg.mean, cfg.std))
    return v2.Compose(steps) if steps else None


class TimmRandAugment(v2.RandAugment):
    """torchvision's RandAugment with timm's magnitude scale (0-10) and magnitude noise (rand-m9-mstd0.5).

    Each op's magnitude is m + N(0, mstd), clipped to [0, 10], on a grid of 0.1 (torchvision indexes a
    table of magnitudes); the ops are torchvision's (the paper's 14), not timm's.
    """

    STEPS = 10  # grid points per unit of timm magnitude

    def __init__(self, num_ops: int, magnitude: float, magnitude_std: float) -> None:
        super().__init__(num_ops=num_ops, magnitude=round(magnitude * self.STEPS),
                         num_magnitude_bins=10 * self.STEPS + 1)
        self.mean_magnitude, self.magnitude_std = magnitude, magnitude_std

    def forward(self, *inputs):
        flat_inputs_with_spec, image = self._flatten_and_extract_image_or_video(inputs)
        height, width = v2.functional.get_size(image)
        for _ in range(self.num_ops):
            transform_id, (magnitudes_fn, signed) = self._get_random_item(self._AUGMENTATION_SPACE)
            magnitudes = magnitudes_fn(self.num_magnitude_bins, height, width)
            magnitude = 0.0
            if magnitudes is not None:
                level = self.mean_magnitude
                if self.magnitude_std > 0:
                    level = min(max(level + self.magnitude_std * torch.randn(()).item(), 0.0), 10.0)
                magnitude = float(magnitudes[round(level * self.STEPS)])
                if signed and torch.rand(()) <= 0.5:
                    magnitude *= -1
            image = self._apply_image_or_video_transform(image, transform_id, magnitude,
                                                         interpolation=self.interpolation, fill=self._fill)
        return self._unflatten_and_insert_image_or_video(flat_inputs_with_spec, image)


class PixelErasing(v2.RandomErasing):
    """Random erasing on uint8 with per-pixel random values: timm's mode='pixel' (normal in the normalized
    space, i.e. mean + std * N(0, 1) per channel) mapped back to uint8 pixels."""

    def __init__(self, p: float, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__(p=p, value="random")
        self.mean = torch.tensor(mean)[:, None, None]
        self.std = torch.tensor(std)[:, None, None]

    def make_params(self, flat_inputs):
        params = super().make_params(flat_inputs)
        if params["v"] is not None:  # N(0, 1) per pixel, as float
            params["v"] = (255 * (self.mean + self.std * params["v"])).round().clamp(0, 255).to(torch.uint8)
        return params


def eval_transform(cfg: DataConfig) -> A.Compose:
    """Resize the short side to img_size / crop_pct, centre crop img_size, as uint8."""
    resize_to = int(round(cfg.img_size / cfg.crop_pct))
    return A.Compose([
        A.SmallestMaxSize(max_size=resize_to, interpolation=cv2.INTER_LINEAR),
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
