"""A run put together: start-up's config, data and model, the parts it trains with, its training state (resumed
or fresh) -- prepare(), which --dry-run runs too, writes nothing -- then its sinks, checkpointer and record, and the
hooks that do each side effect, in their order."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from torch import nn

from assembly.parts import build_parts
from assembly.start import build_start, load_teacher, resolve_start
from core.config import Config, global_batch, run_values, to_dict
from core.dist import DistInfo, broadcast_object, broadcast_tensors, is_fsdp, rank0_decides, replicated_tensors
from core.startup import cpu_share, threads_line
from data.loader import DataBundle, full_epoch_images
from data.pipeline import pipeline_copies
from engine.checkpoint.resume import Resume
from engine.checkpoint.run_dir import FolderLock, RunRecord, check_writable
from engine.checkpoint.saver import Checkpointer
from engine.evaluation import ImageOutcomes, validate_epoch, validation_precision
from engine.hooks import (BestArtifact, CloseEpoch, Curves, EmaUpdate, EpochCheckpoint, EpochEnd, EpochInputs,
                          FinishSinks, Hook, RecordRow, SkippedImages, StepCheckpoint, StopRules, Tracking,
                          ValidateEvery, ValidationErrors)
from engine.precision import Precision, run_precisions
from engine.profiling import FOLDER as PROFILE_FOLDER, ProfileSteps
from engine.speed import InputAdvice
from engine.state import TrainState, best_metric, finished_reason, lower_is_better
from engine.tracking import CONFUSION_CLASSES, TensorBoardWriter, WandbTracker
from engine.trainer import LoopConfig, TrainParts, train_columns
from models.factory import hub_origin, prepare_model

log = logging.getLogger(__name__)


@dataclass
class Run:
    """Everything fit() loops with; `hooks` in the order they are called."""

    cfg: Config
    info: DistInfo
    data: DataBundle
    parts: TrainParts
    loop: LoopConfig
    ema: Any
    state: TrainState
    measured: Precision  # eval_amp's: every reported number is computed in it
    chosen_on: str  # the metrics.jsonl column best.pth follows
    tracker: WandbTracker
    checkpointer: Checkpointer
    record: RunRecord
    hooks: list[Hook] = field(default_factory=list)
    step_checkpoint: StepCheckpoint = field(init=False)  # hooks_of's, with the other hooks: Run's methods call them
    stop_rules: StopRules = field(init=False)
    outcomes: Any = None  # the last validation's per-image outcomes, on rank 0 (wants_outcomes)
    started: float = field(default_factory=time.monotonic)

    def validate(self) -> dict[str, float]:
        """The epoch's validation columns, of the model and its EMA (the same numbers on every rank); with
        logging.wandb_errors, the model's per-image outcomes gathered to rank 0 for the ValidationErrors hook."""
        model = self.parts.model
        if is_fsdp(model):  # DDP broadcasts rank 0's buffers (BatchNorm statistics) at each forward; FSDP never
            broadcast_tensors(replicated_tensors(model))
        outcomes = ImageOutcomes(self.data.val.sampler.start) if self.wants_outcomes() else None
        row = validate_epoch(model, self.ema.module if self.ema is not None else None, self.data.val, self.measured,
                             self.info, self.loop.normalize, self.cfg.data, outcomes)
        self.outcomes = outcomes.gather(self.info.device) if outcomes is not None else None  # a collective
        return row

    def wants_outcomes(self) -> bool:
        """Whether validation gathers each image's outcome (W&B's error analysis, TensorBoard's confusion figure):
        decided from the config and the classes alone, the same on every rank (the gather is a collective)."""
        logging = self.cfg.logging
        board = logging.tensorboard and len(self.data.class_names) <= CONFUSION_CLASSES
        return (logging.wandb and logging.wandb_errors > 0 or board) and not self.cfg.data.multi_label

    def end_validation(self, state: TrainState, train: dict[str, float], finished: bool,
                       mid_epoch: bool = False) -> None:
        """Validate, then hand the row (train columns `train`, the validation's, the lr) to every hook's after_epoch:
        at an epoch's end (fit) and inside it (validate_mid_epoch) alike."""
        row = {"epoch": state.epoch, "step": state.global_step, **train, **self.validate(),
               "lr": self.parts.optimizer.param_groups[0]["lr"]}
        end = EpochEnd(row, state.update_best(row[self.chosen_on], lower_is_better(self.chosen_on)), finished,
                       mid_epoch)
        for hook in self.hooks:
            hook.after_epoch(state, end)

    def validate_mid_epoch(self, state: TrainState) -> None:
        """train.val_every_steps (ValidateEvery): a validation inside the epoch with the epoch's train columns so far
        (a collective), its time kept off the training clock; raises StopRun when a stop rule holds (StopRules)."""
        began = self.loop.clock()
        self.end_validation(state, train_columns(state.sync_sums(), self.loop.multi_label), finished=False,
                            mid_epoch=True)
        self.step_checkpoint.saved_step = state.global_step  # EpochCheckpoint just wrote last.pth at this step
        self.parts.model.train()
        state.paused += self.loop.clock() - began
        self.stop_rules.check(state)  # StopRun when a stop rule holds

    def save_now(self, state: TrainState) -> Path | None:
        """last.pth at this step, written (a stopped run's); every rank learns that it worked."""
        self.step_checkpoint.save(state)
        self.checkpointer.wait()
        return self.checkpointer.last


