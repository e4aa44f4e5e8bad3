"""train.batch_size=auto: the largest per-process batch whose training step fits, the same on every rank.

The search (largest_batch) only asks a `fits(batch) -> bool` rule, so it is tested on the CPU with any rule. On CUDA
the rule is a real step (on_device_fits): forward, backward and optimizer step of a copy of the run's model under
its precision, at data.img_size, out-of-memory caught. Each rank searches alone (no collective inside a probe,
whose count differs by rank), keeps back the headroom a real run needs beyond the probe's one step (kept_batch:
the batch the prefetcher reads ahead, a stated margin), then the smallest answer over the ranks is every rank's
(train.py). On the CPU host
memory is not the limit that matters and the speed per image hardly changes with the batch, so `auto` there is
CPU_BATCH (capped by the data), and train.py says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
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
# Of the memory the largest probe step's images took, the share kept back for what no probe step holds: NCCL's
# communicator buffers (created at the first collective, after the probe), DDP's buckets, allocator fragmentation.
MARGIN = 0.05


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


class DeviceFits:
    """The CUDA rule: whether one training step at `batch` runs without running out of memory, and each trial's
    peak memory (`peaks`: batch -> bytes, None where it ran out). The model and optimizer are a copy the caller
    throws away; no collective (precision.step's all-reduce) is called."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision, img_size: int,
                 num_classes: int, channels_last: bool) -> None:
        self.model, self.optimizer, self.precision = model, optimizer, precision
        self.img_size, self.num_classes, self.channels_last = img_size, num_classes, channels_last
        self.device = next(model.parameters()).device
        self.scaler = torch.amp.GradScaler("cuda") if precision.scaler else None  # the run's own keeps its scale
        self.peaks: dict[int, int | None] = {}
        model.train()

    def __call__(self, batch: int) -> bool:
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            self.step(batch)
            torch.cuda.synchronize(self.device)
            self.peaks[batch] = torch.cuda.max_memory_allocated(self.device)
            return True
        except torch.OutOfMemoryError:
            pass
        self.peaks[batch] = None
        self.optimizer.zero_grad(set_to_none=True)  # outside the except block: its traceback no longer holds tensors
        torch.cuda.empty_cache()
        return False

    def step(self, batch: int) -> None:
        """Forward, backward and optimizer step on random images, as training takes them."""
        images = torch.randn(batch, 3, self.img_size, self.img_size, device=self.device)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with self.precision.autocast():
            loss = F.cross_entropy(self.model(images), torch.randint(self.num_classes, (batch,), device=self.device))
        if self.scaler:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def on_device_fits(model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision, img_size: int,
                   num_classes: int, channels_last: bool) -> DeviceFits:
    """The CUDA rule (DeviceFits) for a copy of the run's model and optimizer."""
    return DeviceFits(model, optimizer, precision, img_size, num_classes, channels_last)


@dataclass(frozen=True)
class Capacity:
    """What the probe found: the largest batch whose step fit, and the step's peak memory per image (bytes)."""

    batch: int
    bytes_per_image: float
    limited: bool  # a larger step ran out of memory (False: the data or MAX_BATCH capped the search)


def input_bytes_per_image(img_size: int) -> int:
    """One image of the batch the prefetcher holds beside the step's (engine/prefetch.py: batch i+1 on the side
    stream, whose allocator pool the compute stream cannot reuse): float32 model input and its uint8 copy."""
    return 3 * img_size * img_size * (4 + 1)


def kept_batch(found: Capacity, input_bytes: int, margin: float = MARGIN) -> int:
    """The batch a real run keeps (even, 0 if none): the largest b whose images' step memory plus the batch read
    ahead, b x (bytes_per_image + input_bytes), fits in (1 - margin) of what the found batch's images took. The
    found batch as it is when no step ran out of memory (the memory's edge was never reached)."""
    if not found.limited or not found.batch:
        return found.batch
    room = (1 - margin) * found.batch * found.bytes_per_image
    return min(found.batch, int(room // (found.bytes_per_image + input_bytes)) // UNIT * UNIT)


def capacity(found: int, peaks: dict[int, int | None]) -> Capacity:
    """Capacity from the probe's trials (batch -> peak bytes, None: out of memory): the memory per image is the
    slope between the smallest and the largest step that fit (the model, gradients and optimizer state cancel)."""
    fitted = sorted(batch for batch, peak in peaks.items() if peak is not None and batch <= found)
    low, high = (fitted[0], found) if fitted else (found, found)
    per_image = ((peaks[high] - peaks[low]) / (high - low) if high > low else
                 (peaks.get(found) or 0) / max(found, 1))
    return Capacity(found, per_image, any(peak is None for peak in peaks.values()))


def headroom_note(found: Capacity, kept: int, input_bytes: int, margin: float = MARGIN) -> str:
    """The one line train.py logs: what the probe found and what was kept back, in numbers."""
    if not found.limited:
        return (f"train.batch_size=auto: a step of {found.batch} fit and none larger was tried (the images per "
                f"process or {MAX_BATCH} cap it): kept {kept}")
    return (f"train.batch_size=auto: the largest step that fit was {found.batch} "
            f"({found.bytes_per_image / 2**20:.1f} MiB per image); kept {kept}, holding back the batch the "
            f"prefetcher reads ahead ({input_bytes / 2**20:.2f} MiB per image) and a {margin:.0%} margin "
            "(NCCL buffers, fragmentation)")


def with_headroom(fits: "DeviceFits", found: int, img_size: int, speak: bool) -> int:
    """kept_batch for the CUDA search that `fits` ran and found `found` with; logs headroom_note when `speak`."""
    measured, input_bytes = capacity(found, fits.peaks), input_bytes_per_image(img_size)
    kept = kept_batch(measured, input_bytes)
    if speak:
        log.info(headroom_note(measured, kept, input_bytes))
    return kept
