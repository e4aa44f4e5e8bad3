"""The two albumentations presets (training, evaluation), the policies after them, and the normalization
that follows them on the device.

Which library does which step (the pixels equal timm's and torchvision's, tests/test_pixels.py):
- decoding: OpenCV (data.datasets); the RandomResizedCrop box, flip and colour jitter: albumentations, from
  the per-sample seeded RNG;
- every bilinear or bicubic resize (the training crop, the eval preset's short side, hence evaluate, predict
  and export's checks): torchvision's antialiased uint8 kernel, as PIL resizes in timm's and torchvision's
  pipelines, with their sizes (timm's floor(img_size / crop_pct), the long side truncated, torchvision's
  centre-crop offsets); nearest, area and lanczos stay OpenCV's;
- rand-...-inc1: timm's own RandAugment ops on a PIL view; the other policies and erasing: torchvision.v2 on
  the uint8 CHW tensor (albumentations 2.0.8, its last MIT release, has no RandAugment), its nearest
  geometric ops through OpenCV (FastKernels).

The presets end in uint8 tensors; `DeviceNormalize` turns a batch into normalized float32 where the model
runs. Workers then ship uint8 (a quarter of float32's bytes, through shared memory and, on a GPU, host to
device) and skip the float conversion; the normalization is one elementwise pass on the device, as in
timm's prefetcher (docs/benchmarks.md measures the difference). Nothing else touches transforms. The
policies draw from torch's global RNG, which data.datasets seeds per sample (timm's from Python's and
NumPy's, seeded from it in TimmPolicy).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence

import albumentations as A
import cv2
import numpy as np
import torch
from albumentations.pytorch import ToTensorV2
from PIL import Image
from torchvision.transforms import v2

from core.config import DataConfig, train_size
from core.errors import UserError
from data.config_checks import parse_auto_augment
from data.pipeline import FileTransform

TensorTransform = Callable[[torch.Tensor], torch.Tensor]  # uint8 CHW -> uint8 CHW

INTERPOLATION = {"bilinear": cv2.INTER_LINEAR, "bicubic": cv2.INTER_CUBIC, "nearest": cv2.INTER_NEAREST,
                 "area": cv2.INTER_AREA, "lanczos": cv2.INTER_LANCZOS4}  # data.interpolation -> OpenCV flag
ANTIALIASED = {"bilinear": v2.InterpolationMode.BILINEAR, "bicubic": v2.InterpolationMode.BICUBIC}  # torch's modes


def resize(image: np.ndarray, height: int, width: int, interpolation: str) -> np.ndarray:
    """HWC uint8 resized as PIL does (antialiased when it shrinks): torchvision's uint8 kernel for bilinear and
    bicubic (within 0.01/255 of PIL in the mean for images wider than tall; up to 0.28/255 for taller than wide,
    which Pillow resizes vertical-first: tests/test_pixels.py); OpenCV for nearest, area and lanczos."""
    if interpolation not in ANTIALIASED:
        return cv2.resize(image, (width, height), interpolation=INTERPOLATION[interpolation])
    chw = torch.from_numpy(np.require(image, requirements="CW")).permute(2, 0, 1)  # channels-last memory: fast
    out = v2.functional.resize_image(chw, [height, width], ANTIALIASED[interpolation], antialias=True)
    return out.permute(1, 2, 0).numpy()


def short_side_size(height: int, width: int, short: int) -> tuple[int, int]:
    """torchvision's Resize(int) output size: the short side `short`, the long side truncated, not rounded."""
    if height <= width:
        return short, int(short * width / height)
    return int(short * height / width), short


class ResizeCentreCrop(A.ImageOnlyTransform):
    """timm's and torchvision's eval preset: the short side to floor(size / crop_pct), then the centre
    size x size crop with their rounding of the offsets."""

    def __init__(self, size: int, crop_pct: float, interpolation: str) -> None:
        super().__init__(p=1.0)
        self.size, self.interpolation = size, interpolation
        self.resize_to = math.floor(size / crop_pct)

    def apply(self, img: np.ndarray, **params) -> np.ndarray:
        height, width = short_side_size(*img.shape[:2], self.resize_to)
        resized = resize(img, height, width, self.interpolation)
        top, left = int(round((height - self.size) / 2.0)), int(round((width - self.size) / 2.0))
        return resized[top:top + self.size, left:left + self.size]


