"""Train a timm image classifier, one process per device, with DDP.

    python train.py --config configs/digits.yaml                       # one process
    torchrun --nproc_per_node=N train.py --config resnet50 optim.lr=0.2  # N processes, overrides

Everything the run does is in `fit`: find the checkpoint to resume (resume=auto: <output_dir>/last.pth),
build data, model, optimizer; then per epoch train, evaluate, write metrics.jsonl and checkpoints
(rank 0 writes, every rank joins the collectives). `main` holds output_dir's lock while `fit` runs, and
nothing in output_dir changes before the run's first write (engine/checkpoint/run_dir.py).
"""

from __future__ import annotations

if __name__ == "__main__":  # first: a SIGTERM or SIGUSR1 during the imports below (seconds) gets handled
    from core.signals import handle_early

    handle_early()

import argparse
import copy
import dataclasses
import logging
import random
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from core.startup import cpu_share, import_timm_without_wandb, training_kernels, tune_cpu_process

import_timm_without_wandb()  # first: the imports below reach timm, which would import wandb (core/startup.py)

from core.cli import parse_with_overrides, run_main
from core.config import (Config, ModelConfig, best_metric, command_line_keys, config_yaml, given_keys, keys_help,
                         lower_is_better, mixing, replace_keys, replace_section, run_values, to_dict)
from core.config_load import load_config
from core.dist import (DistInfo, all_gather_object, broadcast_object, broadcast_tensors, init_distributed, is_fsdp,
                       main_first, min_over_ranks, rank0_decides, read_launch_env, replicated_tensors)
from core.errors import UserError
from core.logs import run_summary, setup_logging
from core.signals import Preempted
from data.loader import (DataBundle, build_data, dropped_images_note, skipped_train_images, steps_per_epoch,
                         with_batch_size)
from data.erasing import NormalizedFill
from data.mixing import BatchMix
from data.transforms import DeviceNormalize
from engine.batch_size import (CPU_BATCH, MAX_BATCH, UNIT, largest_batch, on_device_fits, resolved_batch,
                                whole_groups)
from engine.checkpoint.resume import Resume, config_changes
from engine.checkpoint.run_dir import (FolderLock, RunRecord, check_shared, check_writable, continue_with, locked,
                                      resolve_output_dir)
from engine.checkpoint.saver import Checkpointer
from engine.checkpoint.weights import Pretrained, check_pretrained, resolve_preprocessing
from engine.distill import build_distillation, check_teacher_needed, freeze_teacher, read_teacher, teacher_sha256
from engine.evaluation import validate_epoch, validation_precision
from engine.hooks import EmaUpdate, IntervalTracking, StepCheckpoint
from engine.losses import build_loss, heavy_weight_warning, set_loss_epoch
from engine.lr_find import LABEL as LR_RULE_LABEL, range_test, write_results
from engine.optim import (build_optimizer, build_scheduler, check_optimizer, check_scheduler, with_batch_and_lr,
                          with_scaled_lr)
from engine.precision import Precision, resolve_precision
from engine.profiling import FOLDER as PROFILE_FOLDER, ProfileSteps, check_trace_folder, window_warnings
from engine.speed import InputAdvice
from engine.state import TrainState
from engine.tracking import TensorBoardWriter, WandbTracker
from engine.trainer import LoopConfig, TrainParts, train_one_epoch
from models.ema import create_ema
from models.factory import (check_model_name, compile_warning, create_model, hub_origin, prepare_model,
                            pretrained_cfg_of)
from models.parallel import shard_for_training, wrap_for_training

log = logging.getLogger("train")