@dataclass
class Prepared:
    """A run's parts before anything is written to output_dir: what assemble() adds its record, sinks and
    checkpointer to, and what --dry-run checks (so that it makes every check fit() makes before training)."""

    cfg: Config
    start: Resume
    chosen_on: str  # the metrics.jsonl column best.pth follows
    data: DataBundle
    precision: Precision
    measured: Precision  # eval_amp's
    model: nn.Module  # placed (prepare_model), before sharding and wrapping
    teacher: tuple | None
    parts: TrainParts
    loop: LoopConfig
    ema: Any
    state: TrainState
    started_from: dict[str, Any] | None  # the model card's starting weights


def prepare(cfg: Config, info: DistInfo) -> Prepared | None:
    """Start-up (assembly/start.py), the model placed, its teacher, its parts and the training state (resumed or
    fresh), the run's lines said; None when the resumed run has nothing left to train (said in the log)."""
    cfg, start, weights = resolve_start(cfg, info)
    chosen_on = best_metric(cfg)
    if (reason := finished_reason(start.ckpt, cfg.train, cfg.model.name, chosen_on)) is not None:
        log.info("the run in %s is finished (%s): nothing was trained or written; raise train.epochs (or "
                 "train.max_steps, train.early_stop_patience) to continue it, or use another output_dir for a new run",
                 start.path.parent, reason)  # the checkpoint's folder: output_dir, unless resume=<path> names another
        return None
    precision, measured = run_precisions(cfg.amp, cfg.eval_amp, cfg.loss_scale, cfg.dist.strategy, info.device)
    cfg, data, model = build_start(cfg, start, weights, precision, info)  # the data read after the precision
    teacher = load_teacher(cfg, weights.teacher, model, data.num_classes)
    model = prepare_model(model, cfg.model, info.device, info.world_size)  # placed once it has its starting weights
    hub = hub_origin(cfg.model.name, weights.hub_cfg)  # timm's weights, for the model card
    started_from = start.started_from(weights.pretrained, hub)
    parts, loop, ema = build_parts(cfg, info, data, precision, model, teacher, start)
    state = TrainState()
    start.load_training(state, cfg, info, data.steps_per_epoch, model=parts.model, optimizer=parts.optimizer,
                        scheduler=parts.scheduler, scaler=precision.scaler, chosen_on=chosen_on)
    log.info("model %s (%.1fM params), %d process(es) on %s, training in %s, validating in %s, global batch %d, "
             "%d steps/epoch", cfg.model.name, sum(p.numel() for p in model.parameters()) / 1e6, info.world_size,
             info.device.type, precision.name, validation_precision(measured, precision, model),
             global_batch(info.world_size, cfg.train.batch_size, cfg.train.accum_steps), data.steps_per_epoch)
    if info.device.type == "cpu":
        log.info("CPU: %s", threads_line(info.local_world_size, cfg.data.num_workers))
    return Prepared(cfg, start, chosen_on, data, precision, measured, model, teacher, parts, loop, ema, state,
                    started_from)


def assemble(cfg: Config, info: DistInfo, lock: FolderLock | None = None, extra: Sequence[Hook] = ()) -> Run | None:
    """The run fit() trains (prepare's parts, then its record, sinks and checkpointer), with `extra` hooks after its
    own; None when the resumed run has nothing left to train."""
    started = time.monotonic()
    ready = prepare(cfg, info)
    if ready is None:
        return None
    cfg, start, data, parts, state, model, ema = (ready.cfg, ready.start, ready.data, ready.parts, ready.state,
                                                   ready.model, ready.ema)
    out = Path(cfg.output_dir)
    # Nothing in output_dir changes before the run's first write (record.start): a run that fails to
    # start leaves the previous run's config.yaml, metrics.jsonl and checkpoints as they were.
    record = RunRecord(out, to_dict(cfg), first_epoch=state.epoch, first_step=state.global_step, lock=lock,
                       files={**(data.split.files() if data.split else {}),  # data.val_fraction's lists
                              **pipeline_copies(cfg.data)})  # data.train_transform / eval_transform files
    tracker = WandbTracker(cfg.logging, info.is_main)  # W&B on rank 0; never raises
    tracker.start({**to_dict(cfg), "world_size": info.world_size}, out, resume_id=start.wandb_id)
    board = TensorBoardWriter(cfg.logging, info.is_main)  # TensorBoard on rank 0; never raises
    board.start({**to_dict(cfg), "world_size": info.world_size}, out, state.global_step, lambda: record.started)
    if state.global_step == 0:
        tracker.log_samples(data.train.dataset, cfg.logging.wandb_samples)
    checkpointer = Checkpointer(out, info, cfg.train.keep_last_k, model=model, optimizer=parts.optimizer,
                                scheduler=parts.scheduler, scaler=ready.precision.scaler, config=to_dict(cfg),
                                class_names=data.class_names, ema=ema.module if ema is not None else None,
                                wandb_id=tracker.run_id or start.wandb_id,  # kept for a resume with tracking on
                                best_metric=ready.chosen_on, sharded=cfg.train.ckpt_format == "sharded",
                                async_save=cfg.train.async_save, lock=lock,
                                run_id=start.run_id or broadcast_object(uuid.uuid4().hex),  # a fresh run's: rank 0's
                                data_sizes=data.sizes(), started_from=ready.started_from)
    run = Run(cfg, info, data, parts, ready.loop, ema, state, ready.measured, ready.chosen_on, tracker, checkpointer,
              record, started=started)
    run.hooks = [*hooks_of(run, model, tracker, board), *extra]
    return run


