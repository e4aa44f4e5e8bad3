"""Recipe augmentations (issue 14): torchvision policies and erasing, mixup/cutmix, repeated augmentation.

Every draw is a pure function of (seed, epoch, index[, repeat]) or, for a mixed pair, (seed, epoch, pair):
the tests compare per-sample outputs through real DataLoaders and samplers for 1 and 2 ranks and 0 and 2
workers, and the global batches the samplers hand out for 1 and 2 ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
import timm.data.mixup as timm_mixup
import torch
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import DistributedSampler
from torchvision.transforms import v2

import train
from core.cli import report_errors
from core.config import DataConfig, TrainConfig
from core.config_load import load_config
from core.dist import DistInfo
from core.errors import UserError
from data.datasets import DummyDataset
from data.loader import EpochSampler, build_train_loader
from data.erasing import NormalizedFill
from data.mixing import BatchMix, CUTMIX, MIXUP, MixCollate, cutmix_box
from data.transforms import DeviceNormalize, TimmRandAugment, deferred_erasing, tensor_augment, train_transform
from engine.checkpoint.formats import load_checkpoint
from engine.checkpoint.resume import check_global_batch
from engine.losses import build_loss
from tests import test_correctness as correctness, test_resume as resume
from tests.helpers import TINY, read_jsonl, run_on_ranks, train_here

RECIPE = dict(img_size=16, auto_augment="rand-m9-mstd0.5", random_erase=0.5)


def dataset(cfg: DataConfig, size: int = 24, image_size: int = 20) -> DummyDataset:
    data = DummyDataset(size, 4, image_size, train_transform(cfg), seed=3, tensor_transform=tensor_augment(cfg))
    data.erasing = deferred_erasing(cfg)  # as data.loader.build_data sets it
    return data


@pytest.mark.parametrize("value, message", [
    ("rand", None), ("rand-m9-mstd0.5", None), ("rand-m7-n3-p1", None), ("rand-m9-mstd101-p0.25", None),
    ("rand-m9-mstd0.5-inc1", None), ("rand-m9-inc2", "p in [0, 1] and inc 0 or 1"),
    ("trivialaugment", None), ("augmix", None),
    ("augmix-m3-w3", None), ("autoaugment", None),
    ("randaugment", "config key 'data.auto_augment' is 'randaugment'; use rand-m<magnitude"),
    ("rand-m9-x2", "config key 'data.auto_augment' is 'rand-m9-x2': cannot read 'x2'"),
    ("rand-m12", "rand needs m in 0-10"), ("rand-m9-p1.5", "p in [0, 1]"), ("rand-m9.5", "cannot read 'm9.5'"),
    ("augmix-m0", "augmix needs m in 1-10"),
])
def test_auto_augment_strings(value, message, capsys):
    if message is None:
        assert load_config(None, [f"data.auto_augment={value}"]).data.auto_augment == value
        return
    assert report_errors(train.main, [*TINY, f"data.auto_augment={value}", "output_dir=/nonexistent/x"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("override, message", [
    ("data.random_erase=1.5", "config key 'data.random_erase' must be in [0, 1], got 1.5"),
    ("data.mixup_prob=-1", "config key 'data.mixup_prob' must be in [0, 1], got -1.0"),
    ("data.cutmix_alpha=-1", "config key 'data.cutmix_alpha' must be >= 0, got -1.0"),
    ("data.aug_repeats=-2", "config key 'data.aug_repeats' must be >= 0, got -2"),
    ("train.loss=focal", "config key 'train.loss' is 'focal'; choose one of ce, bce"),
    ("data.random_erase_mode=zero", "config key 'data.random_erase_mode' is 'zero'; choose one of pixel, rand, "
     "const"),
    ("data.random_erase_count=0", "config key 'data.random_erase_count' must be > 0, got 0"),
])
def test_recipe_keys_out_of_range(override, message):
    with pytest.raises(UserError) as err:
        load_config(None, [override])
    assert str(err.value) == message


def test_mixing_needs_an_even_batch():
    with pytest.raises(UserError, match="'train.batch_size' must be even with mixup or cutmix on .* got 7"):
        load_config(None, ["data.mixup_alpha=0.2", "train.batch_size=7"])
    load_config(None, ["data.mixup_alpha=0.2", "train.batch_size=8"])


@pytest.mark.parametrize("overrides, message", [
    (["data.aug_repeats=1000"], "data.aug_repeats 1000 is more than the 32 training images"),
    (["data.aug_repeats=20"], "data.aug_repeats 20 is more than the global batch of 8 images"),
    (["data.aug_repeats=32", "data.mixup_alpha=0.2", "train.batch_size=32"],
     "data.aug_repeats 32 with mixup or cutmix needs at least 34 training images (a different partner for "
     "each copy); there are 32"),
])
def test_aug_repeats_beyond_the_data_or_the_batch_is_refused(overrides, message, capsys):
    """issue 23 item 12: 1000 repeats of 32 images made every epoch one image, silently."""
    argv = ["--dry-run", *TINY, *overrides, "output_dir=/nonexistent/x"]
    assert report_errors(train.main, argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err and len(errors) == 1 and message in errors[0], err


@pytest.mark.parametrize("policy", ["rand-m9-mstd0.5", "trivialaugment", "augmix", "autoaugment", ""])
def test_each_policy_changes_images_and_keeps_them_uint8(policy):
    plain = dataset(DataConfig(img_size=16))
    augmented = dataset(DataConfig(img_size=16, auto_augment=policy, random_erase=0.0 if policy else 1.0))
    changed = 0
    for i in range(8):
        image, label = augmented[(0, i)]
        assert image.dtype == torch.uint8 and image.shape == (3, 16, 16) and label == plain[(0, i)][1]
        changed += not torch.equal(image, plain[(0, i)][0])  # same crop and flip underneath
    assert changed >= 4


@pytest.mark.parametrize("op, magnitudes", [
    ("Rotate", (-27.0, -5.5, 13.0, 30.0)), ("ShearX", (-0.27, 0.1, 0.3)), ("ShearY", (-0.3, 0.05, 0.27)),
    ("TranslateX", (-13.0, 4.7, 61.0)), ("TranslateY", (-9.0, 20.0)), ("Sharpness", (-0.9, -0.3, 0.3, 0.9)),
    ("Solarize", (0.0, 0.3, 0.5001, 1.0)), ("AutoContrast", (0.0,)),
])
def test_opencv_kernels_match_torchvision(op, magnitudes):
    """FastKernels' ops against torchvision's own kernels, on uint8 CHW views of HWC images (as ToTensorV2 gives)."""
    ours, theirs = TimmRandAugment(2, 9, 0.0), v2.RandAugment()
    generator = torch.Generator().manual_seed(0)
    for height, width in ((32, 32), (45, 28), (224, 180)):
        noise = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator)
        image = noise.permute(2, 0, 1)
        if op == "AutoContrast":  # narrow channel ranges to stretch, one of them flat
            image = (noise // 3 + 40).permute(2, 0, 1).contiguous()
            image[1] = 77
            image = image.permute(1, 2, 0).contiguous().permute(2, 0, 1)
        for magnitude in magnitudes:
            got, want = (policy._apply_image_or_video_transform(image, op, magnitude, policy.interpolation,
                                                                policy._fill) for policy in (ours, theirs))
            assert got.shape == want.shape and got.dtype == torch.uint8
            same = (got == want).all(dim=0).float().mean().item()
            # nearest-neighbour ties may round the other way in OpenCV's fixed point: a pixel in thousands
            assert same == 1.0 or (op in ("Rotate", "ShearX", "ShearY") and same > 0.999), (op, magnitude, same)


@pytest.mark.parametrize("policy", ["rand-m9-n3-p1", "trivialaugment", "autoaugment"])
def test_policies_take_the_opencv_kernels(policy, monkeypatch):
    """The policies call the ops as torchvision does (interpolation as the string "nearest"; TrivialAugment
    takes data.interpolation, as torchvision's preset); a spy on torchvision's own kernels (which still run
    when called) shows FastKernels answered every such op."""
    from torchvision.transforms.v2 import _auto_augment

    called = []

    def spy(name: str):
        kernel = getattr(_auto_augment.F, name)
        return lambda *args, **kwargs: called.append(name) or kernel(*args, **kwargs)

    for name in ("affine", "rotate", "adjust_sharpness", "solarize", "autocontrast"):
        monkeypatch.setattr(_auto_augment.F, name, spy(name))
    transform = tensor_augment(DataConfig(img_size=32, auto_augment=policy, interpolation="nearest"))
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    for _ in range(60):
        transform(torch.randint(0, 256, (32, 32, 3), dtype=torch.uint8, generator=generator).permute(2, 0, 1))
    assert called == []


def test_erasing_fills_a_box_with_varied_pixels():
    cfg = DataConfig(img_size=16, random_erase=1.0)
    erased, plain = dataset(cfg)[(0, 1)][0], dataset(DataConfig(img_size=16))[(0, 1)][0]
    box = (erased != plain).any(dim=0).nonzero()
    rows, cols = box[:, 0], box[:, 1]
    inside = erased[:, rows.min():rows.max() + 1, cols.min():cols.max() + 1]
    assert inside.float().std() > 20  # random pixel values, not one constant


@pytest.mark.parametrize("box", ["timm", "torchvision"])
def test_erasing_box_is_timms_or_torchvisions_formula_on_the_same_draws(box):
    """data.random_erase_box: timm's RandomErasing._erase (timm/data/random_erasing.py) takes target_area =
    uniform(min_area, max_area) x area, aspect = exp(uniform(*log_aspect_ratio)), h = int(round(sqrt(target_area x
    aspect))), w = int(round(sqrt(target_area / aspect))), kept if h < img_h and w < img_w, with its defaults
    (0.02, 1/3, 0.3 and 1/0.3) read from timm's object; torchvision's RandomErasing the same with (0.02, 0.33) and
    (0.3, 3.3). On a portrait 61 x 23 image (up to 10 tries, aspect near the limits), each erasing's (h, w) equals the
    formula's on the same two uniforms per try; the other ranges give other boxes on some of the 100 seeds."""
    import math

    from timm.data.random_erasing import RandomErasing

    from data.transforms import TimmErasing

    source = RandomErasing(probability=1.0, mode="pixel", device="cpu")
    ranges = {"timm": ((source.min_area, source.max_area), source.log_aspect_ratio),
              "torchvision": ((0.02, 0.33), (math.log(0.3), math.log(3.3)))}
    image = torch.zeros(3, 61, 23, dtype=torch.uint8)
    erasing = TimmErasing(1.0, (0.5,) * 3, (0.25,) * 3, "pixel", box=box)

    def formula(seed: int, area_range, log_aspect) -> tuple[int, int]:
        torch.manual_seed(seed)
        for _ in range(10):
            target_area = torch.empty(1).uniform_(*area_range).item() * 61 * 23
            aspect_ratio = math.exp(torch.empty(1).uniform_(*log_aspect).item())
            h, w = int(round(math.sqrt(target_area * aspect_ratio))), int(round(math.sqrt(target_area / aspect_ratio)))
            if w < 23 and h < 61:
                return h, w
        return 61, 23

    ours, other = [], []
    for seed in range(100):
        torch.manual_seed(seed)
        params = erasing.make_params([image])["boxes"][0]
        ours.append((params["h"], params["w"]))
        assert ours[-1] == formula(seed, *ranges[box]), seed
        other.append(formula(seed, *ranges["torchvision" if box == "timm" else "timm"]))
    assert ours != other


def test_normalized_erasing_fill_is_timms_unbounded_normal():
    """data.random_erase_fill=normalized, mode pixel: each box the workers drew (the same boxes as the uint8 fill),
    filled on the device after DeviceNormalize, against timm's fill of the same box (timm.data.random_erasing.
    _get_pixels, what RandomErasing._erase writes there) and timm's RandomErasing(mode='pixel') on the same
    normalized images: mean 0 and std 1 within 0.02 (the uint8 fill's std is 0.971), 3.25% of the values outside
    each channel's uint8 range (-2.12 to 2.25, -2.04 to 2.43, -1.80 to 2.64), where the uint8 fill cannot go, and
    the same distribution (two-sample Kolmogorov-Smirnov
    distance under 0.012, the 0.1% critical value at these sizes; the uint8 fill is at 0.017). Outside the boxes
    the image is the uint8 one normalized, bit for bit."""
    import random

    from scipy.stats import ks_2samp
    from timm.data.random_erasing import RandomErasing, _get_pixels

    cfg = DataConfig(img_size=64, random_erase=1.0, random_erase_fill="normalized")  # ImageNet's mean and std
    uint8_fill = dataset(DataConfig(img_size=64, random_erase=1.0), size=40, image_size=64)
    data = dataset(cfg, size=40, image_size=64)
    normalize = DeviceNormalize(cfg.mean, cfg.std, torch.device("cpu"), channels_last=False)
    low, high = (-torch.tensor(cfg.mean) / torch.tensor(cfg.std))[:, None], ((1 - torch.tensor(cfg.mean))
                                                                             / torch.tensor(cfg.std))[:, None]
    outside = float((torch.special.ndtr(low) + 1 - torch.special.ndtr(high)).mean())  # N(0, 1): 0.0325
    fill, timm_erasing = NormalizedFill("pixel", torch.device("cpu")), RandomErasing(1.0, mode="pixel", device="cpu")
    ours, same_box, timms, old = [], [], [], []
    for index in range(40):
        image, _, boxes = data[(0, index)]
        assert len(boxes) == 1
        plain = normalize(image[None])
        erased = fill(plain.clone(), [(0, *box) for box in boxes])[0]
        y0, y1, x0, x1, _ = boxes[0]
        inside = torch.zeros(64, 64, dtype=torch.bool)
        inside[y0:y1, x0:x1] = True
        assert torch.equal(erased[:, ~inside], plain[0][:, ~inside])
        ours.append(erased[:, inside])
        torch.manual_seed(index)
        same_box.append(_get_pixels(True, False, (3, y1 - y0, x1 - x0), device="cpu").flatten(1))
        old.append(normalize(uint8_fill[(0, index)][0][None])[0][:, inside])  # the same box, filled on uint8
        random.seed(index)
        theirs = timm_erasing(plain[0].clone())
        timms.append(theirs[:, (theirs != plain[0]).any(dim=0)])
    ours, same_box, timms, old = (torch.cat(values, dim=1) for values in (ours, same_box, timms, old))
    assert ours.shape[1] > 15_000
    for values in (ours, same_box, timms):
        assert abs(values.mean()) < 0.02 and abs(values.std() - 1) < 0.02
        assert abs(((values < low) | (values > high)).float().mean() - outside) < 0.004
        assert ks_2samp(ours.flatten().numpy(), values.flatten().numpy()).statistic < 0.012
    assert old.std() < 0.98 and not ((old < low - 1e-6) | (old > high + 1e-6)).any()  # what it replaces


def test_normalized_erasing_modes_and_layouts():
    """rand: one N(0, 1) per channel and box; const: 0; a channels_last batch is filled with the same values and
    stays channels_last; a box's fill depends on its seed alone (not on its row or the other boxes)."""
    images = torch.zeros(2, 3, 16, 16)
    boxes = [(0, 2, 9, 3, 7, 11), (1, 0, 5, 0, 16, 12)]
    for mode in ("pixel", "rand", "const"):
        fill = NormalizedFill(mode, torch.device("cpu"))
        filled = fill(images.clone(), boxes)
        box = filled[0, :, 2:9, 3:7]
        assert (box == 0).all() if mode == "const" else (box != 0).all()
        assert (box == box[:, :1, :1]).all() == (mode != "pixel")
        last = fill(images.clone().contiguous(memory_format=torch.channels_last), boxes)
        assert torch.equal(last, filled) and last.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(fill(images.clone(), [(1, *boxes[0][1:])])[1], filled[0])


def test_policy_draws_leave_the_global_torch_rng_alone():
    data = dataset(DataConfig(**RECIPE))
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    first = data[(0, 5)][0]
    assert torch.equal(torch.rand(3), expected)
    assert torch.equal(data[(0, 5)][0], first)  # a pure function of (seed, epoch, index)
    assert not torch.equal(data[(1, 5)][0], first)  # a new epoch, new draws


def per_sample_images(cfg: DataConfig, world: int, workers: int, epoch: int = 1) -> dict[tuple, tuple]:
    """key -> (image, and with mixing: its mix draw and its partner's key), as the training loaders of all
    `world` ranks deliver them in `epoch` (a global batch of 8)."""
    cfg.num_workers = workers
    data = dataset(cfg)
    samples, batch_size = {}, 8 // world
    for rank in range(world):
        loader = build_train_loader(data, cfg, batch_size, seed=3,
                                    info=DistInfo(rank, world, rank, world, torch.device("cpu")))
        loader.sampler.set_epoch(epoch)
        keys = list(loader.sampler)
        for step, (images, _, *extra) in enumerate(loader):
            batch_keys = keys[step * batch_size:(step + 1) * batch_size]
            if data.erasing is not None:  # normalized erasing: the boxes filled as the training loop fills them
                images = NormalizedFill(cfg.random_erase_mode, torch.device("cpu"))(normalize(images), extra.pop())
            for row, key in enumerate(batch_keys):
                mix = () if not extra else (extra[0][row, 1:], batch_keys[int(extra[0][row, 0])])
                samples[key] = (images[row], *mix)
    return samples


def normalize(images: torch.Tensor) -> torch.Tensor:
    return DeviceNormalize(DataConfig().mean, DataConfig().std, torch.device("cpu"), channels_last=True)(images)


def equal(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


@pytest.mark.parametrize("policy", ["rand-m9-mstd0.5", "rand-m9-mstd0.5-inc1"])  # torchvision's ops, timm's
def test_sample_augmentation_is_the_same_for_any_ranks_and_workers(policy):
    recipe = {**RECIPE, "auto_augment": policy}
    reference = per_sample_images(DataConfig(**recipe), world=1, workers=0)
    for world, workers in ((2, 0), (1, 2), (2, 2)):
        images = per_sample_images(DataConfig(**recipe), world, workers)
        assert images.keys() <= reference.keys() and len(images) >= 16
        assert all(equal(images[key], reference[key]) for key in images), (world, workers)


# ---- mixup / cutmix ----------------------------------------------------------------------------------------

MIX = dict(mixup_alpha=1.0, cutmix_alpha=1.0, mixup_switch_prob=0.5, mixup_prob=0.9)


def constant_samples(pairs: int, epoch: int = 0) -> list:
    """Pair k's two samples; sample j is filled with the value 3 j + 1 and has label j (pixels reveal sources)."""
    return [(torch.full((3, 12, 10), 3 * j + 1, dtype=torch.uint8), j, (epoch, j // 2)) for j in range(2 * pairs)]


def test_mixed_targets_sum_to_one_and_match_the_mixed_pixels():
    n = 64
    images, labels, mix = MixCollate(DataConfig(**MIX), seed=1)(constant_samples(n // 2))
    mixed, targets = BatchMix(n, smoothing=0.0)(images.float(), labels, mix)
    torch.testing.assert_close(targets.sum(dim=1), torch.ones(n))
    kinds = set()
    for row in range(n):
        own, partner = 3 * row + 1, 3 * (row ^ 1) + 1
        share = targets[row, row].item()  # this image's weight in its target
        assert targets[row, row ^ 1].item() == pytest.approx(1 - share, abs=1e-6)
        pixels = mixed[row]
        if (pixels == own).all():
            kinds.add("none")
            assert share == 1.0
        elif ((pixels == own) | (pixels == partner)).all():  # cutmix: a box of the partner's pixels
            kinds.add("cutmix")
            assert share == pytest.approx((pixels == own).float().mean().item(), abs=1e-6)
            box = (pixels[0] == partner).nonzero()
            assert len(box) == (box[:, 0].max() - box[:, 0].min() + 1) * (box[:, 1].max() - box[:, 1].min() + 1)
        else:  # mixup: every pixel share * own + (1 - share) * partner
            kinds.add("mixup")
            torch.testing.assert_close(pixels, torch.full_like(pixels, share * own + (1 - share) * partner))
    assert kinds == {"none", "cutmix", "mixup"}


def test_label_smoothing_is_folded_into_the_mixed_targets():
    images, labels, mix = MixCollate(DataConfig(mixup_alpha=0.4), seed=1)(constant_samples(4))
    _, targets = BatchMix(10, smoothing=0.1)(images.float(), labels, mix)
    torch.testing.assert_close(targets.sum(dim=1), torch.ones(8))
    assert targets.min().item() == pytest.approx(0.01)  # smoothing / classes on every class not in the pair


def test_a_pair_draws_the_same_mix_in_any_batch_and_a_lone_sample_is_unmixed():
    collate = MixCollate(DataConfig(**MIX), seed=1)
    samples = constant_samples(6, epoch=2)
    _, _, whole = collate(samples)
    _, _, later = collate(samples[4:])
    assert torch.equal(later[:, 1:], whole[4:, 1:])  # same draws; partner rows are batch-local
    _, _, other_epoch = collate(constant_samples(6, epoch=3))
    assert not torch.equal(other_epoch[:, 1:], whole[:, 1:])
    _, _, lone = collate([*samples[:3], None, *samples[4:]])  # data.skip_corrupt dropped sample 3
    assert lone[2, 0] == 2 and lone[2, 1] == 0 and lone[2, 2] == 1  # its own partner, unmixed
    assert torch.equal(lone[3:, 1:], whole[4:, 1:])


def test_the_cutmix_box_is_timms_for_the_same_centre():
    """draw_mix's box from (lambda, centre) is timm's rand_bbox for the centre numpy draws (odd sizes: the
    half-sizes round)."""
    for seed, (height, width), lam in [(0, (12, 10), 0.3), (1, (7, 9), 0.55), (2, (224, 224), 0.81),
                                        (3, (31, 17), 0.02), (4, (5, 5), 0.97)]:
        np.random.seed(seed)
        expected = timm_mixup.rand_bbox((3, height, width), lam)
        np.random.seed(seed)
        centre = int(np.random.randint(0, height)), int(np.random.randint(0, width))
        assert cutmix_box(lam, *centre, height, width) == tuple(int(v) for v in expected), (seed, lam)


def test_symmetric_cutmix_box_is_torchvisions_and_older_timms_for_the_same_draws():
    """data.cutmix_rounding=symmetric: the box from (lambda, centre) is torchvision's CutMix.make_params box for
    the lambda and centre its own draws give, and cut // 2 on each side as older timm's rand_bbox."""
    for seed, (height, width) in enumerate([(12, 10), (7, 9), (224, 224), (31, 17), (5, 5)]):
        cutmix, image = v2.CutMix(alpha=1.0, num_classes=3), torch.zeros(2, 3, height, width)
        torch.manual_seed(seed)
        lam = float(cutmix._dist.sample(()))
        cx, cy = int(torch.randint(width, size=(1,))), int(torch.randint(height, size=(1,)))
        torch.manual_seed(seed)
        x0, y0, x1, y1 = cutmix.make_params([image])["box"]
        assert cutmix_box(lam, cy, cx, height, width, symmetric=True) == (y0, y1, x0, x1), seed
        cut_h = int(height * np.sqrt(1 - lam))
        assert (y0, y1) == (max(cy - cut_h // 2, 0), min(cy + cut_h // 2, height))  # timm 0.3.2's rand_bbox


class FixedCutMix(v2.CutMix):
    """torchvision's CutMix with its draw replaced by a given box and lambda (the mixing itself is torchvision's)."""

    def __init__(self, box: tuple[int, int, int, int], lam: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fixed = dict(box=box, lam_adjusted=lam)

    def make_params(self, flat_inputs: list) -> dict:
        return self.fixed


class FixedMixUp(v2.MixUp):
    """torchvision's MixUp with its lambda given."""

    def __init__(self, lam: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lam = lam

    def make_params(self, flat_inputs: list) -> dict:
        return dict(lam=self.lam)


def test_roll_partners_mix_a_group_as_torchvisions_mixup_and_cutmix():
    """data.mix_partner=roll: row i takes from row i-1 of its group (the first from the last) with the group's
    one draw; BatchMix's images and targets equal torchvision's MixUp/CutMix (references/classification) on the
    same batch with that draw, label smoothing applied to the mixed targets as CrossEntropyLoss does."""
    cfg = DataConfig(**MIX, mix_mode="batch", mix_partner="roll", cutmix_rounding="symmetric")
    group, classes, smoothing, kinds = 6, 4, 0.1, set()
    generator = torch.Generator().manual_seed(0)
    for g in range(16):
        samples = [(torch.randint(0, 256, (3, 11, 9), dtype=torch.uint8, generator=generator), (j + g) % classes,
                    (0, g * group // 2 + j // 2)) for j in range(group)]
        images, labels, mix = MixCollate(cfg, seed=2, group=group)(samples)
        assert mix[:, 0].tolist() == [group - 1, *range(group - 1)]
        kind, lam, y0, y1, x0, x1 = mix[0, 1:].tolist()
        if kind == 0:
            continue
        kinds.add(int(kind))
        source = (FixedCutMix((int(x0), int(y0), int(x1), int(y1)), lam, num_classes=classes) if kind == CUTMIX
                  else FixedMixUp(lam, num_classes=classes))
        expected_images, expected_targets = source(images.float(), labels)
        mixed, targets = BatchMix(classes, smoothing)(images.float(), labels, mix)
        torch.testing.assert_close(mixed, expected_images)
        torch.testing.assert_close(targets, expected_targets * (1 - smoothing) + smoothing / classes)
    assert kinds == {MIXUP, CUTMIX}


def test_roll_partners_need_batch_mode_and_whole_groups_on_a_process():
    with pytest.raises(UserError, match="data.mix_partner=roll mixes each image with the one before it"):
        load_config(None, ["data.mixup_alpha=0.2", "data.mix_partner=roll"])
    cfg = DataConfig(**MIX, mix_mode="batch", mix_partner="roll", mix_group=8)
    with pytest.raises(UserError, match="data.mix_partner=roll mixes within a group of data.mix_group 8 images"):
        build_train_loader(dataset(cfg), cfg, 4, seed=0, info=DistInfo(0, 2, 0, 2, torch.device("cpu")))


class FixedDrawMixup(timm_mixup.Mixup):
    """timm's Mixup with its per-batch random draw replaced by a given one (the mixing itself is timm's)."""

    def __init__(self, lam: float, use_cutmix: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fixed = lam, use_cutmix

    def _params_per_batch(self) -> tuple[float, bool]:
        return self.fixed


def test_batch_mode_mixes_a_group_as_timms_batch_mode(monkeypatch):
    """data.mix_mode=batch: every row of a group shares one draw, and BatchMix gives timm's Mixup(mode='batch')
    images and targets for it, with the group laid out as timm pairs rows (i with B-1-i)."""
    cfg = DataConfig(mixup_alpha=0.8, cutmix_alpha=1.0, mixup_prob=1.0, mixup_switch_prob=0.5, mix_mode="batch")
    group, classes, smoothing = 8, 5, 0.1
    collate = MixCollate(cfg, seed=1, group=group)
    generator = torch.Generator().manual_seed(0)
    kinds = set()
    for g in range(12):
        samples = [(torch.randint(0, 256, (3, 11, 9), dtype=torch.uint8, generator=generator), j % classes,
                    (0, g * group // 2 + j // 2)) for j in range(group)]
        images, labels, mix = collate(samples)
        assert (mix[:, 1:] == mix[0, 1:]).all(), mix  # one draw for the group
        mixed, targets = BatchMix(classes, smoothing)(images.float(), labels, mix)
        timm_order = [*range(0, group, 2), *range(group - 1, 0, -2)]  # pair k at rows k and B-1-k
        kind, lam, y0, y1, x0, x1 = mix[0, 1:].tolist()
        box = tuple(int(v) for v in (y0, y1, x0, x1))
        monkeypatch.setattr(timm_mixup, "rand_bbox", lambda *args, **kwargs: box)
        reference = FixedDrawMixup(lam if kind != CUTMIX else 0.5, kind == CUTMIX, mixup_alpha=0.8, cutmix_alpha=1.0,
                                   mode="batch", label_smoothing=smoothing, num_classes=classes)
        timm_images, timm_targets = reference(images.float()[timm_order], labels[timm_order])
        torch.testing.assert_close(mixed[timm_order], timm_images)
        torch.testing.assert_close(targets[timm_order], timm_targets)
        kinds.add(int(kind))
    assert kinds == {MIXUP, CUTMIX}


def test_batch_mode_draws_per_group_of_the_global_order():
    """Pairs of one group (positions [g G, (g+1) G)) share a draw, the next group draws anew; pair mode draws
    per pair."""
    batch = MixCollate(DataConfig(**MIX, mix_mode="batch"), seed=1, group=4)
    _, _, mix = batch(constant_samples(6))  # pairs 0-5: groups of 2 pairs
    draws = [tuple(row) for row in mix[:, 1:].tolist()]
    assert len(set(draws[0:4])) == len(set(draws[4:8])) == len(set(draws[8:12])) == 1
    assert len(set(draws[::4])) == 3
    _, _, pairs = MixCollate(DataConfig(**MIX), seed=1)(constant_samples(6))
    assert len({tuple(row) for row in pairs[::2, 1:].tolist()}) == 6


@pytest.mark.parametrize("loss", ["ce", "bce"])
def test_losses_take_hard_labels_and_soft_targets(loss):
    logits, labels = torch.randn(6, 5), torch.tensor([0, 1, 2, 3, 4, 0])
    fn = build_loss(TrainConfig(loss=loss, label_smoothing=0.1), mixing=False)
    soft = build_loss(TrainConfig(loss=loss, label_smoothing=0.1), mixing=True)
    smoothed = torch.nn.functional.one_hot(labels, 5) * 0.9 + 0.02
    torch.testing.assert_close(fn(logits, labels), soft(logits, smoothed))
    if loss == "bce":
        expected = torch.nn.functional.binary_cross_entropy_with_logits(logits, smoothed)
        torch.testing.assert_close(fn(logits, labels), expected)


# ---- the samplers: pairs, repeats, global batches ----------------------------------------------------------


def global_batches(n: int, world: int, batch: int, unit: int, repeats: int, epoch: int = 1) -> list[list[tuple]]:
    """For each step, the sorted keys all `world` ranks read (per-rank batch `batch`)."""
    samplers = [EpochSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=7, drop_last=True,
                             unit=unit, repeats=repeats) for r in range(world)]
    per_rank = []
    for sampler in samplers:
        sampler.set_epoch(epoch)
        keys = list(sampler)
        assert len(keys) == len(sampler)
        per_rank.append([keys[s:s + batch] for s in range(0, len(keys) - batch + 1, batch)])
    steps = min(len(batches) for batches in per_rank)
    assert all(len(batches) == steps for batches in per_rank)
    return [sorted(k for batches in per_rank for k in batches[step]) for step in range(steps)]


@pytest.mark.parametrize("unit, repeats", [(1, 1), (2, 1), (1, 3), (2, 2), (2, 3)])
def test_the_global_batches_are_the_same_for_one_and_two_ranks(unit, repeats):
    for n in (50, 51):
        one, two = global_batches(n, 1, 12, unit, repeats), global_batches(n, 2, 6, unit, repeats)
        assert one == two and len(one) == n // 12
        keys = [key for batch in one for key in batch]
        assert len(set(keys)) == len(keys)  # (index, repeat) once each
        if repeats > 1:
            assert {k[2] for k in keys} == set(range(repeats))
            counts = torch.bincount(torch.tensor([k[1] for k in keys]))
            assert counts.max() == repeats  # an index k times, the epoch as long as the dataset


def ranks_of_keys(unit: int, repeats: int, world: int = 3) -> dict[tuple, int]:
    ranks = {}
    for rank in range(world):
        sampler = EpochSampler(range(60), num_replicas=world, rank=rank, shuffle=True, seed=7, drop_last=True,
                               unit=unit, repeats=repeats)
        keys = list(sampler)
        if unit == 2:
            assert [k[3] for k in keys[::2]] == [k[3] for k in keys[1::2]]  # consecutive samples form a pair
        ranks.update({k: rank for k in keys})
    return ranks


def test_pairs_stay_on_one_rank_and_unmixed_repeats_go_to_different_ranks():
    pairs = {}
    for (_, index, repeat, pair), rank in ranks_of_keys(unit=2, repeats=3).items():
        pairs.setdefault(pair, set()).add(rank)
    assert all(len(r) == 1 for r in pairs.values())
    by_index = {}
    for (_, index, repeat, _), rank in ranks_of_keys(unit=1, repeats=3).items():
        by_index.setdefault(index, []).append(rank)
    assert all(len(set(r)) == len(r) for r in by_index.values())  # world size 3 >= 3 repeats


def test_mixed_repeats_have_distinct_partners_and_the_same_order_on_1_2_3_ranks():
    """aug_repeats=3 with mixing: each image's 3 copies in an epoch are mixed with 3 different images (a
    partner is the other member of the key's pair); the global batches are the same for 1, 2 and 3 ranks."""
    for n in (60, 61, 97):
        one = global_batches(n, 1, 12, unit=2, repeats=3)
        assert one == global_batches(n, 2, 6, unit=2, repeats=3) == global_batches(n, 3, 4, unit=2, repeats=3)
        members = {}
        for _, index, repeat, pair in (key for batch in one for key in batch):
            members.setdefault(pair, []).append(index)
        partners = {}
        for a, b in members.values():
            partners.setdefault(a, []).append(b)
            partners.setdefault(b, []).append(a)
        full = [p for p in partners.values() if len(p) == 3]
        assert len(full) >= len(partners) - 6, (n, partners)  # all but the last copies cut by the epoch's end
        assert all(len(set(p)) == len(p) for p in partners.values()), partners
        assert all(index not in p for index, p in partners.items())


@pytest.mark.parametrize("repeats, roll", [(1, False), (3, False), (3, True)])
def test_batch_mode_groups_are_the_sources_gpu_batches_for_any_split_of_a_step(repeats, roll):
    """data.mix_mode=batch with group G and a step of 4 G images: the images of each group (one mixing draw) are
    the batches torch's DistributedSampler (repeats 1) or timm's RepeatAugSampler (DeiT's RASampler) deal to 4
    GPUs of G, and pairs are timm's (row i with G-1-i), or (roll, torchvision's partners) the rows come in the
    batch's own order, whether 4 ranks, 2 ranks with accumulation, 1 rank with 4 micro-batches or 2 ranks of
    2 G compute the step."""
    n, group, gpus = 100, 4, 4
    sources = []
    for gpu in range(gpus):
        source = (RepeatAugSampler(range(n), num_replicas=gpus, rank=gpu, num_repeats=repeats, selected_round=0)
                  if repeats > 1 else DistributedSampler(range(n), num_replicas=gpus, rank=gpu, seed=0))
        source.set_epoch(2)
        stream = list(source)
        sources.append([stream[b:b + group] for b in range(0, len(stream) - group + 1, group)])
    for world, accum in ((4, 1), (2, 2), (1, 4), (2, 1)):
        batch = group * gpus // world // accum
        steps = []
        for rank in range(world):
            sampler = EpochSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True,
                                   unit=min(group, batch), repeats=repeats, group=group, step=group * gpus,
                                   roll=roll)
            sampler.set_epoch(2)
            keys = list(sampler)
            steps.append([keys[s:s + batch * accum] for s in range(0, len(keys), batch * accum)])
        assert len(steps[0]) == n // (group * gpus)
        for j, step in enumerate(zip(*steps)):
            groups = {}
            for _, index, _, pair in (key for keys in step for key in keys):
                groups.setdefault(pair // (group // 2), []).append(index)
            expected = sorted(sources[gpu][j] for gpu in range(gpus))
            ordered = [g if roll else [*g[0::2], *reversed(g[1::2])] for g in groups.values()]
            assert sorted(ordered) == expected, (world, accum, j)


def test_deit_layout_on_four_ranks_puts_copies_on_other_ranks_with_their_own_draws():
    """DeiT's layout at tiny sizes (4 ranks x 4 images, 3 repeats, one draw per GPU batch) through real loaders:
    no GPU batch holds two copies of an image, each GPU batch has one draw, an image's copies have different draws;
    2 ranks x 8 with 2 groups each deliver the same images and draws."""
    cfg = DataConfig(**RECIPE, **MIX, aug_repeats=3, mix_mode="batch", mix_group=4)
    data, draws, copies = dataset(cfg, size=48), {}, {}
    for rank in range(4):
        loader = build_train_loader(data, cfg, 4, seed=3, info=DistInfo(rank, 4, rank, 4, torch.device("cpu")))
        loader.sampler.set_epoch(1)
        keys = list(loader.sampler)
        for step, (_, labels, mix) in enumerate(loader):
            batch = keys[step * 4:(step + 1) * 4]
            assert len({index for _, index, _, _ in batch}) == 4  # no image twice in a GPU batch
            assert (mix[:, 1:] == mix[0, 1:]).all()  # one draw
            draws.update({key: tuple(mix[0, 1:].tolist()) for key in batch})
            for _, index, repeat, _ in batch:
                copies.setdefault(index, []).append(tuple(mix[0, 1:].tolist()))
    assert len(draws) == 48 and max(len(c) for c in copies.values()) == 3
    assert all(len(set(c)) == len(c) for c in copies.values())  # each copy its own draw
    for rank in range(2):
        loader = build_train_loader(data, cfg, 8, seed=3, info=DistInfo(rank, 2, rank, 2, torch.device("cpu")))
        loader.sampler.set_epoch(1)
        keys = list(loader.sampler)
        for step, (_, _, mix) in enumerate(loader):
            assert {tuple(row) for row in mix[:, 1:].tolist()} == {draws[k] for k in keys[step * 8:(step + 1) * 8]}


def test_batch_mode_refuses_groups_that_split_a_batch_or_a_step():
    cfg = DataConfig(**MIX, mix_mode="batch", mix_group=6)
    cpu = DistInfo(0, 1, 0, 1, torch.device("cpu"))
    with pytest.raises(UserError, match="data.mix_group 6 and train.batch_size 4: one must divide the other"):
        build_train_loader(dataset(cfg), cfg, 4, seed=0, info=cpu)
    with pytest.raises(UserError, match="data.mix_group 6 does not divide the 3 images of an optimizer step"):
        build_train_loader(dataset(cfg), cfg, 3, seed=0, info=cpu)


def test_mid_epoch_resume_with_draws_per_batch_keeps_the_batch(tmp_path):
    """data.mix_group=0 draws per train.batch_size images, which orders the epoch: a mid-epoch checkpoint of
    2 x 4 does not continue as 1 x 8 (the same global batch) but says so; with data.mix_group=4 it does."""
    saved = {"world_size": 2, "epoch": 0, "epoch_step": 3, "config": {"train": {"batch_size": 4, "accum_steps": 1}}}
    batch_mode = ["data.mixup_alpha=0.2", "data.mix_mode=batch", "train.batch_size=8"]
    with pytest.raises(UserError, match="stopped mid-epoch with train.batch_size=4 and data.mix_group=0") as caught:
        check_global_batch(saved, tmp_path / "last.pth", load_config("dummy", batch_mode), world_size=1)
    assert "or let the run reach the end of epoch 0 with train.batch_size=4 first" in str(caught.value)  # no epoch file
    check_global_batch(saved, tmp_path / "last.pth", load_config("dummy", [*batch_mode, "data.mix_group=4"]), 1)


def test_the_start_skip_resumes_pairs_and_repeats_exactly():
    full = EpochSampler(range(61), num_replicas=2, rank=1, shuffle=True, seed=7, drop_last=True, unit=2, repeats=2)
    full.set_epoch(4)
    resumed = EpochSampler(range(61), num_replicas=2, rank=1, shuffle=True, seed=7, drop_last=True, unit=2,
                           repeats=2)
    resumed.set_epoch(4, start=8)
    assert list(resumed) == list(full)[8:] and len(resumed) == len(full) - 8


def test_repeats_get_different_augmentations_and_repeat_zero_is_unchanged():
    data = dataset(DataConfig(**RECIPE))
    plain = data[(2, 5)][0]
    assert torch.equal(data[(2, 5, 0, -1)][0], plain)  # repeat 0 is seeded as without repeats
    repeats = [data[(2, 5, r, -1)][0] for r in range(4)]
    assert all(not torch.equal(repeats[a], repeats[b]) for a in range(4) for b in range(a))
    image, label, key = data[(2, 5, 1, 9)]
    assert torch.equal(image, repeats[1]) and key == (2, 9)


@pytest.mark.parametrize("mode", ["pair", "batch"])
def test_mixed_batches_are_the_same_for_any_ranks_and_workers(mode):
    """Through real loaders: each key's image, mix draw and partner key are independent of ranks and workers."""
    cfg = dict(**RECIPE, **MIX, aug_repeats=2, mix_mode=mode, mix_group=8)
    reference = per_sample_images(DataConfig(**cfg), world=1, workers=0)
    assert len(reference) >= 16 and all(len(key) == 4 for key in reference)
    for world, workers in ((2, 0), (2, 2)):
        images = per_sample_images(DataConfig(**cfg), world, workers)
        assert images.keys() <= reference.keys() and len(images) >= 16
        assert all(equal(images[key], reference[key]) for key in images), (world, workers)


def test_normalized_erasing_fills_the_same_for_any_ranks_and_workers_and_on_resume():
    """data.random_erase_fill=normalized with mixing: each key's normalized, erased image (and its mix draw and
    partner) is the same through the loaders of 1 rank and of 2 ranks with 2 workers; a sample's boxes and their
    seeds are a pure function of its key (a resumed run redraws them), new in each epoch."""
    cfg = {**RECIPE, **MIX, "random_erase": 1.0, "random_erase_fill": "normalized", "aug_repeats": 2}
    reference = per_sample_images(DataConfig(**cfg), world=1, workers=0)
    low = min(-m / s for m, s in zip(DataConfig().mean, DataConfig().std))
    assert any((image < low - 0.01).any() for image, *_ in reference.values())  # filled after normalization
    images = per_sample_images(DataConfig(**cfg), world=2, workers=2)
    assert images.keys() <= reference.keys() and len(images) >= 16
    assert all(equal(images[key], reference[key]) for key in images)
    data = dataset(DataConfig(**cfg))
    boxes = data[(2, 5, 1, 9)][2]
    assert boxes and data[(2, 5, 1, 9)][2] == boxes and data[(3, 5, 1, 9)][2] != boxes


# ---- end to end: the guarantees hold with every recipe option on (fp32) ------------------------------------

RECIPE_RUN = ("data.augment=true", "data.mixup_alpha=0.2", "data.cutmix_alpha=1.0", "data.mixup_prob=0.8",
              "data.auto_augment=rand-m9-mstd0.5", "data.random_erase=0.25", "data.aug_repeats=2")


@pytest.mark.slow
def test_recipe_one_process_equals_two_ranks(tmp_path):
    """Guarantee 1 of docs/correctness.md with mixup, cutmix, RandAugment, erasing and repeats on, one draw per
    group of 6 (data.mix_mode=batch: two groups per batch on one process, one on each of two ranks, one per
    micro-batch of one process accumulating two: the layout follows the step, train.py passes accum_steps)."""
    common = (*correctness.COMMON, correctness.NO_BN_MODEL, *RECIPE_RUN, "data.mix_mode=batch", "data.mix_group=6")
    train_here(*common, "train.batch_size=12", f"output_dir={tmp_path}/one")
    run_on_ranks("train.py", *common, "train.batch_size=6", f"output_dir={tmp_path}/two", nproc=2)
    correctness.assert_same_model(tmp_path / "one", tmp_path / "two")
    train_here(*common, "train.batch_size=6", "train.accum_steps=2", f"output_dir={tmp_path}/accum")
    correctness.assert_same_model(tmp_path / "one", tmp_path / "accum")


@pytest.mark.slow
def test_recipe_resume_mid_epoch_is_bitwise_identical(tmp_path):
    """2 ranks x 4 steps per epoch, stopped at step 6 (mid-epoch 1) and resumed == uninterrupted, every bit."""
    straight, out = tmp_path / "straight", tmp_path / "run"
    args = [*resume.RUN, *RECIPE_RUN, "train.loss=bce", "train.label_smoothing=0.1"]
    run_on_ranks("train.py", *args, f"output_dir={straight}", nproc=2)
    run_on_ranks("train.py", *args, f"output_dir={out}", "train.max_steps=6", nproc=2)
    partial = load_checkpoint(out / "last.pth")
    assert (partial["epoch"], partial["epoch_step"]) == (1, 2)
    stop_top1 = read_jsonl(out / "metrics.jsonl")[-1][partial["best_metric"]]  # the evaluation at the stop
    run_on_ranks("train.py", *args, f"output_dir={out}", nproc=2)
    expected, resumed = load_checkpoint(straight / "last.pth"), load_checkpoint(out / "last.pth")
    resume.allow_best_of_the_stop(expected, resumed, stop_top1, partial["epoch"])
    resume.assert_same(expected, resumed)
    assert resume.rows_without_timing(out) == resume.rows_without_timing(straight)
