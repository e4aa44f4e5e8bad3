"""Training's side effects, as small objects the loop calls in list order (detectron2's HookBase, with epochs).

Per step: `after_step(state)` after every optimizer step, `after_interval(state, stats)` every `logging.interval`
steps with the all-reduced interval stats (train_loss, lr, img_per_s). Per epoch: `before_epoch(state)`, and
`after_epoch(state, end)` once the epoch is trained and validated, with its metrics.jsonl row (a hook may add a
column; the ones after it see it), and likewise after each validation inside an epoch (train.val_every_steps:
`end.mid_epoch`, its row without the epoch's timings). At the end of a run that was not stopped by an error:
`after_train(state)`. Every call happens on every rank (a hook that runs a collective is safe). assembly/run.py
orders them on purpose: the stop rules come first (an epoch they end starts nothing); the EMA is updated before a
validation inside the epoch uses it and a step checkpoint saves it; after an epoch the skipped-image count joins the
row, the epoch is closed, the row is recorded, then logged by the sinks, then checkpointed (best.pth), then uploaded;
last of all the ranks ask each other whether one got a stop signal meanwhile (StopRequests): a signal during these
hooks waits for their checkpoint, so no stop falls between a validation's row and its last.pth.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from core.config import DataConfig, train_size
from core.dist import max_over_ranks, rank0_decides
from core.signals import requested, stop_together
from engine.losses import set_loss_epoch
from engine.state import TrainState, stop_reason, train_columns

if TYPE_CHECKING:  # the loop needs only Hook: keep checkpoint/tracking out of its imports
    from core.config import TrainConfig
    from engine.checkpoint.run_dir import RunRecord
    from engine.checkpoint.run_store import RunStore
    from engine.checkpoint.saver import Checkpointer
    from engine.tracking import Sink, TensorBoardWriter, WandbTracker

log = logging.getLogger(__name__)


@dataclass
class EpochEnd:
    """What a validation hands its hooks: its metrics.jsonl row, whether it beat the best of train.best_metric,
    whether every step of the epoch ran (train.max_steps can stop a run mid-epoch: resume continues that epoch),
    whether it is one of train.val_every_steps inside the epoch (never finished), and the per-image outcomes it
    gathered to rank 0 (ValidationErrors)."""

    row: dict[str, Any]
    is_best: bool
    finished: bool
    mid_epoch: bool = False
    outcomes: Any = None  # each image's outcome, gathered to rank 0 (engine/validation.py; None elsewhere or off)


class Hook:
    """Override what you need; every call happens on every rank (a hook that runs a collective is safe)."""

    def before_epoch(self, state: TrainState) -> None:
        pass

    def after_step(self, state: TrainState) -> None:
        pass

    def after_interval(self, state: TrainState, stats: dict[str, float]) -> None:
        pass

    def after_epoch(self, state: TrainState, end: EpochEnd) -> None:
        pass

    def after_train(self, state: TrainState) -> None:
        pass


class EpochInputs(Hook):
    """Before each epoch: the training loader at that epoch, past the batches this rank already trained on in it
    (a mid-epoch resume), and the loss at it (train.class_weights_from_epoch)."""

    def __init__(self, loader: Any, accum_steps: int, loss_fn: Any) -> None:
        self.loader, self.accum_steps, self.loss_fn = loader, accum_steps, loss_fn

    def before_epoch(self, state: TrainState) -> None:
        state.set_loader_epoch(self.loader, self.accum_steps)
        set_loss_epoch(self.loss_fn, state.epoch)


class Unfreeze(Hook):
    """model.freeze_epochs: before epoch `epochs` (or the first epoch of a run resumed past it) the frozen backbone is
    released (`release`) and the whole model trains from there, said once on rank 0. Decided by the epoch alone, so
    a resumed run unfreezes at the same step as one not stopped."""

    def __init__(self, epochs: int, release: Callable[[], None], is_main: bool) -> None:
        self.epochs, self.release, self.is_main = epochs, release, is_main
        self.done = False

    def before_epoch(self, state: TrainState) -> None:
        if self.done or state.epoch < self.epochs:
            return
        self.release()
        self.done = True
        if self.is_main:
            log.info("epoch %d: the backbone is unfrozen, the whole model trains from here (model.freeze_epochs=%d)",
                     state.epoch, self.epochs)


class SizeChanges(Hook):
    """data.size_schedule: one line on rank 0 before the first epoch the run trains and before each epoch whose
    training crop size differs from the one before it (the loader's workers pick the size from the epoch: data/)."""

    def __init__(self, data: DataConfig, is_main: bool) -> None:
        self.data, self.is_main, self.size = data, is_main, 0

    def before_epoch(self, state: TrainState) -> None:
        size = train_size(self.data, state.epoch)
        if size != self.size and self.is_main:
            log.info("epoch %d: training crops of %d px from here (data.size_schedule; evaluation at %d px)",
                     state.epoch, size, self.data.val_img_size or self.data.img_size)
        self.size = size


class EmaUpdate(Hook):
    """model.ema_decay: fold the model's weights into the EMA after every optimizer step.

    `reset_epochs` N (model.ema_reset_epochs): every step of epochs 0..N-1 and the first step of epoch N copy the
    model, as torchvision's train.py does by zeroing its AveragedModel's n_averaged after each update in its lr
    warmup epochs (the next update, with n_averaged 0, copies too). Step 0 makes ModelEmaV3's decay 0: a copy.
    """

    def __init__(self, ema, model: nn.Module, reset_epochs: int = 0) -> None:
        self.ema, self.model, self.reset_epochs = ema, model, reset_epochs

    def after_step(self, state: TrainState) -> None:
        self.ema.update(self.model, step=0 if ema_copies(state, self.reset_epochs) else state.global_step)


def ema_copies(state: TrainState, reset_epochs: int) -> bool:
    """Whether the step just done resets the EMA to the model (model.ema_reset_epochs): decided by the epoch and
    its step alone, so a resumed run continues the rule."""
    return state.epoch < reset_epochs or (state.epoch == reset_epochs > 0 and state.epoch_step == 1)


class StopRun(Exception):
    """A stop rule holds (StopRules: train.max_steps reached, train.early_stop_patience run out), before an epoch or
    after a validation inside one: the run ends there, its checkpoint written, the reason said."""


class StopRules(Hook):
    """The run's stop rules (engine/state.stop_reason), checked before each epoch (the first hook: nothing starts an
    epoch they end) and after each validation inside one (`check`, once that validation's hooks have run). When one
    holds: the reason said on rank 0, an early stop kept in the W&B summary, and StopRun raised for fit to end."""

    def __init__(self, train: TrainConfig, chosen_on: str, tracker: WandbTracker) -> None:
        self.train, self.chosen_on, self.tracker = train, chosen_on, tracker

    def before_epoch(self, state: TrainState) -> None:
        self.check(state)

    def check(self, state: TrainState) -> None:
        reason = stop_reason(self.train, state, self.chosen_on)
        if reason is None:
            return
        log.info(reason)
        if reason.startswith("stopping early"):
            self.tracker.summary({"early_stopped_at_step": state.global_step,
                                  **({} if state.epoch_step else {"early_stopped_before_epoch": state.epoch})})
        raise StopRun


class ValidateEvery(Hook):
    """train.val_every_steps: after each optimizer step whose global step is a multiple of `every`, a validation
    (`validate`, the run's engine/validation.Validation) with the epoch's train columns so far, handed to the other
    hooks' after_epoch (`after`: every hook but this one), its time kept off the training clock, then the stop rules
    (StopRun when one holds) -- except at the step that ends the epoch, which the epoch's own validation covers: no
    step is validated twice. The schedule is the global step's alone, so a resumed run repeats or skips none."""

    def __init__(self, every: int, steps_per_epoch: int, validate: Callable[..., EpochEnd], after: Sequence[Hook],
                 stop_rules: StopRules, model: nn.Module, multi_label: bool, clock: Callable[[], float]) -> None:
        self.every, self.steps_per_epoch, self.validate, self.after = every, steps_per_epoch, validate, tuple(after)
        self.stop_rules, self.model, self.multi_label, self.clock = stop_rules, model, multi_label, clock

    def after_step(self, state: TrainState) -> None:
        if state.global_step % self.every or state.epoch_finished(self.steps_per_epoch):
            return
        began = self.clock()
        end = self.validate(state, train_columns(state.sync_sums(), self.multi_label), finished=False, mid_epoch=True)
        for hook in self.after:
            hook.after_epoch(state, end)
        self.model.train()
        state.paused += self.clock() - began
        self.stop_rules.check(state)  # StopRun when a stop rule holds


class StepCheckpoint(Hook):
    """train.ckpt_every_steps: write last.pth every `every` optimizer steps (0: never mid-epoch).

    `save` also serves a preempted run, which needs last.pth at its last step, written once.
    The run starts (config.yaml and metrics.jsonl become this run's) at its first write, which may be this one.
    """

    def __init__(self, record: RunRecord, checkpointer: Checkpointer, every: int) -> None:
        self.record, self.checkpointer, self.every = record, checkpointer, every
        self.saved_step = -1  # the global step last.pth holds from this hook (known on every rank)

    def after_step(self, state: TrainState) -> None:
        if self.every and state.global_step % self.every == 0:
            self.save(state)

    def after_epoch(self, state: TrainState, end: EpochEnd) -> None:
        self.saved_step = state.global_step  # EpochCheckpoint writes last.pth at this step, after this hook

    def save(self, state: TrainState) -> None:
        """last.pth at the current step, unless this hook just wrote it (a collective: every rank calls it)."""
        if self.saved_step != state.global_step:
            self.record.start()
            self.checkpointer.save(state)
            self.saved_step = state.global_step


class StopRequests(Hook):
    """Last after each validation (an epoch's, or one of train.val_every_steps): every rank asks every other whether
    one got SIGTERM, SIGUSR1 or SIGINT during the validation's hooks (one all-reduce); if so all stop here, with
    last.pth just written at this step (Preempted), instead of after one more step and a second save."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def after_epoch(self, state: TrainState, end: EpochEnd) -> None:
        stop_together(max_over_ranks(requested(), self.device), state.global_step)


class Tracking(Hook):
    """The tracking sinks, W&B and TensorBoard (no-ops off rank 0 or when off): the `interval/` curves, and each
    epoch's row with the best value of `chosen_on` so far, and the epoch's log line (rank 0)."""

    def __init__(self, sinks: Sequence[Sink], chosen_on: str, is_main: bool) -> None:
        self.sinks, self.chosen_on, self.is_main = sinks, chosen_on, is_main

    def after_interval(self, state: TrainState, stats: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log_interval(state.global_step, stats)

    def after_epoch(self, state: TrainState, end: EpochEnd) -> None:
        if self.is_main:
            for sink in self.sinks:
                sink.log_epoch(state.global_step, end.row, {self.chosen_on: state.best_value})
            log.info(epoch_line(end.row, end.mid_epoch))


class ValidationErrors(Hook):
    """Each validation's error analysis from the per-image outcomes it gathered to rank 0 (`end.outcomes`: None
    elsewhere, or when off): logging.wandb_errors' worst images and confusion matrix in W&B, and the confusion
    matrix as a TensorBoard figure."""

    def __init__(self, tracker: WandbTracker, board: TensorBoardWriter, dataset: Any, class_names: list[str],
                 count: int) -> None:
        self.tracker, self.board, self.dataset = tracker, board, dataset
        self.class_names, self.count = class_names, count

    def after_epoch(self, state: TrainState, end: EpochEnd) -> None:
        if end.outcomes is not None:
            self.tracker.log_errors(state.global_step, end.outcomes, self.dataset, self.class_names, self.count)
            self.board.log_confusion(state.global_step, end.outcomes, self.class_names)


class FinishSinks(Hook):
    """Last of all at the end of a run, once its last checkpoint write is known to have worked: the W&B run and the
    TensorBoard writer are closed."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self.sinks = sinks

    def after_train(self, state: TrainState) -> None:
        for sink in self.sinks:
            sink.finish()


