"""One run, built once (build_run): start-up's config, data and model, the parts it trains with, its training state
(resumed or fresh) and its validation -- prepare(), which writes nothing: --dry-run and --find-lr stop there -- then
its outputs (record, sinks, checkpointer) and the hooks that do each side effect, in their order. fit() trains it."""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from torch import nn

from assembly.parts import build_parts
from assembly.start import Teacher, build_start, load_teacher, resolve_start
from core.config import Config, LoggingConfig, global_batch, run_values, to_dict
from core.dist import DistInfo, broadcast_object, rank0_decides
from core.errors import UserError
from core.startup import cpu_share, starved_workers, this_process_cpus, threads_line
from data.datasets import AugmentedDataset, augmented_samples
from data.loader import DataBundle, full_epoch_images
from data.pipeline import pipeline_copies
from engine.checkpoint.resume import Resume
from engine.checkpoint.run_dir import FolderLock, RunRecord, check_writable
from engine.checkpoint.run_store import RunStore, url_of
from engine.checkpoint.saver import Checkpointer
from engine.evaluation import validation_precision
from engine.hooks import (BestArtifact, CloseEpoch, Curves, EmaUpdate, EpochCheckpoint, EpochInputs, FinishSinks, Hook,
                          RecordRow, SizeChanges, SkippedImages, StepCheckpoint, StepOnMetric, StopRequests, StopRules,
                          Tracking, Unfreeze, Upload, ValidateEvery, ValidationErrors)
from engine.optim import extension_warning
from engine.plots import PNG, image_grid, readable, save_png
from engine.precision import Precision, run_precisions
from engine.profiling import FOLDER as PROFILE_FOLDER, ProfileSteps
from engine.speed import InputAdvice
from engine.state import TrainState, best_metric, finished_reason
from engine.tracking import CONFUSION_CLASSES, TensorBoardWriter, WandbTracker
from engine.trainer import LoopConfig, TrainParts
from engine.validation import Validation
from models.ema import CachedEma
from models.factory import hub_origin, prepare_model
from models.freeze import Frozen

log = logging.getLogger(__name__)
SAMPLES = "samples.png"  # logging.samples: a fresh run's augmented training images (fastai's show_batch)


@dataclass
class RunOutputs:
    """Where a run writes: output_dir's record (config.yaml, metrics.jsonl, the split and pipeline copies), the two
    tracking sinks (rank 0; never fatal), the checkpointer, and the step checkpoint a stopped run saves through."""

    record: RunRecord
    tracker: WandbTracker
    board: TensorBoardWriter
    checkpointer: Checkpointer
    step_checkpoint: StepCheckpoint

    def save_now(self, state: TrainState) -> Path | None:
        """last.pth at this step, written (a stopped run's); every rank learns that it worked."""
        self.step_checkpoint.save(state)
        self.checkpointer.wait()
        return self.checkpointer.last


@dataclass
class Run:
    """One run: what fit() loops with, built once by build_run; `outputs` and `hooks` (in the order they are called)
    only when it writes."""

    cfg: Config  # resolved: every derived value applied (core/config.with_derived)
    info: DistInfo
    start: Resume  # the checkpoint it continues, or a fresh start
    chosen_on: str  # the metrics.jsonl column best.pth follows
    data: DataBundle
    precision: Precision  # training's
    measured: Precision  # eval_amp's: every reported number is computed in it
    model: nn.Module  # placed (prepare_model), before sharding and wrapping: what checkpoints save
    teacher: Teacher | None
    parts: TrainParts
    loop: LoopConfig
    ema: CachedEma | None
    frozen: Frozen | None  # model.freeze_epochs' backbone, until the Unfreeze hook releases it
    state: TrainState
    started_from: dict[str, Any] | None  # the model card's starting weights
    validation: Validation
    started: float  # time.monotonic() when build_run began: the run summary's wall time
    outputs: RunOutputs | None = None  # None: built without writing (--dry-run, --find-lr)
    hooks: list[Hook] = field(default_factory=list)


