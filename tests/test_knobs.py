"""timm's remaining training knobs (issue 27 item 5): gradient clipping modes, BCE's target threshold and
positive weight, random erasing's fill modes and box count, each checked against timm's or torch's own
function on the same gradients / logits / images."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from timm.data.random_erasing import RandomErasing as TimmRandomErasing
from timm.loss import BinaryCrossEntropy as TimmBinaryCrossEntropy
from timm.utils import dispatch_clip_grad
from torch import nn

from core.config import TrainConfig
from core.config_load import load_config
from core.errors import UserError
from data.datasets import seeded
from data.transforms import DeviceNormalize, TimmErasing
from engine.losses import build_loss
from engine.precision import Precision

CLIP = {"norm": 0.05, "value": 0.002, "agc": 0.01}  # small enough that every mode clips these gradients


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(6, 3, 8, 8, generator=generator)
    images[0] *= 50  # one outlier image: gradients far above every clip value
    return images, torch.tensor([0, 1, 2, 3, 4, 0])


@pytest.mark.parametrize("scaled", [False, True], ids=["fp32", "grad-scaler"])
@pytest.mark.parametrize("mode", ["norm", "value", "agc"])
def test_clip_modes_equal_timms_dispatch_clip_grad(mode, scaled):
    """The app's step (fp32/bf16 path, or GradScaler's unscale-then-clip path) leaves the weights timm's
    dispatch_clip_grad + SGD leaves from the same gradients; and the clipping changed something."""
    model, reference, unclipped = tiny_model(), tiny_model(), tiny_model()
    images, labels = batch()
    precision = Precision("cpu", None, torch.amp.GradScaler("cpu", init_scale=2.0**12) if scaled else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    precision.backward(nn.functional.cross_entropy(model(images), labels))
    stepped, _ = precision.step(optimizer, model, CLIP[mode], clip_mode=mode)
    assert stepped
    for net, clip in ((reference, True), (unclipped, False)):
        nn.functional.cross_entropy(net(images), labels).backward()
        if clip:
            dispatch_clip_grad(net.parameters(), CLIP[mode], mode=mode)
        torch.optim.SGD(net.parameters(), lr=1.0).step()
    for (name, mine), theirs, raw in zip(model.named_parameters(), reference.parameters(), unclipped.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.allclose(a, b) for a, b in zip(model.parameters(), unclipped.parameters()))


def test_clip_grad_zero_leaves_gradients_alone():
    model = tiny_model()
    images, labels = batch()
    nn.functional.cross_entropy(model(images), labels).backward()
    before = copy.deepcopy([p.grad for p in model.parameters()])
    for mode in CLIP:
        Precision("cpu", None).step(torch.optim.SGD(model.parameters(), lr=0.0), model, 0.0, clip_mode=mode)
        for grad, p in zip(before, model.parameters()):
            torch.testing.assert_close(p.grad, grad, rtol=0, atol=0)


def mixed_targets(classes: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft targets as mixup/cutmix make them: lam x one-hot(a) + (1 - lam) x one-hot(b), lam on either side
    of the threshold, so that thresholding keeps one or both classes."""
    a, b = torch.tensor([0, 1, 2, 3, 4, 0]), torch.tensor([1, 2, 3, 4, 0, 0])
    lam = torch.tensor([0.9, 0.7, 0.5, 0.15, 0.85, 0.6])[:, None]
    one_hot = nn.functional.one_hot
    return a, lam * one_hot(a, classes).float() + (1 - lam) * one_hot(b, classes).float()


