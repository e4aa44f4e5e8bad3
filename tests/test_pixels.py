"""Pixels equal to the sources' (issue 31): the eval preset, the training crop and the recipe policies
against timm's and torchvision's installed functions on the same photos and draws.

The photos are scikit-learn's two samples (427x640, real JPEG content); the bound is a mean |difference| of
0.1/255 per image, where OpenCV's resize without antialiasing was 3.5-21/255 off.
"""

from __future__ import annotations

import copy
import math
import random

import albumentations as A
import numpy as np
import pytest
import timm.data
import torch
from PIL import Image
from sklearn.datasets import load_sample_images
from torchvision.transforms import InterpolationMode, v2
from torchvision.transforms import functional as F
from torchvision.transforms._presets import ImageClassification

from core.config import DataConfig
from core.config_load import load_config
from data.datasets import seeded
from data.transforms import DeviceNormalize, eval_transform, tensor_augment, train_transform

PHOTOS = [np.array(photo) for photo in load_sample_images().images]  # writable copies
BOUND = 0.1  # mean |difference| per image, in 0-255 levels


def pixels(tensor: torch.Tensor) -> torch.Tensor:
    """A float CHW image in 0-255 levels (timm's and torchvision's ToTensor output x 255)."""
    return tensor.float() * (255 if tensor.is_floating_point() else 1)


def assert_close_photo(ours: torch.Tensor, theirs: torch.Tensor, where: object) -> None:
    assert ours.shape == theirs.shape, where
    diff = (pixels(ours) - pixels(theirs)).abs().mean().item()
    assert diff <= BOUND, (where, diff)


@pytest.mark.parametrize("size", [32, 160, 224, 288])
@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_eval_preset_equals_timms(size, interpolation):
    for crop_pct in (0.875, 0.95, 1.0):
        theirs = timm.data.create_transform(size, is_training=False, crop_pct=crop_pct, interpolation=interpolation,
                                            mean=(0, 0, 0), std=(1, 1, 1))
        ours = eval_transform(DataConfig(img_size=size, crop_pct=crop_pct, interpolation=interpolation))
        for photo in PHOTOS:
            assert_close_photo(ours(image=photo)["image"], theirs(Image.fromarray(photo)), (crop_pct, photo.shape))


@pytest.mark.parametrize("size", [32, 160, 176, 224, 288])
def test_eval_preset_equals_torchvisions_for_its_recipe(size):
    """torchvision's eval preset (its weights' transforms: resize the short side, centre crop, on PIL) with the
    resize size the recipe's val_crop_pct gives: 232 for a 224 crop, as --val-resize-size 232."""
    cfg = load_config("resnet50_torchvision").data
    cfg.val_img_size = size
    resize_size = math.floor(size / cfg.val_crop_pct)
    assert size != 224 or resize_size == 232
    theirs = ImageClassification(crop_size=size, resize_size=resize_size, mean=(0, 0, 0), std=(1, 1, 1),
                                 interpolation=InterpolationMode(cfg.interpolation))
    for photo in PHOTOS:
        assert_close_photo(eval_transform(cfg)(image=photo)["image"], theirs(Image.fromarray(photo)), photo.shape)


def test_eval_preset_equals_maes_for_its_recipe():
    """MAE's eval transform (util/datasets.py: torchvision Resize(int(224 / (224 / 256)), bicubic), CenterCrop(224),
    ToTensor on PIL) and the MAE recipe's data section give the same pixels."""
    from torchvision import transforms

    cfg = load_config("vit_large_mae_finetune").data
    theirs = transforms.Compose([transforms.Resize(int(224 / (224 / 256)), interpolation=InterpolationMode.BICUBIC),
                                 transforms.CenterCrop(224), transforms.ToTensor()])
    for photo in PHOTOS:
        assert_close_photo(eval_transform(cfg)(image=photo)["image"], theirs(Image.fromarray(photo)), photo.shape)


