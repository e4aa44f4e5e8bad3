"""The two albumentations presets: one for training, one for evaluation. Nothing else touches transforms."""

from __future__ import annotations

import albumentations as A
import cv2
from albumentations.pytorch import ToTensorV2

from engine.config import DataConfig


def train_transform(cfg: DataConfig) -> A.Compose:
    """RandomResizedCrop + flip (+ colour jitter) + normalize; the eval preset when augment is off."""
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
    steps += [A.Normalize(mean=cfg.mean, std=cfg.std, max_pixel_value=255.0), ToTensorV2()]
    return A.Compose(steps)


def eval_transform(cfg: DataConfig) -> A.Compose:
    """Resize the short side to img_size / crop_pct, centre crop img_size, normalize."""
    resize_to = int(round(cfg.img_size / cfg.crop_pct))
    return A.Compose([
        A.SmallestMaxSize(max_size=resize_to, interpolation=cv2.INTER_LINEAR),
        A.CenterCrop(height=cfg.img_size, width=cfg.img_size),
        A.Normalize(mean=cfg.mean, std=cfg.std, max_pixel_value=255.0),
        ToTensorV2(),
    ])
