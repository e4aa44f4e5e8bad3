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
import logging
import random
import uuid
from pathlib import Path

import numpy as np
import torch
from torch import nn

from core.startup import cpu_share, import_timm_without_wandb, tune_cpu_process

import_timm_without_wandb()  # first: the imports below reach timm, which would import wandb (core/startup.py)

from core.cli import run_main
from core.config import (Config, ModelConfig, best_metric, config_yaml, given_keys, keys_help, lower_is_better, mixing,
                         replace_section, to_dict)
from core.config_load import load_config
from core.dist import (DistInfo, broadcast_object, broadcast_tensors, init_distributed, is_fsdp, rank0_decides,
                       read_launch_env, replicated_tensors)
from core.errors import UserError
from core.logs import setup_logging
from core.signals import Preempted
from data.loader import DataBundle, build_data, skipped_train_images, steps_per_epoch
from data.mixing import BatchMix
from data.transforms import DeviceNormalize
from engine.checkpoint.resume import Resume
from engine.checkpoint.run_dir import FolderLock, RunRecord, check_writable, locked
from engine.checkpoint.saver import Checkpointer
from engine.checkpoint.weights import check_pretrained, resolve_preprocessing
from engine.distill import build_distillation, check_teacher_needed, freeze_teacher, read_teacher, teacher_sha256
from engine.evaluation import validate_epoch
from engine.hooks import EmaUpdate, IntervalTracking, StepCheckpoint
from engine.losses import build_loss, class_weights
from engine.optim import (build_optimizer, build_scheduler, check_optimizer, check_scheduler, scaled_lr_note,
                          with_global_batch, with_scaled_lr)
from engine.precision import Precision, resolve_precision
from engine.profiling import ProfileSteps, window_warnings
from engine.speed import InputAdvice
from engine.state import TrainState
from engine.tracking import TensorBoardWriter, WandbTracker
from engine.trainer import LoopConfig, TrainParts, train_one_epoch
from models.ema import create_ema
from models.factory import check_model_name, compile_warning, create_model, prepare_model
from models.parallel import shard_for_training, wrap_for_training

log = logging.getLogger("train")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, epilog=keys_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/digits.yaml",
                        help="YAML file, or a bare name looked up in configs/ (default: digits)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (defaults, then --config, then overrides) and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="make every check a run makes before training (config, resume checkpoint, data folders "
                             "and classes, model, output_dir writable), write nothing, and exit")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for user errors")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. optim.lr=0.2 train.epochs=3")
    return parser.parse_args(argv)


def start_up(cfg: Config, info: DistInfo) -> tuple[Config, Resume, DataBundle, Precision, nn.Module]:
    """What fit() checks and builds before anything is placed on the device: the checkpoint to resume, the
    preprocessing (unset keys resolved: resumed, the weights', or defaults), optim.lr from optim.lr_base, the data,
    the precision, the model with its starting weights (resumed, or model.init_from's through timm's loading).
    --dry-run stops after it."""
    check_optimizer(cfg.optim)
    start = Resume.find(cfg.resume, Path(cfg.output_dir))
    pretrained = start.pretrained(cfg.model)
    cfg = resolve_preprocessing(cfg, pretrained, start.ckpt["config"] if start.ckpt else None)
    cfg = with_global_batch(cfg, info.world_size)
    cfg = with_scaled_lr(cfg, info.world_size)  # after resolve_preprocessing, which reads the keys the user set
    seed_everything(cfg.seed)
    data = build_data(cfg.data, cfg.train.batch_size, cfg.seed, info)
    updates = steps_per_epoch(data.train, cfg.train.accum_steps)
    steps = start.step_range(cfg.train.epochs, updates, cfg.train.max_steps)
    for warning in (check_scheduler(cfg.sched, cfg.train.epochs, updates)
                    + window_warnings(cfg.logging.profile_steps, *steps)):
        if info.is_main:
            log.warning(warning)
    precision = resolve_precision(cfg.amp, info.device)
    if cfg.dist.strategy == "fsdp" and precision.scaler is not None:  # amp=fp16 itself: core/config_checks.py
        raise UserError(f"amp={cfg.amp} chose fp16 on this GPU, which dist.strategy=fsdp cannot use (the GradScaler "
                        "would see only each process's shard of the gradients); use amp=off, or dist.strategy=ddp")
    if pretrained is None:
        model = create_model(cfg.model, data.num_classes)
    else:
        model = create_model(cfg.model, data.num_classes, pretrained.state_dict, pretrained.source)
        check_pretrained(model, pretrained)
    start.load_model(model, cfg, data.class_names, info.world_size)
    class_weights(cfg.train.class_weights, data.class_counts, data.class_names)  # checked before anything is written
    return cfg, start, data, precision, model


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
            f"{resumed}; {out} is writable; nothing was written")