USAGE = """Train a timm image classifier: one process, or one per GPU under torchrun.

    python train.py --config finetune data.root=photos            # your photos: photos/{train,val}/<class>/*
    python train.py --config digits                               # the quickstart (no download)
    torchrun --nproc_per_node=8 train.py --config resnet50 data.root=/data/imagenet
"""
QUICKSTART = "configs/digits.yaml"  # --config's default: the quickstart's own data and 32 px settings


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=USAGE, epilog=keys_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None,
                        help="YAML file, or a bare name looked up in configs/ (finetune, digits, resnet50, ...; "
                             "default: digits, the quickstart)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (defaults, then --config, then overrides) and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="make every check a run makes before training (config, resume checkpoint, data folders "
                             "and classes, model, output_dir writable), write nothing, and exit")
    parser.add_argument("--find-lr", action="store_true",
                        help="run an LR range test (tune.lr_min to tune.lr_max over tune.steps steps) on a fresh "
                             "model, write lr_find.json and lr_find.png with a suggested optim.lr to output_dir, "
                             "and exit: no checkpoint is written or read (docs/tuning.md)")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for user errors")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="e.g. optim.lr=0.2 train.epochs=3 (or --optim.lr=0.2, --optim.lr 0.2), anywhere among the "
                             "flags")
    return parse_with_overrides(parser, argv)


def config_file(given: str | None, overrides: list[str]) -> str:
    """--config, or the quickstart's; other data without --config is refused in one line: the digits config's
    32 px and mean/std 0.5 would silently apply to the user's photos."""
    if given is not None:
        return given
    data = [item.split("=", 1)[0] for item in overrides if item.split("=", 1)[0] in ("data.root", "data.name")]
    if data:
        raise UserError(f"{' and '.join(data)} given without --config, whose default is the digits quickstart (32 px, "
                        "its own mean/std); for your own images add --config finetune (a pretrained model at 224 px) "
                        "or another config from configs/")
    return QUICKSTART


def start_up(cfg: Config, info: DistInfo,
             fresh: bool = False) -> tuple[Config, Resume, DataBundle, Precision, nn.Module]:
    """What fit() checks and builds before anything is placed on the device: the checkpoint to resume and the config
    resolved against it (resolve_start), then the data, the precision, the model with its starting weights (resumed,
    model.init_from's through timm's loading, or timm's pretrained weights) and train.batch_size=auto's batch.
    --dry-run stops after it. `fresh` (--find-lr): from a new model whatever output_dir and resume say."""
    cfg, start, weights = resolve_start(cfg, info, fresh)
    cfg, data, precision, model = build_start(cfg, start, weights, info)
    return cfg, start, data, precision, model


def resolve_start(cfg: Config, info: DistInfo, fresh: bool = False) -> tuple[Config, Resume, StartingWeights]:
    """The checkpoint to resume (resume=auto: only the folder's own run, Resume.check_continuation), model.init_from's
    weights, and the config with the preprocessing (unset keys: resumed, the weights', or defaults), the batch per
    process from train.global_batch_size and optim.lr from optim.lr_base resolved (train.batch_size=auto: later,
    once the model is built)."""
    check_optimizer(cfg.optim)
    if cfg.logging.profile_steps:
        rank0_decides(lambda: check_trace_folder(Path(cfg.output_dir)))
    start = Resume(None, None) if fresh else Resume.find(cfg.resume, Path(cfg.output_dir))
    pretrained = start.pretrained(cfg.model)
    hub_cfg = None if start.ckpt else rank0_decides(lambda: pretrained_cfg_of(cfg.model))  # model.pretrained=true
    cfg = resolve_preprocessing(cfg, pretrained, start.ckpt["config"] if start.ckpt else None, hub_cfg)
    cfg = with_batch_and_lr(cfg, info.world_size)  # after resolve_preprocessing, which reads the keys the user set
    start.check_continuation(cfg)
    return cfg, start, StartingWeights(pretrained, hub_cfg)


@dataclasses.dataclass
class StartingWeights:
    """Where a fresh run's weights come from: model.init_from's file, or (model.pretrained) timm's weights' config."""

    pretrained: Pretrained | None = None
    hub_cfg: dict | None = None