def build_run(cfg: Config, info: DistInfo, write: bool, lock: FolderLock | None = None, extra: Sequence[Hook] = (),
              fresh: bool = False, store: RunStore | None = None) -> Run | None:
    """The run (prepare), and with `write` its outputs and hooks (`extra` after its own); None when the resumed run
    has nothing left to train. `lock`: rank 0's lock on output_dir, checked before each write there; `fresh`
    (--find-lr): a new model whatever output_dir and resume say, without an EMA."""
    run = prepare(cfg, info, fresh, started=time.monotonic())
    if run is None or not write:
        return run
    run.outputs = open_outputs(run, lock)
    run.hooks = hooks_of(run, run.outputs, extra, store)
    return run


def prepare(cfg: Config, info: DistInfo, fresh: bool, started: float) -> Run | None:
    """Start-up (assembly/start.py), the model placed, its teacher, its parts, the training state (resumed or fresh)
    and the validation, the run's lines said, nothing written; None when the resumed run has nothing left to train
    (said in the log)."""
    cfg, start, weights = resolve_start(cfg, info, fresh)
    chosen_on = best_metric(cfg)
    if (reason := finished_reason(start.ckpt, cfg.train, cfg.model.name, chosen_on)) is not None:
        log.info("the run in %s is finished (%s): nothing was trained or written; raise train.epochs (or "
                 "train.max_steps, train.early_stop_patience) to continue it, or use another output_dir for a new run",
                 url_of(start.path.parent), reason)  # the checkpoint's folder: output_dir, unless resume= names another
        return None
    precision, measured = run_precisions(cfg.amp, cfg.eval_amp, cfg.loss_scale, cfg.dist.strategy, info.device,
                                         cfg.tf32)
    cfg, data, model = build_start(cfg, start, weights, precision, info)  # the data read after the precision
    teacher = load_teacher(cfg, weights, model, data.num_classes)
    model = prepare_model(model, cfg.model, info.device, info.world_size)  # placed once it has its starting weights
    hub = hub_origin(cfg.model.name, weights.hub_cfg)  # timm's weights, for the model card
    started_from = start.started_from(weights.pretrained, hub)
    parts, loop, ema, frozen = build_parts(cfg, info, data, precision, model, teacher, None if fresh else start)
    state = TrainState()
    start.load_training(state, cfg, info, data.steps_per_epoch, model=parts.model, optimizer=parts.optimizer,
                        scheduler=parts.scheduler, scaler=precision.scaler, chosen_on=chosen_on)
    if info.is_main and (warning := raised_epochs_warning(cfg, start, state.epoch, data.steps_per_epoch)):
        log.warning(warning)
    log.info("model %s (%.1fM params), %d process(es) on %s, training in %s, validating in %s, global batch %d, "
             "%d steps/epoch", cfg.model.name, sum(p.numel() for p in model.parameters()) / 1e6, info.world_size,
             info.device.type, precision.described, validation_precision(measured, precision, model),
             global_batch(info.world_size, cfg.train.batch_size, cfg.train.accum_steps), data.steps_per_epoch)
    if info.device.type == "cpu":
        log.info("CPU: %s", threads_line(info.local_world_size, cfg.data.num_workers))
    starved = starved_workers(this_process_cpus(info.local_world_size), cfg.data.num_workers, os.environ)
    if starved is not None and info.is_main:
        log.warning(starved)
    validation = Validation(parts.model, ema.module if ema is not None else None, data.val, measured, info,
                            loop.normalize, cfg.data, parts.optimizer, chosen_on, gathers_outcomes(cfg, data))
    return Run(cfg, info, start, chosen_on, data, precision, measured, model, teacher, parts, loop, ema, frozen,
               state, started_from, validation, started)


def raised_epochs_warning(cfg: Config, start: Resume, epoch: int, updates_per_epoch: int) -> str | None:
    """What a train.epochs raised on a finished run trains at (engine/optim.extension_warning); None otherwise."""
    done = ((start.ckpt or {}).get("config") or {}).get("train", {}).get("epochs")
    if done is None or epoch < done:  # fresh, or the run had epochs left: its schedule continues as it was
        return None
    return extension_warning(cfg.sched, cfg.optim.lr, done, cfg.train.epochs, updates_per_epoch, str(start.path))