@pytest.mark.parametrize("threshold, pos_weight", [(0.2, None), (None, 3.0), (0.2, 3.0)])
def test_bce_threshold_and_pos_weight_equal_timms(threshold, pos_weight):
    """Hard labels (smoothed) and mixed soft targets against timm's BinaryCrossEntropy and torch's formula."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 5, generator=generator)
    labels, soft = mixed_targets()
    cfg = TrainConfig(loss="bce", label_smoothing=0.1, bce_target_threshold=threshold, bce_pos_weight=pos_weight)
    timm_hard = TimmBinaryCrossEntropy(0.1, target_threshold=threshold, pos_weight=pos_weight)
    timm_soft = TimmBinaryCrossEntropy(0.0, target_threshold=threshold, pos_weight=pos_weight)
    torch.testing.assert_close(build_loss(cfg, mixing=False)(logits, labels), timm_hard(logits, labels))
    torch.testing.assert_close(build_loss(cfg, mixing=True)(logits, soft), timm_soft(logits, soft))
    binary = (soft > threshold).float() if threshold is not None else soft
    weight = torch.full((5,), pos_weight) if pos_weight is not None else None
    expected = nn.functional.binary_cross_entropy_with_logits(logits, binary, pos_weight=weight)
    torch.testing.assert_close(build_loss(cfg, mixing=True)(logits, soft), expected)
    if threshold is not None:  # a 0.7/0.3 mix keeps both classes, a 0.15/0.85 mix only the 0.85 one
        assert binary[1].tolist() == [0, 1, 1, 0, 0] and binary[3].tolist() == [0, 0, 0, 0, 1]


def test_bce_under_autocast_uses_float32_targets():
    """bf16 logits under autocast: the loss equals the float32 loss of the same (rounded) logits."""
    logits = torch.randn(6, 5, generator=torch.Generator().manual_seed(3)).bfloat16()
    labels, _ = mixed_targets()
    fn = build_loss(TrainConfig(loss="bce", label_smoothing=0.1, bce_target_threshold=0.2), mixing=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fn(logits, labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, fn(logits.float(), labels), rtol=0, atol=0)


@pytest.mark.parametrize("overrides, message", [
    (["optim.clip_mode=l1"], "config key 'optim.clip_mode' is 'l1'; choose one of norm, value, agc"),
    (["optim.clip_mode=agc"], "config key 'optim.clip_mode' is agc but optim.clip_grad is 0 (off); set "
     "optim.clip_grad (the AGC clip factor, e.g. 0.01)"),
    (["train.bce_target_threshold=0.2"], "config key 'train.bce_target_threshold' applies to train.loss=bce only "
     "(train.loss is 'ce'); set train.loss=bce or remove it"),
    (["train.loss=bce", "train.bce_target_threshold=1.5"], "config key 'train.bce_target_threshold' must be in "
     "[0, 1) (or null: off), got 1.5"),
    (["train.loss=bce", "train.bce_pos_weight=0"], "config key 'train.bce_pos_weight' must be > 0 (or null: 1), "
     "got 0.0"),
    (["optim.no_decay_match=bn", "optim.layer_decay=0.7"], "config key 'optim.no_decay_match' cannot be used with "
     "optim.layer_decay (timm groups the parameters by layer); remove one of them"),
    (["optim.no_decay_match=bn", "optim.no_decay_norm_layers=true"], "config key 'optim.no_decay_match' cannot be "
     "used with optim.no_decay_norm_layers=true (two rules for the same parameters); remove one of them"),
    (["model.conv_init=fan"], "config key 'model.conv_init' is 'fan'; choose one of , fan_in, fan_out"),
])
def test_bad_knob_values_are_one_line_errors(overrides, message):
    with pytest.raises(UserError) as err:
        load_config(None, overrides)
    assert str(err.value) == message


# ---- random erasing: timm's fill modes and --recount ----------------------------------------------------------

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def fill_kind(box: torch.Tensor) -> str:
    """What fills an erased box (C x pixels, normalized): const 0, one colour per channel (rand), or noise."""
    if box.abs().max() < 0.02:  # 0 up to the uint8 rounding of the mean colour
        return "const"
    return "rand" if bool((box == box[:, :1]).all()) else "pixel"


@pytest.mark.parametrize("mode", ["pixel", "rand", "const"])
def test_erasing_fills_its_box_as_timms_mode(mode):
    """The same mode fills a box the same way in timm's RandomErasing (on the normalized image) and in ours
    (on uint8, then the device normalization): noise per pixel, one noise colour per channel, or 0."""
    black = torch.zeros(3, 32, 32, dtype=torch.uint8)
    normalize = DeviceNormalize(MEAN, STD, torch.device("cpu"), channels_last=False)
    plain = normalize(black[None])[0]
    timm_erase = TimmRandomErasing(probability=1.0, mode=mode, device="cpu")
    ours = TimmErasing(1.0, MEAN, STD, mode)
    for seed in range(5):
        random.seed(seed)
        torch.manual_seed(seed)
        theirs = timm_erase(plain.clone())
        mine = normalize(seeded(ours, black, seed)[None])[0]
        for erased in (theirs, mine):
            inside = (erased != plain).any(dim=0)
            assert inside.any()
            assert fill_kind(erased[:, inside]) == mode


def erased_fraction(erase, seeds: range) -> float:
    """Mean fraction of a 48 x 48 image that `erase` (seeded per image) changes."""
    image = torch.full((3, 48, 48), 200, dtype=torch.uint8)
    total = 0.0
    for seed in seeds:
        random.seed(seed)
        total += float((seeded(erase, image, seed) != image).any(dim=0).float().mean())
    return total / len(seeds)


def test_recount_erases_1_to_count_boxes_of_a_count_th_of_the_area_as_timm():
    """count=3: 1-3 boxes per image, each of a third of the area: the mean erased fraction over 100 seeded
    images is timm's (max_count=3) within 15% (0.166 vs 0.182), and so is count=1's; boxes of the whole area
    would erase 0.30."""
    for count in (1, 3):
        theirs = TimmRandomErasing(probability=1.0, mode="const", max_count=count, device="cpu")
        timm_fraction = erased_fraction(lambda image: (theirs(image.float() / 255) * 255).round().byte(),
                                        range(100))
        ours = TimmErasing(1.0, MEAN, STD, "const", count)
        assert erased_fraction(ours, range(100)) == pytest.approx(timm_fraction, rel=0.15), count
    boxes = {len(TimmErasing(1.0, MEAN, STD, "rand", 3).make_params([torch.zeros(3, 48, 48)])["boxes"])
             for _ in range(30)}
    assert boxes == {1, 2, 3}