def build_start(cfg: Config, start: Resume, weights: StartingWeights,
                info: DistInfo) -> tuple[Config, DataBundle, Precision, nn.Module]:
    """The data, the precision and the model with its starting weights, checked against the resumed checkpoint; the
    config with train.batch_size=auto's batch found."""
    pretrained, hub_cfg = weights.pretrained, weights.hub_cfg
    auto_batch = cfg.train.batch_size == "auto"  # found once the model is built: with_auto_batch
    seed_everything(cfg.seed)
    if auto_batch:  # loaders of UNIT images only count this rank's share: draws per group wait for the batch
        data = build_data(dataclasses.replace(cfg.data, mix_mode="pair"), UNIT, cfg.seed, info)
    else:
        data = build_data(cfg.data, cfg.train.batch_size, cfg.seed, info, cfg.train.accum_steps)
    precision = resolve_precision(cfg.amp, info.device, cfg.loss_scale)
    if cfg.dist.strategy == "fsdp" and precision.scaler is not None:  # amp=fp16 itself: core/config_checks.py
        raise UserError(f"amp={cfg.amp} chose fp16 on this GPU, which dist.strategy=fsdp cannot use (the GradScaler "
                        "would see only each process's shard of the gradients); use amp=off, or dist.strategy=ddp")
    if hub_cfg is not None:  # rank 0 fills the Hugging Face cache, the others read it
        model = main_first(lambda: create_model(cfg.model, data.num_classes, from_hub=True))
        log.info("model.pretrained: the weights of %s (%s) from the Hugging Face cache%s", cfg.model.name,
                 hub_cfg.get("hf_hub_id") or hub_cfg.get("url"), "" if hub_cfg.get("num_classes") == data.num_classes
                 else f"; classifier freshly initialised for {data.num_classes} classes")
    elif pretrained is None:
        model = create_model(cfg.model, data.num_classes)
    else:
        model = create_model(cfg.model, data.num_classes, pretrained.state_dict, pretrained.source)
        check_pretrained(model, pretrained)
    if auto_batch:
        cfg, data = with_auto_batch(cfg, data, model, precision, info)
    per_epoch = steps_per_epoch(data.train, cfg.train.accum_steps, cfg.train.drop_last_accum)
    steps = start.step_range(cfg.train.epochs, per_epoch, cfg.train.max_steps)
    for warning in (check_scheduler(cfg.sched, cfg.train.epochs, per_epoch)
                    + window_warnings(cfg.logging.profile_steps, *steps)):
        if info.is_main:
            log.warning(warning)
    if info.is_main and (note := dropped_images_note(data.train, info.world_size, cfg.train.accum_steps,
                                                     cfg.train.drop_last_accum)):
        log.log(*note)
    start.load_model(model, cfg, data.class_names, info.world_size)
    loss = build_loss(cfg.train, mixing(cfg.data), data.class_counts, data.class_names)  # checked before any write
    global_batch = cfg.train.batch_size * info.world_size * cfg.train.accum_steps
    if info.is_main and (warning := heavy_weight_warning(loss, data.class_names, global_batch)):
        log.warning(warning)
    return cfg, data, precision, model


def with_auto_batch(cfg: Config, data: DataBundle, model: nn.Module, precision: Precision,
                    info: DistInfo) -> tuple[Config, DataBundle]:
    """train.batch_size=auto: the largest batch every rank fits (engine/batch_size.py), train.accum_steps for
    train.global_batch_size, optim.lr from optim.lr_base, and the loaders rebuilt for that batch."""
    cap = len(data.train.sampler)  # this rank's training images: no batch may be larger
    if info.device.type == "cuda":
        probe = prepare_model(copy.deepcopy(model), cfg.model, info.device, world_size=1)
        optimizer = build_optimizer(probe, cfg.optim, grad_scaler=precision.scaler is not None)
        fits = on_device_fits(probe, optimizer, precision, cfg.data.img_size, data.num_classes,
                              cfg.model.channels_last)
        largest = largest_batch(fits, min(cap, MAX_BATCH))
        del probe, optimizer, fits
        torch.cuda.empty_cache()
        how = f"the largest {precision.name} training step that fits on every GPU"
    else:
        largest = largest_batch(lambda batch: batch <= CPU_BATCH, cap)
        how = (f"{CPU_BATCH} on the CPU, where host memory is not the limit and the speed per image hardly changes "
               "with the batch; set train.batch_size to choose")
    largest = min_over_ranks(largest, info.device)
    if mixing(cfg.data) and cfg.data.mix_mode == "batch" and cfg.data.mix_group:  # each batch whole draws
        largest = whole_groups(largest, cfg.data.mix_group)
    if not largest:
        raise UserError(f"train.batch_size=auto: not even a batch of {UNIT} fits ({cfg.model.name} at "
                        f"data.img_size {cfg.data.img_size}, amp={cfg.amp}); lower data.img_size, set "
                        "model.grad_checkpointing=true, or use a smaller model", all_ranks=True)
    cfg = replace_section(cfg, "train", **resolved_batch(cfg.train, largest, info.world_size, mixing(cfg.data),
                                                         "train.accum_steps" in command_line_keys(cfg)))
    cfg = with_scaled_lr(cfg, info.world_size)
    if info.is_main:
        log.info("train.batch_size=auto: %d per process (%s)%s", cfg.train.batch_size, how,
                 f", x train.accum_steps={cfg.train.accum_steps} for train.global_batch_size="
                 f"{cfg.train.global_batch_size}" if cfg.train.global_batch_size else "")
    return cfg, with_batch_size(data, cfg.data, cfg.train.batch_size, cfg.seed, info, cfg.train.accum_steps)


