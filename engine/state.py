"""The training state: what the loop advances and a checkpoint stores, changed only through its methods.

While an epoch trains, each rank keeps its running train sums on the device (`meter`); `sync_sums`
all-reduces them into `epoch_sums`. A checkpoint stores the synced sums, so a run resumed mid-epoch
reports the whole epoch's train_loss and train_top1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from core.config import Config, TrainConfig
from engine.metrics import SumMeter

TRAIN_SUMS = ("loss_sum", "correct", "count")
CHECKPOINTED = ("epoch", "global_step", "best_value", "best_epoch", "epoch_step", "epoch_sums", "epoch_seconds",
                "validations_without_best", "best_uncounted", "unvalidated")


@dataclass
class TrainState:
    epoch: int = 0  # the next epoch to run (or the one in progress, when epoch_step > 0)
    global_step: int = 0  # optimizer steps done
    best_value: float = -math.inf  # the best value of train.best_metric so far (-inf: none yet)
    best_epoch: int | None = None  # the epoch of that value (None: none yet, or a checkpoint older than this field)
    epoch_step: int = 0  # optimizer steps done in `epoch`; > 0 in a mid-epoch checkpoint
    epoch_sums: dict[str, float] = field(default_factory=dict)  # train sums over all ranks, as of the last sync
    epoch_seconds: float = 0.0  # training time of the epoch's steps
    validations_without_best: int = 0  # counted validations in a row that did not improve best_value (early stop)
    best_uncounted: bool = False  # best_value improved since the last counted validation (also at a max_steps stop's)
    # A validation begun and not finished (a stop cut it short): {"train": its row's train columns, "mid_epoch": one of
    # train.val_every_steps}; None: none owed. A checkpoint that holds one makes the continued run do it first.
    unvalidated: dict[str, Any] | None = None
    paused: float = 0.0  # host seconds spent validating inside epochs (train.val_every_steps): off the training clock
    meter: SumMeter | None = field(default=None, repr=False, compare=False)  # this rank's sums while training

    def start_epoch(self, device: torch.device, is_main: bool) -> SumMeter:
        """Running sums for `epoch`, starting from the synced sums of steps done before a resume (on rank 0 only,
        so the all-reduce counts them once)."""
        self.meter = SumMeter(TRAIN_SUMS, device)
        if self.epoch_sums and is_main:
            self.meter.add(*(self.epoch_sums[name] for name in TRAIN_SUMS))
        return self.meter

    def step_done(self, seconds: float) -> None:
        """One optimizer step more; `seconds`: the epoch's training time so far."""
        self.global_step += 1
        self.epoch_step += 1
        self.epoch_seconds = seconds

    def sync_sums(self) -> dict[str, float]:
        """The epoch's train sums over all ranks (while an epoch trains, a collective: every rank calls it)."""
        if self.meter is not None:
            self.epoch_sums = self.meter.global_sums()
        return self.epoch_sums

    def sync_sums_and_max(self, per_rank: tuple[float, ...]) -> tuple[dict[str, float], list[float]]:
        """sync_sums(), with the largest over ranks of each of this rank's `per_rank` host values (same all-reduce)."""
        if self.meter is None:
            return self.epoch_sums, list(per_rank)
        self.epoch_sums, largest = self.meter.global_sums_and_max(per_rank)
        return self.epoch_sums, largest

    def epoch_finished(self, steps_per_epoch: int) -> bool:
        """Whether every step of `epoch` ran (train.max_steps can stop a run mid-epoch)."""
        return self.epoch_step >= steps_per_epoch

    def await_validation(self, train: dict[str, float], mid_epoch: bool) -> None:
        """A validation of the steps done begins, with the train columns of its row: owed until validation_done()."""
        self.unvalidated = {"train": dict(train), "mid_epoch": mid_epoch}

    def validation_done(self) -> None:
        """The validation begun is measured: nothing is owed (its row and checkpoint follow in the hooks)."""
        self.unvalidated = None

    def finish_epoch(self) -> None:
        """The next epoch; the epoch's validation counts towards early stopping."""
        self.epoch, self.epoch_step, self.epoch_sums, self.epoch_seconds, self.meter = self.epoch + 1, 0, {}, 0.0, None
        self.count_validation()

    def count_validation(self) -> None:
        """A counted validation (an epoch's, or one of train.val_every_steps) is one more without a better best_value
        unless the best improved since the last counted one (which may have been at an uncounted max_steps stop)."""
        self.validations_without_best = 0 if self.best_uncounted else self.validations_without_best + 1
        self.best_uncounted = False

    def update_best(self, value: float, lower_is_better: bool = False) -> bool:
        """Record a validation metric; True when it beats every earlier one (strictly: a tie is no improvement)."""
        if math.isnan(value):
            return False
        best = self.best_value
        better = best == -math.inf or (value < best if lower_is_better else value > best)
        if better:
            self.best_value, self.best_epoch, self.best_uncounted = value, self.epoch, True
        return better

    def forget_best(self) -> None:
        """The best value so far measured another metric (train.best_metric changed at a resume): start over."""
        self.best_value, self.best_epoch, self.validations_without_best = -math.inf, None, 0

    def schedule_position(self, updates_per_epoch: int) -> int:
        """Where the lr schedule stands: epochs done in this run's updates, plus the epoch's own steps.

        Equal to global_step while the global batch stays; after a resume with another global batch (at an
        epoch boundary) the schedule continues at the same epoch, counted in the new batch's updates.
        """
        return self.epoch * updates_per_epoch + self.epoch_step

    def samples_done(self, accum_steps: int, batch_size: int, batches_per_epoch: int) -> int:
        """How many of its samples this rank already trained on in `epoch` (a mid-epoch resume skips them)."""
        return min(self.epoch_step * accum_steps, batches_per_epoch) * batch_size

    def set_loader_epoch(self, loader: DataLoader, accum_steps: int) -> None:
        """Point the training loader at `epoch`, past the batches this rank already trained on in it: the one place
        a resume position is counted, in this rank's samples, as its sampler (data.loader.EpochSampler) counts."""
        loader.sampler.set_epoch(self.epoch, start=self.samples_done(accum_steps, loader.batch_size, len(loader)))

    def state_dict(self) -> dict[str, Any]:
        """The checkpointed fields, with the running sums synced first (a collective: every rank calls it)."""
        self.sync_sums()
        return {name: getattr(self, name) for name in CHECKPOINTED}

    def load_state_dict(self, ckpt: dict[str, Any]) -> None:
        """Put back what state_dict() stored (older checkpoints may lack the mid-epoch fields and best_epoch; their
        best_top1 is read as best_value: engine.checkpoint.formats.current_names; their epochs_without_best and
        best_in_epoch counted one validation per epoch, as these do without train.val_every_steps)."""
        self.epoch, self.global_step, self.best_value = ckpt["epoch"], ckpt["global_step"], ckpt["best_value"]
        self.best_epoch = ckpt.get("best_epoch")
        self.epoch_step = ckpt.get("epoch_step", 0)
        self.epoch_sums = dict(ckpt.get("epoch_sums") or {})
        self.epoch_seconds = ckpt.get("epoch_seconds", 0.0)
        self.validations_without_best = ckpt.get("validations_without_best", ckpt.get("epochs_without_best", 0))
        self.best_uncounted = ckpt.get("best_uncounted", ckpt.get("best_in_epoch", False))
        self.unvalidated = ckpt.get("unvalidated")
        self.meter = None


