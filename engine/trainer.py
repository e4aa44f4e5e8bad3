"""The training loop: one epoch of optimizer steps, with accumulation, AMP and exact metrics.

`train_one_epoch` is the whole loop. It reads one value on the host per optimizer step (the inf/NaN
gradient check, which decides whether to step) and the metrics only every `log_interval` steps (one
all-reduce of a few sums); nothing else in the hot path waits for the device.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader

from engine.dist import DistInfo
from engine.errors import UserError
from engine.logs import progress
from engine.metrics import SumMeter, hits, ranked_classes
from engine.precision import Precision
from engine.prefetch import Normalize, device_batches

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """What the loop advances; checkpointed so a resumed run continues where it stopped."""

    epoch: int = 0  # the next epoch to run (or the one in progress, when epoch_step > 0)
    global_step: int = 0  # optimizer steps done
    best_top1: float = float("-inf")
    epoch_step: int = 0  # optimizer steps done in `epoch`; > 0 in a mid-epoch checkpoint
    epoch_sums: dict[str, float] = field(default_factory=dict)  # train sums over all ranks of those steps
    epoch_seconds: float = 0.0  # training time of those steps


@dataclass
class LoopConfig:
    accum_steps: int
    clip_grad: float
    max_steps: int  # 0 = no limit
    log_interval: int
    normalize: Normalize
    show_progress: bool
    max_nonfinite: int = 5  # consecutive skipped (inf/NaN) steps before training stops


def train_one_epoch(model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer,
                    scheduler, loss_fn: Callable, precision: Precision, state: TrainState,
                    cfg: LoopConfig, info: DistInfo,
                    on_log: Callable[[int, dict[str, float]], None] | None = None,
                    after_step: Callable[[TrainState, SumMeter], None] | None = None) -> dict[str, float]:
    """Run one epoch (or until max_steps); return all-reduced train_loss, train_top1, img/s.

    Every `log_interval` steps, rank 0 calls on_log(global_step, stats) with the all-reduced
    train_loss, lr and global img/s over the steps since the previous call. A resumed epoch starts
    with `state.epoch_sums` (the loader then yields only the remaining batches); `after_step` runs
    after every optimizer step (e.g. to write a step checkpoint).
    """
    model.train()
    meter = SumMeter(("loss_sum", "correct", "count"), info.device)
    if state.epoch_sums and info.is_main:  # the global sums of the steps done before the resume
        meter.add(*(state.epoch_sums[name] for name in meter.names))
    num_batches = len(loader)
    batches = device_batches(loader, info.device, cfg.normalize)
    bar = progress(batches, num_batches, f"epoch {state.epoch}", cfg.show_progress and info.is_main)
    start = time.perf_counter() - state.epoch_seconds
    last_sums, last_time = dict(state.epoch_sums) or dict.fromkeys(meter.names, 0.0), time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    skipped = 0  # optimizer steps in a row skipped for inf/NaN gradients
    for i, (images, targets) in enumerate(bar):
        group_start = i - i % cfg.accum_steps
        group_size = min(cfg.accum_steps, num_batches - group_start)
        last_micro_step = i == group_start + group_size - 1
        # DDP all-reduces gradients only on the micro-step that ends an accumulation group.
        sync = contextlib.nullcontext() if last_micro_step or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with precision.autocast():
                logits = model(images)
                loss = loss_fn(logits, targets)
            precision.backward(loss / group_size)
        meter.add(loss.detach() * len(targets), hits(ranked_classes(logits.detach(), 1), targets, 1), len(targets))
        if not last_micro_step:
            continue
        skipped = 0 if precision.step(optimizer, model, cfg.clip_grad) else skipped + 1
        optimizer.zero_grad(set_to_none=True)
        state.global_step += 1
        if skipped:
            check_nonfinite(skipped, cfg.max_nonfinite, state.global_step, info)
        state.epoch_step += 1
        scheduler.step_update(num_updates=state.global_step)
        if after_step is not None:
            state.epoch_seconds = time.perf_counter() - start
            after_step(state, meter)
        if state.global_step % cfg.log_interval == 0:
            sums = meter.global_sums()
            bar.set_postfix(loss=f"{sums['loss_sum'] / sums['count']:.4f}",
                            lr=f"{optimizer.param_groups[0]['lr']:.3g}",
                            img_s=f"{sums['count'] / (time.perf_counter() - start):.0f}")
            now, count = time.perf_counter(), sums["count"] - last_sums["count"]
            if on_log is not None and info.is_main:
                on_log(state.global_step, {"train_loss": (sums["loss_sum"] - last_sums["loss_sum"]) / count,
                                           "lr": optimizer.param_groups[0]["lr"],
                                           "img_per_s": count / (now - last_time)})
            last_sums, last_time = sums, now
        if cfg.max_steps and state.global_step >= cfg.max_steps:
            break
    sums = meter.global_sums()
    seconds = time.perf_counter() - start
    state.epoch_sums, state.epoch_seconds = sums, seconds
    count = max(sums["count"], 1.0)
    return {"train_loss": sums["loss_sum"] / count, "train_top1": 100.0 * sums["correct"] / count,
            "train_img_per_s": sums["count"] / seconds, "epoch_time_s": seconds, "train_images": int(sums["count"])}


def check_nonfinite(skipped: int, limit: int, step: int, info: DistInfo) -> None:
    """Warn about a skipped step; stop (on every rank: they all saw the same gradients) after `limit` in a row."""
    if skipped >= limit:
        raise UserError(f"the gradients were inf or NaN for {skipped} optimizer steps in a row (up to global step "
                        f"{step}, train.max_nonfinite={limit}); training stopped without writing a checkpoint. "
                        "Lower optim.lr, set optim.clip_grad, or check the data, then resume from last.pth",
                        all_ranks=True)
    if info.is_main:
        log.warning("step %d: inf or NaN gradients, optimizer step skipped (%d in a row)", step, skipped)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, precision: Precision, info: DistInfo,
             normalize: Normalize,
             on_batch: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None) -> dict[str, float]:
    """Exact val_loss / val_top1 / val_top5 over the whole (sharded, unpadded) validation set.

    on_batch(logits, targets, ranked) sees each batch with the top-5 classes the metrics counted.
    """
    model.eval()
    meter = SumMeter(("loss_sum", "top1", "top5", "count"), info.device)
    for images, targets in device_batches(loader, info.device, normalize):
        with precision.autocast():
            logits = model(images)
        logits = logits.float()
        loss = nn.functional.cross_entropy(logits, targets, reduction="sum")
        ranked = ranked_classes(logits, 5)
        meter.add(loss, hits(ranked, targets, 1), hits(ranked, targets, 5), len(targets))
        if on_batch is not None:
            on_batch(logits, targets, ranked)
    sums = meter.global_sums()
    count = sums["count"]
    return {"val_loss": sums["loss_sum"] / count, "val_top1": 100.0 * sums["top1"] / count,
            "val_top5": 100.0 * sums["top5"] / count, "val_count": int(count)}