def load_teacher(cfg: Config, start: Resume, model: nn.Module, num_classes: int) -> tuple[Config, tuple | None]:
    """distill.*: (cfg with distill.teacher_sha256 recorded, (teacher model frozen with its file's weights, the
    file, its model name)); (cfg, None) without a teacher. engine/distill.py says what the teacher does."""
    check_teacher_needed(cfg.distill, model, cfg.model.name)
    if not cfg.distill.teacher_weights:
        return cfg, None
    pretrained, name = read_teacher(cfg.distill)
    digest = teacher_sha256(cfg.distill, "distill.teacher_sha256" in given_keys(cfg),
                            start.ckpt["config"] if start.ckpt else None)
    check_model_name(name, key="distill.teacher_name")
    teacher = freeze_teacher(create_model(ModelConfig(name=name, kwargs=cfg.distill.teacher_kwargs), num_classes),
                             pretrained, name)
    return replace_section(cfg, "distill", teacher_sha256=digest), (teacher, pretrained, name)


def dry_run(cfg: Config, info: DistInfo) -> str:
    """fit()'s checks up to the first training step, with nothing written to output_dir; returns a summary."""
    out = Path(cfg.output_dir)
    cfg, start, data, _, model = start_up(cfg, info)
    cfg, teacher = load_teacher(cfg, start, model, data.num_classes)
    rank0_decides(lambda: check_writable(out))
    resumed = f"resumes {start.path}" if start.path else "starts fresh"
    taught = f", distilled from {teacher[2]} ({cfg.distill.type})" if teacher else ""
    return (f"dry run passed: {cfg.model.name}{taught} on {len(data.train.dataset)} train / {len(data.val.dataset)} "
            f"val images, {data.num_classes} classes{', multi-label' if cfg.data.multi_label else ''}; the run "
            f"{resumed}; {out} is writable; nothing was written\nthe run uses: {run_values(cfg, info.world_size)}")


def find_lr(cfg: Config, info: DistInfo) -> dict:
    """--find-lr: the LR range test on the run's data, fresh model, optimizer, precision and loss (never a checkpoint
    of output_dir, which it leaves as it is); rank 0 writes lr_find.json and lr_find.png to output_dir."""
    cfg, start, data, precision, model = start_up(cfg, info, fresh=True)
    cfg, teacher = load_teacher(cfg, start, model, data.num_classes)
    model = prepare_model(model, cfg.model, info.device, info.world_size)
    parts, loop, _ = build_parts(cfg, info, data, precision, model, teacher, start=None)
    result = {**range_test(parts, data.train, loop, info, cfg.tune), "world_size": info.world_size,
              "batch_size": cfg.train.batch_size, "accum_steps": cfg.train.accum_steps}
    rank0_decides(lambda: write_results(result, Path(cfg.output_dir)))  # every rank learns whether it could
    if info.is_main:
        log.info("LR range test: %d steps (%s); suggested optim.lr %.3g (%s; its steepest descent at lr %.3g); "
                 "lr_find.json and lr_find.png in %s", result["steps"], result["stopped"], result["suggested_lr"],
                 LR_RULE_LABEL, result["steepest_lr"], cfg.output_dir)
    return result


