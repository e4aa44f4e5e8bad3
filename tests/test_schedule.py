"""LR schedule and optimizer knobs: decay at the configured epochs, warmup in steps, and config-time errors.

The schedules are driven as train.py drives them: built by engine.optim.build_scheduler from the config, then
`step_update(global_step)` after every optimizer step; `epoch_lrs` records the lr each step trained with.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import train
from engine.cli import report_errors
from engine.config import load_config
from engine.errors import UserError
from engine.optim import build_optimizer, build_scheduler
from tests.helpers import TINY, read_jsonl


def step_lrs(overrides: list[str], epochs: int, updates_per_epoch: int) -> list[list[float]]:
    """The lr of every optimizer step, per epoch, for a schedule built from `overrides` as fit() builds it."""
    cfg = load_config(None, ["optim.lr=0.1", f"train.epochs={epochs}", *overrides])
    optimizer = build_optimizer(nn.Linear(2, 2), cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.sched, cfg.train.epochs, updates_per_epoch)
    lrs, step = [], 0
    for _ in range(epochs):
        lrs.append([])
        for _ in range(updates_per_epoch):
            lrs[-1].append(optimizer.param_groups[0]["lr"])
            step += 1
            scheduler.step_update(num_updates=step)
    return lrs


def epoch_lrs(overrides: list[str], epochs: int, updates_per_epoch: int = 3) -> list[float]:
    """The lr of each epoch, for schedules that hold it constant through an epoch."""
    lrs = step_lrs(overrides, epochs, updates_per_epoch)
    assert all(len(set(epoch)) == 1 for epoch in lrs), lrs
    return [epoch[0] for epoch in lrs]


def test_step_decays_every_decay_epochs_by_decay_rate():
    got = epoch_lrs(["sched.name=step", "sched.decay_epochs=2", "sched.decay_rate=0.5"], epochs=5)
    assert got == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025])


def test_multistep_decays_at_the_milestones():
    got = epoch_lrs(["sched.name=multistep", "sched.decay_milestones=[1, 3]", "sched.decay_rate=0.1"], epochs=5)
    assert got == pytest.approx([0.1, 0.01, 0.01, 0.001, 0.001])


def test_warmup_in_steps_rises_linearly_from_warmup_lr():
    lrs = [lr for epoch in step_lrs(["sched.name=constant", "sched.warmup_steps=4", "sched.warmup_lr=0.02"],
                                    epochs=2, updates_per_epoch=3) for lr in epoch]
    assert lrs == pytest.approx([0.02, 0.04, 0.06, 0.08, 0.1, 0.1])


def test_warmup_in_epochs_counts_updates_per_epoch():
    lrs = [lr for epoch in step_lrs(["sched.name=constant", "sched.warmup_epochs=1", "sched.warmup_lr=0.04"],
                                    epochs=2, updates_per_epoch=3) for lr in epoch]
    assert lrs == pytest.approx([0.04, 0.06, 0.08, 0.1, 0.1, 0.1])


def test_cooldown_epochs_hold_min_lr_at_the_end():
    lrs = step_lrs(["sched.name=cosine", "sched.cooldown_epochs=2", "sched.min_lr=0.001"], epochs=5,
                   updates_per_epoch=3)
    assert lrs[0][0] == pytest.approx(0.1) and lrs[2][-1] > 0.001  # the cosine spans epochs 0-2
    assert lrs[3] + lrs[4] == pytest.approx([0.001] * 6)


@pytest.mark.parametrize("overrides, message", [
    (["sched.name=plateau"], "sched.name 'plateau' is not supported"),
    (["sched.name=step"], "sched.name=step needs sched.decay_epochs > 0"),
    (["sched.name=multistep"], "sched.name=multistep needs sched.decay_milestones"),
    (["sched.name=multistep", "sched.decay_milestones=[3, 2]"], "must increase"),
    (["sched.name=multistep", "sched.decay_milestones=[0, 2]"], "must increase"),
    (["sched.warmup_epochs=1", "sched.warmup_steps=100"], "set sched.warmup_epochs or sched.warmup_steps, not both"),
    (["sched.name=step", "sched.decay_epochs=30", "sched.cooldown_epochs=5"],
     "sched.cooldown_epochs applies to schedules with an end"),
    (["sched.cooldown_epochs=10"], "sched.cooldown_epochs must be below train.epochs"),
    (["sched.name=cosinee"], "config key 'sched.name' is 'cosinee'; choose one of"),
    (["sched.decay_rate=0"], "config key 'sched.decay_rate' must be > 0"),
    (["sched.warmup_steps=-1"], "config key 'sched.warmup_steps' must be >= 0"),
])
def test_schedule_mistakes_are_config_errors(overrides, message):
    """Caught when the config loads (also by --dry-run and --print-config), never at run time."""
    with pytest.raises(UserError) as err:
        load_config(None, ["train.epochs=10", *overrides])
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_step_schedule_in_a_run_decays_at_the_configured_epoch(tmp_path):
    """fit() passes the epochs and steps per epoch: the lr column (the lr after each epoch's last update,
    i.e. the next epoch's) shows the decay after epoch 1, not timm's default of 90 epochs."""
    out = tmp_path / "run"
    argv = [*TINY, "train.epochs=3", "sched.name=step", "sched.decay_epochs=2", "sched.decay_rate=0.1",
            f"output_dir={out}"]
    assert report_errors(train.main, argv) == 0
    assert [row["lr"] for row in read_jsonl(out / "metrics.jsonl")] == pytest.approx([0.01, 0.001, 0.001])
