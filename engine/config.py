"""The typed configuration: one dataclass schema, loaded from YAML, overridden by `key=value`.

Every field is typed and checked; an unknown key or a wrong type is a `UserError` that names
the key and suggests the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.errors import UserError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class YamlLoader(yaml.SafeLoader):
    """SafeLoader whose only booleans are true/false (YAML 1.2), so `amp: off` stays the string "off",
    and which refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # keys beside a `<<` merge override the merged ones: YAML's meaning, not a mistake
            key = self.construct_object(key_node)
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}, first on line {first_line[key] + 1}", key_node.start_mark)
            first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


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
    drop_rate: float = 0.0  # dropout before the classifier, in [0, 1)
    drop_path_rate: float = 0.0  # stochastic depth, in [0, 1)
    sync_bn: bool = False  # convert BatchNorm to a synchronized one when world size > 1
    channels_last: bool = True  # NHWC memory format (faster convolutions with AMP)
    compile: bool = False  # torch.compile the model
    init_from: str = ""  # weights to start from: checkpoint, .pth, .safetensors or model folder; "" = random init
    ema_decay: float = 0.0  # keep an EMA of the weights (timm ModelEmaV3), e.g. 0.9998; 0 = off
    ema_warmup: bool = False  # EMA decay rises from 0 to ema_decay (timm ModelEmaV3 use_warmup), by global step
    kwargs: dict[str, Any] = field(default_factory=dict)  # more timm.create_model options, e.g. kwargs.img_size=224
    grad_checkpointing: bool = False  # recompute activations in the backward pass (less memory, slower steps)
    freeze: str = "none"  # none | backbone: train only the classifier (linear probing; frozen BatchNorm stays in eval)


@dataclass
class DataConfig:
    name: str = "digits"  # imagefolder | dummy | digits | wds (python -m data.make_shards) | listfile | hf
    root: str = ".cache/digits"  # the folder (wds: or URL) holding the splits named by data.train_split/val_split
    train_split: str = "train"  # the split trained on: data.root/<split>/, <split>.json (wds), <split>.csv|tsv
    val_split: str = "val"  # the split evaluated (e.g. test)
    image_column: str = "image"  # hf: the column of images (an Image feature, bytes, or paths relative to data.root)
    label_column: str = "label"  # hf: the column of labels (ClassLabel, integers or class names)
    path_column: str = ""  # hf: the column naming each image in predictions.csv; "" = the Image's file name
    shard_cache: str = ""  # wds: folder for shards read from URLs; "" = $WIDS_CACHE or /tmp/_wids_cache
    img_size: int = 32  # train crop size (pixels)
    crop_pct: float = 0.875  # eval: resize to img_size / crop_pct, centre crop; unset: model.init_from weights'
    val_img_size: int = 0  # eval (each epoch, best.pth, evaluate/predict/export) crop size; 0 = data.img_size
    val_crop_pct: float = 0.0  # eval: resize to val_img_size / val_crop_pct; 0 = data.crop_pct
    interpolation: str = "bilinear"  # bilinear | bicubic | nearest | area | lanczos; unset: model.init_from weights'
    train_interpolation: str = ""  # train crop, policies: "" = data.interpolation | random (bilinear/bicubic)
    augment: bool = True  # false: the train pipeline is the (deterministic) eval pipeline
    scale: list[float] = field(default_factory=lambda: [0.08, 1.0])  # RandomResizedCrop area
    ratio: list[float] = field(default_factory=lambda: [0.75, 1.3333])  # RandomResizedCrop aspect
    hflip: float = 0.5  # probability of a horizontal flip
    color_jitter: float = 0.0  # brightness/contrast/saturation strength; 0 disables it
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])  # RGB, 0-1; unset: init_from weights'
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])  # RGB, 0-1; unset: init_from weights'
    num_workers: int = 2  # DataLoader workers per process
    skip_corrupt: bool = False  # train: drop unreadable images (counted per epoch) instead of stopping; val never
    max_image_pixels: int = 89_478_485  # larger images are unreadable, found from the header (PIL's default limit)
    persistent_workers: bool = True  # keep DataLoader workers alive between epochs
    prefetch_factor: int = 2  # batches each worker prepares ahead
    dummy_train_size: int = 1024  # dummy: training images
    dummy_val_size: int = 250  # dummy: validation images
    dummy_num_classes: int = 10  # dummy: classes
    dummy_image_size: int = 64  # dummy: side of the generated images (pixels)
    auto_augment: str = ""  # "" | rand-m9-mstd0.5 (-n2, -p0.5, -inc1: timm's) | trivialaugment | augmix | autoaugment
    random_erase: float = 0.0  # probability of erasing a random box (timm's RandomErasing, as data.random_erase_mode)
    random_erase_mode: str = "pixel"  # pixel: noise per pixel | rand: noise colour per box | const: 0 normalized
    random_erase_count: int = 1  # erase 1 to this many boxes, each 1/count of the area (timm's --recount)
    mixup_alpha: float = 0.0  # mixup Beta(alpha, alpha) between pairs of images; 0 = off
    cutmix_alpha: float = 0.0  # cutmix Beta(alpha, alpha) box between pairs of images; 0 = off
    mixup_prob: float = 1.0  # probability that a pair is mixed (when mixup or cutmix is on)
    mixup_switch_prob: float = 0.5  # probability of cutmix instead of mixup when both are on
    sampler: str = "uniform"  # uniform: each image once an epoch | class_balanced: classes drawn equally (replacement)
    aug_repeats: int = 0  # repeated augmentation: each image k times per epoch (k >= 2), differently augmented
    mix_mode: str = "pair"  # pair: one mixup/cutmix draw per pair of images | batch: one per data.mix_group images
    mix_group: int = 0  # batch mode: images per draw, of the global order (any world size); 0 = train.batch_size
    multi_label: bool = False  # images have sets of labels (listfile: a|b|c; hf: Sequence(ClassLabel); wds: --list)
    multi_label_threshold: float = 0.5  # multi-label: a class is predicted when its sigmoid is >= this (val_f1)


