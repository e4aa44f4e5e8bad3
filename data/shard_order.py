"""data.shard_order=by_rank: each rank trains on its own whole shards, read shard after shard, so a node copies from
object storage only the shards its ranks read, and only once while data.shard_cache holds them (as wids'
DistributedChunkedSampler: "workers end up with a fixed set of shards they need to download"), with the same number
of samples on every rank and an exact mid-epoch resume.

The deal, once per run: the shard sizes are laid out into slots, one list per rank (largest first, each to the rank
holding the fewest samples so far), and the shards of each size, permuted (seeded by `seed`), fill the slots of that
size: the ranks' shard sets are disjoint, hold equal shares to within one shard, and keep to their rank for the whole
run (webdataset's detshuffle + split_by_node deals anew each epoch: every node then copies every shard over a run).
Each epoch a rank reads its shards in an order seeded by (seed, epoch, rank), its samples shuffled within about
SHUFFLE_SHARDS shards' worth of positions (each sample's place in the stream plus a uniform jitter, sorted: a bounded
shuffle buffer, in array operations). Every rank reads as many samples as the rank holding the fewest; the longer
ranks' streams are cut there (drop_last: the samples cut are the ends of their last shards, other ones each epoch).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

SHUFFLE_SHARDS = 2  # a sample moves up to this many (mean) shards' worth of positions in its rank's stream


def slot_layout(counts: Sequence[int], world: int) -> list[tuple[int, int]]:
    """(rank, shard size) slots, largest first, each to the rank then holding the fewest samples (the lowest rank
    on a tie): the ranks' totals differ by at most one shard, and depend on the sizes alone."""
    loads = [(0, rank) for rank in range(world)]
    slots = []
    for size in sorted(counts, reverse=True):
        load, rank = heapq.heappop(loads)
        slots.append((rank, int(size)))
        heapq.heappush(loads, (load + int(size), rank))
    return slots


class ShardPlan:
    """Which shards rank `rank` of `world` reads in each epoch and in what order: the sampler's order and the order
    the dataset copies shards from a URL in."""

    def __init__(self, counts: Sequence[int], seed: int, rank: int, world: int, unit: int = 1) -> None:
        self.counts = np.asarray(counts, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)])
        self.seed, self.rank, self.world = seed, rank, world
        self.slots = slot_layout(self.counts, world)
        loads = [sum(size for owner, size in self.slots if owner == r) for r in range(world)]
        self.num_samples = min(loads) // unit * unit  # the same on every rank (drop_last)
        self.mine = self.dealt()

    def dealt(self) -> list[int]:
        """This rank's shards for the whole run: each slot filled by the next of the permuted shards of its size."""
        deal = np.random.default_rng([self.seed])
        pools = {size: iter(deal.permutation(np.flatnonzero(self.counts == size)).tolist())
                 for size in np.unique(self.counts).tolist()}
        filled = [(rank, next(pools[size])) for rank, size in self.slots]
        return [shard for rank, shard in filled if rank == self.rank]

    def shards(self, epoch: int) -> list[int]:
        """This rank's shards in the order it reads them in `epoch`."""
        return np.random.default_rng([self.seed, epoch, 1, self.rank]).permutation(self.mine).tolist()

    def span(self) -> float:
        """How far (in positions) the shuffle may move a sample in its rank's stream."""
        return SHUFFLE_SHARDS * float(self.counts.mean())

    def order(self, epoch: int) -> np.ndarray:
        """The sample indices this rank reads in `epoch`, num_samples of them."""
        shards = self.shards(epoch)
        samples = np.concatenate([np.arange(self.starts[s], self.starts[s + 1]) for s in shards] or
                                 [np.zeros(0, np.int64)])
        jitter = np.random.default_rng([self.seed, epoch, 2, self.rank]).uniform(0, self.span(), len(samples))
        return samples[np.argsort(np.arange(len(samples)) + jitter, kind="stable")][:self.num_samples]

    def first_shard(self, epoch: int, start: int) -> int:
        """The earliest (in this rank's order) shard its reading of `epoch` from sample `start` on may need: the
        shuffle only delays a sample, by less than span() positions."""
        shards = self.shards(epoch)
        ends = np.cumsum(self.counts[shards])
        return shards[min(int(np.searchsorted(ends, max(start - self.span(), 0), side="right")), len(shards) - 1)]


class ByRankSampler(Sampler[tuple[int, ...]]):
    """The training sampler of data.shard_order=by_rank: ShardPlan's order as (epoch, index) keys, or with mixing in
    pairs (epoch, index, 0, pair), positions 2k and 2k+1 of a rank forming pair k world + rank (a pair id no other
    rank uses: data/mixing.py draws each pair's mix from it). `set_epoch(epoch, start)` skips this rank's first
    `start` samples of the epoch (a resumed run continues exactly), as data.loader.EpochSampler's; `warm(epoch,
    start)` (data/shards.ShardDataset.warm) is told each epoch's start."""

    start = 0
    epoch = 0

    def __init__(self, plan: ShardPlan, mixed: bool = False, warm: Callable[[int, int], None] | None = None) -> None:
        self.plan, self.mixed, self.warm = plan, mixed, warm
        self.num_samples = plan.num_samples

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The epoch read next, from this rank's sample `start` on; `warm` starts copying its first shards."""
        self.epoch, self.start = epoch, start
        if self.warm is not None:
            self.warm(epoch, start)

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        indices = self.plan.order(self.epoch)[self.start:].tolist()
        epoch = itertools.repeat(self.epoch)
        if not self.mixed:
            return zip(epoch, indices)
        pairs = np.arange(self.start, self.num_samples) // 2 * self.plan.world + self.plan.rank
        return zip(epoch, indices, itertools.repeat(0), pairs.tolist())

    def __len__(self) -> int:
        return max(self.num_samples - self.start, 0)
