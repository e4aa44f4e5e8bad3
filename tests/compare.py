"""Compare what two training runs left behind (the weights in last.pth and the rows of metrics.jsonl), and the
references metrics are compared with."""

from __future__ import annotations

import math
import operator
from pathlib import Path

import numpy as np
import torch

from engine.checkpoint import formats
from engine.trainer import MEASURED_COLUMNS
from tests.helpers import STEPS, read_jsonl

# A state dict's floating-point tensors in three groups of like scale: BatchNorm's running means and
# running variances, and everything else (the parameters).
GROUPS = ("parameters", "running_mean", "running_var")
# Differences the comparison must ignore: wall-clock time, the config (output_dir, max_steps, workers), and the
# run's own id (two runs compared are two runs: a fresh run makes one).
NOT_COMPARED = {"epoch_seconds", "config", "run_id"}
# Runs that must agree differ only in float32 summation order: per-rank partial sums all-reduced by gloo,
# BatchNorm statistics as per-rank moments combined after one all_reduce, kernels run with 2 threads in one
# process and 1 per rank. Measured here as ||a - b|| / ||a|| per group (13 seeds x 2 ranks, 10 seeds x 3 ranks):
# 2e-8 for the parameters, 2e-7 for the running statistics; when rounding flips a discrete decision (a
# ReLU sign, a max-pool choice: 3 comparisons of 23, seed 0 among them) up to 8.8e-6 and 2.4e-5.
# TOL is 4x that; dropping SyncBN moves the same groups by 9e-3 and 5e-2 (guarantee 2), 90x TOL or more.
TOL = 1e-4


def load_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The unwrapped model's state dict (parameters and BatchNorm buffers) from run_dir/last.pth."""
    return torch.load(Path(run_dir) / "last.pth", weights_only=True, map_location="cpu")["model"]


def group_of(key: str) -> str:
    for group in GROUPS[1:]:
        if key.endswith(group):
            return group
    return GROUPS[0]


def relative_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """||a - b|| / ||a|| over each group's tensors taken together; integer buffers (counters) must be equal.

    Per group rather than per tensor: a tensor that training left near zero (a BatchNorm bias followed by
    another BatchNorm gets a gradient of ~1e-9) has no meaningful relative error of its own.
    """
    assert a.keys() == b.keys(), f"different state dict keys: {sorted(set(a) ^ set(b))}"
    squared_diff = dict.fromkeys(GROUPS, 0.0)
    squared_norm = dict.fromkeys(GROUPS, 0.0)
    for key in a:
        if not a[key].is_floating_point():
            assert torch.equal(a[key], b[key]), f"{key}: {a[key].tolist()} != {b[key].tolist()}"
            continue
        x, y = a[key].double(), b[key].double()
        squared_diff[group_of(key)] += (x - y).square().sum().item()
        squared_norm[group_of(key)] += x.square().sum().item()
    return {g: (squared_diff[g] / squared_norm[g]) ** 0.5 for g in GROUPS if squared_norm[g] > 0}


