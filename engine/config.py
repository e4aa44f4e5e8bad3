"""The typed configuration: one dataclass schema, loaded from YAML, overridden by `key=value`.

Every field is typed and checked; an unknown key or a wrong type is a `UserError` that names
the key and suggests the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.errors import UserError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class YamlLoader(yaml.SafeLoader):
    """SafeLoader whose only booleans are true/false (YAML 1.2), so `amp: off` stays the string "off"."""


YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
YamlLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                 list("tTfF"))


def read_yaml(text: str) -> Any:
    """Parse YAML text with YamlLoader (plain data only, like yaml.safe_load)."""
    return yaml.load(text, Loader=YamlLoader)


@dataclass
class ModelConfig:
    name: str = "resnet18"  # any timm model name
    drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    sync_bn: bool = False  # convert BatchNorm to a synchronized one when world size > 1
    channels_last: bool = True
    compile: bool = False  # torch.compile the model
    init_from: str = ""  # local checkpoint or timm/torchvision state dict to start from; "" = random init
    ema_decay: float = 0.0  # keep an EMA of the weights (timm ModelEmaV3), e.g. 0.9998; 0 = off


@dataclass
class DataConfig:
    name: str = "digits"  # imagefolder | dummy | digits
    root: str = ".cache/digits"  # imagefolder: holds train/<class>/* and val/<class>/*
    img_size: int = 32
    crop_pct: float = 0.875  # eval: resize to img_size / crop_pct, then centre crop
    augment: bool = True  # false: the train pipeline is the (deterministic) eval pipeline
    scale: list[float] = field(default_factory=lambda: [0.08, 1.0])  # RandomResizedCrop area
    ratio: list[float] = field(default_factory=lambda: [0.75, 1.3333])  # RandomResizedCrop aspect
    hflip: float = 0.5  # probability of a horizontal flip
    color_jitter: float = 0.0  # brightness/contrast/saturation strength; 0 disables it
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    num_workers: int = 2  # DataLoader workers per process
    skip_corrupt: bool = False  # train: drop unreadable images (counted per epoch) instead of stopping; val never
    persistent_workers: bool = True
    prefetch_factor: int = 2
    dummy_train_size: int = 1024
    dummy_val_size: int = 250
    dummy_num_classes: int = 10
    dummy_image_size: int = 64


@dataclass
class OptimConfig:
    name: str = "sgd"  # any timm optimizer name (sgd, momentum, adamw, lamb, ...)
    lr: float = 0.1  # for the global batch; see README for the scaling rule
    momentum: float = 0.9
    weight_decay: float = 1e-4
    no_decay_norm_bias: bool = True  # no weight decay on norm layers and biases
    clip_grad: float = 0.0  # max gradient norm; 0 disables clipping


@dataclass
class SchedConfig:
    name: str = "cosine"  # any timm scheduler name (cosine, step, multistep, plateau, ...)
    warmup_epochs: int = 0
    warmup_lr: float = 1e-5
    min_lr: float = 0.0


@dataclass
class TrainConfig:
    epochs: int = 10
    batch_size: int = 64  # per process; the global batch is batch_size x world size x accum_steps
    accum_steps: int = 1  # micro-batches per optimizer step
    label_smoothing: float = 0.0
    max_steps: int = 0  # stop after this many optimizer steps (smoke runs); 0 = no limit
    ckpt_every_steps: int = 0  # also write last.pth every this many optimizer steps; 0 = only after each epoch
    keep_last_k: int = 0  # keep the newest k epoch_NNNN.pth files; 0 = none
    max_nonfinite: int = 5  # fp32/bf16: stop after this many optimizer steps in a row with inf/NaN gradients


@dataclass
class LoggingConfig:
    interval: int = 20  # optimizer steps between progress updates
    level: str = "INFO"
    progress: bool = True  # tqdm bar on rank 0
    wandb: bool = False  # track the run in Weights & Biases (one run, from rank 0); see engine/tracking.py
    wandb_project: str = "image-classification"
    wandb_entity: str = ""  # W&B team or user; "" = your default entity
    wandb_name: str = ""  # run name; "" = the output_dir folder name
    wandb_group: str = ""  # groups related runs in the W&B UI
    wandb_tags: list[str] = field(default_factory=list)
    wandb_notes: str = ""
    wandb_log_checkpoints: bool = False  # upload best.pth as a model artifact at the end of training
    wandb_samples: int = 0  # W&B table of this many augmented training images when a training starts; 0 = none
    tensorboard: bool = False  # also write TensorBoard event files to <output_dir>/tensorboard (rank 0)


@dataclass
class DistConfig:
    backend: str = "auto"  # auto (nccl with CUDA, else gloo) | nccl | gloo
    timeout_s: int = 0  # collective timeout before a hung job is aborted; 0 = 1800 under torchrun, 600 without it
    rendezvous_timeout_s: int = 300  # how long the processes may take to meet at start-up


@dataclass
class Config:
    seed: int = 0
    output_dir: str = "runs/default"
    amp: str = "auto"  # auto | bf16 | fp16 | off
    resume: str = "auto"  # auto (continue from <output_dir>/last.pth if present) | none | <checkpoint path>
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    dist: DistConfig = field(default_factory=DistConfig)


CHOICES = {
    "amp": ("auto", "bf16", "fp16", "off"),
    "data.name": ("imagefolder", "dummy", "digits"),
    "dist.backend": ("auto", "nccl", "gloo"),
    "logging.level": ("DEBUG", "INFO", "WARNING", "ERROR"),
}
POSITIVE = ("train.epochs", "train.batch_size", "train.accum_steps", "data.img_size",
            "logging.interval", "dist.rendezvous_timeout_s", "train.max_nonfinite", "data.prefetch_factor",
            "data.dummy_train_size", "data.dummy_val_size", "data.dummy_num_classes", "data.dummy_image_size")
NON_NEGATIVE = ("dist.timeout_s", "optim.lr", "optim.weight_decay", "optim.clip_grad", "train.max_steps", "data.num_workers",
                "train.ckpt_every_steps", "train.keep_last_k",
                "model.drop_rate", "model.drop_path_rate", "sched.warmup_epochs", "sched.min_lr")


def resolve_config_path(name: str) -> Path:
    """Accept a path, or a bare name (`resnet50`, `resnet50.yaml`) looked up in configs/."""
    path = Path(name)
    if path.is_file():
        return path
    for candidate in (CONFIG_DIR / name, CONFIG_DIR / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise UserError(f"config file {name!r} not found (give a path, or one of configs/: {', '.join(known)})")


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Build the Config from defaults, then the YAML file, then dotted `key=value` overrides."""
    raw: dict[str, Any] = {}
    if path:
        file = resolve_config_path(path)
        try:
            raw = read_yaml(file.read_text()) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise UserError(f"{file}:{where} is not valid YAML ({getattr(err, 'problem', err)})") from None
        if not isinstance(raw, dict):
            raise UserError(f"{file}: expected a mapping of config sections, got {type(raw).__name__}")
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    return config_from_dict(raw)


