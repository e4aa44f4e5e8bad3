"""The typed configuration: one dataclass schema, the one place each key's facts live.

Each field is made by `key()`: its type (the annotation), default, help text, and the facts the rest of the app
derives from it: the values it may take (choices, within), whether a resumed run may change it (continues), and
its rank among --help's first keys (first). core/config_load.py builds a Config from YAML and `key=value` overrides
(an unknown key or a wrong type is a one-line UserError naming the key and the closest valid one);
core/config_checks.py refuses the values that type-check but cannot work (the choices and ranges of every field
among them). What is here besides the schema reads it: the keys' reference (--help, docs/configuration.md), the
resolved YAML, and the few answers several modules ask of a Config.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

Within = Literal["> 0", ">= 0", "[0, 1]", "[0, 1)"]  # a number's range, as the refusal names it


@dataclass(frozen=True)
class KeyFacts:
    """What the app knows of one config key besides its type and default (a field's metadata["facts"])."""

    note: str = ""  # the help text of --help and docs/configuration.md
    choices: tuple[str, ...] = ()  # the only values it may take (core/config_checks.py refuses others)
    within: Within | None = None  # the range a number must be in (core/config_checks.py refuses others)
    continues: bool = False  # a run continued by resume=auto may change it (engine/checkpoint/resume.py)
    first: int = 0  # > 0: its place among the keys --help lists first


def key(default: Any, note: str, *, choices: tuple[str, ...] = (), within: Within | None = None,
        continues: bool = False, first: int = 0) -> Any:
    """A schema field carrying its key's facts; a mutable default (list, dict) is copied for each Config."""
    metadata = {"facts": KeyFacts(note, choices, within, continues, first)}
    if type(default).__hash__ is None:  # what dataclasses refuse as a default: each instance gets its own copy
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelConfig:
    name: str = key("resnet18", "any timm model name", first=2)
    drop_rate: float = key(0.0, "dropout before the classifier, in [0, 1)", within="[0, 1)")
    drop_path_rate: float = key(0.0, "stochastic depth, in [0, 1)", within="[0, 1)")
    sync_bn: bool = key(False, "convert BatchNorm to a synchronized one when world size > 1")
    channels_last: bool = key(True, "NHWC memory format (faster convolutions with AMP)", continues=True)
    compile: bool = key(False, "torch.compile the model", continues=True)
    pretrained: bool = key(False,
                           "start from timm's weights of model.name (resnet50.a1_in1k, hf-hub:<id>) via the HF cache",
                           first=3)
    init_from: str = key("",
                         'weights to start from: checkpoint, .pth, .safetensors or model folder; "" = random init',
                         continues=True)
    ema_decay: float = key(0.0, "keep an EMA of the weights (timm ModelEmaV3), e.g. 0.9998; 0 = off", within="[0, 1)")
    ema_warmup: bool = key(False, "EMA decay rises from 0 to ema_decay (timm ModelEmaV3 use_warmup), by global step")
    ema_reset_epochs: int = key(0,
                                "the EMA copies the model at each step of the first N epochs and the step after them "
                                "(torchvision's reset during its lr warmup); 0 = off",
                                within=">= 0")
    kwargs: dict[str, Any] = key({}, "more timm.create_model options, e.g. kwargs.img_size=224")
    conv_init: str = key("",
                         "\"\" = timm's init | fan_in | fan_out: a fresh model's Conv2d weights drawn "
                         "kaiming_normal(mode, relu) (NVIDIA's ResNet-50: fan_in)",
                         choices=("", "fan_in", "fan_out"))
    cls_token_std: float = key(0.0,
                               "> 0: a fresh ViT's cls_token is drawn from trunc_normal(std) (DeiT's timm 0.3.2: "
                               "0.02); 0 = timm's init (normal, std 1e-6)",
                               within=">= 0")
    head_init_std: float = key(0.0,
                               "> 0: a freshly made classifier's weight (get_classifier()) is drawn from "
                               "trunc_normal(std, cut at +-2), also when model.init_from/pretrained re-make it for "
                               "the class count; a loaded one is kept (MAE fine-tuning: 2e-5); 0 = timm's init",
                               within=">= 0")
    grad_checkpointing: bool = key(False,
                                   "recompute activations in the backward pass (less memory, slower steps)",
                                   continues=True)
    freeze: str = key("none",
                      "none | backbone: train only the classifier (linear probing; frozen BatchNorm stays in eval)",
                      choices=("none", "backbone"))
    freeze_epochs: int = key(0,
                             "with model.freeze=backbone: only the classifier trains for this many epochs, then the "
                             "whole model (fastai's fine_tune); 0 = frozen for the whole run",
                             within=">= 0")


@dataclass
class DataConfig:
    name: str = key("digits",
                    "imagefolder | dummy | digits | wds (python -m data.make_shards) | listfile | hf",
                    choices=("imagefolder", "dummy", "digits", "wds", "listfile", "hf"))
    root: str = key(".cache/digits",
                    "the folder (wds: or URL) holding the splits named by data.train_split/val_split",
                    first=1)
    train_split: str = key("train", "the split trained on: data.root/<split>/, <split>.json (wds), <split>.csv|tsv")
    val_split: str = key("val", "the split evaluated (e.g. test)")
    val_fraction: float = key(0.0,
                              "imagefolder: data.root holds the class folders; validate on this fraction of each "
                              "class (train.txt/val.txt in the run folder); 0 = off",
                              within="[0, 1)")
    split_seed: int = key(0, "data.val_fraction: the seed of the split")
    folds_file: str = key("",
                          "audit.py's k-fold file: train on the training images of every fold but data.fold, "
                          "validate on data.fold's; \"\" = off")
    fold: int = key(0, "data.folds_file: the fold held out for validation", within=">= 0")
    image_column: str = key("image",
                            "hf: the column of images (an Image feature, bytes, or paths relative to data.root)")
    label_column: str = key("label", "hf: the column of labels (ClassLabel, integers or class names)")
    path_column: str = key("", "hf: the column naming each image in predictions.csv; \"\" = the Image's file name")
    hf_config: str = key("", "hf with data.root=hf-hub:<org>/<name>: the dataset's config name; \"\" = its default")
    hf_revision: str = key("",
                           "hf-hub: the dataset repo's commit (40 hex digits); \"\" = main's, recorded at start-up")
    shard_cache: str = key("",
                           'folder for shards read from URLs, and (mirror/) other data.root URLs\' local copies; "" = '
                           '$WIDS_CACHE or /tmp/_wids_cache',
                           continues=True)
    shard_cache_gb: float = key(20.0,
                                "wds: the most data.shard_cache holds of shards copied from URLs (GB, 1e9 bytes); "
                                "past it the least recently used are removed; other formats: the largest data.root "
                                "URL copied",
                                within="> 0", continues=True)
    shard_order: str = key("auto",
                           "wds training order: by_rank = each process reads only its own whole shards of an epoch "
                           "(a seeded deal, shuffled within a few shards); global = one permutation of all samples "
                           "for all processes; auto = by_rank for a URL data.root, else global",
                           choices=("auto", "global", "by_rank"))
    img_size: int = key(32, "train crop size (pixels); with data.size_schedule, the last one", within="> 0", first=7)
    size_schedule: list[list[int]] = key([],
                                         "progressive resizing: [[epoch, size], ...], train crops of `size` px from "
                                         "`epoch` on (the first at epoch 0, the last size data.img_size); [] = off")
    crop_pct: float = key(0.875, "eval: resize to img_size / crop_pct, centre crop; unset: model.init_from weights'")
    val_img_size: int = key(0,
                            "eval (each epoch, best.pth, evaluate/predict/export) crop size; 0 = data.img_size",
                            within=">= 0")
    val_crop_pct: float = key(0.0, "eval: resize to val_img_size / val_crop_pct; 0 = data.crop_pct")
    interpolation: str = key("bilinear",
                             "bilinear | bicubic | nearest | area | lanczos; unset: model.init_from weights'",
                             choices=("bilinear", "bicubic", "nearest", "area", "lanczos"))
    train_interpolation: str = key("",
                                   'train crop, policies: "" = data.interpolation | random (bilinear/bicubic)',
                                   choices=("", "random", "bilinear", "bicubic", "nearest", "area", "lanczos"))
    augment: bool = key(True, "false: the train pipeline is the (deterministic) eval pipeline")
    train_transform: str = key("",
                               "an albumentations pipeline file (A.save, YAML or JSON) in place of the train preset; "
                               "it must end at uint8 img_size x img_size")
    eval_transform: str = key("", "as data.train_transform, in place of the eval preset (ending at the eval size)")
    train_transform_sha256: str = key("", "data.train_transform's sha256, recorded (a resume with another is refused)")
    eval_transform_sha256: str = key("", "data.eval_transform's sha256, recorded (a resume with another is refused)")
    scale: list[float] = key([0.08, 1.0], "RandomResizedCrop area")
    ratio: list[float] = key([0.75, 1.3333], "RandomResizedCrop aspect")
    hflip: float = key(0.5, "probability of a horizontal flip", within="[0, 1]")
    color_jitter: float = key(0.0, "brightness/contrast/saturation strength; 0 disables it", within=">= 0")
    mean: list[float] = key([0.485, 0.456, 0.406], "RGB, 0-1; unset: init_from weights'")
    std: list[float] = key([0.229, 0.224, 0.225], "RGB, 0-1; unset: init_from weights'")
    num_workers: int = key(2, "DataLoader workers per process; on the CPU each takes one of its compute threads; "
                              "unset: 2, capped at the process's share of the CPUs",
                           within=">= 0", continues=True, first=8)
    skip_corrupt: bool = key(False, "train: drop unreadable images (counted per epoch) instead of stopping; val never")
    max_image_pixels: int = key(89_478_485,
                                "larger images are unreadable, found from the header (PIL's default limit)",
                                within="> 0")
    persistent_workers: bool = key(True, "keep DataLoader workers alive between epochs", continues=True)
    prefetch_factor: int = key(2, "batches each worker prepares ahead", within="> 0", continues=True)
    dummy_train_size: int = key(1024, "dummy: training images", within="> 0")
    dummy_val_size: int = key(250, "dummy: validation images", within="> 0")
    dummy_num_classes: int = key(10, "dummy: classes", within="> 0")
    dummy_image_size: int = key(64, "dummy: side of the generated images (pixels)", within="> 0")
    auto_augment: str = key("",
                            "\"\" | rand-m9-mstd0.5 (-n2, -p0.5, -inc1: timm's) | trivialaugment | augmix | "
                            "autoaugment")
    random_erase: float = key(0.0,
                              "probability of erasing a random box (timm's RandomErasing, as data.random_erase_mode)",
                              within="[0, 1]")
    random_erase_mode: str = key("pixel",
                                 "pixel: noise per pixel | rand: noise colour per box | const: 0 normalized",
                                 choices=("pixel", "rand", "const"))
    random_erase_box: str = key("timm",
                                "the box's ranges: timm (area 0.02-1/3, aspect 0.3-1/0.3, timm's RandomErasing) | "
                                "torchvision (0.02-0.33, 0.3-3.3)",
                                choices=("timm", "torchvision"))
    random_erase_count: int = key(1,
                                  "erase 1 to this many boxes, each 1/count of the area (timm's --recount)",
                                  within="> 0")
    random_erase_fill: str = key("uint8",
                                 "uint8: mean + std x N(0, 1) clipped to 0-255 (workers) | normalized: timm's "
                                 "unclipped N(0, 1) after normalization (device)",
                                 choices=("uint8", "normalized"))
    mixup_alpha: float = key(0.0, "mixup Beta(alpha, alpha) between pairs of images; 0 = off", within=">= 0")
    cutmix_alpha: float = key(0.0, "cutmix Beta(alpha, alpha) box between pairs of images; 0 = off", within=">= 0")
    mixup_prob: float = key(1.0, "probability that a pair is mixed (when mixup or cutmix is on)", within="[0, 1]")
    mixup_switch_prob: float = key(0.5, "probability of cutmix instead of mixup when both are on", within="[0, 1]")
    sampler: str = key("uniform",
                       "uniform: each image once an epoch | class_balanced: classes drawn equally (replacement)",
                       choices=("uniform", "class_balanced"))
    aug_repeats: int = key(0,
                           "repeated augmentation: each image k times per epoch (k >= 2), differently augmented",
                           within=">= 0")
    mix_mode: str = key("pair",
                        "pair: one mixup/cutmix draw per pair of images | batch: one per data.mix_group images",
                        choices=("pair", "batch"))
    mix_group: int = key(0,
                         "batch mode: images per draw = the source's GPU batch, laid out as its sampler deals them; 0 "
                         "= train.batch_size",
                         within=">= 0")
    mix_partner: str = key("flip",
                           "batch mode: flip: row i with row G-1-i of its group, both ways (timm's Mixup) | roll: row "
                           "i takes from row i-1 (torchvision's MixUp/CutMix, batch.roll(1, 0))",
                           choices=("flip", "roll"))
    cutmix_rounding: str = key("timm",
                               "the cutmix box around its centre: timm (timm 1.0: cut // 2 before, the rest after) | "
                               "symmetric (cut // 2 each side: older timm's rand_bbox, torchvision's CutMix)",
                               choices=("timm", "symmetric"))
    multi_label: bool = key(False,
                            "images have sets of labels (listfile: a|b|c; hf: Sequence(ClassLabel); wds: --list)")
    multi_label_threshold: float = key(0.5, "multi-label: a class is predicted when its sigmoid is >= this (val_f1)")


@dataclass
class OptimConfig:
    name: str = key("sgd", "any timm optimizer name (sgd, momentum, adamw, lamb, ...)")
    lr: float = key(0.1, "for the global batch; docs/recipes.md has the scaling rule", within=">= 0", first=6)
    momentum: float = key(0.9, "SGD momentum (timm passes it where the optimizer takes one)")
    weight_decay: float = key(1e-4, "L2 penalty / decoupled decay (adamw)", within=">= 0")
    no_decay_norm_bias: bool = key(True, "no weight decay on norm layers and biases")
    no_decay_match: str = key("",
                              "with no_decay_norm_bias: \"\" = timm's rule (1-D tensors) | text: no decay only where "
                              "a parameter's name contains it (NVIDIA: bn)")
    no_decay_norm_layers: bool = key(False,
                                     "with no_decay_norm_bias: no decay only for normalization layers' parameters, "
                                     "other biases decay (torchvision's --norm-weight-decay 0)")
    clip_grad: float = key(0.0,
                           "max gradient norm (value: max |element|; agc: the clip factor, e.g. 0.01); 0 = off",
                           within=">= 0")
    clip_mode: str = key("norm",
                         "norm (total norm) | value (each element) | agc (adaptive, per unit): timm's clip modes",
                         choices=("norm", "value", "agc"))
    betas: list[float] = key([], "Adam-family [beta1, beta2]; [] = the optimizer's default")
    eps: float | None = key(None, "the optimizer's epsilon; null = its default")
    nesterov: bool | None = key(None,
                                "SGD-family Nesterov momentum; null = optimizer default (timm: sgd yes, momentum no)")
    layer_decay: float = key(0.0, "layer-wise lr decay (ViT, ConvNeXt: 0.65-0.8), lr x decay^(blocks above); 0 = off")
    lr_base: float = key(0.0,
                         "> 0: optim.lr = lr_base x global batch / lr_base_size (over a config file's optim.lr; an "
                         "optim.lr given on the command line wins); 0 = off",
                         within=">= 0")
    lr_base_size: int = key(256, "the batch lr_base is given for", within="> 0")
    lr_base_scale: str = key("linear",
                             "linear | sqrt: how lr_base follows the global batch (timm: sqrt for lamb)",
                             choices=("linear", "sqrt"))
    kwargs: dict[str, Any] = key({}, "more optimizer options, e.g. kwargs.trust_clip=true (lamb)")


@dataclass
class SchedConfig:
    name: str = key("cosine",
                    "cosine | tanh | poly | wsd | rsqrt | step | multistep | constant (timm's schedulers) | onecycle "
                    "(torch's OneCycleLR) | plateau (torch's ReduceLROnPlateau on train.best_metric)",
                    choices=("cosine", "tanh", "poly", "wsd", "rsqrt", "step", "multistep", "constant", "onecycle",
                             "plateau"))
    warmup_epochs: int = key(0, "linear warmup from warmup_lr over this many epochs", within=">= 0")
    warmup_steps: int = key(0, "or over this many optimizer steps (set one of the two)", within=">= 0")
    warmup_lr: float = key(1e-5, "learning rate at the start of warmup", within=">= 0")
    warmup_prefix: bool = key(False, "the schedule runs over the epochs after warmup (timm's warmup_prefix), not all")
    warmup_shape: str = key("timm",
                            "timm: linear from warmup_lr | nvidia: warmup epoch e at lr x (e+1)/warmup_epochs",
                            choices=("timm", "nvidia"))
    step_on_epochs: bool = key(False, "the lr changes once per epoch (at its first step), not every update")
    epoch_lag: int = key(0,
                         "with step_on_epochs: epoch e trains at the schedule's value for max(e - lag, 0) (DeiT's "
                         "step(epoch) after each epoch: 1); 0 = e's value (timm's train.py)",
                         within=">= 0")
    min_lr: float = key(0.0, "floor of the schedule", within=">= 0")
    decay_epochs: float = key(0.0,
                              "step: decay every this many epochs; wsd/rsqrt: decay phase (< 1: fraction; 0: 0.2)",
                              within=">= 0")
    decay_milestones: list[int] = key([], "multistep: epochs to decay at, e.g. [30,60,80]")
    decay_rate: float = key(0.1, "step/multistep/plateau: lr factor at each decay; poly: the power", within="> 0")
    cooldown_epochs: int = key(0,
                               "cosine/tanh/poly/wsd/rsqrt: the schedule ends this many epochs early; min_lr after",
                               within=">= 0")
    plateau_patience: int = key(10,
                                "plateau: validations without a better train.best_metric after which the lr decays "
                                "(the next one decays it; torch's patience)",
                                within=">= 0")
    plateau_threshold: float = key(1e-4,
                                   "plateau: a value better than the best by less than this fraction is no "
                                   "improvement (torch's threshold, relative)",
                                   within=">= 0")
    plateau_cooldown: int = key(0, "plateau: validations after a decay before counting again", within=">= 0")
    pct_start: float = key(0.3, "onecycle: the fraction of the run's steps that the lr rises", within="[0, 1]")
    div_factor: float = key(25.0, "onecycle: the first lr is optim.lr / div_factor", within="> 0")
    final_div_factor: float = key(1e4, "onecycle: the last lr is the first / final_div_factor", within="> 0")
    anneal_strategy: str = key("cos", "onecycle: cos | linear", choices=("cos", "linear"))
    three_phase: bool = key(False, "onecycle: a third phase down to the last lr (fastai's is two)")
    cycle_momentum: list[float] = key([],
                                      "onecycle: [base, max] momentum (Adam: beta1) cycled against the lr (torch's "
                                      "cycle_momentum, fastai's moms: [0.85, 0.95]); [] = optim's momentum kept")


@dataclass
class TrainConfig:
    epochs: int = key(10, "a resumed run may raise it", within="> 0", continues=True, first=4)
    batch_size: int | str = key(64,
                                "per process; the global batch is batch_size x world size x accum_steps; auto: the "
                                "largest that fits",
                                continues=True, first=5)
    global_batch_size: int = key(0,
                                 "set: batch_size = this / (world size x accum_steps), the same global batch on any "
                                 "number of processes (a train.batch_size given on the command line wins); 0 = off",
                                 within=">= 0", continues=True)
    accum_steps: int = key(1, "micro-batches per optimizer step", within="> 0", continues=True)
    drop_last_accum: bool = key(False,
                                "an epoch's last micro-batches, fewer than accum_steps, are skipped, not stepped as a "
                                "shorter group (ConvNeXt's images // global batch steps)")
    label_smoothing: float = key(0.0, "cross-entropy label smoothing, in [0, 1)", within="[0, 1)")
    loss: str = key("ce",
                    "ce (soft-target cross-entropy when mixing) | bce (binary cross-entropy, the RSB recipes)",
                    choices=("ce", "bce"))
    bce_target_threshold: float | None = key(None, "bce: targets above it become 1, others 0 (RSB: 0.2); null = off")
    bce_pos_weight: float | None = key(None, "bce: weight of the positive term of every class; null = 1")
    max_steps: int = key(0,
                         "stop after this many optimizer steps (smoke runs); 0 = no limit",
                         within=">= 0", continues=True)
    val_every_steps: int = key(0,
                               "also validate the model (and EMA) after each optimizer step whose global step is a "
                               "multiple of this, inside an epoch (a row in metrics.jsonl with its step; best.pth and "
                               "early stopping count it); the step that ends an epoch is validated once, by the "
                               "epoch's validation; 0 = after each epoch only",
                               within=">= 0", continues=True)
    ckpt_every_steps: int = key(0,
                                "also write last.pth every this many optimizer steps; 0 = only after each epoch",
                                within=">= 0", continues=True)
    keep_last_k: int = key(0, "keep the newest k epoch_NNNN.pth files; 0 = none", within=">= 0", continues=True)
    ckpt_format: str = key("file",
                           "last checkpoint: file (last.pth, rank 0) | sharded (last.dcp/ folder, every rank)",
                           choices=("file", "sharded"), continues=True)
    async_save: bool = key(True,
                           "file checkpoints: rank 0 writes a copy of the state in a background thread while training "
                           "goes on (host memory for one checkpoint); false = training waits for each write",
                           continues=True)
    max_nonfinite: int = key(5,
                             "fp32/bf16: stop after this many optimizer steps in a row with inf/NaN gradients",
                             within="> 0", continues=True)
    best_on_ema: bool = key(True,
                            "with model.ema_decay: best.pth is the epoch with the best ema_val_top1 (as timm)",
                            continues=True)
    class_weights: str | list[float] = key("none",
                                           "ce: none | balanced (n / (classes x class count)) | effective (Cui et al. "
                                           "2019: (1 - beta) / (1 - beta^count), summing to the class count) | [w0, "
                                           "w1, ...]; weights each image's whole (smoothed) loss, averaged over the "
                                           "batch's images; balanced is capped at class_weights_max (uncapped, its "
                                           "loss spiked for epochs at 142:1 with lr 0.1: docs/data.md)")
    class_weights_max: float = key(10.0,
                                   "class_weights=balanced: no class weighs more than this (balanced averages 1 per "
                                   "image); 0 = scikit-learn's weights uncapped (they spiked at 142:1: docs/data.md)",
                                   within=">= 0")
    class_weights_beta: float = key(0.9999,
                                    "class_weights=effective: beta in [0, 1); 0 = no weighting, towards 1 = balanced")
    class_weights_from_epoch: int = key(0,
                                        "deferred re-weighting (Cao et al. 2019, DRW): class weights apply from this "
                                        "epoch on, plain cross-entropy before; 0 = from the start")
    logit_adjustment: float = key(0.0,
                                  "ce: tau of the logit-adjusted loss (Menon et al. 2021): cross-entropy of logits + "
                                  "tau x log(class prior of the training set); evaluation and prediction use the raw "
                                  "logits; 0 = off, 1 = the paper's")
    best_metric: str = key("val_top1",
                           "best.pth: val_top1 | val_balanced_acc | val_macro_f1 | val_map | val_loss (min)",
                           choices=("val_top1", "val_balanced_acc", "val_macro_f1", "val_map", "val_loss"),
                           continues=True)
    early_stop_patience: int = key(0,
                                   "stop after this many validations in a row without a better train.best_metric "
                                   "(one per epoch, and those of train.val_every_steps; checked after each of them; "
                                   "the validation of a train.max_steps stop is not counted); 0 = off",
                                   within=">= 0", continues=True)


@dataclass
class LoggingConfig:
    interval: int = key(20, "optimizer steps between progress updates", within="> 0", continues=True)
    level: str = key("INFO",
                     "DEBUG | INFO | WARNING | ERROR (rank 0; other ranks log warnings)",
                     choices=("DEBUG", "INFO", "WARNING", "ERROR"), continues=True)
    progress: bool = key(True, "rank 0: a tqdm bar on a terminal, a log line every interval otherwise", continues=True)
    wandb: bool = key(False,
                      "track the run in Weights & Biases (one run, from rank 0); see engine/tracking.py",
                      continues=True, first=12)
    wandb_project: str = key("image-classification",
                             "W&B project (1-128 characters, none of / \\ # ? % :)",
                             continues=True)
    wandb_entity: str = key("", 'W&B team or user; "" = your default entity', continues=True)
    wandb_name: str = key("", 'run name; "" = the output_dir folder name', continues=True)
    wandb_group: str = key("", "groups related runs in the W&B UI", continues=True)
    wandb_tags: list[str] = key([], "e.g. [r50,baseline] (1-64 characters each)", continues=True)
    wandb_notes: str = key("", "free text shown with the run", continues=True)
    wandb_log_checkpoints: bool = key(False,
                                      "upload each best.pth as a model artifact version when it is written",
                                      continues=True)
    wandb_samples: int = key(0,
                             "W&B table of this many augmented training images when a training starts; 0 = none",
                             within=">= 0", continues=True)
    samples: int = key(16,
                       "draw samples.png in output_dir at a fresh run's start: this many training images as the model "
                       "gets them in epoch 0 (augmented; before normalization and mixup/cutmix), with their classes "
                       "(rank 0); 0 = none",
                       within=">= 0", continues=True)
    wandb_errors: int = key(16,
                            "W&B, each validation (single-label): a table of its this many worst images by loss "
                            "(image, true and predicted class, confidence, loss) and its confusion matrix (up to 100 "
                            "classes); 0 = neither",
                            within=">= 0", continues=True)
    curves: bool = key(True,
                       "draw curves.png (loss, the best.pth metric, lr) in output_dir after each validation (rank 0; "
                       "redraw a finished run with python -m engine.curves RUN_DIR)",
                       continues=True)
    tensorboard: bool = key(False,
                            "also write TensorBoard event files to <output_dir>/tensorboard (rank 0)",
                            continues=True)
    profile_steps: list[int] = key([], "[start, end]: torch.profiler trace of those steps (rank 0)", continues=True)


@dataclass
class DistConfig:
    backend: str = key("auto",
                       "auto (nccl with CUDA, else gloo) | nccl | gloo",
                       choices=("auto", "nccl", "gloo"), continues=True)
    timeout_s: int = key(0,
                         "collective timeout before a hung job is aborted; 0 = 1800 under torchrun, 600 without it",
                         within=">= 0", continues=True)
    rendezvous_timeout_s: int = key(300,
                                    "how long the processes may take to meet at start-up",
                                    within="> 0", continues=True)
    strategy: str = key("ddp",
                        "ddp: every process holds the whole model | fsdp: parameters, gradients, optimizer sharded",
                        choices=("ddp", "fsdp"), continues=True)
    fsdp_shard_size: int = key(0,
                               "fsdp: shard within groups of this many processes (a node's: HSDP), replicate across "
                               "groups; 0 = shard across all processes",
                               continues=True)
    fsdp_accum_whole: bool = key(False,
                                 "fsdp with train.accum_steps > 1: keep whole weights and gradients between "
                                 "micro-steps (one all-gather and reduce-scatter per step, ddp's memory for them); "
                                 "false = reshard after each",
                                 continues=True)


@dataclass
class DistillConfig:
    teacher_weights: str = key("", "teacher's weights (any form model.init_from takes); \"\" = no distillation")
    teacher_name: str = key("",
                            "the teacher's timm model name; \"\" = the one its weights name (a train.py checkpoint)")
    teacher_kwargs: dict[str, Any] = key({}, "more timm.create_model options for the teacher")
    teacher_sha256: str = key("",
                              "the teacher file's sha256, recorded at start-up; a resumed run's teacher must match",
                              continues=True)
    type: str = key("soft",
                    "soft: KL of softened logits (distill.tau) | hard: cross-entropy on the teacher's argmax",
                    choices=("soft", "hard"))
    alpha: float = key(0.5,
                       "loss = (1 - alpha) x train.loss + alpha x distillation loss (DeiT's distillation-alpha)",
                       within="[0, 1]")
    tau: float = key(1.0, "soft: the softmax temperature of both logits (the loss is scaled by tau^2)", within="> 0")


@dataclass
class TuneConfig:
    lr_min: float = key(1.0e-6, "train.py --find-lr: the range test's first lr (docs/tuning.md)", continues=True)
    lr_max: float = key(10.0,
                        "--find-lr: its last lr, reached after tune.steps optimizer steps unless the loss diverges",
                        continues=True)
    steps: int = key(100,
                     "--find-lr: optimizer steps of the exponential lr ramp (one value of the curve each)",
                     continues=True)


@dataclass
class Config:
    seed: int = key(0, "seeds model init, data order and augmentation, in [0, 2^32)")
    output_dir: str = key("runs/default",
                          "where config.yaml, metrics.jsonl and checkpoints go",
                          continues=True, first=10)
    amp: str = key("auto",
                   "training's precision: auto | bf16 | fp16 | off",
                   choices=("auto", "bf16", "fp16", "off"), first=9)
    eval_amp: str = key("off",
                        "the precision of every reported number: each validation (and best.pth's choice), and the "
                        "default of evaluate.py, predict.py, export.py for this run's weights: off (fp32) | bf16 | "
                        "fp16 | auto (amp's rule)",
                        choices=("off", "bf16", "fp16", "auto"))
    loss_scale: float = key(0.0,
                            "fp16's GradScaler: a static scale (halved on overflow, never grown: NVIDIA's "
                            "--static-loss-scale); 0 = dynamic (65536, grown every 2000 good steps)")
    tf32: bool = key(True,
                     "fp32 matmuls and convolutions (amp=off, eval_amp=off) on TF32 Tensor Cores, GPUs of compute "
                     "capability 8.0+ (A100, H100), in training, validation and evaluate.py alike; false = full "
                     "fp32 (cuDNN's convolutions included)",
                     continues=True)
    resume: str = key("auto",
                      "auto (continue from <output_dir>/last.pth or last.dcp if present) | none | <checkpoint path>",
                      first=11)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)  # knowledge distillation (engine/distill.py)
    tune: TuneConfig = field(default_factory=TuneConfig)  # train.py --find-lr's LR range test (engine/lr_find.py)
    # Which keys the user set, as dotted keys (core/config_load sets them; empty for a Config built in code): `given`
    # by the YAML file or an override, `from_command_line` by a key=value override alone, which a value a start-up
    # rule derives (optim.lr from optim.lr_base, train.batch_size from train.global_batch_size) never replaces; the
    # config file's own values it may. Attributes, not fields: no YAML key, and dataclasses.replace drops them.
    given: typing.ClassVar[frozenset[str]] = frozenset()
    from_command_line: typing.ClassVar[frozenset[str]] = frozenset()
    # What loading decided for the user (a value the command line implies), said on the run's first lines.
    notes: typing.ClassVar[tuple[str, ...]] = ()