class RandomResizedCrop(A.RandomResizedCrop):
    """albumentations' box draw (torchvision's algorithm, from the per-sample seeded RNG), resized by `resize`;
    interpolation "random" picks bilinear or bicubic per image, as timm's RandomResizedCropAndInterpolation."""

    def __init__(self, size: int, scale: Sequence[float], ratio: Sequence[float], interpolation: str) -> None:
        super().__init__(size=(size, size), scale=tuple(scale), ratio=tuple(ratio))
        self.resample = interpolation

    def get_params_dependent_on_data(self, params: dict, data: dict) -> dict:
        chosen = self.py_random.choice(list(ANTIALIASED)) if self.resample == "random" else self.resample
        return {**super().get_params_dependent_on_data(params, data), "resample": chosen}

    def apply(self, img: np.ndarray, crop_coords: tuple[int, int, int, int], resample: str, **params) -> np.ndarray:
        x1, y1, x2, y2 = crop_coords
        return resize(img[y1:y2, x1:x2], *self.size, resample)


def train_interpolation(cfg: DataConfig) -> str:
    """data.train_interpolation, or data.interpolation when it is unset."""
    return cfg.train_interpolation or cfg.interpolation


def train_transform(cfg: DataConfig) -> A.Compose | FileTransform:
    """RandomResizedCrop + flip (+ colour jitter), as uint8; the eval preset when augment is off."""
    if cfg.train_transform:
        if not cfg.augment:
            raise UserError(f"data.train_transform={cfg.train_transform} and data.augment=false: choose one (the "
                            "file's pipeline, or the deterministic eval preset)")
        return FileTransform(cfg.train_transform, "data.train_transform", cfg.img_size)
    if not cfg.augment:  # at the training size, whatever data.val_img_size says
        return A.Compose([ResizeCentreCrop(cfg.img_size, cfg.crop_pct, cfg.interpolation), ToTensorV2()])
    steps: list[A.BasicTransform] = [
        RandomResizedCrop(cfg.img_size, cfg.scale, cfg.ratio, train_interpolation(cfg)),
        A.HorizontalFlip(p=cfg.hflip),
    ]
    if cfg.color_jitter > 0:
        strength = cfg.color_jitter
        steps.append(A.ColorJitter(brightness=strength, contrast=strength, saturation=strength, hue=0.0, p=0.8))
    return A.Compose([*steps, ToTensorV2()])


class SizedTransforms:
    """data.size_schedule: the training preset and tensor policies built once per size of the schedule (timm's
    RandAugment translates by 0.45 of the crop, so the policies follow the size too), called with an epoch for
    that epoch's pair."""

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg, self.by_size = cfg, {}
        for _, size in cfg.size_schedule:
            at_size = dataclasses.replace(cfg, img_size=size)
            self.by_size[size] = (train_transform(at_size), tensor_augment(at_size))

    def __call__(self, epoch: int) -> tuple[A.Compose, TensorTransform | None]:
        return self.by_size[train_size(self.cfg, epoch)]


def tensor_augment(cfg: DataConfig) -> TensorTransform | None:
    """data.auto_augment's policy, then random erasing, on uint8 CHW tensors; None when both are off."""
    if not cfg.augment:
        return None
    steps: list[TensorTransform] = []
    policy, options = parse_auto_augment(cfg.auto_augment)
    if policy == "rand" and options["inc"]:
        steps.append(TimmPolicy(timm_rand_augment(cfg)))
    elif policy == "rand":
        steps.append(TimmRandAugment(int(options["n"]), options["m"], options["mstd"], options["p"]))
    elif policy == "trivialaugment":  # torchvision's preset passes its --interpolation (bilinear) to the policy
        mode = ANTIALIASED.get(train_interpolation(cfg), v2.InterpolationMode.NEAREST)
        steps.append(TrivialAugmentWide(interpolation=mode))
    elif policy == "augmix":
        steps.append(v2.AugMix(severity=int(options["m"]), mixture_width=int(options["w"]),
                               chain_depth=int(options["d"])))
    elif policy == "autoaugment":
        steps.append(AutoAugment(v2.AutoAugmentPolicy.IMAGENET))
    if cfg.random_erase > 0 and cfg.random_erase_fill == "uint8":
        steps.append(TimmErasing(cfg.random_erase, cfg.mean, cfg.std, cfg.random_erase_mode, cfg.random_erase_count,
                                 cfg.random_erase_box))
    return v2.Compose(steps) if steps else None