BOXES = [(0, 0, 427, 640), (13, 101, 301, 255), (200, 77, 97, 131), (5, 400, 40, 33)]  # top, left, height, width


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_training_crop_equals_torchvisions_and_timms_for_a_given_box(interpolation, monkeypatch):
    """The app's RandomResizedCrop + flip, given a box, against torchvision's resized_crop on PIL and timm's
    RandomResizedCropAndInterpolation with its draw fixed to the same box (both shrink and enlarge)."""
    from timm.data.transforms import RandomResizedCropAndInterpolation

    crop = train_transform(DataConfig(img_size=160, interpolation=interpolation)).transforms[0]
    timm_crop = RandomResizedCropAndInterpolation(160, interpolation=interpolation)
    mode = InterpolationMode(interpolation)
    for photo in PHOTOS:
        for top, left, height, width in BOXES:
            ours = crop.apply(photo, crop_coords=(left, top, left + width, top + height), resample=interpolation)
            ours = torch.from_numpy(np.ascontiguousarray(ours)).permute(2, 0, 1)
            theirs = F.resized_crop(Image.fromarray(photo), top, left, height, width, [160, 160], mode)
            assert_close_photo(ours, F.pil_to_tensor(theirs), (top, left, height, width))
            monkeypatch.setattr(timm_crop, "get_params", lambda *args: (top, left, height, width))
            flipped = F.pil_to_tensor(F.hflip(timm_crop(Image.fromarray(photo))))
            assert_close_photo(ours.flip(-1), flipped, (top, left, height, width, "flip"))


def test_random_training_interpolation_picks_bilinear_or_bicubic_per_image():
    """data.train_interpolation=random (configs/resnet50_rsb_a3.yaml, timm's train.py default): each crop is
    torchvision's resized_crop with one of the two, both occur, and the eval preset keeps data.interpolation."""
    cfg = load_config("resnet50_rsb_a3").data
    assert cfg.train_interpolation == "random" and cfg.interpolation == "bicubic"
    cfg.img_size, cfg.hflip = 96, 0.0
    pipeline = A.Compose(train_transform(cfg).transforms, save_applied_params=True)  # the app's steps
    photo = PHOTOS[0]
    chosen = set()
    for seed in range(16):
        pipeline.set_random_state(np.random.default_rng(seed), random.Random(seed))
        out = pipeline(image=photo)
        ours, (_, data) = out["image"], out["applied_transforms"][0]
        left, top, right, bottom = data["crop_coords"]
        theirs = F.resized_crop(Image.fromarray(photo), top, left, bottom - top, right - left, [96, 96],
                                InterpolationMode(data["resample"]))
        assert_close_photo(ours, F.pil_to_tensor(theirs), (seed, data))
        chosen.add(data["resample"])
    assert chosen == {"bilinear", "bicubic"}


# ---- RandAugment inc1: timm's own ops --------------------------------------------------------------------


def timm_and_our_rand_augment(config: str) -> tuple:
    """(timm's RandAugment from its create_transform, ours from tensor_augment) for a recipe-like setting."""
    mean = (0.485, 0.456, 0.406)
    ours = tensor_augment(DataConfig(img_size=160, auto_augment=config, interpolation="bicubic", mean=list(mean)))
    theirs = timm.data.create_transform(160, is_training=True, auto_augment=config, interpolation="bicubic",
                                        mean=mean)
    found = [t for t in theirs.transforms if type(t).__name__ == "RandAugment"]
    assert len(found) == 1
    return ours.transforms[0], found[0]


@pytest.mark.parametrize("magnitude", [0, 3, 6, 9, 10])
def test_rand_augment_inc1_ops_equal_timms(magnitude):
    ours, theirs = timm_and_our_rand_augment("rand-m9-mstd0.5-inc1")
    names = [op.name for op in theirs.ops]
    assert [op.name for op in ours.policy.ops] == names and "PosterizeIncreasing" in names
    photo = Image.fromarray(PHOTOS[0][100:260, 200:360])
    for op, their_op in zip(ours.policy.ops, theirs.ops):
        op, their_op = copy.copy(op), copy.copy(their_op)
        for o in (op, their_op):
            o.prob, o.magnitude, o.magnitude_std = 1.0, magnitude, 0.0
        random.seed(1)  # the sign of signed ops
        got = np.asarray(op(photo))
        random.seed(1)
        if op.name == "PosterizeIncreasing" and magnitude == 10:  # 0 bits: Pillow 13 refuses, older Pillow zeroed
            with pytest.raises(ValueError, match="bits must be between"):
                their_op(photo)
            assert not got.any()
            continue
        assert np.array_equal(got, np.asarray(their_op(photo))), (op.name, magnitude)