def with_derived(cfg: Config, **changes: Any) -> Config:
    """cfg with the values start-up derived (a section's as a dict of its keys, data={"mean": ...}; a top-level key's
    as its value), keeping which keys the user gave, and where (attributes, not fields: dataclasses.replace drops
    them). Every start-up derivation returns its values and they are applied here, so none of them forgets what
    was set."""
    resolved = dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **value)
                                           if isinstance(value, dict) else value for name, value in changes.items()})
    resolved.given, resolved.from_command_line = cfg.given, cfg.from_command_line
    return resolved


def global_batch(world_size: int, batch_size: int, accum_steps: int) -> int:
    """Images per optimizer step over all processes: the one place it is computed."""
    return world_size * batch_size * accum_steps


def train_size(cfg: DataConfig, epoch: int) -> int:
    """The training crop size of `epoch`: data.size_schedule's size from the last of its epochs <= `epoch`, else
    data.img_size. A function of the epoch alone, so loader workers, resumed runs and every rank agree on it."""
    sizes = [size for start, size in cfg.size_schedule if start <= epoch]
    return sizes[-1] if sizes else cfg.img_size


def reads_by_rank(cfg: DataConfig) -> bool:
    """Whether data.shard_order reads WebDataset shards by rank, asked or by auto's default for a URL data.root, as far
    as the config says (data/loader.shard_order still falls back to global, or refuses, where the data needs it)."""
    from core.store import is_url  # (core/store's module imports torch: not at the config's own import)

    return cfg.name == "wds" and (cfg.shard_order == "by_rank" or (cfg.shard_order == "auto" and is_url(cfg.root)))


