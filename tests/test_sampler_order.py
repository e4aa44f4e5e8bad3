"""The epoch's sample order built with array operations (issue 62 item 3) is exactly the one the pure-Python build
gave: that build is kept here as the reference, called on the same sampler, for every layout EpochSampler makes
(plain, mixed pairs, repeats, both, class-balanced draws, batch-mode groups with either partner rule), on 1-3
ranks, from the start of an epoch and from a resume position."""

from __future__ import annotations

import itertools
from typing import Iterator

import numpy as np
import pytest
import torch

from data.loader import EpochSampler


# The reference: data/loader.py's EpochSampler order as the pure-Python build made it before issue 62 ------------

def reference_balanced_draws(order: torch.Tensor, starts: torch.Tensor, n: int, generator: torch.Generator) -> list:
    classes = torch.randint(len(starts) - 1, (n,), generator=generator)
    counts = starts[1:] - starts[:-1]
    within = torch.randint(2**62, (n,), generator=generator) % counts[classes]
    return order[starts[classes] + within].tolist()


def reference_repeated_pairs(perm: list[int], repeats: int) -> list[tuple[int, int]]:
    size = repeats + 2 - repeats % 2
    order = []
    for start in range(0, len(perm), size):
        block = perm[start:start + size]
        block = block[:len(block) - len(block) % 2]
        last, ring = len(block) - 1, block[:-1]
        for repeat in range(repeats if block else 0):
            r = repeat % max(last, 1)
            pairs = [(block[last], ring[r])] if ring else []
            pairs += [(ring[(r + i) % last], ring[(r - i) % last]) for i in range(1, len(block) // 2)]
            order += [(index, repeat) for pair in pairs for index in pair]
    return order


def reference_source_layout(perm: list[int], repeats: int, ranks: int, group: int, steps: int,
                            roll: bool = False) -> list[tuple[int, int]]:
    rows = np.arange(group) if roll else np.array([row for k in range(group // 2) for row in (k, group - 1 - k)])
    batches = np.arange(steps)[:, None, None] * group + rows[None, None, :]
    stream = (batches * ranks + np.arange(ranks)[None, :, None]).reshape(-1)
    indices = np.asarray(perm)[stream // repeats]
    return list(zip(indices.tolist(), (stream % repeats).tolist()))


def reference_global_order(s: EpochSampler) -> list[tuple[int, int]]:
    generator = torch.Generator()
    generator.manual_seed(s.seed + s.epoch)
    if s.by_class is None:
        perm = torch.randperm(len(s.dataset), generator=generator).tolist()
    else:
        perm = reference_balanced_draws(*s.by_class, len(s.dataset), generator)
    if s.group:
        return reference_source_layout(perm, s.repeats, s.step // s.group, s.group, len(perm) // s.step, s.roll)
    if s.unit == 2 and s.repeats > 1:
        return reference_repeated_pairs(perm, s.repeats)[:len(perm)]
    units = [perm[i:i + s.unit] for i in range(0, len(perm), s.unit)]
    return [(index, repeat) for unit in units for repeat in range(s.repeats) for index in unit][:len(perm)]


def reference_keys(s: EpochSampler) -> Iterator[tuple[int, ...]]:
    order, u = reference_global_order(s), s.unit
    positions = (p for first in range(s.rank * u, s.total_size, s.num_replicas * u) for p in range(first, first + u))

    def key(item: tuple[int, int], position: int) -> tuple[int, ...]:
        index, repeat = item
        if not s.mixed and s.repeats == 1:
            return s.epoch, index
        return s.epoch, index, repeat, position // 2 if s.mixed else -1

    return itertools.islice((key(order[p], p) for p in positions), s.start, None)


# The comparison ----------------------------------------------------------------------------------------------

class Labelled:
    """What EpochSampler reads of a dataset: its labels, its classes, its length."""

    def __init__(self, size: int, classes: int) -> None:
        self.labels = np.arange(size) * 7 % classes  # every class present, unevenly
        self.classes = [str(c) for c in range(classes)]

    def __len__(self) -> int:
        return len(self.labels)


LAYOUTS = {  # build_train_loader's EpochSampler options per data config (batch 4 per process where it matters)
    "plain": {},
    "pairs": {"unit": 2},  # mixup/cutmix pairs
    "repeats": {"repeats": 3},  # data.aug_repeats=3
    "pairs+repeats2": {"unit": 2, "repeats": 2},
    "pairs+repeats3": {"unit": 2, "repeats": 3},  # blocks of 4, a short last block
    "balanced": {"balanced": True},
    "balanced+pairs+repeats": {"balanced": True, "unit": 2, "repeats": 2},
    "groups": {"group": 4, "unit": 4},  # data.mix_mode=batch, timm's partners
    "groups+roll": {"group": 4, "unit": 4, "roll": True},  # torchvision's partners
    "groups+repeats": {"group": 2, "unit": 2, "repeats": 2},
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("size", [61, 100])
def test_the_vectorized_epoch_order_is_the_pure_python_one(layout, size):
    options = dict(LAYOUTS[layout])
    for world in (1, 2, 3):
        if "group" in options:
            options["step"] = options["group"] * world * 2  # two process batches of a group per optimizer step
        for rank, epoch, start in itertools.product(range(world), (0, 5), (0, 3)):
            sampler = EpochSampler(Labelled(size, 5), num_replicas=world, rank=rank, shuffle=True, seed=11,
                                   drop_last=True, **options)
            sampler.set_epoch(epoch, start)
            expected = list(reference_keys(sampler))
            assert len(expected) == len(sampler) > 0
            assert list(sampler) == expected, (layout, size, world, rank, epoch, start)


def test_the_order_is_built_from_arrays_not_a_tuple_per_sample():
    """What made 1.28M images cost 2.3 s per epoch on every rank (6.1 s without gc.freeze): a Python list and a
    tuple per sample before the first batch. The order is now arrays (docs/benchmarks.md has the timing)."""
    sampler = EpochSampler(Labelled(1000, 5), num_replicas=2, rank=0, shuffle=True, seed=0, drop_last=True,
                           unit=2, repeats=2)
    indices, repeats = sampler.global_order()
    assert isinstance(indices, np.ndarray) and isinstance(repeats, np.ndarray) and len(indices) == 1000
