"""The training loop: one epoch of optimizer steps, with accumulation, AMP and exact metrics.

`train_one_epoch` is the whole loop. It reads one value on the host per optimizer step (`Precision.step`):
the inf/NaN gradient check, which decides whether to step, fused with the stop flag (did any rank get SIGTERM
or SIGUSR1?), which makes every rank stop after the same step: one tensor, one all-reduce, one read. The
metrics are read only every `log_interval` steps (one all-reduce of a few sums, which also carries each rank's
input wait share and step time: engine/speed.py); nothing else in the hot path waits for the device.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from timm.scheduler.scheduler import Scheduler
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader

from core.dist import DistInfo
from core.errors import UserError
from core.signals import requested, stop_together, training_steps, workers_shielded
from engine.hooks import Hook
from engine.metrics import hits, ranked_classes
from engine.precision import Precision
from engine.prefetch import Normalize, device_batches, reads_ahead
from engine.progress import Progress
from engine.speed import LoaderWait, clock_start
from engine.state import TrainState, train_columns

if TYPE_CHECKING:  # the loop only calls it: keep the teacher's and weights' modules out of its imports
    from engine.distill import Distillation

log = logging.getLogger(__name__)

# The metrics.jsonl columns that measure the machine, not the model: two runs of the same model differ in them (the
# tests compare runs without them). A new timing column goes here.
MEASURED_COLUMNS = ("epoch_time_s", "train_img_per_s", "train_input_wait", "train_step_s")


@dataclass
class TrainParts:
    """What an optimizer step uses; `model` is the module as trained (DDP / compiled wrapper)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Scheduler
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    precision: Precision
    distill: Distillation | None = None  # distill.*: a teacher's logits in the loss (engine/distill.py)


@dataclass(kw_only=True)
class LoopConfig:
    """How train_one_epoch steps, built with keywords (train.py takes them from the config's sections)."""

    normalize: Normalize  # uint8 batches to the model's input, on the device
    accum_steps: int = 1
    drop_last_accum: bool = False  # the epoch's micro-batches after its last whole group are left out
    clip_grad: float = 0.0  # 0 = no clipping
    max_steps: int = 0  # 0 = no limit
    log_interval: int = 20  # logging.interval
    show_progress: bool = False
    max_nonfinite: int = 5  # consecutive skipped (inf/NaN) steps before training stops
    total_steps: int = 0  # optimizer steps of the whole run, for its ETA (0: unknown, the epoch's are shown)
    mix: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None  # (images, labels, mix) -> images, targets
    erase: Callable[[torch.Tensor, list], torch.Tensor] | None = None  # (images, boxes) -> images (data.erasing)
    clip_mode: str = "norm"  # optim.clip_mode: norm | value | agc
    multi_label: bool = False  # multi-hot targets (data.multi_label): no train_top1, train_loss only
    fsdp_accum_whole: bool = False  # dist.fsdp_accum_whole: a sharded model keeps weights and gradients whole
    read_ahead: bool | None = None  # batches fetched one ahead (None: as device_batches does on the device)
    clock: Callable[[], float] = time.perf_counter  # the host clock of the timings (settable for the tests)


