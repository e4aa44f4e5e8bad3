"""Synchronized BatchNorm that works on every torch.distributed backend, including gloo on CPU.

Why this exists: ``torch.nn.SyncBatchNorm`` cannot train on CPU. Its training forward raises
"SyncBatchNorm expected input tensor to be on GPU", DistributedDataParallel rejects SyncBatchNorm
in CPU modules, and ``aten::batch_norm_stats`` has no CPU kernel. ``AllReduceBatchNorm`` instead
shares each rank's count, mean and sum of squared deviations (M2) with one plain ``dist.all_reduce``
and combines them as torch's SyncBatchNorm does (Chan et al.'s parallel variance), so forward and
backward equal BatchNorm over the concatenated global batch to float32 rounding even for channels
whose mean is thousands of times their std, once DDP has averaged the parameter gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm


def _reduce_dims(x: Tensor) -> list[int]:
    """Every dim except the channel dim 1, so 1d/2d/3d and channels_last inputs all work."""
    return [0, *range(2, x.dim())]


def _local_moments(xf: Tensor, dims: list[int], channels: int) -> Tensor:
    """This rank's (mean, M2, count) per channel as one (2C + 1,) row; zeros for an empty batch."""
    count = xf.numel() // channels
    if count == 0:
        return xf.new_zeros(2 * channels + 1)
    var, mean = torch.var_mean(xf, dims, correction=0)  # Welford: stable for any mean/std
    return torch.cat([mean, var * count, xf.new_full((1,), count)])


def _global_moments(local: Tensor, channels: int, process_group: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Global mean, biased variance and count from every rank's row, in one all_reduce (no all_gather on gloo)."""
    rows = local.new_zeros(dist.get_world_size(process_group), local.numel())
    rows[dist.get_rank(process_group)] = local
    dist.all_reduce(rows, group=process_group)
    means, m2s, counts = rows.split([channels, channels, 1], dim=1)
    count = counts.sum(0)
    mean = (means * counts).sum(0) / count
    m2 = m2s.sum(0) + ((means - mean) ** 2 * counts).sum(0)  # empty ranks have count 0 and add nothing
    return mean, m2 / count, count


def _per_channel(t: Tensor, x: Tensor) -> Tensor:
    """View a (C,) tensor so that it broadcasts against x of shape (N, C, *)."""
    return t.view(1, -1, *([1] * (x.dim() - 2)))


class _AllReduceBatchNormFunction(torch.autograd.Function):
    """Batch norm whose statistics and input gradient use sums all-reduced over the process group."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        eps: float,
        factor: float,
        process_group: Any,
    ) -> Tensor:
        """Normalize with global batch stats (one all_reduce) and update the running stats."""
        channels = x.shape[1]
        xf = x.float()
        local = _local_moments(xf, _reduce_dims(x), channels)
        mean, var, count = _global_moments(local, channels, process_group)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            unbiased_var = var * (count / (count - 1))
            running_mean.lerp_(mean.to(running_mean.dtype), factor)
            running_var.lerp_(unbiased_var.to(running_var.dtype), factor)
        y = (xf - _per_channel(mean, x)) * _per_channel(invstd, x)
        if weight is not None:
            y = y * _per_channel(weight.float(), x)
        if bias is not None:
            y = y + _per_channel(bias.float(), x)
        ctx.save_for_backward(x, weight, mean, invstd, count)
        ctx.process_group = process_group
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        """Input grad uses global means of dy and dy*xhat; weight/bias grads stay local for DDP to average."""
        x, weight, mean, invstd, count = ctx.saved_tensors
        channels = x.shape[1]
        dims = _reduce_dims(x)
        dy = grad_output.float()
        xhat = (x.float() - _per_channel(mean, x)) * _per_channel(invstd, x)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            global_sums = torch.cat([sum_dy, sum_dy_xhat])
            dist.all_reduce(global_sums, group=ctx.process_group)
            mean_dy, mean_dy_xhat = (global_sums / count).split([channels, channels])
            scale = invstd if weight is None else invstd * weight.float()
            centered = dy - _per_channel(mean_dy, x) - xhat * _per_channel(mean_dy_xhat, x)
            grad_input = (centered * _per_channel(scale, x)).to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class AllReduceBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of a process group, on any backend (gloo on CPU included)."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        """Same arguments as torch.nn.SyncBatchNorm, so it is a drop-in replacement."""
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias
        )
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        """Accept any (N, C, *) input, like SyncBatchNorm."""
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _needs_sync(self) -> bool:
        """Sync only when batch stats are used in training and the group has more than one rank."""
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return False
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return dist.get_world_size(group) > 1

    def _momentum_factor(self) -> float:
        """Count the batch and return the running-stats update factor, exactly as _BatchNorm does."""
        if not self.track_running_stats or self.num_batches_tracked is None:
            return 0.0
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def forward(self, input: Tensor) -> Tensor:
        """All-reduced batch stats when synchronizing; otherwise plain BatchNorm (eval, world size 1)."""
        if not self._needs_sync():
            return super().forward(input)
        self._check_input_dim(input)
        factor = self._momentum_factor()
        return _AllReduceBatchNormFunction.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if self.track_running_stats else None,
            self.running_var if self.track_running_stats else None,
            self.eps,
            factor,
            self.process_group,
        )


class AllReduceBatchNormAct(AllReduceBatchNorm):
    """Replacement for timm's BatchNormAct2d: all-reduced BatchNorm followed by its drop and act."""

    def __init__(self, num_features: int, *args: Any, act: nn.Module | None = None,
                 drop: nn.Module | None = None, **kwargs: Any) -> None:
        """AllReduceBatchNorm arguments plus the act and drop modules (Identity when omitted)."""
        super().__init__(num_features, *args, **kwargs)
        self.drop = drop if drop is not None else nn.Identity()
        self.act = act if act is not None else nn.Identity()

    def forward(self, input: Tensor) -> Tensor:
        """Normalize, then drop, then act, in BatchNormAct2d's order."""
        return self.act(self.drop(super().forward(input)))


def _replacement_for(bn: _BatchNorm, process_group: Any) -> AllReduceBatchNorm:
    """Build the AllReduce twin of one BatchNorm, sharing its parameters, buffers and mode."""
    from timm.layers import BatchNormAct2d  # lazy: timm takes ~2 s to import; only converters need it

    args = (bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, process_group)
    new: AllReduceBatchNorm
    if isinstance(bn, BatchNormAct2d):
        new = AllReduceBatchNormAct(*args, bias=bn.bias is not None, act=bn.act, drop=bn.drop)
    else:
        new = AllReduceBatchNorm(*args, bias=bn.bias is not None)
    if bn.affine:
        new.weight = bn.weight
        new.bias = bn.bias
    new.running_mean = bn.running_mean
    new.running_var = bn.running_var
    new.num_batches_tracked = bn.num_batches_tracked
    new.training = bn.training
    return new


def convert_to_allreduce_bn(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Swap every _BatchNorm (BatchNormAct2d included) for its AllReduce twin; returns the new root."""
    output = module
    if isinstance(module, _BatchNorm) and not isinstance(module, AllReduceBatchNorm):
        output = _replacement_for(module, process_group)
    for name, child in module.named_children():
        output.add_module(name, convert_to_allreduce_bn(child, process_group))
    return output


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """CUDA gets torch's fused SyncBatchNorm via timm; every other device gets AllReduceBatchNorm."""
    if device.type == "cuda":
        from timm.layers import convert_sync_batchnorm as timm_convert_sync_batchnorm

        return timm_convert_sync_batchnorm(model)
    return convert_to_allreduce_bn(model)
