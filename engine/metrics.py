"""Exact metrics across ranks: keep sums (loss x n, correct, n) and all-reduce those, never means."""

from __future__ import annotations

import torch

from engine.dist import all_reduce_sum


def topk_correct(logits: torch.Tensor, target: torch.Tensor, k: int) -> torch.Tensor:
    """How many rows have the target among the top-k logits (k capped at the class count)."""
    k = min(k, logits.shape[1])
    top = logits.topk(k, dim=1).indices
    return (top == target[:, None]).any(dim=1).sum()


class SumMeter:
    """Named running sums kept on the device, so updating them never syncs with the host."""

    def __init__(self, names: tuple[str, ...], device: torch.device) -> None:
        self.names = names
        self.sums = torch.zeros(len(names), dtype=torch.float64, device=device)

    def add(self, *values: torch.Tensor | float) -> None:
        self.sums += torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.sums.device)
                                  for v in values])

    def global_sums(self) -> dict[str, float]:
        """Sums over all ranks (a collective: every rank must call it)."""
        total = all_reduce_sum(self.sums.clone()).tolist()
        return dict(zip(self.names, total))

    def reset(self) -> None:
        self.sums.zero_()