def seed_everything(seed: int) -> None:
    """Same seed on every rank, so models start identical (DDP also broadcasts rank 0's weights)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def fit(cfg: Config, info: DistInfo, lock: FolderLock | None = None) -> TrainState | None:
    """The run; `lock`: rank 0's lock on output_dir (main holds it), checked before each write there."""
    out, started = Path(cfg.output_dir), time.monotonic()
    cfg, start, weights = resolve_start(cfg, info)
    if (reason := finished_reason(cfg, start.ckpt)) is not None:
        log.info("the run in %s is finished (%s): nothing was trained or written; raise train.epochs (or "
                 "train.max_steps, train.early_stop_patience) to continue it, or use another output_dir for a new run",
                 start.path.parent, reason)  # the checkpoint's folder: output_dir, unless resume=<path> names another
        return None
    cfg, data, precision, model = build_start(cfg, start, weights, info)
    cfg, teacher = load_teacher(cfg, start, model, data.num_classes)
    model = prepare_model(model, cfg.model, info.device, info.world_size)
    parts, loop, ema = build_parts(cfg, info, data, precision, model, teacher, start)
    optimizer, normalize = parts.optimizer, loop.normalize
    updates_per_epoch = steps_per_epoch(data.train, cfg.train.accum_steps, cfg.train.drop_last_accum)
    state = TrainState()
    start.load_training(state, cfg, info, updates_per_epoch, model=parts.model, optimizer=optimizer,
                        scheduler=parts.scheduler, scaler=precision.scaler)
    global_batch = cfg.train.batch_size * info.world_size * cfg.train.accum_steps
    measured = resolve_precision(cfg.eval_amp, info.device, key="eval_amp")  # every reported number's precision
    log.info("model %s (%.1fM params), %d process(es) on %s, training in %s, validating in %s, global batch %d, "
             "%d steps/epoch", cfg.model.name, sum(p.numel() for p in model.parameters()) / 1e6, info.world_size,
             info.device.type, precision.name, validation_precision(measured, precision, model), global_batch,
             updates_per_epoch)
    chosen_on = best_metric(cfg)  # the metrics.jsonl column best.pth follows
    tracker = WandbTracker(cfg.logging, info.is_main)  # W&B on rank 0; never raises
    tracker.start({**to_dict(cfg), "world_size": info.world_size}, out, resume_id=start.wandb_id)
    checkpointer = Checkpointer(out, info, cfg.train.keep_last_k, model=model, optimizer=optimizer,
                                scheduler=parts.scheduler, scaler=precision.scaler, config=to_dict(cfg),
                                class_names=data.class_names, ema=ema.module if ema is not None else None,
                                wandb_id=tracker.run_id or start.wandb_id,  # kept for a resume with tracking on
                                best_metric=chosen_on, sharded=cfg.train.ckpt_format == "sharded",
                                async_save=cfg.train.async_save, lock=lock,
                                run_id=start.run_id or broadcast_object(uuid.uuid4().hex),  # a fresh run's: rank 0's
                                data_sizes=data.sizes(), started_from=start.started_from(
                                    weights.pretrained, hub_origin(cfg.model.name, weights.hub_cfg)))  # model card
    # Nothing in output_dir changes before the run's first write (record.start): a run that fails to
    # start leaves the previous run's config.yaml, metrics.jsonl and checkpoints as they were.
    record = RunRecord(out, to_dict(cfg), first_epoch=state.epoch, lock=lock)
    board = TensorBoardWriter(cfg.logging, info.is_main)  # TensorBoard on rank 0; never raises
    board.start({**to_dict(cfg), "world_size": info.world_size}, out, state.global_step, lambda: record.started)
    sinks = [tracker, board]
    if state.global_step == 0:
        tracker.log_samples(data.train.dataset, cfg.logging.wandb_samples)
    step_checkpoint = StepCheckpoint(record, checkpointer, cfg.train.ckpt_every_steps)
    profile = (ProfileSteps(cfg.logging.profile_steps, out / PROFILE_FOLDER, info.device, record, info.is_main, state)
               if cfg.logging.profile_steps else None)  # off: no hook, torch.profiler never starts
    ema_hook = [EmaUpdate(ema, model, cfg.model.ema_reset_epochs)] if ema is not None else []
    hooks = [*ema_hook,  # before the checkpoint that saves it
             step_checkpoint, IntervalTracking(sinks), *([profile] if profile else [])]
    input_advice = InputAdvice(cfg.data, cpu_share(info.local_world_size), info.is_main)

    try:  # close(): however the run ends, its last checkpoint write (train.async_save) finishes first
        while state.epoch < cfg.train.epochs and not stop_before_epoch(cfg, state, chosen_on, tracker):
            state.set_loader_epoch(data.train, cfg.train.accum_steps)  # mid-epoch: past this rank's batches done
            set_loss_epoch(parts.loss_fn, state.epoch)  # train.class_weights_from_epoch
            try:
                train_stats = train_one_epoch(parts, data.train, state, loop, info, hooks)
            except Preempted as stopped:  # SIGTERM, SIGUSR1 or SIGINT: every rank stopped after the same step
                step_checkpoint.save(state)  # mid-epoch: resume=auto continues the epoch where it stopped
                checkpointer.wait()
                stopped.checkpoint, stopped.overrides = checkpointer.last, continue_with(cfg.output_dir, cfg.resume)
                raise
            input_advice.after_epoch(state.epoch, train_stats)
            if is_fsdp(model):  # DDP broadcasts rank 0's buffers (BatchNorm statistics) at each forward; FSDP never
                broadcast_tensors(replicated_tensors(model))
            row = {"epoch": state.epoch, **train_stats,
                   **validate_epoch(parts.model, ema.module if ema is not None else None, data.val, measured, info,
                                    normalize, cfg.data),
                   "lr": optimizer.param_groups[0]["lr"]}
            is_best = state.update_best(row[chosen_on], lower_is_better(chosen_on))
            finished = state.epoch_finished(updates_per_epoch)  # else max_steps stopped it: resume continues it
            if finished and cfg.data.skip_corrupt:
                row["skipped_images"] = skipped_train_images(data.train, info.world_size, train_stats["train_images"])
                if row["skipped_images"] and info.is_main:
                    log.warning("epoch %d: %d unreadable training image(s) skipped (data.skip_corrupt=true)",
                                state.epoch, row["skipped_images"])
            if finished:
                state.finish_epoch()
            record.append(row)
            if info.is_main:
                for sink in sinks:
                    sink.log_epoch(state.global_step, row, {chosen_on: state.best_value})
                log.info(epoch_line(row))
            checkpointer.save(state, metric_value=row[chosen_on], best=is_best, epoch_file=finished)
            if is_best and tracker.logs_checkpoints and checkpointer.written():  # a model version per best.pth,
                # so a preempted run keeps its best model in W&B
                tracker.log_checkpoint(out / "best.pth", {"epoch": row["epoch"], "global_step": state.global_step,
                                                          "best_metric": chosen_on, chosen_on: state.best_value,
                                                          "model": cfg.model.name})
        checkpointer.wait()  # every rank learns that the last write worked
        if profile is not None:  # the run ended inside the profiled steps: write what it recorded
            profile.finish(state.global_step)
        for sink in sinks:
            sink.finish()
    finally:
        checkpointer.close()
    if info.is_main:
        log.info(run_summary(record.rows(), chosen_on, state.best_value, state.best_epoch, time.monotonic() - started,
                             out))
    return state