def test_rand_augment_inc1_draws_as_timm_from_the_sample_seed_and_leaves_global_rngs_alone():
    """The whole policy: timm's draws from Python's and NumPy's RNGs seeded from the sample's torch seed;
    the same seed gives the same image, and the global RNGs are put back."""
    ours, theirs = timm_and_our_rand_augment("rand-m9-mstd0.5-inc1")
    image = torch.from_numpy(PHOTOS[1][50:210, 300:460]).permute(2, 0, 1)
    state = random.getstate(), np.random.get_state()
    changed = 0
    for seed in range(12):
        got = seeded(ours, image, seed)
        assert torch.equal(got, seeded(ours, image, seed))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            inner = int(torch.randint(2**62, ()))
        random.seed(inner)
        np.random.seed(inner % 2**32)
        expected = np.asarray(theirs(Image.fromarray(image.permute(1, 2, 0).numpy())))
        random.setstate(state[0])
        np.random.set_state(state[1])
        assert np.array_equal(got.permute(1, 2, 0).numpy(), expected), seed
        changed += not torch.equal(got, image)
    assert changed >= 6
    assert random.getstate() == state[0] and np.array_equal(np.random.get_state()[1], state[1][1])


# ---- the torchvision recipe: TrivialAugment bilinear, erasing 0 after Normalize ----------------------------


def test_trivial_augment_samples_as_torchvisions_preset():
    """configs/resnet50_torchvision.yaml: TrivialAugmentWide with the preset's interpolation (bilinear), the same
    draws and kernels as torchvision's own on the same uint8 image."""
    cfg = load_config("resnet50_torchvision").data
    ours = tensor_augment(cfg).transforms[0]
    assert ours.interpolation == InterpolationMode.BILINEAR
    theirs = v2.TrivialAugmentWide(interpolation=InterpolationMode.BILINEAR)
    image = torch.from_numpy(PHOTOS[0][:176, :176]).permute(2, 0, 1)
    for seed in range(20):
        assert torch.equal(seeded(ours, image, seed), seeded(theirs, image, seed)), seed


def test_const_erasing_is_zero_after_normalize_as_torchvisions():
    """data.random_erase_mode=const on uint8 then the device normalization, against torchvision's
    RandomErasing (value 0) after Normalize: the same box, equal up to uint8 rounding of the mean."""
    cfg = load_config("resnet50_torchvision").data
    assert cfg.random_erase_mode == "const"
    cfg.random_erase, cfg.auto_augment = 1.0, ""
    image = torch.from_numpy(PHOTOS[1][100:276, 200:376]).permute(2, 0, 1)
    normalize = DeviceNormalize(cfg.mean, cfg.std, torch.device("cpu"), channels_last=False)
    theirs = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(cfg.mean, cfg.std),
                         v2.RandomErasing(p=1.0)])
    tolerance = 0.5 / 255 / min(cfg.std) + 1e-6  # half a uint8 level of the mean colour
    for seed in range(5):
        erased = seeded(tensor_augment(cfg), image, seed)
        assert not torch.equal(erased, image)
        ours = normalize(erased[None])[0]
        expected = seeded(theirs, image, seed)
        torch.testing.assert_close(ours, expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize("kind", ["exif_rotated", "cmyk", "grey16.png", "grey16.tiff"])
def test_images_opencv_reads_otherwise_decode_as_pils_loader(kind, tmp_path):
    """The app's decoder gives the pixels of torchvision's pil_loader (convert("RGB"): what timm's and torchvision's
    datasets read, in every source recipe) for the files where OpenCV differs: a JPEG with EXIF Orientation=6, which
    OpenCV turned (517x333 where PIL gives 333x517, as stored); a CMYK JPEG, which OpenCV converted one level off on
    nearly every pixel; 16-bit greyscale PNG and TIFF (PIL mode I;16), which PIL clips at 255 where OpenCV divided
    by 256 (issue 51 item 7: a mean of 128.5 against PIL's 254.6, 254 levels apart), here with dark rows of values
    below 256 too (OpenCV made them 0). Training, evaluation and predict.py all decode through data.datasets.read_image."""
    from torchvision.datasets.folder import pil_loader

    from data.datasets import read_image

    photo = np.asarray(load_sample_images().images[0])[:333, :517]
    path = tmp_path / (kind if "." in kind else f"{kind}.jpg")
    if kind == "exif_rotated":
        exif = Image.Exif()
        exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
        Image.fromarray(photo).save(path, "JPEG", quality=90, exif=exif)
    elif kind == "cmyk":
        Image.fromarray(photo).convert("CMYK").save(path, "JPEG", quality=90)
    else:
        grey = photo.mean(axis=2) * 257  # the photo's full 16-bit range
        grey[:50] /= 256  # dark rows: 0-255
        Image.fromarray(grey.astype(np.uint16)).save(path)
        with Image.open(path) as written:
            assert written.mode == "I;16"
    theirs = np.asarray(pil_loader(str(path)))
    ours = read_image(str(path))
    assert ours.shape == theirs.shape == (333, 517, 3)
    assert np.array_equal(ours, theirs)