@dataclass
class OptimConfig:
    name: str = "sgd"  # any timm optimizer name (sgd, momentum, adamw, lamb, ...)
    lr: float = 0.1  # for the global batch; see README for the scaling rule
    momentum: float = 0.9  # SGD momentum (timm passes it where the optimizer takes one)
    weight_decay: float = 1e-4  # L2 penalty / decoupled decay (adamw)
    no_decay_norm_bias: bool = True  # no weight decay on norm layers and biases
    clip_grad: float = 0.0  # max gradient norm (value: max |element|; agc: the clip factor, e.g. 0.01); 0 = off
    clip_mode: str = "norm"  # norm (total norm) | value (each element) | agc (adaptive, per unit): timm's clip modes
    betas: list[float] = field(default_factory=list)  # Adam-family [beta1, beta2]; [] = the optimizer's default
    eps: float | None = None  # the optimizer's epsilon; null = its default
    nesterov: bool | None = None  # SGD-family Nesterov momentum; null = optimizer default (timm: sgd yes, momentum no)
    layer_decay: float = 0.0  # layer-wise lr decay (ViT, ConvNeXt: 0.65-0.8), lr x decay^(blocks above); 0 = off
    lr_base: float = 0.0  # > 0: optim.lr = lr_base x global batch / lr_base_size (optim.lr ignored); 0 = off
    lr_base_size: int = 256  # the batch lr_base is given for
    lr_base_scale: str = "linear"  # linear | sqrt: how lr_base follows the global batch (timm: sqrt for lamb)
    kwargs: dict[str, Any] = field(default_factory=dict)  # more optimizer options, e.g. kwargs.trust_clip=true (lamb)


@dataclass
class SchedConfig:
    name: str = "cosine"  # cosine | tanh | poly | wsd | rsqrt | step | multistep | constant (timm's schedulers)
    warmup_epochs: int = 0  # linear warmup from warmup_lr over this many epochs
    warmup_steps: int = 0  # or over this many optimizer steps (set one of the two)
    warmup_lr: float = 1e-5  # learning rate at the start of warmup
    warmup_prefix: bool = False  # the schedule runs over the epochs after warmup (timm's warmup_prefix), not all
    warmup_shape: str = "timm"  # timm: linear from warmup_lr | nvidia: warmup epoch e at lr x (e+1)/warmup_epochs
    step_on_epochs: bool = False  # the lr changes once per epoch (at its first step), not every update
    min_lr: float = 0.0  # floor of the schedule
    decay_epochs: float = 0.0  # step: decay every this many epochs; wsd/rsqrt: decay phase (< 1: fraction; 0: 0.2)
    decay_milestones: list[int] = field(default_factory=list)  # multistep: epochs to decay at, e.g. [30,60,80]
    decay_rate: float = 0.1  # step/multistep: lr factor at each decay; poly: the power
    cooldown_epochs: int = 0  # cosine/tanh/poly/wsd/rsqrt: the schedule ends this many epochs early; min_lr after