def build_parts(cfg: Config, info: DistInfo, data: DataBundle, precision: Precision, model: nn.Module,
                teacher: tuple | None, start: Resume | None) -> tuple[TrainParts, LoopConfig, Any]:
    """The placed model's teacher and EMA (with `start`'s weights; no EMA without a `start`), the model sharded
    (dist.strategy=fsdp) and wrapped, its optimizer, schedule, loss and loop settings: (parts, loop, EMA or None).
    What fit() trains with, and what --find-lr's range test steps (engine/lr_find.py)."""
    distill = build_distillation(cfg.distill, *teacher, model, cfg.data.mean, cfg.data.std, info.device,
                                 cfg.model.channels_last) if teacher else None
    ema = None
    if start is not None:
        ema = create_ema(model, cfg.model.ema_decay, cfg.model.ema_warmup)
        start.load_ema(ema.module if ema is not None else None)
    if cfg.dist.strategy == "fsdp":
        shard_for_training(model, ema.module if ema is not None else None, precision.dtype, info.world_size,
                           cfg.dist.fsdp_shard_size)
    torch.manual_seed(cfg.seed + info.rank)  # dropout / drop-path differ per rank, reproducibly
    training_kernels(info.device.type)  # cuDNN's autotuning on CUDA, as benchmark.py times it
    optimizer = build_optimizer(model, cfg.optim, grad_scaler=precision.scaler is not None, sharded=is_fsdp(model))
    updates_per_epoch = steps_per_epoch(data.train, cfg.train.accum_steps, cfg.train.drop_last_accum)
    if (warning := compile_warning(cfg.model, info.world_size)) and info.is_main:
        log.warning(warning)
    parts = TrainParts(wrap_for_training(model, info.device, info.world_size, cfg.model.compile), optimizer,
                       build_scheduler(optimizer, cfg.sched, cfg.train.epochs, updates_per_epoch),
                       build_loss(cfg.train, mixing(cfg.data), data.class_counts, data.class_names),
                       precision, distill)
    normalize = DeviceNormalize(cfg.data.mean, cfg.data.std, info.device, cfg.model.channels_last)
    erasing = data.train.dataset.erasing  # data.random_erase_fill=normalized: boxes to fill after normalize
    total_steps = cfg.train.epochs * updates_per_epoch
    loop = LoopConfig(normalize=normalize, accum_steps=cfg.train.accum_steps, drop_last_accum=cfg.train.drop_last_accum,
                      clip_grad=cfg.optim.clip_grad,
                      max_steps=cfg.train.max_steps, log_interval=cfg.logging.interval,
                      show_progress=cfg.logging.progress, max_nonfinite=cfg.train.max_nonfinite,
                      total_steps=min(total_steps, cfg.train.max_steps or total_steps),
                      mix=BatchMix(data.num_classes, cfg.train.label_smoothing) if mixing(cfg.data) else None,
                      erase=NormalizedFill(cfg.data.random_erase_mode, info.device) if erasing else None,
                      clip_mode=cfg.optim.clip_mode, multi_label=cfg.data.multi_label,
                      fsdp_accum_whole=cfg.dist.fsdp_accum_whole and is_fsdp(model) and cfg.train.accum_steps > 1)
    return parts, loop, ema