def mixing(cfg: DataConfig) -> bool:
    """Whether training mixes pairs of images (mixup or cutmix)."""
    return cfg.mixup_alpha > 0 or cfg.cutmix_alpha > 0


def config_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, description) of every leaf of the schema, in schema order."""
    hints, defaults = typing.get_type_hints(cls), cls()
    keys = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            keys += config_keys(hint, f"{prefix}{f.name}.")
        else:
            name = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
            if isinstance(hint, types.UnionType):  # `float | None` -> float|null, one word in --help
                name = "|".join("null" if arg is type(None) else arg.__name__ for arg in hint.__args__)
            keys.append((f"{prefix}{f.name}", name, getattr(defaults, f.name), facts_of_field(f).note))
    return keys


def facts_of_field(f: dataclasses.Field) -> KeyFacts:
    """A leaf field's facts (every leaf is made by key(): tests/test_architecture.py checks it)."""
    return f.metadata.get("facts", KeyFacts())


@functools.cache
def key_facts(cls: type = Config, prefix: str = "") -> dict[str, KeyFacts]:
    """Every leaf key of the schema (dotted) with its facts, in schema order: what the checks, resume and --help
    derive their tables from."""
    hints, facts = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            facts |= key_facts(hints[f.name], f"{prefix}{f.name}.")
        else:
            facts[f"{prefix}{f.name}"] = facts_of_field(f)
    return facts