def train_columns(sums: dict[str, float], multi_label: bool) -> dict[str, float]:
    """train_loss and train_top1 (not multi-label) of the epoch's steps so far, from its synced sums."""
    count = max(sums["count"], 1.0)
    top1 = {} if multi_label else {"train_top1": 100.0 * sums["correct"] / count}
    return {"train_loss": sums["loss_sum"] / count, **top1}


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


def stop_reason(train: TrainConfig, state: TrainState, chosen_on: str) -> str | None:
    """train.max_steps reached, or train.early_stop_patience run out (checked before each epoch, so that a resumed
    run stops alike, and after each validation of train.val_every_steps); None: the run goes on."""
    if train.max_steps and state.global_step >= train.max_steps:
        return f"stopping at train.max_steps={train.max_steps}"
    patience = train.early_stop_patience
    if patience and state.validations_without_best >= patience:
        return (f"stopping early after {stop_point(state)}: {chosen_on} has not improved for "
                f"{state.validations_without_best} validations (train.early_stop_patience={patience} counts "
                f"validations); best {chosen_on} {state.best_value:.4f}")
    return None


def stop_point(state: TrainState) -> str:
    """Where a stop comes, in words: checked before an epoch, it comes after the previous epoch's end (state.epoch
    is already the next one), which said "at epoch 7" for a stop after epoch 6."""
    if state.epoch_step:
        return f"step {state.epoch_step} of epoch {state.epoch} (global step {state.global_step})"
    return f"epoch {state.epoch - 1} (global step {state.global_step})"


def finished_reason(ckpt: dict[str, Any] | None, train: TrainConfig, model_name: str, chosen_on: str) -> str | None:
    """Why the resumed checkpoint's run has nothing left to train under `train`, so that starting a finished run
    again trains and writes nothing; None for a fresh run or one with work left."""
    if ckpt is None or (ckpt.get("config") or {}).get("model", {}).get("name") != model_name:
        return None  # (another model: build_start refuses the checkpoint with its own line)
    state = TrainState()
    state.load_state_dict(ckpt)
    if ckpt.get("best_metric", "val_top1") != chosen_on:
        state.forget_best()  # as Resume.load_training does: the best (and the epochs without it) start again
    if state.epoch >= train.epochs:
        return f"all {train.epochs} epochs of train.epochs done"
    if state.unvalidated is not None:
        return None  # a validation a stop cut short is owed, even where a stop rule then ends the run
    return stop_reason(train, state, chosen_on)