def stop_before_epoch(cfg: Config, state: TrainState, chosen_on: str, tracker: WandbTracker) -> bool:
    """Whether the run stops before its next epoch (stop_reason); says why on rank 0, and keeps an early stop in
    the W&B summary."""
    reason = stop_reason(cfg, state, chosen_on)
    if reason is None:
        return False
    log.info(reason)
    if reason.startswith("stopping early"):
        tracker.summary({"early_stopped_before_epoch": state.epoch})
    return True


def stop_reason(cfg: Config, state: TrainState, chosen_on: str) -> str | None:
    """train.max_steps reached, or train.early_stop_patience run out (checked before each epoch, so that a resumed
    run stops alike); None: the run goes on."""
    if cfg.train.max_steps and state.global_step >= cfg.train.max_steps:
        return f"stopping at train.max_steps={cfg.train.max_steps}"
    patience = cfg.train.early_stop_patience
    if patience and state.epochs_without_best >= patience:
        return (f"stopping early before epoch {state.epoch}: {chosen_on} has not improved for "
                f"{state.epochs_without_best} epochs (train.early_stop_patience={patience}); best {chosen_on} "
                f"{state.best_value:.4f}")
    return None


def finished_reason(cfg: Config, ckpt: dict | None) -> str | None:
    """Why the resumed checkpoint's run has nothing left to train under cfg, so that starting a finished run again
    trains and writes nothing; None for a fresh run or one with work left."""
    if ckpt is None or (ckpt.get("config") or {}).get("model", {}).get("name") != cfg.model.name:
        return None  # (another model: build_start refuses the checkpoint with its own line)
    state, chosen_on = TrainState(), best_metric(cfg)
    state.load_state_dict(ckpt)
    if ckpt.get("best_metric", "val_top1") != chosen_on:
        state.forget_best()  # as Resume.load_training does: the best (and the epochs without it) start again
    if state.epoch >= cfg.train.epochs:
        return f"all {cfg.train.epochs} epochs of train.epochs done"
    return stop_reason(cfg, state, chosen_on)


