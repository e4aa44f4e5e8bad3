"""Recipe augmentations (issue 14): torchvision policies and erasing, mixup/cutmix, repeated augmentation.

Every draw is a pure function of (seed, epoch, index[, repeat]) or, for a mixed pair, (seed, epoch, pair):
the tests compare per-sample outputs through real DataLoaders and samplers for 1 and 2 ranks and 0 and 2
workers, and the global batches the samplers hand out for 1 and 2 ranks.
"""

from __future__ import annotations

import pytest
import torch

import train
from data.datasets import DummyDataset
from data.loader import EpochSampler, build_train_loader
from data.transforms import tensor_augment, train_transform
from engine.cli import report_errors
from engine.config import DataConfig, load_config
from engine.dist import DistInfo
from engine.errors import UserError
from tests.helpers import TINY

RECIPE = dict(img_size=16, auto_augment="rand-m9-mstd0.5", random_erase=0.5)


def dataset(cfg: DataConfig, size: int = 24) -> DummyDataset:
    return DummyDataset(size, 4, 20, train_transform(cfg), seed=3, tensor_transform=tensor_augment(cfg))


@pytest.mark.parametrize("value, message", [
    ("rand", None), ("rand-m9-mstd0.5", None), ("rand-m7-n3", None), ("trivialaugment", None), ("augmix", None),
    ("augmix-m3-w3", None), ("autoaugment", None),
    ("randaugment", "config key 'data.auto_augment' is 'randaugment'; use rand-m<magnitude"),
    ("rand-m9-x2", "config key 'data.auto_augment' is 'rand-m9-x2': cannot read 'x2'"),
    ("rand-m12", "rand needs m in 0-10"), ("rand-m9.5", "cannot read 'm9.5'"), ("augmix-m0", "augmix needs m in 1-10"),
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
])
def test_recipe_keys_out_of_range(override, message):
    with pytest.raises(UserError) as err:
        load_config(None, [override])
    assert str(err.value) == message


def test_mixing_needs_an_even_batch():
    with pytest.raises(UserError, match="'train.batch_size' must be even with mixup or cutmix on .* got 7"):
        load_config(None, ["data.mixup_alpha=0.2", "train.batch_size=7"])
    load_config(None, ["data.mixup_alpha=0.2", "train.batch_size=8"])


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


def test_erasing_fills_a_box_with_varied_pixels():
    cfg = DataConfig(img_size=16, random_erase=1.0)
    erased, plain = dataset(cfg)[(0, 1)][0], dataset(DataConfig(img_size=16))[(0, 1)][0]
    box = (erased != plain).any(dim=0).nonzero()
    rows, cols = box[:, 0], box[:, 1]
    inside = erased[:, rows.min():rows.max() + 1, cols.min():cols.max() + 1]
    assert inside.float().std() > 20  # random pixel values, not one constant


def test_policy_draws_leave_the_global_torch_rng_alone():
    data = dataset(DataConfig(**RECIPE))
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    first = data[(0, 5)][0]
    assert torch.equal(torch.rand(3), expected)
    assert torch.equal(data[(0, 5)][0], first)  # a pure function of (seed, epoch, index)
    assert not torch.equal(data[(1, 5)][0], first)  # a new epoch, new draws


def per_sample_images(cfg: DataConfig, world: int, workers: int, epoch: int = 1) -> dict[tuple, torch.Tensor]:
    """key -> image, as the training loaders of all `world` ranks deliver them in `epoch`."""
    cfg.num_workers = workers
    data = dataset(cfg)
    images = {}
    for rank in range(world):
        loader = build_train_loader(data, cfg, 4, seed=3, info=DistInfo(rank, world, rank, world, torch.device("cpu")))
        loader.sampler.set_epoch(epoch)
        keys = list(loader.sampler)
        batches = [batch[0] for batch in loader]
        stacked = torch.cat(batches)
        images.update({key: stacked[i] for i, key in enumerate(keys[:len(stacked)])})
    return images


def test_sample_augmentation_is_the_same_for_any_ranks_and_workers():
    cfg = DataConfig(**RECIPE)
    reference = per_sample_images(cfg, world=1, workers=0)
    for world, workers in ((2, 0), (1, 2), (2, 2)):
        images = per_sample_images(DataConfig(**RECIPE), world, workers)
        assert images.keys() <= reference.keys() and len(images) >= 16
        assert all(torch.equal(images[key], reference[key]) for key in images), (world, workers)