FIRST_KEYS = tuple(sorted((name for name, facts in key_facts().items() if facts.first),
                          key=lambda name: key_facts()[name].first))  # --help's top: the dozen people change first


def keys_help() -> str:
    """The config keys as `--help` lists them (generated from the schema): the dozen people change first, then all."""
    keys = config_keys()
    width = max(len(key) for key, *_ in keys)

    def line(key: str, kind: str, default: Any, note: str) -> str:
        shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
        return f"  {key:<{width}}  {kind:<11} {shown or repr(default):<14} {note}"

    first = {key: row for key, *row in keys if key in FIRST_KEYS}
    lines = ["the keys people change first (override any with key=value or --key=value):"]
    lines += [line(key, *first[key]) for key in FIRST_KEYS]
    lines += ["", "every config key (the default is the schema's, before --config; docs/configuration.md):"]
    lines += [line(*row) for row in keys]
    return "\n".join(lines)


def keys_markdown() -> str:
    """The config keys as docs/configuration.md's reference table (generated from the schema; tests/test_cli.py compares)."""
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key, kind, default, note in config_keys():
        shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
        cells = [f"`{key}`", kind, f"`{shown or repr(default)}`", note]
        lines.append("| " + " | ".join(cell.replace("|", "\\|").replace("<", "\\<") for cell in cells) + " |")
    return "\n".join(lines)


