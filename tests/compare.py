"""Compare what two training runs left behind: the weights in last.pth and the rows of metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import torch

# Keys of a metrics.jsonl row that measure the machine, not the model.
TIMING_KEYS = ("epoch_time_s", "train_img_per_s", "train_input_wait", "train_step_s")
# A state dict's floating-point tensors in three groups of like scale: BatchNorm's running means and
# running variances, and everything else (the parameters).
GROUPS = ("parameters", "running_mean", "running_var")


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
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]
