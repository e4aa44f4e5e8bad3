"""The parts a run trains with: the placed model's EMA and teacher, the model sharded and wrapped, its optimizer,
schedule, loss and loop settings (what fit() and --find-lr step)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from assembly.start import Teacher
from core.config import Config, DataConfig, global_batch, mixing
from core.dist import DistInfo, is_fsdp
from core.startup import training_kernels
from data.erasing import NormalizedFill
from data.loader import DataBundle
from data.mixing import BatchMix
from data.pipeline import REPLACED_KEYS
from data.transforms import DeviceNormalize
from engine.checkpoint.resume import Resume
from engine.distill import build_distillation
from engine.losses import ImbalancedCrossEntropy, Loss, build_loss, capped_note, heavy_weight_warning
from engine.optim import build_optimizer, build_scheduler
from engine.precision import Precision
from engine.state import best_metric, lower_is_better
from engine.trainer import LoopConfig, TrainParts
from models.ema import CachedEma, create_ema
from models.factory import compile_warning
from models.freeze import Frozen, freeze_backbone
from models.parallel import shard_for_training, wrap_for_training

log = logging.getLogger(__name__)


def build_parts(cfg: Config, info: DistInfo, data: DataBundle, precision: Precision, model: nn.Module,
                teacher: Teacher | None, start: Resume | None
                ) -> tuple[TrainParts, LoopConfig, CachedEma | None, Frozen | None]:
    """The placed model's teacher and EMA (with `start`'s weights; no EMA without a `start`), the model sharded
    (dist.strategy=fsdp) and wrapped, its optimizer, schedule, loss and loop settings, and model.freeze_epochs' frozen
    backbone: (parts, loop, EMA or None, Frozen or None).
    What fit() trains with, and what --find-lr's range test steps (engine/lr_find.py)."""
    loss = run_loss(cfg, data, info)  # first: a setting it refuses stops the run before its other parts are built
    distill = build_distillation(cfg.distill, teacher.model, teacher.weights, teacher.name, model, cfg.data.mean,
                                 cfg.data.std, info.device, cfg.model.channels_last) if teacher else None
    ema = None
    if start is not None:
        ema = create_ema(model, cfg.model.ema_decay, cfg.model.ema_warmup)
        start.load_ema(ema.module if ema is not None else None)
    if cfg.dist.strategy == "fsdp":
        shard_for_training(model, ema.module if ema is not None else None, precision.dtype, info.world_size,
                           cfg.dist.fsdp_shard_size)
    torch.manual_seed(cfg.seed + info.rank)  # dropout / drop-path differ per rank, reproducibly
    training_kernels(info.device.type, precision.tf32)  # cuDNN's autotuning on CUDA, as benchmark.py times it
    if (warning := compile_warning(cfg.model, info.world_size)) and info.is_main:
        log.warning(warning)
    unfreezes = cfg.model.freeze_epochs > 0
    trained = wrap_for_training(model, info.device, info.world_size, cfg.model.compile, unfreezes)  # what the loop calls
    updates_per_epoch = data.steps_per_epoch
    optimizer = build_optimizer(model, cfg.optim, grad_scaler=precision.scaler is not None, sharded=is_fsdp(model),
                                unfreezes=unfreezes)
    # model.freeze_epochs: DDP and the optimizer hold every parameter, then the backbone is frozen (the Unfreeze hook
    # releases it), so a run resumed on either side of the unfreeze steps the same optimizer as one not stopped.
    frozen = freeze_backbone(model, cfg.model.freeze_epochs) if unfreezes else None
    scheduler = build_scheduler(optimizer, cfg.sched, cfg.train.epochs, updates_per_epoch,
                                lower_is_better(best_metric(cfg)))
    parts = TrainParts(trained, optimizer, scheduler, loss, precision, distill)
    normalize = DeviceNormalize(cfg.data.mean, cfg.data.std, info.device, cfg.model.channels_last)
    erasing = data.train.dataset.erasing  # data.random_erase_fill=normalized: boxes to fill after normalize
    total_steps = cfg.train.epochs * updates_per_epoch
    loop = LoopConfig(normalize=normalize, accum_steps=cfg.train.accum_steps, drop_last_accum=cfg.train.drop_last_accum,
                      clip_grad=cfg.optim.clip_grad, max_steps=cfg.train.max_steps, log_interval=cfg.logging.interval,
                      show_progress=cfg.logging.progress, max_nonfinite=cfg.train.max_nonfinite,
                      total_steps=min(total_steps, cfg.train.max_steps or total_steps),
                      mix=BatchMix(data.num_classes, cfg.train.label_smoothing) if mixing(cfg.data) else None,
                      erase=NormalizedFill(cfg.data.random_erase_mode, info.device) if erasing else None,
                      clip_mode=cfg.optim.clip_mode, multi_label=cfg.data.multi_label,
                      fsdp_accum_whole=cfg.dist.fsdp_accum_whole and is_fsdp(model) and cfg.train.accum_steps > 1)
    return parts, loop, ema, frozen


