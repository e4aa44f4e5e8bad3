"""Put saved weights into a model: exactly for resume and evaluation, head-tolerant for init_from.

Files are read with engine.checkpoint.read_checkpoint (weights_only, never a download). Any
mismatch is a UserError that names the file and the first differing tensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.config import DataConfig, key_facts
from core.errors import UserError
from core.store import is_url
from engine.checkpoint.formats import is_sharded, load_checkpoint, read_checkpoint
from engine.checkpoint.run_store import fetched

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


def load_weights(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str,
                 check: str = "model.name") -> None:
    """Load exactly these weights: a missing, unexpected or reshaped tensor is a UserError (`check`: the key to fix)."""
    problems = _mismatch(model, state_dict)
    if any(problems):
        raise UserError(f"{source} does not fit this model ({_describe(*problems)}); "
                        f"check {check} and the number of classes")
    model.load_state_dict(state_dict)


def classifier_names(model: nn.Module) -> tuple[str, ...]:
    """Module names of the classifier head, from timm's pretrained_cfg (e.g. ("fc",) or ("head.fc",))."""
    head = getattr(model, "pretrained_cfg", {}).get("classifier") or ()
    return (head,) if isinstance(head, str) else tuple(head)


@dataclass
class Pretrained:
    """Weights to start from (model.init_from), with what the file says about itself."""

    state_dict: dict[str, torch.Tensor]
    path: str
    architecture: str | None = None  # the model the file names (config.json, a train.py checkpoint); None: unknown
    preprocessing: dict[str, Any] = field(default_factory=dict)  # data.* keys the weights were trained with
    key: str = "model.init_from"  # the config key that named the file (distill.teacher_weights for a teacher)
    sha256: str = ""  # of the files the tensors were read from (weights_sha256): the model card, a teacher's check

    @property
    def source(self) -> str:
        return f"{self.key}={self.path}"


def read_pretrained(path: str | os.PathLike, key: str = "model.init_from") -> Pretrained:
    """model.init_from's file (or `key`'s): a train.py checkpoint, a timm/torchvision .pth, a .safetensors file,
    or a Hugging Face / timm model folder (config.json + model.safetensors or pytorch_model.bin); with the sha256
    of the files read (the run records it), taken as they are read. At a URL: read through its local copy
    (run_store.fetched), named by the URL."""
    if is_url(str(path)):
        pretrained = read_pretrained(fetched(str(path)), key)
        pretrained.path = str(path)
        return pretrained
    path = Path(path)
    source = f"{key}={path}"
    if path.is_dir() and not is_sharded(path):
        return read_model_folder(path, key)
    if not path.exists():
        raise UserError(f"{source}: {path} does not exist; give a checkpoint, a .pth or .safetensors file, or a "
                        "model folder (config.json + model.safetensors)")
    if path.suffix == ".safetensors":
        return Pretrained(state_dict_in(read_safetensors(path, key), source), str(path), key=key,
                          sha256=weights_sha256([path]))
    obj = read_checkpoint(path)  # a .pth file, or a sharded .dcp folder (every file of it: index, shards, plain data)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    pretrained = Pretrained(state_dict_in(obj, source), str(path), key=key, sha256=weights_sha256(files))
    if isinstance(obj, dict) and isinstance(obj.get("config"), dict):  # a train.py checkpoint knows its training
        config = obj["config"]
        pretrained.architecture = config.get("model", {}).get("name")
        data = config.get("data", {})
        pretrained.preprocessing = {k: data[k] for k in PREPROCESSING if data.get(k) not in (None, "", [], 0)}
    return pretrained


PREPROCESSING = ("mean", "std", "interpolation", "crop_pct")  # the data.* keys pretrained weights come with
MODEL_CONFIG = "config.json"  # a model folder's description (timm / Hugging Face layout)
MODEL_WEIGHTS = "model.safetensors"


def read_safetensors(path: Path, key: str = "model.init_from") -> dict[str, torch.Tensor]:
    """A .safetensors file's tensors; a damaged file is a UserError naming it (as `key`=path)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (OSError, SafetensorError) as err:
        raise UserError(f"{key}={path} cannot be read as safetensors ({err}); it is damaged or not a "
                        ".safetensors file (export.py --format safetensors writes one again)") from None


def model_folder_files(folder: Path, key: str) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path]:
    """The one reader of a Hugging Face / timm model folder (export.py writes one): config.json as a mapping and
    its weights (model.safetensors, or pytorch_model.bin read as data only), named as `key`=folder in errors."""
    config_file = folder / MODEL_CONFIG
    if not config_file.is_file():
        raise UserError(f"{key}={folder} is a folder without {MODEL_CONFIG}; give a checkpoint, a .pth or "
                        f".safetensors file, or a model folder holding {MODEL_CONFIG} and {MODEL_WEIGHTS}")
    try:
        meta = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{key}: cannot read {config_file} ({err}); it should be the {MODEL_CONFIG} export.py "
                        "writes") from None
    if not isinstance(meta, dict):
        raise UserError(f"{key}: {config_file} is not a timm/Hugging Face model config (not a mapping)")
    for name in (MODEL_WEIGHTS, "pytorch_model.bin"):
        if (folder / name).is_file():
            weights = folder / name
            break
    else:
        raise UserError(f"{key}={folder} holds no {MODEL_WEIGHTS} (or pytorch_model.bin) beside {MODEL_CONFIG}")
    raw = read_safetensors(weights, key) if weights.suffix == ".safetensors" else load_checkpoint(weights)
    return meta, state_dict_in(raw, f"{key}={weights}"), weights


def read_model_folder(folder: Path, key: str = "model.init_from") -> Pretrained:
    """A model folder as model.init_from's weights, with its architecture and pretrained_cfg preprocessing."""
    meta, state_dict, weights = model_folder_files(folder, key)
    pretrained_cfg = meta.get("pretrained_cfg") if isinstance(meta.get("pretrained_cfg"), dict) else {}
    preprocessing = {k: pretrained_cfg[k] for k in PREPROCESSING if pretrained_cfg.get(k) is not None}
    architecture = meta.get("architecture") if isinstance(meta.get("architecture"), str) else None
    return Pretrained(state_dict, str(folder), architecture, preprocessing, key, weights_sha256([weights]))