def seed_everything(seed: int) -> None:
    """Same seed on every rank, so models start identical (DDP also broadcasts rank 0's weights)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def fit(cfg: Config, info: DistInfo, lock: FolderLock | None = None) -> TrainState:
    """The run; `lock`: rank 0's lock on output_dir (main holds it), checked before each write there."""
    out = Path(cfg.output_dir)
    cfg, start, data, precision, model = start_up(cfg, info)
    cfg, teacher = load_teacher(cfg, start, model, data.num_classes)
    if cfg.optim.lr_base and info.is_main:
        log.info(scaled_lr_note(cfg, info.world_size))
    model = prepare_model(model, cfg.model, info.device, info.world_size)
    distill = build_distillation(cfg.distill, *teacher, model, cfg.data.mean, cfg.data.std, info.device,
                                 cfg.model.channels_last) if teacher else None
    ema = create_ema(model, cfg.model.ema_decay, cfg.model.ema_warmup)
    start.load_ema(ema.module if ema is not None else None)
    if cfg.dist.strategy == "fsdp":
        shard_for_training(model, ema.module if ema is not None else None, precision.dtype, info.world_size)
    torch.manual_seed(cfg.seed + info.rank)  # dropout / drop-path differ per rank, reproducibly
    if info.device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    optimizer = build_optimizer(model, cfg.optim, grad_scaler=precision.scaler is not None, sharded=is_fsdp(model))
    updates_per_epoch = steps_per_epoch(data.train, cfg.train.accum_steps)
    if (warning := compile_warning(cfg.model, info.world_size)) and info.is_main:
        log.warning(warning)
    parts = TrainParts(wrap_for_training(model, info.device, info.world_size, cfg.model.compile), optimizer,
                       build_scheduler(optimizer, cfg.sched, cfg.train.epochs, updates_per_epoch),
                       build_loss(cfg.train, mixing(cfg.data),
                                  class_weights(cfg.train.class_weights, data.class_counts, data.class_names)),
                       precision, distill)
    state = TrainState()
    start.load_training(state, cfg, info, updates_per_epoch, model=parts.model, optimizer=optimizer,
                        scheduler=parts.scheduler, scaler=precision.scaler)
    normalize = DeviceNormalize(cfg.data.mean, cfg.data.std, info.device, cfg.model.channels_last)
    total_steps = cfg.train.epochs * updates_per_epoch
    loop = LoopConfig(normalize=normalize, accum_steps=cfg.train.accum_steps, clip_grad=cfg.optim.clip_grad,
                      max_steps=cfg.train.max_steps, log_interval=cfg.logging.interval,
                      show_progress=cfg.logging.progress, max_nonfinite=cfg.train.max_nonfinite,
                      total_steps=min(total_steps, cfg.train.max_steps or total_steps),
                      mix=BatchMix(data.num_classes, cfg.train.label_smoothing) if mixing(cfg.data) else None,
                      clip_mode=cfg.optim.clip_mode, multi_label=cfg.data.multi_label,
                      fsdp_accum_whole=cfg.dist.fsdp_accum_whole and is_fsdp(model) and cfg.train.accum_steps > 1)
    global_batch = cfg.train.batch_size * info.world_size * cfg.train.accum_steps
    log.info("model %s (%.1fM params), %d process(es) on %s, %s, global batch %d, %d steps/epoch",
             cfg.model.name, sum(p.numel() for p in model.parameters()) / 1e6, info.world_size,
             info.device.type, precision.name, global_batch, updates_per_epoch)
    chosen_on = best_metric(cfg)  # the metrics.jsonl column best.pth follows
    tracker = WandbTracker(cfg.logging, info.is_main)  # W&B on rank 0; never raises
    tracker.start({**to_dict(cfg), "world_size": info.world_size}, out, resume_id=start.wandb_id)
    checkpointer = Checkpointer(out, info, cfg.train.keep_last_k, model=model, optimizer=optimizer,
                                scheduler=parts.scheduler, scaler=precision.scaler, config=to_dict(cfg),
                                class_names=data.class_names, ema=ema.module if ema is not None else None,
                                wandb_id=tracker.run_id or start.wandb_id,  # kept for a resume with tracking on
                                best_metric=chosen_on, sharded=cfg.train.ckpt_format == "sharded",
                                async_save=cfg.train.async_save, lock=lock,
                                run_id=start.run_id or broadcast_object(uuid.uuid4().hex))  # a fresh run's: rank 0's
    # Nothing in output_dir changes before the run's first write (record.start): a run that fails to
    # start leaves the previous run's config.yaml, metrics.jsonl and checkpoints as they were.
    record = RunRecord(out, to_dict(cfg), first_epoch=state.epoch, lock=lock)
    board = TensorBoardWriter(cfg.logging, info.is_main)  # TensorBoard on rank 0; never raises
    board.start({**to_dict(cfg), "world_size": info.world_size}, out, state.global_step, lambda: record.started)
    sinks = [tracker, board]
    if state.global_step == 0:
        tracker.log_samples(data.train.dataset, cfg.logging.wandb_samples)
    step_checkpoint = StepCheckpoint(record, checkpointer, cfg.train.ckpt_every_steps)
    profile = (ProfileSteps(cfg.logging.profile_steps, out / "profile", info.device, record, info.is_main, state)
               if cfg.logging.profile_steps else None)  # off: no hook, torch.profiler never starts
    hooks = [*([EmaUpdate(ema, model)] if ema is not None else []),  # before the checkpoint that saves it
             step_checkpoint, IntervalTracking(sinks), *([profile] if profile else [])]
    input_advice = InputAdvice(cfg.data, cpu_share(info.local_world_size), info.is_main)

    try:  # close(): however the run ends, its last checkpoint write (train.async_save) finishes first
        while state.epoch < cfg.train.epochs and not stop_before_epoch(cfg, state, chosen_on, tracker):
            data.train.sampler.set_epoch(state.epoch, start=state.samples_done(
                cfg.train.accum_steps, cfg.train.batch_size, len(data.train)))
            try:
                train_stats = train_one_epoch(parts, data.train, state, loop, info, hooks)
            except Preempted as stopped:  # SIGTERM or SIGUSR1: every rank stopped after the same step
                step_checkpoint.save(state)  # mid-epoch: resume=auto continues the epoch where it stopped
                checkpointer.wait()
                stopped.checkpoint = checkpointer.last
                raise
            input_advice.after_epoch(state.epoch, train_stats)
            if is_fsdp(model):  # DDP broadcasts rank 0's buffers (BatchNorm statistics) at each forward; FSDP never
                broadcast_tensors(replicated_tensors(model))
            row = {"epoch": state.epoch, **train_stats,
                   **validate_epoch(parts.model, ema.module if ema is not None else None, data.val, precision, info,
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
                    sink.log_epoch(state.global_step, row, state.best_top1)
                log.info(epoch_line(row))
            checkpointer.save(state, val_top1=row[chosen_on], best=is_best, epoch_file=finished)
            if is_best and tracker.logs_checkpoints and checkpointer.written():  # a model version per best.pth,
                # so a preempted run keeps its best model in W&B
                tracker.log_checkpoint(out / "best.pth", {"epoch": row["epoch"], "global_step": state.global_step,
                                                          "val_top1": state.best_top1, "model": cfg.model.name})
        checkpointer.wait()  # every rank learns that the last write worked
        if profile is not None:  # the run ended inside the profiled steps: write what it recorded
            profile.finish(state.global_step)
        for sink in sinks:
            sink.finish()
    finally:
        checkpointer.close()
    log.info("done: best %s %.2f, outputs in %s", chosen_on, state.best_top1, out)
    return state


def stop_before_epoch(cfg: Config, state: TrainState, chosen_on: str, tracker: WandbTracker) -> bool:
    """train.max_steps reached, or train.early_stop_patience run out (checked before each epoch, so that a resumed
    run stops alike); says why on rank 0."""
    if cfg.train.max_steps and state.global_step >= cfg.train.max_steps:
        log.info("stopping at train.max_steps=%d", cfg.train.max_steps)
        return True
    patience = cfg.train.early_stop_patience
    if patience and state.epochs_without_best >= patience:
        log.info("stopping early before epoch %d: %s has not improved for %d epochs (train.early_stop_patience="
                 "%d); best %s %.4f", state.epoch, chosen_on, state.epochs_without_best, patience, chosen_on,
                 state.best_top1)
        tracker.summary({"early_stopped_before_epoch": state.epoch})
        return True
    return False


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


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        if read_launch_env()[0] == 0:
            print(config_yaml(cfg), end="")
        return 0
    setup_logging(read_launch_env()[0], cfg.logging.level)  # before the rendezvous, which may wait
    info = init_distributed(cfg.dist.backend, cfg.dist.timeout_s, cfg.dist.rendezvous_timeout_s)
    if info.device.type == "cpu":
        tune_cpu_process(cpu_share(info.local_world_size))
    if args.dry_run:
        summary = dry_run(cfg, info)
        if info.is_main:
            print(summary)
        return 0
    with locked(Path(cfg.output_dir)) as lock:  # one live run per output_dir
        fit(cfg, info, lock)  # report_errors leaves the process group, after reporting any error
    return 0


if __name__ == "__main__":
    run_main(main, after_sigterm="with resume=auto the same command continues from the last checkpoint in "
                               "output_dir")