def worst_tensor(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """(max |a - b| / max |a|, key) of the tensor that differs most on its own scale: for reports only."""
    def difference(x: torch.Tensor, y: torch.Tensor) -> float:
        x, y = x.double(), y.double()
        return (x - y).abs().max().item() / max(x.abs().max().item(), 1e-30)

    return max((difference(a[k], b[k]), k) for k in a if a[k].is_floating_point())


def differing_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ in any bit (empty when the two state dicts are identical)."""
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def model_rows(rows: list[dict]) -> list[dict]:
    """metrics.jsonl rows without the timing fields, which differ between any two runs."""
    return [{k: v for k, v in row.items() if k not in MEASURED_COLUMNS} for row in rows]


def rows_without_timing(run: Path) -> list[dict]:
    return model_rows(read_jsonl(run / "metrics.jsonl"))


def allow_best_of_the_stop(expected: dict, resumed: dict, stop_value: float, stop_epoch: int) -> None:
    """A run stopped mid-epoch evaluated at the stop, which the uninterrupted run did not: its best value (and that
    value's epoch, and the early-stop count of validations since the best) may come from that evaluation, the only
    allowed difference; then `resumed` takes expected's."""
    stop_won = stop_value > expected["best_value"]  # train.best_metric here: a top-1, higher is better
    assert resumed["best_value"] == (stop_value if stop_won else expected["best_value"])
    assert resumed["best_epoch"] == (stop_epoch if stop_won else expected["best_epoch"])
    if stop_won:  # counted from the stop's best on
        resumed["validations_without_best"] = expected["validations_without_best"]
    resumed["best_value"], resumed["best_epoch"] = expected["best_value"], expected["best_epoch"]


def assert_same(a, b, where: str = "checkpoint") -> None:
    """Every tensor equal (torch.equal), every other value equal, recursively."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where} keys differ: {set(a) ^ set(b)}"
        for key in a:
            if key not in NOT_COMPARED:
                assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where} lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_model(a: Path, b: Path, steps: int = STEPS) -> None:
    """a's and b's last.pth agree within TOL: parameters, BatchNorm running means and variances, counters."""
    for run_dir in (a, b):
        assert torch.load(run_dir / "last.pth", weights_only=True)["global_step"] == steps
    weights_a, weights_b = load_weights(a), load_weights(b)
    diffs = relative_differences(weights_a, weights_b)  # also asserts equal BatchNorm batch counters
    print(f"{a.name} vs {b.name}:", ", ".join(f"{g} {v:.1e}" for g, v in diffs.items()),
          "| worst single tensor %.1e (%s)" % worst_tensor(weights_a, weights_b))
    assert max(diffs.values()) <= TOL, f"{diffs} (relative), more than {TOL}"


def nvidia_cosine_lr(base_lr: float, warmup: int, epochs: int, epoch: int, end_lr: float = 0.0) -> float:
    """NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/image_classification/training.py,
    lr_cosine_policy's _lr_fn (not installable: the formula, as the source writes it)."""
    if epoch < warmup:
        return base_lr * (epoch + 1) / warmup
    e, es = epoch - warmup, epochs - warmup
    return end_lr + (0.5 * (1 + math.cos(math.pi * e / es)) * (base_lr - end_lr))


def direct_ece(confidence: np.ndarray, correct: np.ndarray, bins: int = 15) -> float:
    """Guo et al.'s reference loop: bins (lo, hi], |mean confidence - accuracy| weighted by the bin's share."""
    edges, ece = np.linspace(0.0, 1.0, bins + 1), 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (confidence > lo) & (confidence <= hi)
        if inside.any():
            ece += abs(confidence[inside].mean() - correct[inside].mean()) * inside.mean()
    return 100.0 * ece


def fastai_most_confused(labels: np.ndarray, predicted: np.ndarray, classes: int) -> list[tuple[int, int, int]]:
    """fastai's ClassificationInterpretation.most_confused(min_val=1), its lines on its confusion matrix."""
    cm = np.zeros((classes, classes), dtype=int)
    np.add.at(cm, (labels, predicted), 1)
    np.fill_diagonal(cm, 0)
    res = [(i, j, int(cm[i, j])) for i, j in zip(*np.where(cm >= 1))]
    return sorted(res, key=operator.itemgetter(2), reverse=True)


def as_file_checkpoint(folder: Path) -> dict:
    """A sharded last.dcp/ as the dict last.pth would hold: its optimizer tensors keyed by parameter index."""
    ckpt = formats.read_checkpoint(folder)
    rest, tensors = ckpt.pop("optimizer_rest"), formats.read_tensors(folder, "optimizer.")
    names = [name for group in rest["param_groups"] for name in group["params"]]
    state = {}
    for index, name in enumerate(names):
        entry = {**rest["state"].get(name, {}), **{key[len(name) + 1:]: value for key, value in tensors.items()
                                                    if key.startswith(f"{name}.") and "." not in key[len(name) + 1:]}}
        if entry:
            state[index] = entry
    groups = [{**group, "params": list(range(start, start + len(group["params"])))}
              for group, start in zip(rest["param_groups"], accumulate(rest["param_groups"]))]
    del ckpt["format"]
    return {**ckpt, "optimizer": {"state": state, "param_groups": groups}}


def accumulate(groups: list[dict]) -> list[int]:
    """The index of each parameter group's first parameter."""
    starts, total = [], 0
    for group in groups:
        starts.append(total)
        total += len(group["params"])
    return starts
