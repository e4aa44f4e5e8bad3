"""data.shard_order=by_rank (data/shard_order.py): the ranks' samplers, built in this process for each rank of 2 (no
process group needed), read disjoint sets of whole shards (the same ones every epoch), the same number of samples
each, a sample at most once an epoch; a resume at a step continues with the rest; the order is resolved from data.shard_order and data.root, and
refused in one line where by_rank cannot be."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from torch.utils.data import DataLoader

from core.config import DataConfig
from core.errors import UserError
from data.loader import dropped_images_note, shard_order
from data.shard_order import ByRankSampler, ShardPlan
from data.shards import ShardDataset

COUNTS = [5, 5, 3, 5, 5, 5, 4]  # samples per shard: 32 in 7 shards, two short ones


def keys(plan: ShardPlan, epoch: int, start: int = 0, mixed: bool = False) -> list[tuple[int, ...]]:
    sampler = ByRankSampler(plan, mixed)
    sampler.set_epoch(epoch, start)
    found = list(sampler)
    assert len(found) == len(sampler)
    return found


def test_by_rank_samplers_read_disjoint_whole_shards_cover_their_epoch_and_resume_with_the_rest():
    plans = [ShardPlan(COUNTS, seed=3, rank=rank, world=2) for rank in range(2)]
    starts = np.concatenate([[0], np.cumsum(COUNTS)])
    assert plans[0].num_samples == plans[1].num_samples == 15  # 17 + 15 samples dealt: each rank reads 15
    held = [set(plan.mine) for plan in plans]
    assert not held[0] & held[1] and held[0] | held[1] == set(range(len(COUNTS)))
    orders = []
    for epoch in range(3):
        read = [[index for _, index in keys(plan, epoch)] for plan in plans]
        assert [set(plan.shards(epoch)) for plan in plans] == held  # the deal holds for the run
        for indices, shards in zip(read, held):
            assert len(indices) == len(set(indices)) == 15  # each sample once
            assert set(np.searchsorted(starts, indices, side="right") - 1) <= shards  # its own shards alone
        mine = {i for shard in held[0] for i in range(starts[shard], starts[shard + 1])}
        assert len(mine - set(read[0])) == sum(COUNTS[s] for s in held[0]) - 15  # only the cut end left out
        orders.append(read)
    assert orders[0] != orders[1] != orders[2]  # another order each epoch
    for plan in plans:
        assert keys(plan, 1, start=6) == keys(plan, 1)[6:]  # a run resumed at sample 6 reads the rest, in order
        assert keys(plan, 1) == [(1, int(i)) for i in plan.order(1)]
    pairs = [{key[3] for key in keys(ShardPlan(COUNTS, 3, rank, 2, unit=2), 0, mixed=True)} for rank in range(2)]
    assert len(pairs[0]) == len(pairs[1]) == 7 and not pairs[0] & pairs[1]  # mixing: pairs of 14, ids apart


def test_the_images_an_uneven_deal_leaves_out_are_said():
    """The start-up note counts, and names, the images of the ranks dealt more than the one with the fewest."""
    loader = DataLoader(list(range(32)), batch_size=4, sampler=ByRankSampler(ShardPlan(COUNTS, 3, 0, 2)), drop_last=True)
    level, line = dropped_images_note(loader, 2, 1, False)
    assert line.startswith("each epoch trains on 24 of the 32 training images (75%): 2 process(es) x 3 batch(es) of "
                           "train.batch_size=4, the rest (2 image(s) of the processes dealt more whole shards than the "
                           "one with the fewest, data.shard_order=by_rank: smaller shards leave out fewer; a last "
                           "partial batch) is left out"), line


def test_the_order_follows_data_shard_order_and_by_rank_where_it_cannot_be_is_one_line(tmp_path):
    """auto: by_rank for shards at a URL, global for local ones and where by_rank cannot be (said why); an explicit
    by_rank that cannot be is refused in one line naming the key and what to set."""
    shards = ShardDataset.__new__(ShardDataset)  # the order reads the dataset's shard list alone
    shards.urls = [f"s3://b/train-{i}.tar" for i in range(3)]
    url = DataConfig(name="wds", root="s3://b")
    assert shard_order(url, shards, 2)[0] == "by_rank"
    assert shard_order(dataclasses.replace(url, root=str(tmp_path)), shards, 2)[0] == "global"
    assert shard_order(dataclasses.replace(url, shard_order="global"), shards, 2)[0] == "global"
    assert shard_order(url, shards, 4) == ("global", "data.shard_order=auto: global (a URL data.root, but 3 shard(s) "
                                                     "for 4 processes needs it)")
    with pytest.raises(UserError, match=r"^data.shard_order=by_rank cannot be used with data.aug_repeats > 1 "):
        shard_order(dataclasses.replace(url, shard_order="by_rank", aug_repeats=3), shards, 2)
    with pytest.raises(UserError, match=r"^data.shard_order=by_rank deals whole WebDataset shards to the processes, "
                                        r"and data.name=dummy has none; set data.shard_order=auto or global$"):
        shard_order(DataConfig(name="dummy", shard_order="by_rank"), shards, 2)
