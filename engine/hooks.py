"""Per-step side effects of training, as small objects the loop calls in list order.

The loop calls `after_step(state)` after every optimizer step and `after_interval(state, stats)` every
`logging.interval` steps with the all-reduced interval stats (train_loss, lr, img_per_s), on every rank.
fit() orders them on purpose: the EMA is updated before a step checkpoint saves it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from torch import nn

from engine.state import TrainState

if TYPE_CHECKING:  # the loop needs only Hook: keep checkpoint/tracking out of its imports
    from engine.checkpoint.run_dir import RunRecord
    from engine.checkpoint.saver import Checkpointer
    from engine.tracking import Sink


class Hook:
    """Override what you need; both calls happen on every rank (a hook that runs a collective is safe)."""

    def after_step(self, state: TrainState) -> None:
        pass

    def after_interval(self, state: TrainState, stats: dict[str, float]) -> None:
        pass


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

    def save(self, state: TrainState) -> None:
        """last.pth at the current step, unless this hook just wrote it (a collective: every rank calls it)."""
        if self.saved_step != state.global_step:
            self.record.start()
            self.checkpointer.save(state)
            self.saved_step = state.global_step


class IntervalTracking(Hook):
    """The `interval/` curves of the tracking sinks, W&B and TensorBoard (no-ops off rank 0 or when off)."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self.sinks = sinks

    def after_interval(self, state: TrainState, stats: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log_interval(state.global_step, stats)
