"""Exact metrics across ranks: keep sums (loss x n, correct, n) and all-reduce those, never means."""

from __future__ import annotations

import torch

from engine.dist import all_reduce_sum, get_rank, get_world_size


def ranked_classes(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The k best classes of each row, best first (k capped at the class count).

    Call it once per batch and derive every metric and written prediction from the result: two topk
    calls may break a tie between equal logits differently.
    """
    return logits.topk(min(k, logits.shape[1]), dim=1).indices


def hits(ranked: torch.Tensor, target: torch.Tensor, k: int) -> torch.Tensor:
    """How many rows have the target among their first k ranked classes."""
    return (ranked[:, :k] == target[:, None]).any(dim=1).sum()


class SumMeter:
    """Named running sums kept on the device, so updating them never syncs with the host."""

    def __init__(self, names: tuple[str, ...], device: torch.device) -> None:
        self.names = names
        self.sums = torch.zeros(len(names), dtype=torch.float64, device=device)

    def add(self, *values: torch.Tensor | float) -> None:
        """Tensors are added where they are; Python numbers become device fills, not blocking host copies."""
        self.sums += torch.stack([v.to(torch.float64) if isinstance(v, torch.Tensor)
                                  else torch.full((), v, dtype=torch.float64, device=self.sums.device)
                                  for v in values])

    def global_sums(self) -> dict[str, float]:
        """Sums over all ranks (a collective: every rank must call it)."""
        return self.global_sums_and_max(())[0]

    def global_sums_and_max(self, per_rank: tuple[float, ...]) -> tuple[dict[str, float], list[float]]:
        """Sums over all ranks, and the largest over ranks of each host value in `per_rank`, in one all-reduce.

        Each rank writes its values into its own slots of a zero tensor (device fills, not host copies); the
        sum then holds every rank's values, exactly, and the host takes their max: no second collective.
        """
        rank, world, count = get_rank(), get_world_size(), len(per_rank)
        slots = torch.zeros(world * count, dtype=torch.float64, device=self.sums.device)
        for i, value in enumerate(per_rank):
            slots[rank * count + i].fill_(value)
        total = all_reduce_sum(torch.cat([self.sums, slots])).tolist()
        ranks = [total[len(self.names) + r * count:len(self.names) + (r + 1) * count] for r in range(world)]
        return dict(zip(self.names, total)), [max(values) for values in zip(*ranks)]