def epoch_line(row: dict) -> str:
    """The log line of an epoch's metrics.jsonl row (multi-label: no top-1, mAP and F1 instead)."""
    if "val_map" in row:
        shown = (f"train_loss {row['train_loss']:.4f} | val_loss {row['val_loss']:.4f} val_map {row['val_map']:.2f} "
                 f"val_map_micro {row['val_map_micro']:.2f} val_f1 {row['val_f1']:.2f}")
    else:
        shown = (f"train_loss {row['train_loss']:.4f} train_top1 {row['train_top1']:.2f} | val_loss "
                 f"{row['val_loss']:.4f} val_top1 {row['val_top1']:.2f} val_top5 {row['val_top5']:.2f} "
                 f"bal_acc {row['val_balanced_acc']:.2f} macro_f1 {row['val_macro_f1']:.2f}")
    return f"epoch {row['epoch']}: {shown} | {row['train_img_per_s']:.0f} img/s, {row['epoch_time_s']:.1f}s"


def with_run_folder(cfg: Config) -> Config:
    """cfg with output_dir's placeholders resolved once for every rank (run_dir.resolve_output_dir), said on rank 0;
    config.yaml and the checkpoints keep the folder, so the run resumes there."""
    folder = resolve_output_dir(cfg.output_dir, cfg.model.name, cfg.resume)
    if folder != cfg.output_dir:
        log.info("output_dir %s: %s", cfg.output_dir, folder)
    return replace_keys(cfg, output_dir=folder)


def check_same_config(cfg: Config) -> None:
    """Every process trains the same resolved config: processes launched with other arguments or environment (a
    sweep agent per node, a script that varies by rank) would otherwise train a mix of runs as one."""
    configs = all_gather_object(to_dict(cfg))
    for rank, other in enumerate(configs):
        if other != configs[0]:
            differ = ", ".join(config_changes(configs[0], other))
            raise UserError(f"process {rank} has another config than process 0 ({differ}); launch every process with "
                            "the same arguments and environment (one W&B sweep agent per job, which starts torchrun)",
                            all_ranks=True)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cfg = load_config(config_file(args.config, args.overrides), args.overrides)
    if args.print_config:
        rank, world_size, *_ = read_launch_env()
        if rank == 0:  # the batch and lr for this launch's processes; preprocessing: --dry-run shows it
            print(f"# as {world_size} process(es) run it\n{config_yaml(with_batch_and_lr(cfg, world_size))}", end="")
        return 0
    setup_logging(read_launch_env()[0], cfg.logging.level)  # before the rendezvous, which may wait
    info = init_distributed(cfg.dist.backend, cfg.dist.timeout_s, cfg.dist.rendezvous_timeout_s)
    if info.device.type == "cpu":
        tune_cpu_process(cpu_share(info.local_world_size))
    cfg = with_run_folder(cfg)
    check_same_config(cfg)
    if args.dry_run:
        summary = dry_run(cfg, info)
        if info.is_main:
            print(summary)
        return 0
    with locked(Path(cfg.output_dir)) as lock:  # one live run per output_dir
        check_shared(Path(cfg.output_dir))  # every process writes into rank 0's folder: one folder for all
        if args.find_lr:
            find_lr(cfg, info)
            return 0
        fit(cfg, info, lock)  # report_errors leaves the process group, after reporting any error
    return 0


if __name__ == "__main__":
    run_main(main, after_sigterm="with resume=auto the same command continues from the last checkpoint in "
                               "output_dir")
