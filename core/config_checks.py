"""The values a Config can type-check with and still not work (batch size 0, an unknown mode, a schedule timm
would quietly default): each refused at load time, in one line naming the key and what to use."""

from __future__ import annotations

from typing import Any, Callable

from core.config import (Config, LoggingConfig, OptimConfig, SchedConfig, TrainConfig, TuneConfig, key_facts,
                         mixing)
from core.errors import UserError


ENDLESS_SCHEDULES = ("step", "multistep", "constant")  # no end to cool down after
TORCH_SCHEDULES = ("onecycle", "plateau")  # torch's schedulers: timm's warmup, cooldown and epoch steps are not theirs
IN_RANGE = {"> 0": lambda v: v > 0, ">= 0": lambda v: v >= 0, "[0, 1]": lambda v: 0 <= v <= 1,
            "[0, 1)": lambda v: 0 <= v < 1}  # each range a schema field may name (core/config.py Within)
LAYER_CHECKS: list[Callable[[Config], None]] = []  # added by add_check from the layers above core (core imports none)
MAX_SEED = 2**32 - 1  # np.random.seed (train.py) takes nothing larger
OPENCV_MAX_PIXELS = 2**30  # OpenCV refuses larger images (CV_IO_MAX_IMAGE_PIXELS)


def add_check(check: Callable[[Config], None]) -> None:
    """Run `check` in every validate (load time), after the keys' choices and ranges: a layer above core (data/)
    registers here what only it knows of its keys, as core may not import it."""
    if check not in LAYER_CHECKS:
        LAYER_CHECKS.append(check)