def train_one_epoch(parts: TrainParts, loader: DataLoader, state: TrainState, cfg: LoopConfig, info: DistInfo,
                    hooks: Sequence[Hook] = ()) -> dict[str, float]:
    """Run one epoch (or until max_steps); return all-reduced train_loss, train_top1, img/s.

    A resumed epoch starts from `state`'s synced sums (the loader then yields only the remaining batches).
    After every optimizer step each hook's after_step runs; every `log_interval` steps, after_interval
    gets the all-reduced train_loss, lr and global img/s since the previous interval. At every step the
    ranks ask each other whether one got SIGTERM or SIGUSR1, and all raise Preempted after that same step.
    """
    model, optimizer = parts.model, parts.optimizer
    model.train()
    meter = state.start_epoch(info.device, info.is_main)
    num_batches = len(loader) - (len(loader) % cfg.accum_steps if cfg.drop_last_accum else 0)  # the batches trained on
    steps = state.epoch_step + math.ceil(num_batches / cfg.accum_steps)  # the whole epoch's, also when resumed

    def clock() -> float:  # validations inside the epoch (train.val_every_steps) are not training time
        return cfg.clock() - state.paused

    ahead = reads_ahead(info.device) if cfg.read_ahead is None else cfg.read_ahead
    with workers_shielded():  # DataLoader workers start here; a SIGTERM to the process group must not kill them
        # Host time blocked in the loader's next(), from the second optimizer step on: is the run input-bound?
        waits = LoaderWait(itertools.islice(loader, num_batches), clock_start(cfg.accum_steps, ahead), clock)
        batches = device_batches(waits, info.device, cfg.normalize, ahead)
    shown = Progress(batches, num_batches, state.epoch, steps, cfg.show_progress and info.is_main)
    start = clock() - state.epoch_seconds
    last_sums, last_time = dict(state.epoch_sums) or dict.fromkeys(meter.names, 0.0), clock()
    first_step, began = state.epoch_step, clock()  # this process's part
    timed = StepClock(first_step, began)  # step time from the end of this process's first step (start-up) on
    optimizer.zero_grad(set_to_none=True)
    skipped = 0  # optimizer steps in a row skipped for inf/NaN gradients
    with training_steps():  # from here SIGTERM, like SIGUSR1, only asks for a stop at the next step boundary
        for i, (images, labels, *extra) in enumerate(shown):
            if cfg.erase is not None:  # the erasing boxes, last, filled after normalization and before mixing (timm)
                images = cfg.erase(images, extra.pop())
            # Mixup/cutmix (data.mixing): soft targets for the loss; train_top1 counts against the hard labels.
            images, targets = cfg.mix(images, labels, *extra) if extra else (images, labels)
            group_start = i - i % cfg.accum_steps
            group_size = min(cfg.accum_steps, num_batches - group_start)
            last_micro_step = i == group_start + group_size - 1
            # DDP all-reduces gradients only on the micro-step that ends an accumulation group (FSDP2 with
            # dist.fsdp_accum_whole likewise reduce-scatters them only then).
            sync = contextlib.nullcontext() if last_micro_step or not hasattr(model, "no_sync") else model.no_sync()
            if cfg.fsdp_accum_whole:
                fsdp_micro_step(model, last_micro_step)
            with sync:
                with parts.precision.autocast():
                    logits = model(images)
                    if parts.distill is None:
                        loss = parts.loss_fn(logits, targets)
                    else:  # the teacher sees these (mixed) images, under the same autocast
                        logits, loss = parts.distill(logits, targets, images, parts.loss_fn)
                parts.precision.backward(loss / group_size)
            correct = 0.0 if cfg.multi_label else hits(ranked_classes(logits.detach(), 1), labels, 1)
            meter.add(loss.detach() * len(labels), correct, len(labels))
            if not last_micro_step:
                continue
            stepped, signum = parts.precision.step(optimizer, model, cfg.clip_grad, requested(), cfg.clip_mode)
            skipped = 0 if stepped else skipped + 1
            optimizer.zero_grad(set_to_none=True)
            state.step_done(clock() - start)
            timed.step_done(state.epoch_step, clock())
            if skipped:
                check_nonfinite(skipped, cfg.max_nonfinite, state.global_step, info)
            parts.scheduler.step_update(num_updates=state.schedule_position(steps))
            for hook in hooks:
                hook.after_step(state)
            if state.global_step % cfg.log_interval == 0:
                now = clock()
                # The input wait share and step time of this rank, the largest over ranks in the sums' all-reduce.
                local = (waits.interval(), timed.interval(state.epoch_step, now))
                sums, (wait, step_s) = state.sync_sums_and_max(local)
                count = sums["count"] - last_sums["count"]
                stats = {"train_loss": (sums["loss_sum"] - last_sums["loss_sum"]) / count,
                         "lr": optimizer.param_groups[0]["lr"], "img_per_s": count / (now - last_time),
                         "input_wait": wait, "step_s": step_s}
                pace = (now - start) / state.epoch_step  # seconds per optimizer step over the epoch
                run_left = max(cfg.total_steps - state.global_step, steps - state.epoch_step)
                shown.show(state.epoch_step, stats, pace * (steps - state.epoch_step), pace * run_left)
                for hook in hooks:
                    hook.after_interval(state, stats)
                last_sums, last_time = sums, now
            stop_together(signum, state.global_step)  # every rank got the same answer: all stop after this step
            if cfg.max_steps and state.global_step >= cfg.max_steps:
                break
    sums, (wait, step_s) = state.sync_sums_and_max((waits.epoch(), timed.epoch(state.epoch_step, clock())))
    seconds = state.epoch_seconds = clock() - start
    return {**train_columns(sums, cfg.multi_label),
            "train_img_per_s": sums["count"] / seconds, "epoch_time_s": seconds, "train_images": int(sums["count"]),
            "train_input_wait": wait, "train_step_s": step_s}


class StepClock:
    """Seconds per optimizer step of this process, leaving out its first step of the epoch (workers starting, the
    first step's warm-up, cuDNN's autotuning, compilation), as the input wait does; an epoch of one step is timed
    whole."""

    def __init__(self, first_step: int, began: float) -> None:
        self.first_step, self.began = first_step, began
        self.origin: tuple[float, int] | None = None  # (clock, step) at the end of the first step
        self.mark: tuple[float, int] = (began, first_step)  # (clock, step) at the previous interval

    def step_done(self, step: int, now: float) -> None:
        if step == self.first_step + 1:
            self.origin = self.mark = (now, step)

    def interval(self, step: int, now: float) -> float:
        """Seconds per step since the previous interval (from the first step's end on, once there is a step after it)."""
        since, at = self.mark
        self.mark = (now, step)
        return (now - since) / (step - at) if step > at else (now - self.began) / max(step - self.first_step, 1)

    def epoch(self, step: int, now: float) -> float:
        """Seconds per step over the epoch's steps after the first."""
        if self.origin is not None and step > self.origin[1]:
            return (now - self.origin[0]) / (step - self.origin[1])
        return (now - self.began) / max(step - self.first_step, 1)


def fsdp_micro_step(model: FSDPModule, last: bool) -> None:
    """dist.fsdp_accum_whole: a micro-step that does not end its accumulation group skips the gradients'
    reduce-scatter and keeps the weights whole after its backward (the next forward needs no all-gather); the
    group's last micro-step reduce-scatters the summed gradients and reshards, as an unaccumulated step does."""
    model.set_requires_gradient_sync(last)
    model.set_reshard_after_backward(last)


def check_nonfinite(skipped: int, limit: int, step: int, info: DistInfo) -> None:
    """Warn about a skipped step; stop (on every rank: they all saw the same gradients) after `limit` in a row."""
    if skipped >= limit:
        raise UserError(f"the gradients were inf or NaN for {skipped} optimizer steps in a row (up to global step "
                        f"{step}, train.max_nonfinite={limit}); training stopped without writing a checkpoint. "
                        "Lower optim.lr, set optim.clip_grad, or check the data, then resume from last.pth",
                        all_ranks=True)
    if info.is_main:
        log.warning("step %d: inf or NaN gradients, optimizer step skipped (%d in a row)", step, skipped)