def gathers_outcomes(cfg: Config, data: DataBundle) -> bool:
    """Whether validation gathers each image's outcome (W&B's error analysis, TensorBoard's confusion figure):
    decided from the config and the classes alone, the same on every rank (the gather is a collective)."""
    logging = cfg.logging
    board = logging.tensorboard and len(data.class_names) <= CONFUSION_CLASSES
    return (logging.wandb and logging.wandb_errors > 0 or board) and not cfg.data.multi_label


def open_outputs(run: Run, lock: FolderLock | None) -> RunOutputs:
    """The run's record, sinks and checkpointer. Nothing in output_dir changes before the run's first write
    (record.start): a run that fails to start leaves the previous run's config.yaml, metrics.jsonl and checkpoints
    as they were."""
    cfg, data, start, state, out = run.cfg, run.data, run.start, run.state, Path(run.cfg.output_dir)
    config = {**to_dict(cfg), "output_dir": url_of(cfg.output_dir)}  # a URL's, not its staging folder's
    record = RunRecord(out, config, first_epoch=state.epoch, first_step=state.global_step, lock=lock,
                       files={**(data.split.files() if data.split else {}),  # data.val_fraction's lists
                              **pipeline_copies(cfg.data)})  # data.train_transform / eval_transform files
    tracker = WandbTracker(cfg.logging, run.info.is_main)  # W&B on rank 0; never raises
    tracker.start({**to_dict(cfg), "world_size": run.info.world_size}, out, resume_id=start.wandb_id)
    board = TensorBoardWriter(cfg.logging, run.info.is_main)  # TensorBoard on rank 0; never raises
    board.start({**to_dict(cfg), "world_size": run.info.world_size}, out, state.global_step, lambda: record.started)
    if state.global_step == 0 and run.info.is_main:
        show_samples(data.train.dataset, cfg.logging, tracker, out)
    checkpointer = Checkpointer(out, run.info, cfg.train.keep_last_k, model=run.model, optimizer=run.parts.optimizer,
                                scheduler=run.parts.scheduler, scaler=run.precision.scaler, config=to_dict(cfg),
                                class_names=data.class_names, ema=run.ema.module if run.ema is not None else None,
                                wandb_id=tracker.run_id or start.wandb_id,  # kept for a resume with tracking on
                                best_metric=run.chosen_on, sharded=cfg.train.ckpt_format == "sharded",
                                async_save=cfg.train.async_save, lock=lock,
                                run_id=start.run_id or broadcast_object(uuid.uuid4().hex),  # a fresh run's: rank 0's
                                data_sizes=data.sizes(), started_from=run.started_from)
    step_checkpoint = StepCheckpoint(record, checkpointer, cfg.train.ckpt_every_steps)
    return RunOutputs(record, tracker, board, checkpointer, step_checkpoint)


def show_samples(dataset: AugmentedDataset, logging: LoggingConfig, tracker: WandbTracker, folder: Path) -> None:
    """A fresh run's first augmented images, as fastai's show_batch: samples.png (logging.samples) and W&B's
    train_samples table (logging.wandb_samples). Rank 0 only; a figure that cannot be written is a warning."""
    if logging.wandb_samples and tracker.active:
        tracker.log_samples(augmented_samples(dataset, logging.wandb_samples))
    if logging.samples:
        try:
            shown = augmented_samples(dataset, logging.samples)
            fig = image_grid([s.image for s in shown], [readable(s.name) for s in shown],
                             f"{len(shown)} training images as the model gets them (epoch 0, before normalization)")
            save_png(fig, folder / SAMPLES, PNG, f"an earlier {SAMPLES} of training", "output_dir")
        except (OSError, UserError) as err:  # a file of the user's own there is kept
            log.warning("%s not written (%s)", folder / SAMPLES, err)