def deferred_erasing(cfg: DataConfig) -> TimmErasing | None:
    """data.random_erase_fill=normalized: the erasing whose boxes the workers draw after tensor_augment's policy
    (TimmErasing.draw) and data.erasing.NormalizedFill fills on the device; None otherwise."""
    if not cfg.augment or cfg.random_erase == 0 or cfg.random_erase_fill != "normalized":
        return None
    return TimmErasing(cfg.random_erase, cfg.mean, cfg.std, cfg.random_erase_mode, cfg.random_erase_count,
                       cfg.random_erase_box)


def mean_colour(mean: Sequence[float]) -> list[int]:
    """data.mean as uint8 pixels, rounded as timm's img_mean (the fill of its geometric ops)."""
    return [min(255, round(255 * m)) for m in mean]


def timm_rand_augment(cfg: DataConfig) -> Callable:
    """timm's own RandAugment for data.auto_augment, with the hparams timm's create_transform gives it: the
    mean colour as fill, translate 0.45 of the crop, the training interpolation (bilinear or bicubic; else
    timm's random choice of the two per op)."""
    from timm.data import auto_augment
    from timm.data.transforms import str_to_pil_interp

    hparams = {"translate_const": int(cfg.img_size * 0.45), "img_mean": tuple(mean_colour(cfg.mean))}
    if train_interpolation(cfg) in ANTIALIASED:
        hparams["interpolation"] = str_to_pil_interp(train_interpolation(cfg))
    policy = auto_augment.rand_augment_transform(cfg.auto_augment, hparams)
    for op in policy.ops:
        if op.aug_fn is auto_augment.posterize:
            op.aug_fn = posterize
    return policy


def posterize(image: Image.Image, bits_to_keep: int, **kwargs) -> Image.Image:
    """timm's posterize, where 0 bits (magnitude 10 of PosterizeIncreasing) gives the black image older Pillow
    gave; Pillow 13 raises instead."""
    from timm.data import auto_augment

    if bits_to_keep <= 0:
        return Image.new(image.mode, image.size)
    return auto_augment.posterize(image, bits_to_keep, **kwargs)


class TimmPolicy:
    """A timm PIL policy on a uint8 CHW tensor. timm draws from Python's and NumPy's global RNGs: both are
    seeded from torch's (which data.datasets seeds per sample) and put back afterwards."""

    def __init__(self, policy: Callable) -> None:
        self.policy = policy

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        seed = int(torch.randint(2**62, ()))
        python_state, numpy_state = random.getstate(), np.random.get_state()
        try:
            random.seed(seed)
            np.random.seed(seed % 2**32)
            out = self.policy(Image.fromarray(np.ascontiguousarray(image.permute(1, 2, 0).numpy())))
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
        return torch.from_numpy(np.array(out)).permute(2, 0, 1)


class FastKernels:
    """For torchvision's policies: Rotate, Shear, Translate, Sharpness, Solarize, AutoContrast on a uint8 CHW image run
    through OpenCV on its HWC view with torchvision's parameters (the same inverse affine map, nearest
    neighbour, fill 0; the same 3x3 smoothing kernel and blend), not through torch's float kernels, which
    cost several times more per image on a single-threaded worker (docs/benchmarks.md). Other ops, and any
    other input or setting (AugMix's float batches), go to torchvision."""

    def _apply_image_or_video_transform(self, image, transform_id, magnitude, interpolation, fill):
        fast = (type(image) is torch.Tensor and image.dtype == torch.uint8 and image.ndim == 3
                and image.shape[0] == 3 and v2.InterpolationMode(interpolation) == v2.InterpolationMode.NEAREST
                and self.fill is None)
        if fast and transform_id in AFFINE_OPS:
            return warp_affine(image, **AFFINE_OPS[transform_id](magnitude))
        if fast and transform_id == "Sharpness":
            return sharpen(image, 1.0 + magnitude)
        if fast and transform_id == "Solarize":
            return solarize(image, math.ceil(255 * magnitude))
        if fast and transform_id == "AutoContrast":
            return autocontrast(image)
        return super()._apply_image_or_video_transform(image, transform_id, magnitude, interpolation, fill)


