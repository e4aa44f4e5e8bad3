"""Mixed precision in one place: which autocast dtype, whether a GradScaler is needed, how to step.

`amp=auto` picks bf16 on GPUs with bf16 Tensor Cores (compute capability 8.0, Ampere, and newer), else fp16
with a GradScaler. On CPU it picks bf16 only where the CPU computes bf16 natively (AVX512-BF16 or AMX) and
fp32 elsewhere, where bf16 is emulated and slower than fp32. fp16 autocast on CPU is refused: it is far
slower than fp32 (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import ContextManager

import torch
from torch import nn

from timm.utils import dispatch_clip_grad
from torch.distributed.tensor import DTensor

from core.dist import step_flags_over_ranks
from core.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class Precision:
    device_type: str
    dtype: torch.dtype | None  # None: plain fp32, no autocast
    scaler: torch.amp.GradScaler | None = None
    tf32: bool = False  # fp32 matmuls and convolutions on TF32 Tensor Cores (tf32_for)

    @property
    def name(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}[self.dtype]

    @property
    def described(self) -> str:
        """The name, and for fp32 whether its matmuls and convolutions use TF32, for the start-up lines."""
        return f"{self.name} (TF32 matmuls and convolutions; tf32=false for full fp32)" if self.tf32 else self.name

    def autocast(self) -> ContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, model: nn.Module, clip_grad: float,
             stop_signal: int = 0, clip_mode: str = "norm") -> tuple[bool, int]:
        """Clip and step; return (False for a step skipped because a gradient was inf or NaN, the stop signal).

        `stop_signal` is this rank's pending SIGTERM/SIGUSR1 (0: none); the largest over ranks comes back, so
        that every rank stops after the same step. DDP has already summed the gradients over ranks, so a NaN
        on any rank is a NaN on every rank and all ranks skip the same step. Both answers travel in one tensor,
        one all-reduce and one read on the host per step, fp16's too: its GradScaler's inf check is that read
        (the gradients unscaled first), not a read of its own inside scaler.step, and its update lowers the scale
        from the inf flags unscale_ recorded, on the device. fp16's skipped steps are the scaler's search for its
        scale, not a fault: they come back as stepped. Clipping (optim.clip_mode) sees the unscaled, summed
        gradients, the same on every rank. Under dist.strategy=fsdp the gradients are sharded (DTensors): their
        total norm is reduced over the ranks, so the inf/NaN decision and the clip factor are the same on every
        rank too.
        """
        if self.scaler:
            self.scaler.unscale_(optimizer)
        params = [p for p in model.parameters() if p.grad is not None]
        norm = total_grad_norm([p.grad for p in params])
        nonfinite, signum = step_flags_over_ranks(torch.isfinite(norm).logical_not(), stop_signal)
        if not nonfinite:
            clip_gradients(params, clip_grad, clip_mode, norm)
            optimizer.step()
        if self.scaler:  # fp16: the scale halves after a non-finite step, grows after enough good ones
            self.scaler.update()
            return True, signum
        return not nonfinite, signum


def shard(grad: DTensor) -> torch.Tensor:
    """This rank's part of a sharded gradient, with no op dispatched (to_local() is a view op per tensor: host work
    that grows with the model); gradients need no autograd through it."""
    return grad._local_tensor


def total_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm over all gradients, in a number of ops that does not grow with the model: torch's foreach norm;
    for a sharded model's DTensor gradients, foreach over this rank's shards and one all-reduce of the sum of
    squares over the mesh dimensions they are sharded on (torch's DTensor path is one op per tensor). The same
    number on every rank."""
    sharded = [g for g in grads if isinstance(g, DTensor)]
    if not sharded:
        return nn.utils.get_total_norm(grads)
    squares = torch.stack(torch._foreach_norm([shard(g) for g in sharded])).float().square().sum()
    mesh, placements = sharded[0].device_mesh, sharded[0].placements
    for dim, placement in enumerate(placements):
        if placement.is_shard():
            torch.distributed.all_reduce(squares, group=mesh.get_group(dim))
    plain = [g for g in grads if not isinstance(g, DTensor)]
    if plain:  # whole on every rank: counted once
        squares = squares + nn.utils.get_total_norm(plain).float().square()
    return squares.sqrt()