def weights_sha256(paths: list[Path]) -> str:
    """One file's sha256; for several (a sharded folder), of their names and contents in order."""
    digest = hashlib.sha256()
    for path in paths:
        if len(paths) > 1:
            digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def check_architecture(pretrained: Pretrained, model_name: str) -> None:
    """A file that names its architecture must name model.name's (its pretrained tag aside)."""
    if pretrained.architecture and pretrained.architecture.split(".")[0] != model_name.split(".")[0]:
        raise UserError(f"{pretrained.source} holds a {pretrained.architecture} but model.name is {model_name}; "
                        f"set model.name={pretrained.architecture.split('.')[0]}")


def check_pretrained(model: nn.Module, pretrained: Pretrained) -> None:
    """After timm's load: every tensor of the model but its classifier came from the file, by name, else a UserError.

    timm loads non-strictly once it has dropped a classifier of another class count; this keeps a file of
    another architecture from leaving most of the model at random.
    """
    heads = classifier_names(model)
    in_head = lambda name: any(name.startswith(f"{head}.") for head in heads)  # noqa: E731
    own = model.state_dict()
    missing = [k for k in own if k not in pretrained.state_dict and not in_head(k)]
    unexpected = [k for k in pretrained.state_dict if k not in own and not in_head(k)]
    if missing or unexpected:
        raise UserError(f"{pretrained.source} does not fit model {type(model).__name__} "
                        f"({_describe(missing, unexpected, [])}); is it a checkpoint of model.name?")
    resized = [f"{k} {list(v.shape)} -> {list(own[k].shape)}" for k, v in pretrained.state_dict.items()
               if k in own and v.shape != own[k].shape and not in_head(k)]
    head = [k for k in own if in_head(k)]
    reset = any(k not in pretrained.state_dict or pretrained.state_dict[k].shape != own[k].shape for k in head)
    log.info("model.init_from: %d tensors from %s%s%s", len(own) - (len(head) if reset else 0), pretrained.path,
             f"; resized by timm: {', '.join(resized)}" if resized else "",
             f"; classifier {', '.join(head)} freshly initialised (the file has another number of classes)"
             if reset else "")


def resolve_preprocessing(data: DataConfig, model_name: str, given: frozenset[str], pretrained: Pretrained | None,
                          resumed: dict[str, Any] | None,
                          pretrained_cfg: dict[str, Any] | None = None) -> dict[str, Any]:
    """data.mean/std/interpolation/crop_pct the config leaves unset (`given`: the keys the user set), decided once
    at start-up: a resumed run keeps its checkpoint's, a run from model.init_from takes the weights' own (the file's
    config, else timm's pretrained_cfg for model.name), a run with model.pretrained=true those of its weights'
    `pretrained_cfg`, any other run the defaults. Returned as data.* values for the run's stored config, so
    evaluate.py, predict.py and export.py use exactly them; one log line says each value and where it came from."""
    values: dict[str, Any] = {}
    said = []
    for key in PREPROCESSING:
        value, origin = getattr(data, key), "default"
        if f"data.{key}" in given:
            origin = "config"
        elif resumed is not None and key in resumed.get("data", {}):
            value, origin = resumed["data"][key], "the resumed checkpoint"
        elif pretrained is not None or pretrained_cfg is not None:
            found, where = (weights_value(pretrained, model_name, key) if pretrained is not None else
                            (pretrained_cfg.get(key), f"the pretrained_cfg of timm's weights {model_name}"))
            if found is not None and usable(key, found):
                value, origin = found, where
            elif found is not None:
                log.warning("the weights' %s %r is not usable here; data.%s stays %r", key, found, key, value)
        values[key] = list(value) if isinstance(value, (list, tuple)) else value
        said.append(f"data.{key} {values[key]} ({origin})")
    log.info("preprocessing: %s", ", ".join(said))
    return values


def weights_value(pretrained: Pretrained, model_name: str, key: str) -> tuple[Any, str]:
    """One preprocessing value of the weights and where it is from: the file's own config, else timm's
    pretrained_cfg for model.name (a bare state dict says nothing about its preprocessing)."""
    if key in pretrained.preprocessing:
        return pretrained.preprocessing[key], f"the weights' config, {pretrained.path}"
    import timm

    default = timm.models.get_pretrained_cfg(model_name)
    if default is None:
        return None, ""
    tag = f"{model_name.split('.')[0]}.{default.tag}" if default.tag else model_name
    return getattr(default, key, None), f"timm's pretrained_cfg of {tag}, as the weights file holds none"


def usable(key: str, value: Any) -> bool:
    """Whether a weights' preprocessing value fits this app's config (else the default stays)."""
    if key == "interpolation":
        return value in key_facts()["data.interpolation"].choices
    if key == "crop_pct":
        return isinstance(value, (int, float)) and 0 < value <= 1
    return isinstance(value, (list, tuple)) and len(value) == 3 and all(isinstance(v, (int, float)) for v in value) \
        and (key == "mean" or min(value) > 0)