def epoch_line(row: dict, mid_epoch: bool = False) -> str:
    """The log line of an epoch's metrics.jsonl row (multi-label: no top-1, mAP and F1 instead); a validation inside
    the epoch says its step, and its train columns are the epoch's so far."""
    if "val_map" in row:
        shown = (f"train_loss {row['train_loss']:.4f} | val_loss {row['val_loss']:.4f} val_map {row['val_map']:.2f} "
                 f"val_map_micro {row['val_map_micro']:.2f} val_f1 {row['val_f1']:.2f}")
    else:
        shown = (f"train_loss {row['train_loss']:.4f} train_top1 {row['train_top1']:.2f} | val_loss "
                 f"{row['val_loss']:.4f} val_top1 {row['val_top1']:.2f} val_top5 {row['val_top5']:.2f} "
                 f"bal_acc {row['val_balanced_acc']:.2f} macro_f1 {row['val_macro_f1']:.2f}")
    if mid_epoch:
        return f"epoch {row['epoch']} step {row['step']}: {shown}"
    return f"epoch {row['epoch']}: {shown} | {row['train_img_per_s']:.0f} img/s, {row['epoch_time_s']:.1f}s"


class SkippedImages(Hook):
    """data.skip_corrupt: a finished epoch's row says how many of its `expected` images (over all ranks) were
    dropped as unreadable, and rank 0 warns when any was."""

    def __init__(self, expected: int, is_main: bool) -> None:
        self.expected, self.is_main = expected, is_main

    def after_epoch(self, state: TrainState, end: EpochEnd) -> None:
        if not end.finished:
            return
        end.row["skipped_images"] = skipped = self.expected - end.row["train_images"]
        if skipped and self.is_main:
            log.warning("epoch %d: %d unreadable training image(s) skipped (data.skip_corrupt=true)", state.epoch,
                        skipped)