AFFINE_OPS = {  # torchvision's F.affine / F.rotate arguments for each op (v2._auto_augment)
    "ShearX": lambda m: dict(shear=(math.degrees(math.atan(m)), 0.0), corner=True),
    "ShearY": lambda m: dict(shear=(0.0, math.degrees(math.atan(m))), corner=True),
    "TranslateX": lambda m: dict(translate=(int(m), 0)),
    "TranslateY": lambda m: dict(translate=(0, int(m))),
    "Rotate": lambda m: dict(angle=-m),  # F.rotate passes -angle to the affine matrix
}


def warp_affine(image: torch.Tensor, angle: float = 0.0, translate: tuple[int, int] = (0, 0),
                shear: tuple[float, float] = (0.0, 0.0), corner: bool = False) -> torch.Tensor:
    """torchvision's tensor affine (nearest, zeros outside) as one cv2.warpAffine on the HWC view."""
    from torchvision.transforms.v2.functional._geometry import _get_inverse_affine_matrix

    height, width = image.shape[1:]
    center = [-width * 0.5, -height * 0.5] if corner else [0.0, 0.0]  # center=[0, 0] in pixels, or the middle
    a, b, c, d, e, f = _get_inverse_affine_matrix(center, angle, list(translate), 1.0, list(shear))
    # The matrix maps output to input coordinates taken from the image's middle; here from pixel (0, 0).
    cx, cy = (width - 1) * 0.5, (height - 1) * 0.5
    matrix = np.array([[a, b, c + cx - a * cx - b * cy], [d, e, f + cy - d * cx - e * cy]])
    hwc = np.ascontiguousarray(image.permute(1, 2, 0).numpy())
    out = cv2.warpAffine(hwc, matrix, (width, height), flags=cv2.INTER_NEAREST | cv2.WARP_INVERSE_MAP,
                         borderMode=cv2.BORDER_CONSTANT, borderValue=(0, 0, 0))
    return torch.from_numpy(out).permute(2, 0, 1)


def sharpen(image: torch.Tensor, factor: float) -> torch.Tensor:
    """torchvision's adjust_sharpness on uint8: blend with the 3x3 (1, 5 in the middle) / 13 blur, borders kept."""
    hwc = image.permute(1, 2, 0)
    kernel = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32) / 13
    blurred = torch.from_numpy(cv2.filter2D(np.ascontiguousarray(hwc.numpy()), cv2.CV_32F, kernel)).round_()
    out = hwc.float()
    inner = out[1:-1, 1:-1]
    inner.add_(blurred[1:-1, 1:-1].sub_(inner), alpha=1.0 - factor)  # torchvision's blend, to its rounding
    return out.clamp_(0, 255).to(torch.uint8).permute(2, 0, 1)


def solarize(image: torch.Tensor, threshold: int) -> torch.Tensor:
    """torchvision's solarize on uint8 (invert the pixels >= threshold) as one table lookup."""
    table = np.arange(256, dtype=np.uint8)
    table[threshold:] = 255 - table[threshold:]
    return torch.from_numpy(cv2.LUT(np.ascontiguousarray(image.permute(1, 2, 0).numpy()), table)).permute(2, 0, 1)


def autocontrast(image: torch.Tensor) -> torch.Tensor:
    """torchvision's autocontrast on uint8 (each channel stretched to 0-255), its float32 formula applied to a
    per-channel table of the 256 values, then one lookup."""
    hwc = np.ascontiguousarray(image.permute(1, 2, 0).numpy())
    ranges = [cv2.minMaxLoc(channel)[:2] for channel in cv2.split(hwc)]
    low, high = torch.tensor(ranges, dtype=torch.float32).T[:, :, None]  # [3, 1] each
    flat = high == low
    inv_scale = (high - low).mul_(1.0 / 255)
    low[flat], inv_scale[flat] = 0.0, 1.0
    values = torch.arange(256, dtype=torch.float32).expand(3, 256)
    table = (values - low).div_(inv_scale).clamp_(0, 255).to(torch.uint8)  # [3, 256]
    return torch.from_numpy(cv2.LUT(hwc, np.ascontiguousarray(table.T.numpy())[None])).permute(2, 0, 1)


