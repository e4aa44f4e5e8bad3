"""Put saved weights into a model: exactly for resume and evaluation, head-tolerant for init_from.

Files are read with engine.checkpoint.load_checkpoint (weights_only, never a download). Any
mismatch is a UserError that names the file and the first differing tensors.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from engine.checkpoint import load_checkpoint
from engine.errors import UserError

log = logging.getLogger(__name__)
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP / DataParallel and torch.compile


def state_dict_in(obj: Any, source: str) -> dict[str, torch.Tensor]:
    """The model tensors in a loaded file: ours ("model"), timm's train.py ("state_dict") or a plain state dict."""
    if isinstance(obj, dict):
        for key in ("model", "state_dict"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UserError(f"{source} holds no model state dict (expected a checkpoint with 'model' or "
                        "'state_dict', or a plain name -> tensor mapping)")
    clean = {}
    for name, tensor in obj.items():
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
        clean[name] = tensor
    return clean


def _mismatch(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, reshaped) tensor names of state_dict against the model."""
    own = model.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    reshaped = [f"{k}: file {list(state_dict[k].shape)} vs model {list(own[k].shape)}"
                for k in state_dict if k in own and state_dict[k].shape != own[k].shape]
    return missing, unexpected, reshaped


def _describe(missing: list[str], unexpected: list[str], reshaped: list[str]) -> str:
    parts = []
    for label, names in (("missing", missing), ("unexpected", unexpected), ("shape differs", reshaped)):
        if names:
            more = f", ... ({len(names)} in all)" if len(names) > 3 else ""
            parts.append(f"{label}: {', '.join(names[:3])}{more}")
    return "; ".join(parts)


def load_weights(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Load exactly these weights: a missing, unexpected or reshaped tensor is a UserError."""
    problems = _mismatch(model, state_dict)
    if any(problems):
        raise UserError(f"{source} does not fit this model ({_describe(*problems)}); "
                        "check model.name and the number of classes")
    model.load_state_dict(state_dict)


def classifier_names(model: nn.Module) -> tuple[str, ...]:
    """Module names of the classifier head, from timm's pretrained_cfg (e.g. ("fc",) or ("head.fc",))."""
    head = getattr(model, "pretrained_cfg", {}).get("classifier") or ()
    return (head,) if isinstance(head, str) else tuple(head)


def init_from(model: nn.Module, path: str | os.PathLike) -> list[str]:
    """model.init_from: weights from a local file, skipping the classifier when its shape differs; returns skipped names."""
    source = f"model.init_from={path}"
    state_dict = state_dict_in(load_checkpoint(path), source)
    own = model.state_dict()
    heads = classifier_names(model)
    skipped = [k for k, v in state_dict.items() if k in own and v.shape != own[k].shape
               and any(k.startswith(f"{head}.") for head in heads)]
    kept = {k: v for k, v in state_dict.items() if k not in skipped}
    missing, unexpected, reshaped = _mismatch(model, kept)
    missing = [k for k in missing if k not in skipped]
    if missing or unexpected or reshaped:
        raise UserError(f"{source} does not fit model {type(model).__name__} "
                        f"({_describe(missing, unexpected, reshaped)}); is it a checkpoint of model.name?")
    model.load_state_dict(kept, strict=False)
    if skipped:
        log.info("model.init_from: loaded %d tensors from %s; skipped %s (the classifier has another number "
                 "of classes; it stays randomly initialised)", len(kept), path, ", ".join(skipped))
    else:
        log.info("model.init_from: loaded all %d tensors from %s", len(kept), path)
    return skipped