def parse_override(item: str) -> tuple[str, Any]:
    """`optim.lr=0.2` -> ("optim.lr", 0.2); the value is read as YAML (numbers, lists, booleans)."""
    if "=" not in item:
        raise UserError(f"override {item!r} must look like key=value, e.g. optim.lr=0.2")
    key, text = item.split("=", 1)
    try:
        value = read_yaml(text) if text else ""
    except yaml.YAMLError:
        value = text
    return key.strip(), value


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set raw["a"]["b"] = value for key "a.b", creating sections as needed."""
    *sections, leaf = key.split(".")
    node = raw
    for section in sections:
        node = node.setdefault(section, {})
        if not isinstance(node, dict):
            raise UserError(f"override {key!r}: {section!r} is not a section")
    node[leaf] = value


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Validate a plain dict (from YAML or a checkpoint) into a Config."""
    cfg = _build(Config, raw, prefix="")
    validate(cfg)
    return cfg


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise UserError(f"config key {prefix.rstrip('.') or '<root>'!r} must be a section (a mapping), got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in raw.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"; did you mean {prefix + close[0]!r}?" if close else f"; valid keys: {', '.join(names)}"
            raise UserError(f"unknown config key {prefix + str(key)!r}{hint}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            values[key] = _build(hint, value, prefix=f"{prefix}{key}.")
        else:
            values[key] = _coerce(f"{prefix}{key}", hint, value)
    return cls(**values)


def _coerce(key: str, hint: Any, value: Any) -> Any:
    """Check one leaf value against its annotation; ints are accepted where floats are expected."""
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # PyYAML reads 1e-3 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if hint in (int, float, str, bool):
        if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
            return value
        raise UserError(f"config key {key!r} must be {hint.__name__}, got {value!r}")
    if typing.get_origin(hint) is list:
        (item_type,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise UserError(f"config key {key!r} must be a list of {item_type.__name__}, got {value!r}")
        return [_coerce(f"{key}[{i}]", item_type, v) for i, v in enumerate(value)]
    raise TypeError(f"unsupported annotation {hint} for {key}")


def _get(cfg: Config, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def validate(cfg: Config) -> None:
    """Reject values that type-check but cannot work (negative lr, batch size 0, unknown modes)."""
    for key, allowed in CHOICES.items():
        if _get(cfg, key) not in allowed:
            raise UserError(f"config key {key!r} is {_get(cfg, key)!r}; choose one of {', '.join(allowed)}")
    for key in POSITIVE:
        if _get(cfg, key) <= 0:
            raise UserError(f"config key {key!r} must be > 0, got {_get(cfg, key)!r}")
    for key in NON_NEGATIVE:
        if _get(cfg, key) < 0:
            raise UserError(f"config key {key!r} must be >= 0, got {_get(cfg, key)!r}")
    if not 0 < cfg.data.crop_pct <= 1:
        raise UserError(f"config key 'data.crop_pct' must be in (0, 1], got {cfg.data.crop_pct}")
    if not 0 <= cfg.train.label_smoothing < 1:
        raise UserError(f"config key 'train.label_smoothing' must be in [0, 1), got {cfg.train.label_smoothing}")
    for key in ("data.scale", "data.ratio"):
        low_high = _get(cfg, key)
        if len(low_high) != 2 or not 0 < low_high[0] <= low_high[1]:
            raise UserError(f"config key {key!r} must be [low, high] with 0 < low <= high, got {low_high}")
    if cfg.logging.wandb:
        validate_wandb(cfg.logging)
    if not 0 <= cfg.model.ema_decay < 1:
        raise UserError(f"config key 'model.ema_decay' must be in [0, 1), got {cfg.model.ema_decay}")
    if not cfg.resume:
        raise UserError("config key 'resume' is empty; use auto, none or the path of a checkpoint")
    if len(cfg.data.mean) != 3 or len(cfg.data.std) != 3 or min(cfg.data.std) <= 0:
        raise UserError("config keys 'data.mean' and 'data.std' need 3 values each (RGB), std > 0")


def validate_wandb(cfg: LoggingConfig) -> None:
    """Names W&B would refuse at init time; caught here so the mistake is a one-line error, not a lost run."""
    if not 0 < len(cfg.wandb_project) <= 128 or any(c in cfg.wandb_project for c in "/\\#?%:"):
        raise UserError(f"config key 'logging.wandb_project' is {cfg.wandb_project!r}; W&B needs 1-128 characters "
                        "without / \\ # ? % :")
    for tag in cfg.wandb_tags:
        if not 0 < len(tag) <= 64:
            raise UserError(f"config key 'logging.wandb_tags' has {tag!r}; W&B tags need 1-64 characters")


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict: what checkpoints and config.yaml store."""
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, output_dir: str | os.PathLike) -> Path:
    """Write the resolved config beside the run, so the run can be repeated from it."""
    path = Path(output_dir) / "config.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path