def config_yaml(cfg: Config) -> str:
    """The resolved config as YAML (config.yaml's text, and --print-config's)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def run_values(cfg: Config, world_size: int) -> str:
    """The derived values a run uses, resolved, each with where it came from (--dry-run's second line): the batch,
    the lr, the preprocessing."""
    train, data = cfg.train, cfg.data
    images = global_batch(world_size, train.batch_size, train.accum_steps)
    rules = {"train.batch_size": "train.global_batch_size" if train.global_batch_size else "",
             "optim.lr": "optim.lr_base x the global batch" if cfg.optim.lr_base else ""}
    shown = [("train.batch_size", train.batch_size), ("train.accum_steps", train.accum_steps),
             ("optim.lr", f"{cfg.optim.lr:g}"), ("data.img_size", data.img_size), ("data.mean", data.mean),
             ("data.std", data.std), ("data.interpolation", data.interpolation), ("data.crop_pct", data.crop_pct),
             ("amp", cfg.amp), ("eval_amp", cfg.eval_amp)]
    parts = [f"{key} {value} ({origin(cfg, key, rules.get(key, ''))})" for key, value in shown]
    return f"global batch {images} = {world_size} process(es) x batch x accumulation; " + ", ".join(parts)


def origin(cfg: Config, key: str, rule: str = "") -> str:
    """Where a resolved value came from: the command line, the config file, a start-up rule, or the default (for
    data.mean/std/interpolation/crop_pct: the weights' or the resumed run's, when neither gave them)."""
    if key in cfg.from_command_line:
        return "command line"
    if rule:
        return f"rule: {rule}"
    if key in cfg.given:
        return "config file"
    if key in ("data.mean", "data.std", "data.interpolation", "data.crop_pct"):
        return "the weights', the resumed run's, or the default"
    return "default"


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict: what checkpoints and config.yaml store."""
    return dataclasses.asdict(cfg)