class CloseEpoch(Hook):
    """A finished epoch moves the state to the next one (before the row is recorded and the checkpoint saved, so
    that resume=auto starts there); an unfinished one (train.max_steps) stays open for resume to continue. A
    validation inside the epoch counts towards early stopping (before the checkpoint keeps the count)."""

    def after_epoch(self, state: TrainState, end: EpochEnd) -> None:
        if end.finished:
            state.finish_epoch()
        elif end.mid_epoch:
            state.count_validation()


class StepOnMetric(Hook):
    """sched.name=plateau: each counted validation's value of `metric` (train.best_metric's column, all-reduced: the
    same on every rank) goes to the schedule, before the row is recorded and checkpointed; the row's lr is then the
    lr the next step trains with, as every schedule's row shows. A train.max_steps stop's validation is not counted
    (as for early stopping): the run resumed there validates that epoch again at its end."""

    def __init__(self, scheduler: Any, metric: str, optimizer: Any) -> None:
        self.scheduler, self.metric, self.optimizer = scheduler, metric, optimizer

    def after_epoch(self, state: TrainState, end: EpochEnd) -> None:
        if end.finished or end.mid_epoch:
            self.scheduler.step_metric(end.row[self.metric])
            end.row["lr"] = self.optimizer.param_groups[0]["lr"]