@dataclass
class TrainConfig:
    epochs: int = 10  # a resumed run may raise it
    batch_size: int = 64  # per process; the global batch is batch_size x world size x accum_steps
    accum_steps: int = 1  # micro-batches per optimizer step
    label_smoothing: float = 0.0  # cross-entropy label smoothing, in [0, 1)
    loss: str = "ce"  # ce (soft-target cross-entropy when mixing) | bce (binary cross-entropy, the RSB recipes)
    bce_target_threshold: float | None = None  # bce: targets above it become 1, others 0 (RSB: 0.2); null = off
    bce_pos_weight: float | None = None  # bce: weight of the positive term of every class; null = 1
    max_steps: int = 0  # stop after this many optimizer steps (smoke runs); 0 = no limit
    ckpt_every_steps: int = 0  # also write last.pth every this many optimizer steps; 0 = only after each epoch
    keep_last_k: int = 0  # keep the newest k epoch_NNNN.pth files; 0 = none
    max_nonfinite: int = 5  # fp32/bf16: stop after this many optimizer steps in a row with inf/NaN gradients
    best_on_ema: bool = True  # with model.ema_decay: best.pth is the epoch with the best ema_val_top1 (as timm)
    class_weights: str | list[float] = "none"  # ce: none | balanced (n / (classes x class count)) | [w0, w1, ...]
    best_metric: str = "val_top1"  # best.pth: val_top1 | val_balanced_acc | val_macro_f1 | val_map | val_loss (min)
    early_stop_patience: int = 0  # stop after this many epochs without a better train.best_metric; 0 = off


@dataclass
class LoggingConfig:
    interval: int = 20  # optimizer steps between progress updates
    level: str = "INFO"  # DEBUG | INFO | WARNING | ERROR (rank 0; other ranks log warnings)
    progress: bool = True  # rank 0: a tqdm bar on a terminal, a log line every interval otherwise
    wandb: bool = False  # track the run in Weights & Biases (one run, from rank 0); see engine/tracking.py
    wandb_project: str = "image-classification"  # W&B project (1-128 characters, none of / \ # ? % :)
    wandb_entity: str = ""  # W&B team or user; "" = your default entity
    wandb_name: str = ""  # run name; "" = the output_dir folder name
    wandb_group: str = ""  # groups related runs in the W&B UI
    wandb_tags: list[str] = field(default_factory=list)  # e.g. [r50,baseline] (1-64 characters each)
    wandb_notes: str = ""  # free text shown with the run
    wandb_log_checkpoints: bool = False  # upload each best.pth as a model artifact version when it is written
    wandb_samples: int = 0  # W&B table of this many augmented training images when a training starts; 0 = none
    tensorboard: bool = False  # also write TensorBoard event files to <output_dir>/tensorboard (rank 0)
    profile_steps: list[int] = field(default_factory=list)  # [start, end]: torch.profiler trace of those steps (rank 0)


@dataclass
class DistConfig:
    backend: str = "auto"  # auto (nccl with CUDA, else gloo) | nccl | gloo
    timeout_s: int = 0  # collective timeout before a hung job is aborted; 0 = 1800 under torchrun, 600 without it
    rendezvous_timeout_s: int = 300  # how long the processes may take to meet at start-up


@dataclass
class DistillConfig:
    teacher_weights: str = ""  # teacher's weights (any form model.init_from takes); "" = no distillation
    teacher_name: str = ""  # the teacher's timm model name; "" = the one its weights name (a train.py checkpoint)
    teacher_kwargs: dict[str, Any] = field(default_factory=dict)  # more timm.create_model options for the teacher
    teacher_sha256: str = ""  # the teacher file's sha256, recorded at start-up; a resumed run's teacher must match
    type: str = "soft"  # soft: KL of softened logits (distill.tau) | hard: cross-entropy on the teacher's argmax
    alpha: float = 0.5  # loss = (1 - alpha) x train.loss + alpha x distillation loss (DeiT's distillation-alpha)
    tau: float = 1.0  # soft: the softmax temperature of both logits (the loss is scaled by tau^2)


@dataclass
class Config:
    seed: int = 0  # seeds model init, data order and augmentation, in [0, 2^32)
    output_dir: str = "runs/default"  # where config.yaml, metrics.jsonl and checkpoints go
    amp: str = "auto"  # auto | bf16 | fp16 | off
    resume: str = "auto"  # auto (continue from <output_dir>/last.pth if present) | none | <checkpoint path>
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)  # knowledge distillation (engine/distill.py)