def dry_run(cfg: Config, info: DistInfo) -> str:
    """--dry-run: prepare(), every check fit() makes before its first training step, with nothing written to
    output_dir (its writability checked); returns a summary."""
    out = Path(cfg.output_dir)
    ready = prepare(cfg, info)
    rank0_decides(lambda: check_writable(out))
    if ready is None:
        return ("dry run passed: the resumed run is finished (the line above says why), nothing would be trained; "
                "nothing was written")
    cfg, data, teacher = ready.cfg, ready.data, ready.teacher
    resumed = f"resumes {ready.start.path}" if ready.start.path else "starts fresh"
    taught = f", distilled from {teacher[2]} ({cfg.distill.type})" if teacher else ""
    return (f"dry run passed: {cfg.model.name}{taught} on {len(data.train.dataset)} train / {len(data.val.dataset)} "
            f"val images, {data.num_classes} classes{', multi-label' if cfg.data.multi_label else ''}; the run "
            f"{resumed}; {out} is writable; nothing was written\nthe run uses: {run_values(cfg, info.world_size)}")


def hooks_of(run: Run, model: Any, tracker: WandbTracker, board: TensorBoardWriter) -> list[Hook]:
    """The run's side effects in the order they must happen (engine/hooks.py says why this order); the stop rules and
    the step checkpoint also kept on the run, whose validation inside an epoch calls them."""
    cfg, info, state, sinks = run.cfg, run.info, run.state, [tracker, board]
    run.stop_rules = StopRules(cfg.train, run.chosen_on, tracker)
    run.step_checkpoint = StepCheckpoint(run.record, run.checkpointer, cfg.train.ckpt_every_steps)
    out = Path(cfg.output_dir)
    profile = ([ProfileSteps(cfg.logging.profile_steps, out / PROFILE_FOLDER, info.device, run.record, info.is_main,
                             state)] if cfg.logging.profile_steps else [])  # off: torch.profiler never starts
    skipped = ([SkippedImages(full_epoch_images(run.data.train, info.world_size), info.is_main)]
               if cfg.data.skip_corrupt else [])
    ema = [EmaUpdate(run.ema, model, cfg.model.ema_reset_epochs)] if run.ema is not None else []
    every = ([ValidateEvery(cfg.train.val_every_steps, run.data.steps_per_epoch, run.validate_mid_epoch)]
             if cfg.train.val_every_steps else [])
    return [run.stop_rules,  # first: before an epoch it ends, nothing else runs
            EpochInputs(run.data.train, cfg.train.accum_steps, run.parts.loss_fn),
            *ema,  # before the checkpoint that saves it, and before a validation of it
            *every,  # its after_epoch hooks write last.pth at the step: StepCheckpoint then need not
            run.step_checkpoint,
            InputAdvice(cfg.data, cpu_share(info.local_world_size), info.is_main),
            *skipped,  # in the row before it is recorded
            CloseEpoch(),  # before the record and the checkpoint: resume=auto starts at the next epoch
            RecordRow(run.record),
            *([Curves(run.record, run.chosen_on, info.is_main)] if cfg.logging.curves else []),  # the row just recorded
            Tracking(sinks, run.chosen_on, info.is_main),
            ValidationErrors(tracker, board, lambda: run.outcomes, run.data.val.dataset, run.data.class_names,
                             cfg.logging.wandb_errors),
            EpochCheckpoint(run.checkpointer, run.chosen_on),  # at the end: the last write is known to have worked
            BestArtifact(run.tracker, run.checkpointer, out / "best.pth", run.chosen_on, cfg.model.name),
            *profile,
            FinishSinks(sinks)]  # last: after the last write and the profile

