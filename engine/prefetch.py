"""Batches onto the training device one step ahead, normalized there.

On CUDA the copy of batch i+1 (from the DataLoader's pinned memory) and its normalization run on a side
stream while batch i computes, as timm's PrefetchLoader does; the compute stream waits for the side
stream before it uses a batch, and `record_stream` keeps the allocator from reusing a batch's memory
while compute still reads it. On the CPU batches are normalized as they come: there is nothing to overlap.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

Normalize = Callable[[torch.Tensor], torch.Tensor]  # uint8 batch on the device -> model input (data.transforms)
# (images, targets), then (mix) with mixup/cutmix (data.mixing), then (boxes) with normalized erasing (data.erasing)
Batch = tuple[torch.Tensor, ...]  # a part that is not a tensor (the boxes, a list) stays on the host


def reads_ahead(device: torch.device) -> bool:
    """Whether device_batches fetches batch i+1 from the loader before it yields batch i (CUDA: to overlap)."""
    return device.type == "cuda"


def device_batches(loader: Iterable[Batch], device: torch.device, normalize: Normalize,
                   read_ahead: bool | None = None) -> Iterator[Batch]:
    """Yield the loader's (uint8 images, targets, ...) as (normalized images, targets, ...) on `device`.

    `read_ahead` (default: reads_ahead(device)) is settable so that the CPU tests drive the CUDA path's order of
    loader calls (on the CPU with no stream: there is nothing to overlap)."""
    ahead = reads_ahead(device) if read_ahead is None else read_ahead
    if not ahead:
        for images, *rest in loader:
            yield normalize(images.to(device)), *(to_device(part, device) for part in rest)
        return
    if device.type != "cuda":
        ready = None
        for images, *rest in loader:
            upcoming = (normalize(images.to(device)), *(to_device(part, device) for part in rest))
            if ready is not None:
                yield ready
            ready = upcoming
        if ready is not None:
            yield ready
        return
    side = torch.cuda.Stream(device)
    ready: Batch | None = None
    for images, *rest in loader:
        with torch.cuda.stream(side):
            upcoming = (normalize(images.to(device, non_blocking=True)),
                        *(to_device(part, device, non_blocking=True) for part in rest))
        if ready is not None:
            yield ready
        compute = torch.cuda.current_stream(device)
        compute.wait_stream(side)
        for tensor in upcoming:
            if isinstance(tensor, torch.Tensor):
                tensor.record_stream(compute)
        ready = upcoming
    if ready is not None:
        yield ready


def to_device(part, device: torch.device, non_blocking: bool = False):
    """A tensor of a batch on `device`; anything else (normalized erasing's list of boxes) as it is."""
    return part.to(device, non_blocking=non_blocking) if isinstance(part, torch.Tensor) else part