CHOICES = {
    "amp": ("auto", "bf16", "fp16", "off"),
    "data.name": ("imagefolder", "dummy", "digits", "wds", "listfile", "hf"),
    "model.freeze": ("none", "backbone"),
    "data.interpolation": ("bilinear", "bicubic", "nearest", "area", "lanczos"),
    "data.random_erase_mode": ("pixel", "rand", "const"),
    "data.train_interpolation": ("", "random", "bilinear", "bicubic", "nearest", "area", "lanczos"),
    "dist.backend": ("auto", "nccl", "gloo"),
    "logging.level": ("DEBUG", "INFO", "WARNING", "ERROR"),
    "train.loss": ("ce", "bce"),
    "data.sampler": ("uniform", "class_balanced"),
    "train.best_metric": ("val_top1", "val_balanced_acc", "val_macro_f1", "val_map", "val_loss"),
    "optim.clip_mode": ("norm", "value", "agc"),
    "data.mix_mode": ("pair", "batch"),
    "distill.type": ("soft", "hard"),
    "sched.warmup_shape": ("timm", "nvidia"),
    "optim.lr_base_scale": ("linear", "sqrt"),
    "sched.name": ("cosine", "tanh", "poly", "wsd", "rsqrt", "step", "multistep", "constant"),
}
ENDLESS_SCHEDULES = ("step", "multistep", "constant")  # no end to cool down after
POSITIVE = ("train.epochs", "train.batch_size", "train.accum_steps", "data.img_size",
            "logging.interval", "dist.rendezvous_timeout_s", "train.max_nonfinite", "data.prefetch_factor",
            "data.dummy_train_size", "data.dummy_val_size", "data.dummy_num_classes", "data.dummy_image_size",
            "data.max_image_pixels", "sched.decay_rate", "optim.lr_base_size", "data.random_erase_count", "distill.tau")
NON_NEGATIVE = ("dist.timeout_s", "logging.wandb_samples", "optim.lr", "optim.weight_decay", "optim.clip_grad",
                "train.max_steps", "data.num_workers", "train.ckpt_every_steps", "train.keep_last_k",
                "data.color_jitter", "data.val_img_size", "sched.warmup_epochs", "sched.warmup_lr", "sched.min_lr",
                "data.mixup_alpha", "data.cutmix_alpha", "data.aug_repeats", "data.mix_group",
                "sched.warmup_steps", "sched.decay_epochs", "sched.cooldown_epochs", "optim.lr_base",
                "train.early_stop_patience")
FRACTIONS = ("model.drop_rate", "model.drop_path_rate", "train.label_smoothing", "model.ema_decay")  # in [0, 1)
MAX_SEED = 2**32 - 1  # np.random.seed (train.py) takes nothing larger
OPENCV_MAX_PIXELS = 2**30  # OpenCV refuses larger images (CV_IO_MAX_IMAGE_PIXELS)


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
            raw = read_yaml(read_text(file)) or {}
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


def read_text(file: Path) -> str:
    """The config file's text; a file that is not UTF-8 or cannot be read is named in one line."""
    try:
        data = file.read_bytes()
    except OSError as err:
        raise UserError(f"cannot read config file {file} ({err.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise UserError(f"config file {file} is not UTF-8 text (line {line}, byte 0x{data[err.start]:02x}); "
                        "save it as UTF-8") from None


def parse_override(item: str) -> tuple[str, Any]:
    """`optim.lr=0.2` -> ("optim.lr", 0.2); the value is read as YAML (numbers, lists, booleans).

    A value YAML would cut at a comment (`output_dir=runs/exp #1` -> `runs/exp`) stays the raw text:
    intact for a string key, refused by the type check for any other.
    """
    if "=" not in item:
        raise UserError(f"override {item!r} must look like key=value, e.g. optim.lr=0.2")
    key, text = item.split("=", 1)
    try:
        value = read_yaml(text) if text.strip() and not has_yaml_comment(text) else text
    except yaml.YAMLError:
        value = text
    return key.strip(), value


def has_yaml_comment(text: str) -> bool:
    """Whether YAML would drop part of text as a comment: a `#` outside every token."""
    if "#" not in text:
        return False
    spans = [(token.start_mark.index, token.end_mark.index) for token in yaml.scan(text, Loader=YamlLoader)]
    return any(char == "#" and not any(start <= i < end for start, end in spans) for i, char in enumerate(text))


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
    cfg.given = frozenset(dotted_keys(raw))  # not a field: what the user set, for defaults resolved at start-up
    return cfg


