"""engine/evaluation.py at unit level: the exact mean every reported loss is, and the float32 logits every number
is computed from whatever eval_amp computed them in."""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from core.dist import DistInfo
from data.transforms import DeviceNormalize
from engine.evaluation import evaluate, exact_mean
from engine.precision import Precision
from tests.helpers import Batches

CPU = torch.device("cpu")


def test_exact_mean_is_the_correctly_rounded_mean():
    """A running float64 sum loses each 2**-53 added to 1.0 (0.25 after dividing by 4); the correctly rounded mean of
    the four values is 0.25 + 2**-53, what evaluate.py's fsum of predictions.csv's losses gives."""
    values = [1.0, 2.0 ** -53, 2.0 ** -53, 2.0 ** -53]  # float32 values: the per-image losses' dtype
    correct = float(sum(map(Fraction, values)) / len(values))
    assert correct == 0.25 + 2.0 ** -53 != sum(values) / len(values)
    assert exact_mean([torch.tensor(values[:1]), torch.tensor(values[1:])], CPU) == correct


def test_low_precision_evaluation_computes_the_loss_from_float32_logits():
    """Under eval_amp=bf16 the model's outputs are bf16; the loss, the softmax and the ECE are computed from them in
    float32 (a bf16 cross-entropy is off by ~1e-3): the batches' logits are float32 and val_loss is their exact mean
    loss."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 7))
    generator = torch.Generator().manual_seed(0)
    loader = Batches([(torch.randint(0, 256, (8, 3, 4, 4), dtype=torch.uint8, generator=generator),
                       torch.randint(0, 7, (8,), generator=generator)) for _ in range(2)], 7)
    seen = []
    metrics = evaluate(model, loader, Precision("cpu", torch.bfloat16), DistInfo(0, 1, 0, 1, CPU),
                       DeviceNormalize([0.5] * 3, [0.25] * 3, CPU, False),
                       on_batch=lambda logits, targets, ranked: seen.append((logits, targets)))
    assert [logits.dtype for logits, _ in seen] == [torch.float32] * 2
    assert all(torch.equal(logits, logits.bfloat16().float()) for logits, _ in seen)  # computed in bf16
    losses = [torch.nn.functional.cross_entropy(logits.double(), targets, reduction="none") for logits, targets in seen]
    assert math.isclose(metrics["val_loss"], math.fsum(torch.cat(losses).tolist()) / 16, rel_tol=1e-6)