class RecordRow(Hook):
    """metrics.jsonl: each validation's row (rank 0 writes; the run's folder starts at its first write)."""

    def __init__(self, record: RunRecord) -> None:
        self.record = record

    def after_epoch(self, state: TrainState, end: EpochEnd) -> None:
        self.record.append(end.row)


class Curves(Hook):
    """curves.png in the run folder, redrawn from metrics.jsonl after each validation (rank 0, after RecordRow).

    A figure that cannot be drawn or written is a warning, not a stop: no other rank waits on it."""

    def __init__(self, record: RunRecord, metric: str, is_main: bool) -> None:
        self.record, self.metric, self.is_main = record, metric, is_main

    def after_epoch(self, state: TrainState, end: EpochEnd) -> None:
        if not self.is_main:
            return
        from engine.curves import NAME, draw_curves  # matplotlib only where a run draws

        try:
            draw_curves(self.record.rows(), self.record.folder / NAME, self.metric)
        except Exception as err:  # noqa: BLE001 (any failure: the run goes on, the user is told)
            log.warning("epoch %d: %s not redrawn (%s)", state.epoch, NAME, err)


class EpochCheckpoint(Hook):
    """last.pth after each evaluation, best.pth when it beat the best of `chosen_on`, epoch_NNNN.pth after a
    finished epoch; at the end every rank learns that the last write worked."""

    def __init__(self, checkpointer: Checkpointer, chosen_on: str) -> None:
        self.checkpointer, self.chosen_on = checkpointer, chosen_on

    def after_epoch(self, state: TrainState, end: EpochEnd) -> None:
        self.checkpointer.save(state, metric_value=end.row[self.chosen_on], best=end.is_best, epoch_file=end.finished)

    def after_train(self, state: TrainState) -> None:
        self.checkpointer.wait()


class BestArtifact(Hook):
    """logging.wandb_log_checkpoints: a W&B model version per best.pth as soon as it is written, so that a
    preempted run keeps its best model in W&B."""

    def __init__(self, tracker: WandbTracker, checkpointer: Checkpointer, best: Path, chosen_on: str,
                 model_name: str) -> None:
        self.tracker, self.checkpointer, self.best = tracker, checkpointer, best
        self.chosen_on, self.model_name = chosen_on, model_name

    def after_epoch(self, state: TrainState, end: EpochEnd) -> None:
        if end.is_best and self.tracker.logs_checkpoints and self.checkpointer.written():
            self.tracker.log_checkpoint(self.best, {"epoch": end.row["epoch"], "global_step": state.global_step,
                                                    "best_metric": self.chosen_on, self.chosen_on: state.best_value,
                                                    "model": self.model_name})


class Upload(Hook):
    """output_dir at a URL: after each validation's hooks, once its checkpoint is on disk (a train.async_save write
    in flight is waited for: else the URL would hold the validation before), what changed in the staging folder is
    uploaded (rank 0; a failure stops every rank with one line)."""

    def __init__(self, store: RunStore, checkpointer: Checkpointer) -> None:
        self.store, self.checkpointer = store, checkpointer

    def after_epoch(self, state: TrainState, end: EpochEnd) -> None:
        self.checkpointer.wait()
        rank0_decides(self.store.push)