def dotted_keys(raw: dict[str, Any], prefix: str = "") -> list[str]:
    """Every leaf key of a raw config dict, dotted ("data.mean"); mappings of free options count as leaves."""
    keys = []
    for key, value in raw.items():
        if isinstance(value, dict) and not key.endswith("kwargs"):
            keys += dotted_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def given_keys(cfg: Config) -> frozenset[str]:
    """The dotted keys the YAML file or an override set (empty for a Config built in code)."""
    return getattr(cfg, "given", frozenset())


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
    if isinstance(hint, types.UnionType) and type(None) in hint.__args__:  # `bool | None`: null = a library default
        (inner,) = [arg for arg in hint.__args__ if arg is not type(None)]
        if value is None:
            return None
        try:
            return _coerce(key, inner, value)
        except UserError as err:
            message = str(err).replace(f"must be {inner.__name__},", f"must be {inner.__name__} or null,")
            raise UserError(message) from None
    if isinstance(hint, types.UnionType):  # `str | list[float]`: a name, or a list (train.class_weights)
        named, listed = hint.__args__
        if isinstance(value, list):
            return _coerce(key, listed, value)
        try:
            return _coerce(key, named, value)
        except UserError as err:
            raise UserError(str(err).replace(f"must be {named.__name__},", f"must be {named.__name__} or a list,")) from None

    if hint is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:  # (PyYAML reads 1e-3, without a dot, as a string)
            value = float(value)
        except (ValueError, OverflowError):
            pass
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"config key {key!r} must be a finite number, got {value!r}")
    if hint in (int, float, str, bool):
        if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
            return value
        raise UserError(f"config key {key!r} must be {hint.__name__}, got {value!r}")
    if typing.get_origin(hint) is dict:  # free options passed on to a library (timm): plain YAML data
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise UserError(f"config key {key!r} must be a mapping of names to values, e.g. "
                            f"{key}.img_size=224, got {value!r}")
        return {k: _yaml12_number(v) for k, v in value.items()}
    if typing.get_origin(hint) is list:
        (item_type,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise UserError(f"config key {key!r} must be a list of {item_type.__name__}, got {value!r}")
        return [_coerce(f"{key}[{i}]", item_type, v) for i, v in enumerate(value)]
    raise TypeError(f"unsupported annotation {hint} for {key}")


def _yaml12_number(value: Any) -> Any:
    """`1e-6` as YAML 1.2 reads it (a float); PyYAML, on YAML 1.1, leaves a float without a dot a string."""
    if isinstance(value, str) and re.fullmatch(r"[-+]?[0-9]+(\.[0-9]*)?[eE][-+]?[0-9]+", value):
        return float(value)
    return value


def _get(cfg: Config, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def validate(cfg: Config) -> None:
    """Reject values that type-check but cannot work (negative lr, batch size 0, unknown modes)."""
    if cfg.sched.name == "plateau":  # before CHOICES: say why it is missing
        raise UserError("sched.name 'plateau' is not supported: it steps on a validation metric and timm does not "
                        "checkpoint its state (a resumed run would not continue it); use cosine, step or multistep")
    for key, allowed in CHOICES.items():
        if _get(cfg, key) not in allowed:
            raise UserError(f"config key {key!r} is {_get(cfg, key)!r}; choose one of {', '.join(allowed)}")
    for key in POSITIVE:
        if _get(cfg, key) <= 0:
            raise UserError(f"config key {key!r} must be > 0, got {_get(cfg, key)!r}")
    for key in NON_NEGATIVE:
        if _get(cfg, key) < 0:
            raise UserError(f"config key {key!r} must be >= 0, got {_get(cfg, key)!r}")
    for key in ("data.hflip", "data.random_erase", "data.mixup_prob", "data.mixup_switch_prob", "distill.alpha"):
        if not 0 <= _get(cfg, key) <= 1:
            raise UserError(f"config key {key!r} must be in [0, 1], got {_get(cfg, key)!r}")
    parse_auto_augment(cfg.data.auto_augment)
    steps = cfg.logging.profile_steps
    if steps and not (len(steps) == 2 and 1 <= steps[0] <= steps[1]):
        raise UserError(f"config key 'logging.profile_steps' must be [start, end] with 1 <= start <= end (optimizer "
                        f"steps, the first is 1), or [] for no profile; got {steps}")
    if mixing(cfg.data) and cfg.train.batch_size % 2:
        raise UserError(f"config key 'train.batch_size' must be even with mixup or cutmix on (images are mixed in "
                        f"pairs within a process's batch), got {cfg.train.batch_size}")
    if mixing(cfg.data) and cfg.data.mix_mode == "batch" and cfg.data.mix_group % 2:
        raise UserError(f"config key 'data.mix_group' must be even (a group holds whole pairs), got "
                        f"{cfg.data.mix_group}")
    for key in FRACTIONS:
        if not 0 <= _get(cfg, key) < 1:
            raise UserError(f"config key {key!r} must be in [0, 1), got {_get(cfg, key)!r}")
    if not 0 <= cfg.seed <= MAX_SEED:
        raise UserError(f"config key 'seed' must be in [0, {MAX_SEED}], got {cfg.seed}")
    if not cfg.output_dir.strip():  # an unset shell variable: checkpoints would land in the current folder
        raise UserError("config key 'output_dir' is empty; give the folder for this run's checkpoints and metrics")
    for key in ("data.train_split", "data.val_split"):
        if not _get(cfg, key).strip():
            raise UserError(f"config key {key!r} is empty; name the split (a folder under data.root, e.g. val)")
    if cfg.data.max_image_pixels > OPENCV_MAX_PIXELS:
        raise UserError(f"config key 'data.max_image_pixels' must be at most {OPENCV_MAX_PIXELS} (OpenCV's own "
                        f"limit), got {cfg.data.max_image_pixels}")
    if not 0 < cfg.data.crop_pct <= 1:
        raise UserError(f"config key 'data.crop_pct' must be in (0, 1], got {cfg.data.crop_pct}")
    if not 0 <= cfg.data.val_crop_pct <= 1:
        raise UserError(f"config key 'data.val_crop_pct' must be in (0, 1] (0 = data.crop_pct), got "
                        f"{cfg.data.val_crop_pct}")
    for key in ("data.scale", "data.ratio"):
        low_high = _get(cfg, key)
        if len(low_high) != 2 or not 0 < low_high[0] <= low_high[1]:
            raise UserError(f"config key {key!r} must be [low, high] with 0 < low <= high, got {low_high}")
    validate_sched(cfg.sched, cfg.train.epochs)
    validate_optim(cfg.optim)
    validate_bce(cfg.train)
    validate_multi_label(cfg)
    validate_imbalance(cfg)
    if cfg.logging.wandb:
        validate_wandb(cfg.logging)
    if not cfg.resume:
        raise UserError("config key 'resume' is empty; use auto, none or the path of a checkpoint")
    if len(cfg.data.mean) != 3 or len(cfg.data.std) != 3 or min(cfg.data.std) <= 0:
        raise UserError("config keys 'data.mean' and 'data.std' need 3 values each (RGB), std > 0")


AUTO_AUGMENT_FORMS = ("rand-m<magnitude 0-10>[-n<ops>][-mstd<std>][-p<op probability>][-inc1] (e.g. "
                      "rand-m9-mstd0.5-inc1), "
                      "trivialaugment, "
                      "augmix[-m<severity 1-10>][-w<width>][-d<depth>], autoaugment, or \"\" for none")
AUTO_AUGMENT_OPTIONS = {"rand": {"m": 9.0, "n": 2.0, "mstd": 0.0, "p": 0.5, "inc": 0.0},
                        "augmix": {"m": 3.0, "w": 3.0, "d": -1.0},
                        "trivialaugment": {}, "autoaugment": {}}


def parse_auto_augment(text: str) -> tuple[str, dict[str, float]]:
    """timm-style policy string -> (policy, options with defaults); ("", {}) for none."""
    if not text:
        return "", {}
    name, *parts = text.split("-")
    if name not in AUTO_AUGMENT_OPTIONS:
        raise UserError(f"config key 'data.auto_augment' is {text!r}; use {AUTO_AUGMENT_FORMS}")
    options = dict(AUTO_AUGMENT_OPTIONS[name])
    for part in parts:
        match = re.fullmatch(r"(mstd|[a-z]+?)(\d+(?:\.\d*)?)", part)
        integer_only = match and match.group(1) not in ("mstd", "p")
        if not match or match.group(1) not in options or (integer_only and "." in match.group(2)):
            raise UserError(f"config key 'data.auto_augment' is {text!r}: cannot read {part!r}; use "
                            f"{AUTO_AUGMENT_FORMS}")
        options[match.group(1)] = float(match.group(2))
    if name == "rand" and not (options["m"] <= 10 and options["n"] >= 1 and options["p"] <= 1
                               and options["inc"] in (0, 1)):
        raise UserError(f"config key 'data.auto_augment' is {text!r}: rand needs m in 0-10, n >= 1, p in [0, 1] "
                        f"and inc 0 or 1")
    if name == "augmix" and not (1 <= options["m"] <= 10 and options["w"] >= 1):
        raise UserError(f"config key 'data.auto_augment' is {text!r}: augmix needs m in 1-10 and w >= 1")
    return name, options


def mixing(cfg: DataConfig) -> bool:
    """Whether training mixes pairs of images (mixup or cutmix)."""
    return cfg.mixup_alpha > 0 or cfg.cutmix_alpha > 0


def validate_sched(cfg: SchedConfig, epochs: int) -> None:
    """Schedule settings timm would ignore or take a default for (step's is 90 epochs), refused at load time."""
    if cfg.name == "step" and cfg.decay_epochs <= 0:
        raise UserError("sched.name=step needs sched.decay_epochs > 0 (decay the lr every that many epochs), "
                        "e.g. sched.decay_epochs=30")
    if cfg.name == "multistep" and not cfg.decay_milestones:
        raise UserError("sched.name=multistep needs sched.decay_milestones, the epochs to decay at, "
                        "e.g. sched.decay_milestones=[30,60,80]")
    milestones = cfg.decay_milestones
    if milestones and (milestones[0] <= 0 or any(b <= a for a, b in zip(milestones, milestones[1:]))):
        raise UserError(f"config key 'sched.decay_milestones' must increase from an epoch > 0, got {milestones}")
    if cfg.warmup_epochs and cfg.warmup_steps:
        raise UserError(f"set sched.warmup_epochs or sched.warmup_steps, not both (got {cfg.warmup_epochs} and "
                        f"{cfg.warmup_steps})")
    if cfg.cooldown_epochs and cfg.name in ENDLESS_SCHEDULES:
        raise UserError(f"sched.cooldown_epochs applies to schedules with an end (cosine, tanh, poly, wsd, rsqrt), "
                        f"not sched.name={cfg.name}; set it to 0")
    if cfg.step_on_epochs and cfg.warmup_steps:
        raise UserError(f"sched.warmup_steps={cfg.warmup_steps} needs an lr that changes every step; with "
                        "sched.step_on_epochs=true give sched.warmup_epochs")
    if cfg.warmup_shape == "nvidia" and not cfg.step_on_epochs:
        raise UserError("sched.warmup_shape=nvidia is NVIDIA's per-epoch warmup; set sched.step_on_epochs=true "
                        "with it")
    if cfg.warmup_prefix and cfg.warmup_epochs >= epochs - cfg.cooldown_epochs:
        raise UserError(f"sched.warmup_prefix=true: sched.warmup_epochs {cfg.warmup_epochs} leaves no epoch of "
                        f"train.epochs {epochs} for the schedule after it; lower sched.warmup_epochs")
    if cfg.cooldown_epochs >= epochs:
        raise UserError(f"sched.cooldown_epochs must be below train.epochs ({epochs}), got {cfg.cooldown_epochs}")


def validate_optim(cfg: OptimConfig) -> None:
    """Optimizer values out of range (whether this optimizer takes them is checked at start-up: engine/optim.py)."""
    if cfg.betas and (len(cfg.betas) != 2 or not all(0 <= b < 1 for b in cfg.betas)):
        raise UserError(f"config key 'optim.betas' must be [beta1, beta2], each in [0, 1), got {cfg.betas}")
    if cfg.eps is not None and cfg.eps <= 0:
        raise UserError(f"config key 'optim.eps' must be > 0 (or null: the optimizer's default), got {cfg.eps}")
    if not 0 <= cfg.layer_decay <= 1:
        raise UserError(f"config key 'optim.layer_decay' must be in [0, 1] (0: off), got {cfg.layer_decay}")
    if cfg.clip_mode != "norm" and cfg.clip_grad == 0:  # a mode without a value would silently clip nothing
        what = "the AGC clip factor, e.g. 0.01" if cfg.clip_mode == "agc" else "the largest |gradient element|"
        raise UserError(f"config key 'optim.clip_mode' is {cfg.clip_mode} but optim.clip_grad is 0 (off); set "
                        f"optim.clip_grad ({what})")


def validate_bce(cfg: TrainConfig) -> None:
    """BCE's options only mean something with train.loss=bce; out of range they would train on nonsense targets."""
    for key in ("bce_target_threshold", "bce_pos_weight"):
        if getattr(cfg, key) is not None and cfg.loss != "bce":
            raise UserError(f"config key 'train.{key}' applies to train.loss=bce only (train.loss is {cfg.loss!r}); "
                            f"set train.loss=bce or remove it")
    if cfg.bce_target_threshold is not None and not 0 <= cfg.bce_target_threshold < 1:
        raise UserError(f"config key 'train.bce_target_threshold' must be in [0, 1) (or null: off), got "
                        f"{cfg.bce_target_threshold}")
    if cfg.bce_pos_weight is not None and cfg.bce_pos_weight <= 0:
        raise UserError(f"config key 'train.bce_pos_weight' must be > 0 (or null: 1), got {cfg.bce_pos_weight}")


MULTI_LABEL_FORMATS = ("listfile", "hf", "wds")  # the formats whose samples can carry a set of labels


def validate_multi_label(cfg: Config) -> None:
    """data.multi_label needs a format that can hold a set of labels, and trains with one sigmoid per class."""
    if not 0 < cfg.data.multi_label_threshold < 1:
        raise UserError(f"config key 'data.multi_label_threshold' must be in (0, 1), got "
                        f"{cfg.data.multi_label_threshold}")
    if not cfg.data.multi_label:
        return
    if cfg.data.name not in MULTI_LABEL_FORMATS:
        raise UserError(f"data.multi_label=true needs data.name {', '.join(MULTI_LABEL_FORMATS)}: data.name="
                        f"{cfg.data.name} gives each image one class (write a list file: path,labels with a|b)")
    if cfg.train.loss != "bce":
        raise UserError(f"data.multi_label=true trains one sigmoid per class: set train.loss=bce (train.loss is "
                        f"{cfg.train.loss!r})")


def validate_imbalance(cfg: Config) -> None:
    """train.class_weights and train.best_metric values that could not work (a list's length is checked
    against the classes when the data is read: engine/losses.py class_weights)."""
    weights, multi_label = cfg.train.class_weights, cfg.data.multi_label
    if isinstance(weights, str) and weights not in ("none", "balanced"):
        raise UserError(f"config key 'train.class_weights' is {weights!r}; use none, balanced or a list of one "
                        "weight per class, e.g. [1.0, 5.0]")
    if isinstance(weights, list) and (not weights or min(weights) < 0 or max(weights) == 0):
        raise UserError(f"config key 'train.class_weights' must be one weight >= 0 per class, not all 0, got "
                        f"{weights}")
    if weights != "none" and cfg.train.loss != "ce":
        raise UserError(f"config key 'train.class_weights' applies to train.loss=ce (train.loss is "
                        f"{cfg.train.loss!r}); "
                        "use train.bce_pos_weight with bce")
    if cfg.train.best_metric == "val_map" and not multi_label:  # the one place that decides where mAP exists
        raise UserError("train.best_metric=val_map needs multi-label data (data.multi_label=true), and this run's "
                        "data is single-label; use val_top1, val_balanced_acc, val_macro_f1 or val_loss")
    if multi_label and cfg.train.best_metric in ("val_balanced_acc", "val_macro_f1"):
        raise UserError(f"train.best_metric={cfg.train.best_metric} is a single-label metric; with "
                        "data.multi_label=true use val_map (the default there) or val_loss")
    if multi_label and cfg.data.sampler == "class_balanced":
        raise UserError("data.sampler=class_balanced draws one class per image, and multi-label images have "
                        "several; use data.sampler=uniform (train.bce_pos_weight weights the positives)")


def validate_wandb(cfg: LoggingConfig) -> None:
    """Names W&B would refuse at init time; caught here so the mistake is a one-line error, not a lost run."""
    if not 0 < len(cfg.wandb_project) <= 128 or any(c in cfg.wandb_project for c in "/\\#?%:"):
        raise UserError(f"config key 'logging.wandb_project' is {cfg.wandb_project!r}; W&B needs 1-128 characters "
                        "without / \\ # ? % :")
    for tag in cfg.wandb_tags:
        if not 0 < len(tag) <= 64:
            raise UserError(f"config key 'logging.wandb_tags' has {tag!r}; W&B tags need 1-64 characters")


def field_notes(cls: type) -> dict[str, str]:
    """Each field's trailing comment in the schema's source: the one place a config key is described."""
    notes = {}
    for line in inspect.getsource(cls).splitlines():
        if match := re.match(r"    (\w+): [^#]*?(?:#\s*(.*))?$", line):
            notes[match.group(1)] = match.group(2) or ""
    return notes


def config_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, description) of every leaf of the schema, in schema order."""
    hints, notes, defaults = typing.get_type_hints(cls), field_notes(cls), cls()
    keys = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            keys += config_keys(hint, f"{prefix}{f.name}.")
        else:
            name = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
            if isinstance(hint, types.UnionType):  # `float | None` -> float|null, one word in --help
                name = "|".join("null" if arg is type(None) else arg.__name__ for arg in hint.__args__)
            keys.append((f"{prefix}{f.name}", name, getattr(defaults, f.name), notes.get(f.name, "")))
    return keys


def keys_help() -> str:
    """The config keys as `--help` lists them (generated from the schema)."""
    keys = config_keys()
    width = max(len(key) for key, *_ in keys)
    lines = ["config keys (override any with key=value; the default is the schema's, before --config):"]
    for key, kind, default, note in keys:
        shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
        lines.append(f"  {key:<{width}}  {kind:<11} {shown or repr(default):<14} {note}")
    return "\n".join(lines)


def keys_markdown() -> str:
    """The config keys as the README's reference table (generated from the schema; tests/test_cli.py compares)."""
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key, kind, default, note in config_keys():
        shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
        cells = [f"`{key}`", kind, f"`{shown or repr(default)}`", note]
        lines.append("| " + " | ".join(cell.replace("|", "\\|").replace("<", "\\<") for cell in cells) + " |")
    return "\n".join(lines)


def config_yaml(cfg: Config) -> str:
    """The resolved config as YAML (config.yaml's text, and --print-config's)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def best_metric(cfg: Config) -> str:
    """The metrics.jsonl column best.pth is chosen on: train.best_metric (val_top1, the default, means val_map for
    multi-label data), of the EMA's weights with model.ema_decay and train.best_on_ema."""
    name = cfg.train.best_metric
    if cfg.data.multi_label and name == "val_top1":
        name = "val_map"
    return f"ema_{name}" if cfg.model.ema_decay > 0 and cfg.train.best_on_ema else name


def lower_is_better(metric: str) -> bool:
    """Whether a smaller value of this metrics.jsonl column is the better one (the losses)."""
    return metric.removeprefix("ema_") == "val_loss"


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict: what checkpoints and config.yaml store."""
    return dataclasses.asdict(cfg)