def _get(cfg: Config, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def validate(cfg: Config) -> None:
    """Reject values that type-check but cannot work (negative lr, batch size 0, unknown modes)."""
    if cfg.loss_scale < 0:
        raise UserError(f"config key 'loss_scale' must be >= 0 (0 = a dynamic scale), got {cfg.loss_scale}")
    validate_facts(cfg)
    for check in LAYER_CHECKS:  # what the layers above core know of their keys (data/config_checks.py)
        check(cfg)
    steps = cfg.logging.profile_steps
    if steps and not (len(steps) == 2 and 1 <= steps[0] <= steps[1]):
        raise UserError(f"config key 'logging.profile_steps' must be [start, end] with 1 <= start <= end (optimizer "
                        f"steps, the first is 1), or [] for no profile; got {steps}")
    batch = cfg.train.batch_size
    if batch != "auto" and (isinstance(batch, str) or batch <= 0):
        raise UserError(f"config key 'train.batch_size' must be > 0, or auto (the largest batch that fits: "
                        f"docs/tuning.md), got {batch!r}")
    if mixing(cfg.data) and batch != "auto" and batch % 2:
        raise UserError(f"config key 'train.batch_size' must be even with mixup or cutmix on (images are mixed in "
                        f"pairs within a process's batch), got {cfg.train.batch_size}")
    if mixing(cfg.data) and cfg.data.mix_partner == "roll" and cfg.data.mix_mode != "batch":
        raise UserError("data.mix_partner=roll mixes each image with the one before it in its group, and "
                        "data.mix_mode is pair; set data.mix_mode=batch (torchvision's batches) or data.mix_partner=flip")
    if mixing(cfg.data) and cfg.data.mix_mode == "batch" and cfg.data.mix_group % 2:
        raise UserError(f"config key 'data.mix_group' must be even (a group holds whole pairs), got "
                        f"{cfg.data.mix_group}")
    if cfg.train.ckpt_format == "sharded" and cfg.train.keep_last_k:
        raise UserError(f"config key 'train.keep_last_k' is {cfg.train.keep_last_k}, but with "
                        "train.ckpt_format=sharded only last.dcp is kept (an epoch file would gather the whole model "
                        "on rank 0); set train.keep_last_k=0, or train.ckpt_format=file")
    for key, seed in (("seed", cfg.seed), ("data.split_seed", cfg.data.split_seed)):
        if not 0 <= seed <= MAX_SEED:
            raise UserError(f"config key {key!r} must be in [0, {MAX_SEED}], got {seed}")
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
    validate_freeze(cfg)
    validate_optim(cfg.optim)
    validate_bce(cfg.train)
    validate_multi_label(cfg)
    validate_imbalance(cfg)
    validate_tune(cfg.tune)
    if cfg.dist.strategy == "fsdp":
        validate_fsdp(cfg)
    elif cfg.dist.fsdp_accum_whole:
        raise UserError("config key 'dist.fsdp_accum_whole' applies to dist.strategy=fsdp (ddp keeps its gradients "
                        "whole between micro-steps already); remove it or set dist.strategy=fsdp")
    elif cfg.dist.fsdp_shard_size:
        raise UserError("config key 'dist.fsdp_shard_size' applies to dist.strategy=fsdp (ddp holds the whole model on "
                        "every process); remove it or set dist.strategy=fsdp")
    if cfg.dist.fsdp_shard_size < 0:
        raise UserError(f"config key 'dist.fsdp_shard_size' must be >= 0 (0 = all processes), got "
                        f"{cfg.dist.fsdp_shard_size}")
    if cfg.logging.wandb:
        validate_wandb(cfg.logging)
    if cfg.model.pretrained and cfg.model.init_from:
        raise UserError(f"model.pretrained=true and model.init_from={cfg.model.init_from} both name the weights to "
                        "start from; keep model.init_from for a local file, or model.pretrained for timm's weights of "
                        "model.name")
    if not cfg.resume:
        raise UserError("config key 'resume' is empty; use auto, none or the path of a checkpoint")
    if len(cfg.data.mean) != 3 or len(cfg.data.std) != 3 or min(cfg.data.std) <= 0:
        raise UserError("config keys 'data.mean' and 'data.std' need 3 values each (RGB), std > 0")



def validate_facts(cfg: Config) -> None:
    """Each key's choices and range, as its schema field states them (core/config.py key())."""
    for key, facts in key_facts().items():
        value = _get(cfg, key)
        if facts.choices and value not in facts.choices:
            raise UserError(f"config key {key!r} is {value!r}; choose one of {', '.join(facts.choices)}")
        if facts.within and not IN_RANGE[facts.within](value):
            where = f"in {facts.within}" if facts.within.startswith("[") else facts.within
            raise UserError(f"config key {key!r} must be {where}, got {value!r}")

def validate_sched(cfg: SchedConfig, epochs: int) -> None:
    """Schedule settings timm would ignore or take a default for (step's is 90 epochs), refused at load time."""
    if cfg.name in TORCH_SCHEDULES:
        validate_torch_sched(cfg)
    if cfg.cycle_momentum and cfg.name != "onecycle":
        raise UserError(f"sched.cycle_momentum applies to sched.name=onecycle, not {cfg.name}; remove it")
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
    if cfg.epoch_lag and not cfg.step_on_epochs:
        raise UserError(f"sched.epoch_lag={cfg.epoch_lag} shifts a schedule stepped once per epoch; set "
                        "sched.step_on_epochs=true with it, or sched.epoch_lag=0")
    if cfg.warmup_shape == "nvidia" and not cfg.step_on_epochs:
        raise UserError("sched.warmup_shape=nvidia is NVIDIA's per-epoch warmup; set sched.step_on_epochs=true "
                        "with it")
    if cfg.warmup_prefix and cfg.warmup_epochs >= epochs - cfg.cooldown_epochs:
        raise UserError(f"sched.warmup_prefix=true: sched.warmup_epochs {cfg.warmup_epochs} leaves no epoch of "
                        f"train.epochs {epochs} for the schedule after it; lower sched.warmup_epochs")
    if cfg.cooldown_epochs >= epochs:
        raise UserError(f"sched.cooldown_epochs must be below train.epochs ({epochs}), got {cfg.cooldown_epochs}")


def validate_torch_sched(cfg: SchedConfig) -> None:
    """onecycle and plateau are torch's schedulers: timm's warmup, cooldown and per-epoch steps are not theirs (a
    one-cycle rises for sched.pct_start of the run), and a plateau decay must lower the lr."""
    for key, value in (("warmup_epochs", cfg.warmup_epochs), ("warmup_steps", cfg.warmup_steps),
                       ("cooldown_epochs", cfg.cooldown_epochs), ("step_on_epochs", cfg.step_on_epochs)):
        if value:
            rise = "; its rise is sched.pct_start of the run" if cfg.name == "onecycle" else ""
            raise UserError(f"sched.{key}={value} does not apply to sched.name={cfg.name} (torch's scheduler){rise}; "
                            f"remove it")
    if cfg.name == "onecycle" and cfg.min_lr:
        raise UserError(f"sched.min_lr={cfg.min_lr:g} does not apply to sched.name=onecycle: its last lr is optim.lr "
                        "/ sched.div_factor / sched.final_div_factor; remove sched.min_lr")
    momentum = cfg.cycle_momentum
    if momentum and (len(momentum) != 2 or not 0 <= momentum[0] <= momentum[1] < 1):
        raise UserError(f"config key 'sched.cycle_momentum' must be [base, max] with 0 <= base <= max < 1, or [] "
                        f"(momentum kept), got {momentum}")
    if cfg.name == "plateau" and cfg.decay_rate >= 1:
        raise UserError(f"sched.name=plateau: sched.decay_rate={cfg.decay_rate:g} would not lower the lr; use a "
                        "factor below 1, e.g. 0.1 (Keras' and torch's default) or 0.5")


def validate_freeze(cfg: Config) -> None:
    """model.freeze_epochs: a head-only phase that ends within the run, on a backbone that can be frozen for it."""
    epochs = cfg.model.freeze_epochs
    if not epochs:
        return
    if cfg.model.freeze != "backbone":
        raise UserError(f"model.freeze_epochs={epochs} needs model.freeze=backbone (what is frozen for those epochs); "
                        "add model.freeze=backbone, or remove model.freeze_epochs")
    if epochs >= cfg.train.epochs:
        raise UserError(f"model.freeze_epochs={epochs} is not below train.epochs={cfg.train.epochs}: the whole model "
                        "would never train; lower model.freeze_epochs, or set it to 0 (frozen for the whole run)")
    if cfg.dist.strategy == "fsdp":
        raise UserError(f"model.freeze_epochs={epochs} with dist.strategy=fsdp: a sharded model cannot unfreeze "
                        "mid-run here; use dist.strategy=ddp, or model.freeze_epochs=0 (frozen for the whole run)")


def validate_optim(cfg: OptimConfig) -> None:
    """Optimizer values out of range (whether this optimizer takes them is checked at start-up: engine/optim.py)."""
    if cfg.betas and (len(cfg.betas) != 2 or not all(0 <= b < 1 for b in cfg.betas)):
        raise UserError(f"config key 'optim.betas' must be [beta1, beta2], each in [0, 1), got {cfg.betas}")
    if cfg.eps is not None and cfg.eps <= 0:
        raise UserError(f"config key 'optim.eps' must be > 0 (or null: the optimizer's default), got {cfg.eps}")
    if not 0 <= cfg.layer_decay <= 1:
        raise UserError(f"config key 'optim.layer_decay' must be in [0, 1] (0: off), got {cfg.layer_decay}")
    for key, value in (("optim.no_decay_match", cfg.no_decay_match), ("optim.no_decay_norm_layers",
                                                                       cfg.no_decay_norm_layers)):
        if value and (cfg.layer_decay or not cfg.no_decay_norm_bias or (cfg.no_decay_match and
                                                                        cfg.no_decay_norm_layers)):
            other = ("optim.layer_decay (timm groups the parameters by layer)" if cfg.layer_decay else
                     "optim.no_decay_norm_bias=false (every parameter is decayed)" if not cfg.no_decay_norm_bias else
                     "optim.no_decay_norm_layers=true (two rules for the same parameters)")
            raise UserError(f"config key '{key}' cannot be used with {other}; remove one of them")
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


def validate_multi_label(cfg: Config) -> None:
    """data.multi_label trains one sigmoid per class (the formats that hold label sets: data/config_checks.py)."""
    if not 0 < cfg.data.multi_label_threshold < 1:
        raise UserError(f"config key 'data.multi_label_threshold' must be in (0, 1), got "
                        f"{cfg.data.multi_label_threshold}")
    if cfg.data.multi_label and cfg.train.loss != "bce":
        raise UserError(f"data.multi_label=true trains one sigmoid per class: set train.loss=bce (train.loss is "
                        f"{cfg.train.loss!r})")


def validate_imbalance(cfg: Config) -> None:
    """train.class_weights and train.best_metric values that could not work (a list's length is checked
    against the classes when the data is read: engine/losses.py class_weights)."""
    weights, multi_label = cfg.train.class_weights, cfg.data.multi_label
    if isinstance(weights, str) and weights not in ("none", "balanced", "effective"):
        raise UserError(f"config key 'train.class_weights' is {weights!r}; use none, balanced, effective or a list "
                        "of one weight per class, e.g. [1.0, 5.0]")
    if isinstance(weights, list) and (not weights or min(weights) < 0 or max(weights) == 0):
        raise UserError(f"config key 'train.class_weights' must be one weight >= 0 per class, not all 0, got "
                        f"{weights}")
    if weights != "none" and cfg.train.loss != "ce":
        raise UserError(f"config key 'train.class_weights' applies to train.loss=ce (train.loss is "
                        f"{cfg.train.loss!r}); "
                        "use train.bce_pos_weight with bce")
    validate_long_tail(cfg)
    if cfg.train.best_metric == "val_map" and not multi_label:  # the one place that decides where mAP exists
        raise UserError("train.best_metric=val_map needs multi-label data (data.multi_label=true), and this run's "
                        "data is single-label; use val_top1, val_balanced_acc, val_macro_f1 or val_loss")
    if multi_label and cfg.train.best_metric in ("val_balanced_acc", "val_macro_f1"):
        raise UserError(f"train.best_metric={cfg.train.best_metric} is a single-label metric; with "
                        "data.multi_label=true use val_map (the default there) or val_loss")
    if multi_label and cfg.data.sampler == "class_balanced":
        raise UserError("data.sampler=class_balanced draws one class per image, and multi-label images have "
                        "several; use data.sampler=uniform (train.bce_pos_weight weights the positives)")


def validate_long_tail(cfg: Config) -> None:
    """train.class_weights_beta, train.class_weights_from_epoch and train.logit_adjustment values that could not
    work, or that would correct for the class prior twice."""
    train = cfg.train
    if not 0 <= train.class_weights_beta < 1:
        raise UserError(f"config key 'train.class_weights_beta' must be in [0, 1) (Cui et al.: 0.9999), got "
                        f"{train.class_weights_beta}")
    if train.class_weights_from_epoch < 0:
        raise UserError(f"config key 'train.class_weights_from_epoch' must be >= 0, got "
                        f"{train.class_weights_from_epoch}")
    if train.class_weights_from_epoch and train.class_weights == "none":
        raise UserError("train.class_weights_from_epoch defers class weights, and train.class_weights is none; set "
                        "train.class_weights (e.g. effective or balanced) or leave train.class_weights_from_epoch at 0")
    if train.class_weights_from_epoch >= train.epochs:  # epochs count from 0: the last is epochs - 1
        raise UserError(f"train.class_weights_from_epoch={train.class_weights_from_epoch} starts the class weights "
                        f"after the last epoch (train.epochs={train.epochs}, numbered from 0), so they would never "
                        f"apply; lower it below {train.epochs} or raise train.epochs")
    tau = train.logit_adjustment
    if tau < 0:
        raise UserError(f"config key 'train.logit_adjustment' must be >= 0 (0 = off, 1 = Menon et al.), got {tau}")
    if tau and train.loss != "ce":
        raise UserError(f"train.logit_adjustment applies to softmax cross-entropy (train.loss=ce), and train.loss is "
                        f"{train.loss!r}; set train.logit_adjustment=0 or train.loss=ce")
    if tau and cfg.data.sampler == "class_balanced":
        raise UserError("train.logit_adjustment corrects for the training set's class prior, and "
                        "data.sampler=class_balanced already draws every class alike (its prior is uniform); use one "
                        "of them")


MIN_TUNE_STEPS = 10  # --find-lr: fewer points leave no curve to read a suggestion from


def validate_tune(cfg: TuneConfig) -> None:
    """The LR range test's ramp must rise from a positive lr over enough steps to read a curve."""
    if not 0 < cfg.lr_min < cfg.lr_max:
        raise UserError(f"config keys 'tune.lr_min' and 'tune.lr_max' must satisfy 0 < lr_min < lr_max, got "
                        f"{cfg.lr_min:g} and {cfg.lr_max:g}")
    if cfg.steps < MIN_TUNE_STEPS:
        raise UserError(f"config key 'tune.steps' must be at least {MIN_TUNE_STEPS} (points of the LR range test's "
                        f"curve), got {cfg.steps}")


def validate_fsdp(cfg: Config) -> None:
    """What dist.strategy=fsdp cannot do (docs/fsdp.md says why), refused before anything starts."""
    refused = {
        "amp=fp16": (cfg.amp == "fp16", "the GradScaler's inf check would see only each process's shard of the "
                     "gradients; use amp=bf16 or amp=off"),
        "model.sync_bn=true": (cfg.model.sync_bn, "BatchNorm models are small enough for dist.strategy=ddp, "
                               "which has SyncBN; use ddp, or model.sync_bn=false"),
        "model.compile=true": (cfg.model.compile, "not supported with sharded models here; use model.compile=false"),
        "optim.clip_mode=agc": (cfg.optim.clip_mode == "agc", "timm's adaptive clipping does in-place steps that "
                                "sharded (DTensor) gradients refuse; use optim.clip_mode=norm or value"),
    }
    for setting, (on, why) in refused.items():
        if on:
            raise UserError(f"dist.strategy=fsdp with {setting}: {why}")


def validate_wandb(cfg: LoggingConfig) -> None:
    """Names W&B would refuse at init time; caught here so the mistake is a one-line error, not a lost run."""
    if not 0 < len(cfg.wandb_project) <= 128 or any(c in cfg.wandb_project for c in "/\\#?%:"):
        raise UserError(f"config key 'logging.wandb_project' is {cfg.wandb_project!r}; W&B needs 1-128 characters "
                        "without / \\ # ? % :")
    for tag in cfg.wandb_tags:
        if not 0 < len(tag) <= 64:
            raise UserError(f"config key 'logging.wandb_tags' has {tag!r}; W&B tags need 1-64 characters")
