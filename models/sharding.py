"""dist.strategy=fsdp: which parts of a timm model FSDP2 shards as units, and the sharding itself.

Each unit (a transformer block, a ResNet bottleneck, a ConvNeXt block) is all-gathered just before its forward
and freed after it, so a rank holds whole weights for one unit at a time; everything outside the units (stem,
downsampling layers, final norm, classifier) forms the root's unit. The rule, first match wins:

  1. `model.blocks` (ViT, DeiT, EVA, BEiT, MLP-Mixer): each block;
  2. `model.stages` or `model.layers` (ConvNeXt, Swin, EfficientFormer, ...): each block of a stage
     (`stage.blocks`), or the stage itself when it has no `blocks`;
  3. `model.layer1` ... `layer4` (ResNet, ResNeXt, SE-ResNet): each residual block;
  4. anything else: each direct child of the model that holds parameters.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The submodules fully_shard wraps one by one (the module docstring's rule), in forward order."""
    if isinstance(getattr(model, "blocks", None), nn.Module):
        return list(model.blocks.children())
    stages = getattr(model, "stages", None) or getattr(model, "layers", None)
    if isinstance(stages, nn.Module):
        units = []
        for stage in stages.children():
            blocks = getattr(stage, "blocks", None)
            units += list(blocks.children()) if isinstance(blocks, nn.Module) else [stage]
        return units
    layers = [getattr(model, f"layer{i}", None) for i in range(1, 5)]
    if all(isinstance(layer, nn.Sequential) for layer in layers):
        return [block for layer in layers for block in layer.children()]
    return [child for child in model.children() if any(True for _ in child.parameters())]


def shard_model(model: nn.Module, param_dtype: torch.dtype | None) -> nn.Module:
    """FSDP2 in place: fully_shard each unit, then the root; the same module object comes back.

    `param_dtype` (amp=bf16): the weights are all-gathered and computed in it; master weights, gradients'
    reduction and optimizer state stay float32. Without a process group (one process) nothing changes.
    model.channels_last applies to the inputs only: FSDP2 refuses non-contiguous parameters, so 4-d weights are
    made contiguous again (a convolution takes channels-last inputs with them).
    """
    if not dist.is_initialized():
        return model
    model.to(memory_format=torch.contiguous_format)  # FSDP2 shards contiguous tensors only; inputs stay channels-last
    # On the model's device (FSDP2's default is the machine's accelerator, wrong for a CPU run on a GPU machine).
    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 shards this module's parameters (its state dicts then hold DTensors)."""
    return isinstance(model, FSDPModule)


def replicated_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The state a sharded model keeps whole on every rank (buffers such as BatchNorm's running statistics)."""
    return [t for t in model.state_dict().values() if not isinstance(t, DTensor)]
