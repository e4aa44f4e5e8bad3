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
    """model.ema_decay: fold the model's weights into the EMA after every optimizer step."""

    def __init__(self, ema, model: nn.Module) -> None:
        self.ema, self.model = ema, model

    def after_step(self, state: TrainState) -> None:
        self.ema.update(self.model, step=state.global_step)


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