class TrivialAugmentWide(FastKernels, v2.TrivialAugmentWide):
    """torchvision's TrivialAugmentWide with the OpenCV kernels of FastKernels."""


class AutoAugment(FastKernels, v2.AutoAugment):
    """torchvision's AutoAugment with the OpenCV kernels of FastKernels."""


class TimmRandAugment(FastKernels, v2.RandAugment):
    """torchvision's RandAugment with timm's rand-m9-n2-mstd0.5-p0.5 semantics: magnitude on a 0-10 scale,
    each op applied with probability p (timm's default 0.5; torchvision always applies), magnitude noise.

    Each op's magnitude is m + N(0, mstd) (uniform in [0, m] for mstd > 100, as timm), clipped to [0, 10], on a
    grid of 0.1 (torchvision indexes a table of magnitudes); the ops are torchvision's (the paper's 14), not
    timm's 15 (timm adds Invert and SolarizeAdd and has no Identity).
    """

    STEPS = 10  # grid points per unit of timm magnitude

    def __init__(self, num_ops: int, magnitude: float, magnitude_std: float, prob: float = 1.0) -> None:
        super().__init__(num_ops=num_ops, magnitude=round(magnitude * self.STEPS),
                         num_magnitude_bins=10 * self.STEPS + 1)
        self.mean_magnitude, self.magnitude_std, self.prob = magnitude, magnitude_std, prob

    def forward(self, *inputs):
        flat_inputs_with_spec, image = self._flatten_and_extract_image_or_video(inputs)
        height, width = v2.functional.get_size(image)
        for _ in range(self.num_ops):
            transform_id, (magnitudes_fn, signed) = self._get_random_item(self._AUGMENTATION_SPACE)
            if self.prob < 1 and torch.rand(()).item() >= self.prob:
                continue
            magnitudes = magnitudes_fn(self.num_magnitude_bins, height, width)
            magnitude = 0.0
            if magnitudes is not None:
                level = self.mean_magnitude
                if self.magnitude_std > 100:
                    level = self.mean_magnitude * torch.rand(()).item()
                elif self.magnitude_std > 0:
                    level = min(max(level + self.magnitude_std * torch.randn(()).item(), 0.0), 10.0)
                magnitude = float(magnitudes[round(level * self.STEPS)])
                if signed and torch.rand(()) <= 0.5:
                    magnitude *= -1
            image = self._apply_image_or_video_transform(image, transform_id, magnitude,
                                                         interpolation=self.interpolation, fill=self._fill)
        return self._unflatten_and_insert_image_or_video(flat_inputs_with_spec, image)


