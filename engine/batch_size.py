"""train.batch_size=auto: the largest per-process batch whose training step fits, the same on every rank.

The search (largest_batch) only asks a `fits(batch) -> bool` rule, so it is tested on the CPU with any rule. On CUDA
the rule is a real step (on_device_fits): forward, backward and optimizer step of a copy of the run's model under
its precision, at data.img_size, out-of-memory caught. Each rank searches alone (no collective inside a probe,
whose count differs by rank), then the smallest answer over the ranks is every rank's (train.py). On the CPU host
memory is not the limit that matters and the speed per image hardly changes with the batch, so `auto` there is
CPU_BATCH (capped by the data), and train.py says so.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from core.config import TrainConfig
from core.errors import UserError
from engine.precision import Precision

log = logging.getLogger(__name__)

CPU_BATCH = 64  # train.batch_size=auto on the CPU: the schema's default batch
MAX_BATCH = 4096  # the search's cap on CUDA (benchmark.py --sweep-batch's too)
UNIT = 2  # batches are even: BatchNorm cannot train on one image at 1x1, and mixup/cutmix pairs images


def largest_batch(fits: Callable[[int], bool], cap: int, unit: int = UNIT) -> int:
    """The largest multiple of `unit` up to `cap` that fits (0 when `unit` does not): doubling from `unit`, then
    bisecting between the last batch that fit and the first that did not. Assumes a larger batch never fits
    where a smaller one did not."""
    cap = cap // unit * unit
    if cap < unit or not fits(unit):
        return 0
    low, high = unit, 0  # low fits; high (once > 0) does not
    while not high:
        trial = min(low * 2, cap)
        if trial == low:
            return low
        if fits(trial):
            low = trial
        else:
            high = trial
    while high - low > unit:
        middle = (low + high) // 2 // unit * unit
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def resolved_batch(train: TrainConfig, largest: int, world_size: int, even: bool,
                   fixed_accum: bool = False) -> dict[str, int]:
    """train.batch_size (and train.accum_steps) for a per-process `largest` batch: `largest` itself, or with
    train.global_batch_size the fewest accumulation steps (from train.accum_steps up; only it when `fixed_accum`,
    a train.accum_steps given on the command line) whose batch fits and splits the global batch evenly over the
    processes; `even`: mixing needs an even batch."""
    if not train.global_batch_size:
        return {"batch_size": largest}
    last = train.accum_steps if fixed_accum else train.global_batch_size // world_size
    for accum in range(train.accum_steps, last + 1):
        batch, left = divmod(train.global_batch_size, world_size * accum)
        if not left and batch <= largest and not (even and batch % 2):
            return {"batch_size": batch, "accum_steps": accum}
    if fixed_accum:
        raise UserError(f"train.batch_size=auto found at most {largest} images per process, and "
                        f"train.accum_steps={train.accum_steps} as given does not split train.global_batch_size="
                        f"{train.global_batch_size} into such batches on {world_size} process(es); leave "
                        "train.accum_steps out (auto then raises it) or lower train.global_batch_size")
    raise UserError(f"train.batch_size=auto found at most {largest} images per process, and no accumulation of "
                    f"train.accum_steps={train.accum_steps} or more splits train.global_batch_size="
                    f"{train.global_batch_size} into such batches on {world_size} process(es); set "
                    f"train.global_batch_size to a multiple of {world_size * UNIT}")


def whole_groups(largest: int, group: int) -> int:
    """The largest batch up to `largest` that holds whole mixing draws of `group` images (data.mix_mode=batch), or
    a whole number of which make one: a multiple of `group`, else its largest divisor that fits (0: none)."""
    if largest >= group:
        return largest // group * group
    return max((d for d in range(UNIT, largest + 1) if group % d == 0 and d % 2 == 0), default=0)


def on_device_fits(model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision, img_size: int,
                   num_classes: int, channels_last: bool) -> Callable[[int], bool]:
    """The CUDA rule: whether one training step at `batch` runs without running out of memory. The model and
    optimizer are a copy the caller throws away; no collective (precision.step's all-reduce) is called."""
    device = next(model.parameters()).device
    scaler = torch.amp.GradScaler("cuda") if precision.scaler else None  # the run's own scaler keeps its scale
    model.train()

    def fits(batch: int) -> bool:
        try:
            images = torch.randn(batch, 3, img_size, img_size, device=device)
            if channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            with precision.autocast():
                loss = F.cross_entropy(model(images), torch.randint(num_classes, (batch,), device=device))
            if scaler:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
            return True
        except torch.OutOfMemoryError:
            pass
        optimizer.zero_grad(set_to_none=True)  # outside the except block: its traceback no longer holds tensors
        torch.cuda.empty_cache()
        return False

    return fits