def clip_gradients(params: list[nn.Parameter], clip_grad: float, mode: str, norm: torch.Tensor | None = None) -> None:
    """optim.clip_mode through timm's dispatch_clip_grad; norm mode reuses a total norm already computed (and
    scales a sharded model's shards in one foreach op, as clip_grads_with_norm_ does for plain tensors)."""
    if clip_grad <= 0:
        return
    if mode == "norm" and norm is not None:  # what clip_grad_norm_ does, without computing the norm again
        grads = [p.grad for p in params]
        if any(isinstance(g, DTensor) for g in grads):
            scale = (clip_grad / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_([shard(g) if isinstance(g, DTensor) else g for g in grads], scale)
        else:
            nn.utils.clip_grads_with_norm_(params, clip_grad, norm)
    else:
        dispatch_clip_grad(params, clip_grad, mode=mode)


def cpu_has_native_bf16() -> bool:
    """True when oneDNN has bf16 instructions here; without them bf16 is emulated and slower than fp32."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's x86 feature checks
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def gpu_auto_mode(capability: tuple[int, int]) -> str:
    """`amp=auto` on a GPU of this compute capability: bf16 from Ampere (8.0) on, fp16 + GradScaler below.

    Not torch.cuda.is_bf16_supported(): it is True on sm_75 (T4, RTX 20xx), where bf16 is emulated and
    cuDNN has no bf16 convolutions.
    """
    return "bf16" if tuple(capability) >= (8, 0) else "fp16"


def tf32_for(dtype: torch.dtype | None, capability: tuple[int, int] | None, allowed: bool) -> bool:
    """Whether a precision computes its fp32 matmuls and convolutions in TF32: only plain fp32 (amp=off,
    eval_amp=off; under autocast the matmuls are bf16/fp16 and the ops it keeps in fp32 stay exact), on a GPU with
    TF32 Tensor Cores (compute capability 8.0, Ampere, and newer: 495 vs 67 TFLOPS on an H100), unless the config
    says tf32=false. torch leaves cuBLAS's TF32 off by default since 1.12; recipes written before ran with it."""
    return allowed and dtype is None and capability is not None and tuple(capability) >= (8, 0)


def capability_of(device: torch.device) -> tuple[int, int] | None:
    """The GPU's compute capability, None on the CPU."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def auto_mode(device: torch.device) -> str:
    """What `amp=auto` means on this device: the fastest precision that trains safely."""
    if device.type == "cuda":
        return gpu_auto_mode(torch.cuda.get_device_capability(device))
    return "bf16" if cpu_has_native_bf16() else "off"


def grad_scaler(device_type: str, loss_scale: float = 0.0) -> torch.amp.GradScaler:
    """fp16's GradScaler: torch's dynamic one, or (loss_scale > 0) one that starts at that scale and never grows,
    halving it on an overflow as NVIDIA's DeepLearningExamples build theirs (--static-loss-scale 128)."""
    if not loss_scale:
        return torch.amp.GradScaler(device_type)
    return torch.amp.GradScaler(device_type, init_scale=loss_scale, growth_factor=2.0, backoff_factor=0.5,
                                growth_interval=STATIC_GROWTH_INTERVAL)


STATIC_GROWTH_INTERVAL = 1_000_000_000  # NVIDIA's: no growth within any run


def run_precisions(amp: str, eval_amp: str, loss_scale: float, strategy: str, device: torch.device,
                   tf32: bool) -> tuple[Precision, Precision]:
    """Training's precision (amp, with `loss_scale` and the dist.strategy it must suit) and validation's
    (eval_amp), decided together before any data is read; `tf32`: the config's tf32."""
    precision = resolve_precision(amp, device, loss_scale, tf32=tf32)
    if strategy == "fsdp" and precision.scaler is not None:  # amp=fp16 itself: core/config_checks.py
        raise UserError(f"amp={amp} chose fp16 on this GPU, which dist.strategy=fsdp cannot use (the GradScaler "
                        "would see only each process's shard of the gradients); use amp=off, or dist.strategy=ddp")
    return precision, resolve_precision(eval_amp, device, key="eval_amp", tf32=tf32)


def resolve_precision(mode: str, device: torch.device, loss_scale: float = 0.0, key: str = "amp", *,
                      tf32: bool = True) -> Precision:
    """Turn `amp: auto|bf16|fp16|off` into a Precision for this device (`loss_scale`: fp16's, see grad_scaler;
    `key`: the config key the mode came from, for messages: amp or eval_amp; `tf32`: the config's tf32, true by default)."""
    cuda = device.type == "cuda"
    if mode == "auto":
        mode = auto_mode(device)
    if mode == "off":
        return Precision(device.type, None, tf32=tf32 and tf32_for(None, capability_of(device), tf32))
    if mode == "bf16":
        if not cuda and not cpu_has_native_bf16():  # info, not warning: every rank would repeat a warning
            log.info("%s=bf16: this CPU has no AVX512-BF16 or AMX, so bf16 is emulated and slower than %s=off", key, key)
        return Precision(device.type, torch.bfloat16)
    if not cuda:
        raise UserError(f"{key}=fp16 on CPU is far slower than fp32 (no fp16 kernels); use {key}=bf16 (or auto) or "
                        f"{key}=off")
    return Precision(device.type, torch.float16, grad_scaler("cuda", loss_scale))
