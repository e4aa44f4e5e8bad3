"""An exponential moving average of the weights (timm's ModelEmaV3), kept when model.ema_decay > 0."""

from __future__ import annotations

import torch
from timm.utils import ModelEmaV3
from torch import nn
from torch.distributed.tensor import DTensor


class CachedEma(ModelEmaV3):
    """timm's ModelEmaV3 whose update pairs its tensors with the model's once, not from two state_dicts per step.

    ModelEmaV3 rebuilds both state_dicts and walks them in Python at every update: a cost that grows with the
    number of layers, paid every optimizer step. Here each update is two foreach calls on cached lists (the
    model's parameters and buffers are updated in place by training, so the same tensors stay valid).
    """

    def __init__(self, model: nn.Module, decay: float, use_warmup: bool) -> None:
        super().__init__(model, decay=decay, use_warmup=use_warmup)
        self._source_id: int | None = None  # id() of the model the lists belong to (not a submodule)
        self._floats: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._others: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._plain = True  # no bf16 EMA tensor (stochastic rounding) and one dtype per pair: one _foreach_lerp_

    def _pair(self, model: nn.Module) -> None:
        """Pair every EMA tensor with the model's, in state_dict order (as ModelEmaV3 does). Under FSDP2 the EMA is
        sharded like the model: each rank averages its own shards (DTensors' local tensors, same layout on both
        sides) and the plain tensors beside them (BatchNorm buffers), so no collective is needed."""
        self._floats, self._others = ([], []), ([], [])
        pairs = zip(self.module.state_dict(keep_vars=True).values(), model.state_dict(keep_vars=True).values())
        for ema_v, model_v in ((local(e), local(m)) for e, m in pairs):
            target = self._floats if ema_v.is_floating_point() else self._others
            target[0].append(ema_v)
            target[1].append(model_v)
        self._plain = all(e.dtype == m.dtype != torch.bfloat16 for e, m in zip(*self._floats))
        self._source_id = id(model)

    def apply_update_(self, model: nn.Module, decay: float) -> None:
        """ModelEmaV3's foreach update: lerp the floating tensors, copy the others (num_batches_tracked)."""
        if self._source_id != id(model):
            self._pair(model)
        if self._plain:
            torch._foreach_lerp_(self._floats[0], self._floats[1], weight=1.0 - decay)
        else:
            self._foreach_lerp_(self._floats[0], self._floats[1], weight=1.0 - decay)
        if self._others[0]:
            torch._foreach_copy_(self._others[0], self._others[1])


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded (DTensor) parameter, sharing its memory; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def create_ema(model: nn.Module, decay: float, warmup: bool = False) -> CachedEma | None:
    """The EMA of `model` (placed and formatted like it), or None when decay is 0.

    `warmup`: the decay grows with the global step passed to update() (1 - (1 + step)^(-2/3), capped at
    `decay`), so early weights, far from the trained ones, fade quickly; it needs no state of its own to resume.
    """
    return CachedEma(model, decay=decay, use_warmup=warmup) if decay > 0 else None