class TimmErasing(v2.RandomErasing):
    """torchvision's RandomErasing on uint8, filled as timm's RandomErasing modes: pixel (mean + std x N(0, 1)
    per pixel, i.e. normal in the normalized space), rand (one such colour per box), const (the mean colour: 0
    after normalization, torchvision's value 0); `count` > 1: 1 to count boxes, each of 1/count the area
    (timm's max_count, train.py --recount). With count 1 the draws are torchvision's own. `box` (data.random_erase_box)
    picks the ranges of the box's area and aspect: timm's RandomErasing defaults or torchvision's.

    The uint8 fill is mean + std x N(0, 1) rounded and clipped to 0-255: after normalization its std is 0.971 and
    its values lie in [-2.12, 2.64] at ImageNet's mean/std. `draw` gives the boxes alone, for the device to fill
    with timm's unbounded N(0, 1) after normalization (data.random_erase_fill=normalized, data.erasing)."""

    BOXES = {"timm": ((0.02, 1 / 3), (0.3, 1 / 0.3)),  # min_area, max_area; min_aspect, 1 / min_aspect
             "torchvision": ((0.02, 0.33), (0.3, 3.3))}  # RandomErasing's scale and ratio

    def __init__(self, p: float, mean: Sequence[float], std: Sequence[float], mode: str = "pixel",
                 count: int = 1, box: str = "timm") -> None:
        scale, ratio = self.BOXES[box]
        super().__init__(p=p, scale=scale, ratio=ratio, value=mean_colour(mean) if mode == "const" else "random")
        self.mean = torch.tensor(mean)[:, None, None]
        self.std = torch.tensor(std)[:, None, None]
        self.per_pixel, self.count = mode == "pixel", count

    def make_params(self, flat_inputs):
        boxes = 1 if self.count == 1 else int(torch.randint(1, self.count + 1, ()).item())
        scale, self.scale = self.scale, (self.scale[0] / boxes, self.scale[1] / boxes)
        try:
            params = [self.fill(super(TimmErasing, self).make_params(flat_inputs)) for _ in range(boxes)]
        finally:
            self.scale = scale
        return {"boxes": params}

    def fill(self, params: dict) -> dict:
        """A box's N(0, 1) draw (torchvision's value="random") as uint8 pixels of mean + std x N(0, 1)."""
        if params["v"] is not None and self.value is None:
            normal = params["v"] if self.per_pixel else params["v"][:, :1, :1]  # rand: one draw per channel
            params["v"] = (255 * (self.mean + self.std * normal)).round().clamp(0, 255).to(torch.uint8)
        return params

    def transform(self, inpt, params):
        for box in params["boxes"]:
            inpt = super().transform(inpt, box)
        return inpt

    def draw(self, image: torch.Tensor) -> list[tuple[int, int, int, int, int]]:
        """The boxes `forward` would erase in this CHW image, from the same draws of torch's global RNG (the same
        boxes), as (y0, y1, x0, x1, seed): each with a seed for its fill, drawn after all the boxes."""
        if torch.rand(1) >= self.p:  # v2's _RandomApplyTransform.forward
            return []
        boxes = [box for box in self.make_params([image])["boxes"] if box["v"] is not None]  # None: no box fit
        seeds = torch.randint(2**63 - 1, (len(boxes),)).tolist()
        return [(box["i"], box["i"] + box["h"], box["j"], box["j"] + box["w"], seed) for box, seed in zip(boxes, seeds)]


class ResizeFiveCrop(ResizeCentreCrop):
    """The eval preset's resize, then torchvision's five_crop (centre + four corners) of the resized image,
    stacked top to bottom as one (5 x size) x size image, so batches collate and normalize as any other."""

    def apply(self, img: np.ndarray, **params) -> np.ndarray:
        height, width = short_side_size(*img.shape[:2], self.resize_to)
        resized = resize(img, height, width, self.interpolation)
        chw = torch.from_numpy(np.ascontiguousarray(resized)).permute(2, 0, 1)
        top_left, top_right, bottom_left, bottom_right, centre = v2.functional.five_crop(chw, [self.size] * 2)
        return torch.cat([centre, top_left, top_right, bottom_left, bottom_right], dim=1).permute(1, 2, 0).numpy()


def eval_size(cfg: DataConfig) -> tuple[int, float]:
    """(crop size, crop_pct) of evaluation: data.val_img_size / val_crop_pct, else the training ones."""
    return cfg.val_img_size or cfg.img_size, cfg.val_crop_pct or cfg.crop_pct


def eval_transform(cfg: DataConfig, crops: int = 1) -> A.Compose | FileTransform:
    """Resize the short side to floor(size / crop_pct), centre crop size x size, as uint8 (timm's eval preset) at
    eval_size; crops=5: the centre and four corner crops of that resize, stacked (ResizeFiveCrop)."""
    size, crop_pct = eval_size(cfg)
    if cfg.eval_transform:
        if crops != 1:
            raise UserError(f"data.eval_transform={cfg.eval_transform}: --tta-crops 5 crops with the app's eval "
                            "preset; use --tta-crops 1 (or data.eval_transform=\"\")")
        return FileTransform(cfg.eval_transform, "data.eval_transform", size)
    crop = ResizeFiveCrop if crops == 5 else ResizeCentreCrop
    return A.Compose([crop(size, crop_pct, cfg.interpolation), ToTensorV2()])


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