def run_loss(cfg: Config, data: DataBundle, info: DistInfo) -> Loss:
    """The run's loss, refused (a bad setting) or warned about (one class's weight dominating a batch) before
    anything else is built: fit(), --dry-run and --find-lr build it first here."""
    loss = build_loss(cfg.train, mixing(cfg.data), data.class_counts, data.class_names)
    images = global_batch(info.world_size, cfg.train.batch_size, cfg.train.accum_steps)
    if info.is_main:
        for line in data_lines(cfg, data, loss):
            log.info(line)
        if note := capped_note(cfg.train, data.class_counts, data.class_names):
            log.info(note)
        if warning := heavy_weight_warning(loss, data.class_names, images):
            log.warning(warning)
    return loss


CLASSES_SHOWN = 20  # classes the start-up block lists by name (the fewest and most images are said beyond it)


def data_lines(cfg: Config, data: DataBundle, loss: Loss) -> list[str]:
    """The start-up block of what training sees: the classes in their index order with their training images, how
    they are sampled, the class weights of the loss, and the augmentation (preset or the user's file). A list of
    weights (train.class_weights) follows this order, which nothing else shows."""
    names, counts = data.class_names, data.class_counts
    shown = [f"{name} {count}" for name, count in zip(names[:CLASSES_SHOWN], counts)]
    if len(names) > CLASSES_SHOWN:
        fewest, most = counts.index(min(counts)), counts.index(max(counts))
        shown.append(f"... and {len(names) - CLASSES_SHOWN} more (fewest: {names[fewest]} {counts[fewest]}, most: "
                     f"{names[most]} {counts[most]})")
    what = "positive images" if cfg.data.multi_label else "training images"
    sampler = ("data.sampler=class_balanced: each class drawn equally often (with replacement)"
               if cfg.data.sampler == "class_balanced" else "data.sampler=uniform: each image once an epoch")
    return [f"classes ({len(names)}, in index order, with their {what}): {', '.join(shown)}",
            f"sampling: {sampler}; loss: {weights_said(cfg, names, loss)}",
            f"augmentation: {augmentation_said(cfg.data)}"]


def weights_said(cfg: Config, names: list[str], loss: Loss) -> str:
    """The class weights (and logit adjustment) the loss applies, in words."""
    weight = loss.weight if isinstance(loss, ImbalancedCrossEntropy) else None
    if weight is None:
        said = "no class weights"
    else:
        values = [f"{name} {float(w):.3g}" for name, w in zip(names[:CLASSES_SHOWN], weight)]
        more = f", ... ({len(names) - CLASSES_SHOWN} more)" if len(names) > CLASSES_SHOWN else ""
        start = f", from epoch {loss.from_epoch}" if loss.from_epoch else ""
        said = f"class weights (train.class_weights={cfg.train.class_weights}{start}): {', '.join(values)}{more}"
    return said + (f", logit adjustment tau {cfg.train.logit_adjustment:g}" if cfg.train.logit_adjustment else "")


def augmentation_said(cfg: DataConfig) -> str:
    """Which training augmentation runs: the user's albumentations file (in place of the preset's keys) or the
    preset's values, then every step that runs after either (the policy, erasing, mixing), so none is unsaid."""
    if not cfg.augment:
        said = "none (data.augment=false: the eval preset's resize and centre crop)"
    elif cfg.train_transform:
        said = (f"the albumentations file data.train_transform={cfg.train_transform}, in place of the preset's "
                f"{', '.join(f'data.{key}' for key in REPLACED_KEYS)}")
    else:
        jitter = f", color_jitter {cfg.color_jitter:g}" if cfg.color_jitter else ""
        said = f"the preset: random resized crop scale {cfg.scale} ratio {cfg.ratio}, hflip {cfg.hflip:g}{jitter}"
    return said + "".join(f"; {step}" for step in after_crop_said(cfg))


def after_crop_said(cfg: DataConfig) -> list[str]:
    """The augmentation keys applied after the crop (file or preset) that are on, as `data.key value`: the policy
    and erasing only with data.augment (data/transforms.tensor_augment), mixing on the batch always."""
    steps = [f"data.auto_augment {cfg.auto_augment}" if cfg.augment and cfg.auto_augment else "",
             f"data.random_erase {cfg.random_erase:g}" if cfg.augment and cfg.random_erase else "",
             f"data.mixup_alpha {cfg.mixup_alpha:g}" if cfg.mixup_alpha else "",
             f"data.cutmix_alpha {cfg.cutmix_alpha:g}" if cfg.cutmix_alpha else ""]
    return [step for step in steps if step]
