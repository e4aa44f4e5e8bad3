"""How the model is spread over processes, applied from outside the model: DDP, FSDP2 and torch.compile.

train.py calls `shard_for_training` (dist.strategy=fsdp) and then `wrap_for_training` (DDP unless sharded, then
compile); both take a dtype, a device and a world size, not the app's config. core/dist.is_fsdp tells a sharded
model from a whole one.

dist.strategy=fsdp: which parts of a timm model FSDP2 shards as units, and the sharding itself.

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
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from core.dist import is_fsdp
from core.errors import UserError

log = logging.getLogger(__name__)
FP32_POLICY = MixedPrecisionPolicy(cast_forward_inputs=False)  # parameters, gradients and inputs left as they are


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


def shard_model(model: nn.Module, param_dtype: torch.dtype | None, shard_size: int = 0,
                mesh: DeviceMesh | None = None) -> nn.Module:
    """FSDP2 in place: fully_shard each unit, then the root; the same module object comes back.

    `param_dtype` (amp=bf16): the weights are all-gathered and computed in it; master weights, gradients'
    reduction and optimizer state stay float32. BatchNorm keeps fp32 weights (its running statistics are fp32),
    as FSDP1 did: each unit's BatchNorms form one fp32 unit (fully_shard of the list), not one unit each, so a
    block costs two small all-gathers and reduce-scatters, not one per BatchNorm (resnet50: 17 BatchNorm units,
    not 53). Without a process group (one process) nothing changes.
    `shard_size` (dist.fsdp_shard_size, HSDP): shard within groups of that many consecutive ranks (a node's) and
    replicate across the groups, so each unit's all-gather and reduce-scatter stay inside a node and only the
    gradients' all-reduce between replicas crosses nodes; 0 or the world size: one group of all ranks.
    `mesh`: one already built (the model's, for its EMA: no second set of process groups); else built here.
    Every rank starts from rank 0's parameters and buffers (from_rank0), whatever each loaded.
    model.channels_last applies to the inputs only: FSDP2 refuses non-contiguous parameters, so 4-d weights are
    made contiguous again (a convolution takes channels-last inputs with them).
    """
    if not dist.is_initialized():
        return model
    model.to(memory_format=torch.contiguous_format)  # FSDP2 shards contiguous tensors only; inputs stay channels-last
    from_rank0(model)
    # On the model's device (FSDP2's default is the machine's accelerator, wrong for a CPU run on a GPU machine).
    mesh = mesh or device_mesh(next(model.parameters()).device.type, dist.get_world_size(), shard_size)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    units = shard_units(model)
    if param_dtype is not None:
        for norms in batchnorm_groups(model, units):
            fully_shard(norms, mesh=mesh, mp_policy=FP32_POLICY)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def from_rank0(model: nn.Module) -> None:
    """Every rank's parameters and buffers become rank 0's, in place, before sharding: each rank keeps only its own
    slice, so ranks that loaded different weights (node-local caches at other revisions) would train a mix of them.
    DDP broadcasts rank 0's state itself; fully_shard does not."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def batchnorm_groups(model: nn.Module, units: list[nn.Module]) -> list[list[nn.Module]]:
    """The BatchNorms with weights, one list per unit that holds any (in unit order), then those outside every
    unit (a ResNet's stem): each list becomes one fp32 FSDP unit under a bf16 policy."""
    def norms(module: nn.Module) -> list[nn.Module]:
        return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                and any(True for _ in m.parameters(recurse=False))]

    groups = [norms(unit) for unit in units]
    inside = {id(norm) for group in groups for norm in group}
    return [group for group in [*groups, [m for m in norms(model) if id(m) not in inside]] if group]


def device_mesh(device_type: str, world_size: int, shard_size: int) -> DeviceMesh:
    """The ranks as FSDP2 sees them: one dimension of all of them, or (replicas, shard_size) for HSDP; a
    shard_size that does not divide the world size is one line."""
    if not shard_size or shard_size == world_size:
        return init_device_mesh(device_type, (world_size,))
    if world_size % shard_size:
        raise UserError(f"dist.fsdp_shard_size={shard_size} does not divide the {world_size} processes into equal "
                        "groups; use a divisor of the number of processes (the processes per node, usually)",
                        all_ranks=True)
    return init_device_mesh(device_type, (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


def shard_for_training(model: nn.Module, ema: nn.Module | None, param_dtype: torch.dtype | None,
                       world_size: int, shard_size: int = 0) -> None:
    """dist.strategy=fsdp: FSDP2 on the model and its EMA, in place, before the optimizer takes the sharded
    parameters; the same units, mesh and policy for both, so the EMA is sharded like the model."""
    if world_size == 1:
        log.info("dist.strategy=fsdp in one process: nothing to shard, the model trains whole (as with ddp)")
        return
    mesh = device_mesh(next(model.parameters()).device.type, world_size, shard_size)
    shard_model(model, param_dtype, mesh=mesh)
    if ema is not None:
        shard_model(ema, param_dtype, mesh=mesh)  # the model's mesh: no second set of process groups (HSDP)
    across = (f"across {world_size} processes" if not shard_size or shard_size == world_size else
              f"within groups of {shard_size} processes, replicated across {world_size // shard_size} groups (HSDP)")
    log.info("dist.strategy=fsdp: parameters, gradients and optimizer state sharded %s%s", across,
             ", weights gathered in bf16" if param_dtype == torch.bfloat16 else "")


def wrap_for_training(model: nn.Module, device: torch.device, world_size: int, compile: bool,
                      unfreezes: bool = False) -> nn.Module:
    """DDP over several processes (unless FSDP2 already shards the model), then torch.compile if asked: the
    module the loop calls. `unfreezes` (model.freeze_epochs): DDP is built over every parameter, which the frozen
    epochs leave without gradients, so its reducer finds the unused ones at each step instead of waiting for them
    (frozen on every rank, their gradients stay None and the optimizer skips them)."""
    train_model = model
    if world_size > 1 and not is_fsdp(model):
        device_ids = [device.index] if device.type == "cuda" else None  # CPU DDP needs None
        train_model = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True,
                                              find_unused_parameters=unfreezes)
    return torch.compile(train_model) if compile else train_model
