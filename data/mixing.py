"""Mixup and CutMix between pairs of images, drawn on the CPU per pair or per group and applied on the device.

timm mixes sample i with sample B-1-i of a process's batch: the pairs, and so the training, then depend on
the world size. Here the pairs are fixed by the epoch's global sample order (positions 2k and 2k+1 form pair
k; data.loader.EpochSampler hands whole pairs to ranks) and the draws (mixup or cutmix, lambda, box) are a
pure function of (seed, epoch, k) in `data.mix_mode=pair` (timm's mode='pair'), or of (seed, epoch, g) in
`data.mix_mode=batch`, where group g is positions [g G, (g+1) G) of the global order, G = data.mix_group
(timm's mode='batch' draws once per process batch; a fixed G keeps the draws the same for any world size).
A resumed or re-sharded run mixes the same images in the same way. Both images of a pair are mixed with
each other.

The collate (`MixCollate`, in the DataLoader workers) draws the mixes and ships them beside the uint8
batch; `BatchMix` applies them after DeviceNormalize and builds the soft targets, with label smoothing
folded in (multi-label: the two images' multi-hot rows are mixed with the same lambda).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from core.config import DataConfig
from data.collate import collate_readable

MIX_STREAM = 0x4D4958  # ends a pair's seed sequence, apart from the augmentation's (seed, epoch, index[, repeat])
NONE, MIXUP, CUTMIX = 0, 1, 2
# Columns of the mix tensor a mixed batch carries: partner row, kind, lambda, box (y0, y1, x0, x1).
PARTNER, KIND, LAM, Y0, Y1, X0, X1 = range(7)


def draw_mix(cfg: DataConfig, seed: int, epoch: int, draw: int, height: int, width: int) -> list[float]:
    """[kind, lambda, y0, y1, x0, x1] of one pair or group, a pure function of (seed, epoch, draw); timm's
    rules: mixed with mixup_prob, cutmix instead of mixup with mixup_switch_prob, the cutmix lambda corrected
    to the box's area after clipping (torchvision's too), the box rounded as data.cutmix_rounding."""
    rng = np.random.default_rng([seed, epoch, draw, MIX_STREAM])
    if rng.random() >= cfg.mixup_prob:
        return [NONE, 1.0, 0, 0, 0, 0]
    use_cutmix = cfg.cutmix_alpha > 0 and (cfg.mixup_alpha == 0 or rng.random() < cfg.mixup_switch_prob)
    alpha = cfg.cutmix_alpha if use_cutmix else cfg.mixup_alpha
    lam = float(rng.beta(alpha, alpha))
    if not use_cutmix:
        return [MIXUP, lam, 0, 0, 0, 0]
    y0, y1, x0, x1 = cutmix_box(lam, int(rng.integers(height)), int(rng.integers(width)), height, width,
                                cfg.cutmix_rounding == "symmetric")
    return [CUTMIX, 1.0 - (y1 - y0) * (x1 - x0) / (height * width), y0, y1, x0, x1]


def cutmix_box(lam: float, cy: int, cx: int, height: int, width: int,
               symmetric: bool = False) -> tuple[int, int, int, int]:
    """(y0, y1, x0, x1) of the box centred at (cy, cx) covering about 1 - lam of the image, clipped: timm 1.0's
    rand_bbox (the upper half-size rounds up), or `symmetric`: cut // 2 each side (older timm's rand_bbox;
    torchvision's CutMix, whose int(0.5 sqrt(1 - lam) W) is the same number)."""
    cut = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(height * cut), int(width * cut)
    up_h, up_w = (cut_h // 2, cut_w // 2) if symmetric else ((cut_h + 1) // 2, (cut_w + 1) // 2)
    y0, y1 = min(max(cy - cut_h // 2, 0), height), min(max(cy + up_h, 0), height)
    x0, x1 = min(max(cx - cut_w // 2, 0), width), min(max(cx + up_w, 0), width)
    return y0, y1, x0, x1


class MixCollate:
    """Collate (image, label, (epoch, pair)) samples into (uint8 images, labels, mix): mix[i] holds row i's
    partner and its pair's draw. A sample whose partner could not be read (data.skip_corrupt) is its own
    partner, unmixed. With data.mix_partner=roll a group's rows arrive in the source's order (data.loader) and
    row i takes from row i - 1 of its group, the first from the last (torchvision's batch.roll(1, 0))."""

    def __init__(self, cfg: DataConfig, seed: int, group: int = 0) -> None:
        """`group`: images per draw in data.mix_mode=batch (data.mix_group, or train.batch_size when that is 0)."""
        if cfg.mix_mode == "batch" and group < 2:
            raise ValueError(f"data.mix_mode=batch needs a group of at least 2 images, got {group}")
        self.cfg, self.seed = cfg, seed
        self.pairs_per_draw = group // 2 if cfg.mix_mode == "batch" else 1
        self.roll = cfg.mix_mode == "batch" and cfg.mix_partner == "roll"

    def __call__(self, samples: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        images, labels = collate_readable([sample and sample[:2] for sample in samples])  # drops unreadable ones
        kept = [sample for sample in samples if sample is not None]
        height, width = images.shape[-2:]
        rows: dict[tuple[int, int], list[int]] = {}  # the rows of each pair (roll: of each group), in order
        for row, (*_, (epoch, pair)) in enumerate(kept):
            rows.setdefault((epoch, pair // self.pairs_per_draw if self.roll else pair), []).append(row)
        mix = torch.zeros(len(kept), 7)
        for (epoch, key), members in rows.items():
            draw = [NONE, 1.0] if len(members) < 2 else draw_mix(self.cfg, self.seed, epoch,
                                                                 key if self.roll else key // self.pairs_per_draw,
                                                                 height, width)
            partners = members[-1:] + members[:-1] if self.roll else reversed(members)  # roll(1, 0) | flip
            for row, partner in zip(members, partners):
                mix[row, PARTNER] = partner
                mix[row, KIND:KIND + len(draw)] = torch.tensor(draw)
        return images, labels, mix


class BatchMix:
    """(normalized images, labels, mix) -> (mixed images, soft targets), on the training device."""

    def __init__(self, num_classes: int, smoothing: float) -> None:
        self.num_classes, self.smoothing = num_classes, smoothing

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, mix: torch.Tensor) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
        partner = mix[:, PARTNER].long()
        lam = mix[:, LAM].to(images.dtype)
        other = images[partner]
        rows = torch.arange(images.shape[-2], device=images.device)
        cols = torch.arange(images.shape[-1], device=images.device)
        in_rows = (rows >= mix[:, Y0, None]) & (rows < mix[:, Y1, None])  # [n, H]
        in_cols = (cols >= mix[:, X0, None]) & (cols < mix[:, X1, None])  # [n, W]
        box = (in_rows[:, :, None] & in_cols[:, None, :])[:, None]  # [n, 1, H, W]; empty unless cutmix
        blend = torch.where(mix[:, KIND] == MIXUP, lam, torch.ones_like(lam))[:, None, None, None]
        mixed = torch.where(box, other, blend * images + (1 - blend) * other)
        if images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous():
            mixed = mixed.contiguous(memory_format=torch.channels_last)
        own = (smooth_one_hot(labels, self.num_classes, self.smoothing, images.dtype) if labels.ndim == 1
               else smooth_multi_hot(labels, self.smoothing, images.dtype))
        targets = lam[:, None] * own + (1 - lam[:, None]) * own[partner]
        return mixed, targets


def smooth_one_hot(labels: torch.Tensor, num_classes: int, smoothing: float, dtype: torch.dtype) -> torch.Tensor:
    """One-hot rows with label smoothing as timm folds it into mixup targets: smoothing / C off, the rest on."""
    off = smoothing / num_classes
    targets = torch.full((len(labels), num_classes), off, dtype=dtype, device=labels.device)
    return targets.scatter_(1, labels[:, None], 1.0 - smoothing + off)


def smooth_multi_hot(labels: torch.Tensor, smoothing: float, dtype: torch.dtype) -> torch.Tensor:
    """Multi-hot rows (multi-label) with timm's smoothing values: smoothing / C off, 1 - smoothing + smoothing / C on."""
    off = smoothing / labels.shape[1]
    on, off = (torch.full((), value, dtype=dtype, device=labels.device) for value in (1.0 - smoothing + off, off))
    return torch.where(labels > 0, on, off)
