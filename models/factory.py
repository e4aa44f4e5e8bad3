"""Build the network: any timm model, never downloading weights, optionally with synchronized BN."""

from __future__ import annotations

import difflib
import logging

import timm
import torch
from torch import nn

from engine.config import ModelConfig
from engine.errors import UserError

log = logging.getLogger(__name__)


def check_model_name(name: str) -> None:
    """Fail fast, with close timm names, instead of timm's long traceback."""
    arch = name.split(".")[0]  # "resnet50.a1_in1k" names a pretrained tag of "resnet50"
    known = timm.list_models()
    if arch in known:
        return
    close = difflib.get_close_matches(arch, known, n=5, cutoff=0.6) or timm.list_models(f"*{arch[:5]}*")[:5]
    hint = f"; did you mean: {', '.join(close)}?" if close else "; see timm.list_models()"
    raise UserError(f"unknown model.name {name!r}{hint}")


def create_model(cfg: ModelConfig, num_classes: int) -> nn.Module:
    """A fresh timm model with `num_classes` outputs (pretrained weights are never downloaded)."""
    check_model_name(cfg.name)
    kwargs = dict(num_classes=num_classes, drop_rate=cfg.drop_rate)
    if cfg.drop_path_rate > 0:
        kwargs["drop_path_rate"] = cfg.drop_path_rate
    kwargs.update(cfg.kwargs)
    try:
        return timm.create_model(cfg.name, pretrained=False, **kwargs)
    except TypeError as err:  # e.g. drop_path_rate on a model without stochastic depth
        raise UserError(f"model {cfg.name!r} rejected its options ({err}); remove them from the model section") from None


def compile_warning(cfg: ModelConfig, world_size: int) -> str | None:
    """Why torch.compile will disappoint with these settings, or None.

    A synchronized BatchNorm all-reduces inside its forward; torch.compile cannot trace that and breaks the
    graph at every BN layer (pytorch/pytorch#161302): with the DDP optimizer's own splits, little is left
    to fuse, and errors have been reported for the combination.
    """
    if cfg.compile and cfg.sync_bn and world_size > 1:
        return ("model.compile=true with model.sync_bn=true: torch.compile breaks the graph at every synchronized "
                "BatchNorm (pytorch/pytorch#161302), so expect little speed-up; with 32 or more images per "
                "process, model.sync_bn=false trains about as well and compiles whole")
    return None


def prepare_model(model: nn.Module, cfg: ModelConfig, device: torch.device, world_size: int) -> nn.Module:
    """SyncBN (several processes only), device placement and memory format, before DDP wraps it."""
    if cfg.sync_bn and world_size > 1:
        from models.sync_bn import convert_sync_batchnorm

        model = convert_sync_batchnorm(model, device)
        log.info("BatchNorm layers synchronized across %d processes", world_size)
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model
