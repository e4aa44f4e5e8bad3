"""The run's validation, an object fit() owns: the model and its EMA on the validation loader, in eval_amp, made into
the metrics.jsonl row its hooks get (EpochEnd). fit calls it after each epoch, ValidateEvery inside one.

A stop signal (SIGTERM, SIGUSR1, SIGINT) during it cuts it short at a batch boundary, every rank at the same one
(StopAtBatch): the training state then says which validation is owed (TrainState.unvalidated), the stopped run
saves it in last.pth, and the continued run does that validation first."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from core.config import DataConfig
from core.dist import DistInfo, LaggedMax, broadcast_tensors, is_fsdp, replicated_tensors
from core.signals import requested, stop_together
from engine.evaluation import ImageOutcomes, validate_epoch
from engine.hooks import EpochEnd
from engine.precision import Precision
from engine.prefetch import Normalize
from engine.state import TrainState, lower_is_better


class Validation:
    """Validate the model (and its EMA) as trained: `model` is the module the loop calls (DDP / sharded), `ema` the
    EMA's module or None; `gather_outcomes`: each image's outcome gathered to rank 0 for the hooks (the same on
    every rank: the gather is a collective)."""

    def __init__(self, model: nn.Module, ema: nn.Module | None, loader: DataLoader, measured: Precision,
                 info: DistInfo, normalize: Normalize, data: DataConfig, optimizer: torch.optim.Optimizer,
                 chosen_on: str, gather_outcomes: bool) -> None:
        self.model, self.ema, self.loader, self.measured = model, ema, loader, measured
        self.info, self.normalize, self.data, self.optimizer = info, normalize, data, optimizer
        self.chosen_on, self.gather_outcomes = chosen_on, gather_outcomes

    def __call__(self, state: TrainState, train: dict[str, float], finished: bool,
                 mid_epoch: bool = False) -> EpochEnd:
        """The row (the train columns `train`, the validation's, the lr) and whether it beat the best (the same on
        every rank), for every hook's after_epoch. Preempted (every rank) when a stop signal cuts it short."""
        state.await_validation(train, mid_epoch)  # what last.pth says is owed, if a stop cuts it short
        where = f"the validation at step {state.global_step}" if mid_epoch else f"epoch {state.epoch}'s validation"
        columns, outcomes = self.measure(StopAtBatch(self.info.device, state.global_step, where))
        state.validation_done()
        row = {"epoch": state.epoch, "step": state.global_step, **train, **columns,
               "lr": self.optimizer.param_groups[0]["lr"]}
        is_best = state.update_best(row[self.chosen_on], lower_is_better(self.chosen_on))
        return EpochEnd(row, is_best, finished, mid_epoch, outcomes)

    def measure(self, stop_check: StopAtBatch | None = None) -> tuple[dict[str, float], Any]:
        """The validation's columns, of the model and its EMA (the same numbers on every rank), and the model's
        per-image outcomes gathered to rank 0 (None elsewhere, or when not wanted); `stop_check`: see StopAtBatch."""
        if is_fsdp(self.model):  # DDP broadcasts rank 0's buffers (BatchNorm statistics) at each forward; FSDP never
            broadcast_tensors(replicated_tensors(self.model))
        outcomes = ImageOutcomes(self.loader.sampler.start) if self.gather_outcomes else None
        columns = validate_epoch(self.model, self.ema, self.loader, self.measured, self.info, self.normalize,
                                 self.data, outcomes, stop_check)
        return columns, outcomes.gather(self.info.device) if outcomes is not None else None  # a collective


class StopAtBatch:
    """Called at each batch boundary of a validation: every rank asks every other whether one got a stop signal
    (LaggedMax: answered one batch later, so the device never waits) and all raise Preempted at the same batch."""

    def __init__(self, device: torch.device, step: int, where: str) -> None:
        self.asked, self.step = LaggedMax(device), step
        self.during = f"{where}, which the continued run does first"

    def __call__(self) -> None:
        stop_together(self.asked(requested()), self.step, self.during)