def dry_run(cfg: Config, info: DistInfo) -> str:
    """--dry-run: the run built without writing (prepare: every check fit() makes before its first training step),
    output_dir's writability checked; returns a summary."""
    out = Path(cfg.output_dir)
    run = build_run(cfg, info, write=False)
    rank0_decides(lambda: check_writable(out))
    if run is None:
        return ("dry run passed: the resumed run is finished (the line above says why), nothing would be trained; "
                "nothing was written")
    cfg, data, teacher = run.cfg, run.data, run.teacher
    resumed = f"resumes {run.start.path}" if run.start.path else "starts fresh"
    taught = f", distilled from {teacher.name} ({cfg.distill.type})" if teacher else ""
    return (f"dry run passed: {cfg.model.name}{taught} on {len(data.train.dataset)} train / {len(data.val.dataset)} "
            f"val images, {data.num_classes} classes{', multi-label' if cfg.data.multi_label else ''}; the run "
            f"{resumed}; {out} is writable; nothing was written\nthe run uses: {run_values(cfg, info.world_size)}")


def hooks_of(run: Run, out: RunOutputs, extra: Sequence[Hook] = (), store: RunStore | None = None) -> list[Hook]:
    """The run's side effects in the order they must happen (engine/hooks.py says why this order), writing through
    `out` (and uploading to `store`, output_dir's URL), with `extra` last. Each hook gets what it uses; none refers back to the run."""
    cfg, info, state, data = run.cfg, run.info, run.state, run.data
    sinks, folder = [out.tracker, out.board], Path(cfg.output_dir)
    stop_rules = StopRules(cfg.train, run.chosen_on, out.tracker)
    profile = ([ProfileSteps(cfg.logging.profile_steps, folder / PROFILE_FOLDER, info.device, out.record, info.is_main,
                             state)] if cfg.logging.profile_steps else [])  # off: torch.profiler never starts
    skipped = ([SkippedImages(full_epoch_images(data.train, info.world_size), info.is_main)]
               if cfg.data.skip_corrupt else [])
    ema = [EmaUpdate(run.ema, run.model, cfg.model.ema_reset_epochs)] if run.ema is not None else []
    plateau = ([StepOnMetric(run.parts.scheduler, run.chosen_on, run.parts.optimizer)]
               if cfg.sched.name == "plateau" else [])
    unfreeze = [Unfreeze(cfg.model.freeze_epochs, run.frozen.release, info.is_main)] if run.frozen else []
    hooks = [stop_rules,  # first: before an epoch it ends, nothing else runs
             *unfreeze,  # before the epoch's first step
             *([SizeChanges(cfg.data, info.is_main)] if cfg.data.size_schedule else []),
             EpochInputs(data.train, cfg.train.accum_steps, run.parts.loss_fn),
             *ema,  # before the checkpoint that saves it, and before a validation of it
             out.step_checkpoint,
             InputAdvice(cfg.data, cpu_share(info.local_world_size), info.is_main),
             *skipped,  # in the row before it is recorded
             CloseEpoch(),  # before the record and the checkpoint: resume=auto starts at the next epoch
             *plateau,  # the row's lr, and the schedule's state in the checkpoint, after its decision
             RecordRow(out.record),
             *([Curves(out.record, run.chosen_on, info.is_main)] if cfg.logging.curves else []),  # the row recorded
             Tracking(sinks, run.chosen_on, info.is_main),
             ValidationErrors(out.tracker, out.board, data.val.dataset, data.class_names, cfg.logging.wandb_errors),
             EpochCheckpoint(out.checkpointer, run.chosen_on),  # at the end: the last write is known to have worked
             BestArtifact(out.tracker, out.checkpointer, folder / "best.pth", run.chosen_on, cfg.model.name),
             *profile,
             FinishSinks(sinks),  # last of the run's own: after the last write and the profile
             *extra,
             *([Upload(store, out.checkpointer)] if store is not None else []),  # what the hooks above wrote
             StopRequests(info.device)]  # last after a validation: a stop during its hooks, once they are done
    if cfg.train.val_every_steps:  # after the EMA's update, before the step checkpoint: its validation's after_epoch
        # hooks (the others, as they stand now: it is not among them) write last.pth at the step, which
        # StepCheckpoint then need not
        every = ValidateEvery(cfg.train.val_every_steps, data.steps_per_epoch, run.validation, hooks, stop_rules,
                              run.parts.model, run.loop.multi_label, run.loop.clock)
        hooks.insert(hooks.index(out.step_checkpoint), every)
    return hooks
