"""LR schedule and optimizer knobs: decay at the configured epochs, warmup in steps, and config-time errors.

The schedules are driven as train.py drives them: built by engine.optim.build_scheduler from the config, then
`step_update(global_step)` after every optimizer step; `epoch_lrs` records the lr each step trained with.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import train
from core.cli import report_errors
from core.config import with_derived
from core.config_load import load_config
from core.errors import UserError
from engine.optim import batch_and_lr, build_optimizer, build_scheduler
from tests.compare import nvidia_cosine_lr
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
    (["sched.name=plateau", "sched.decay_rate=2"], "sched.name=plateau: sched.decay_rate=2 would not lower the lr"),
    (["sched.name=onecycle", "sched.warmup_epochs=1"], "sched.warmup_epochs=1 does not apply to sched.name=onecycle"),
    (["sched.name=plateau", "sched.cooldown_epochs=1"], "sched.cooldown_epochs=1 does not apply to sched.name=plateau"),
    (["sched.name=onecycle", "sched.min_lr=0.001"], "sched.min_lr=0.001 does not apply to sched.name=onecycle"),
    (["sched.name=onecycle", "sched.cycle_momentum=[0.95, 0.85]"], "must be [base, max] with 0 <= base <= max < 1"),
    (["sched.cycle_momentum=[0.85, 0.95]"], "sched.cycle_momentum applies to sched.name=onecycle, not cosine"),
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


@pytest.mark.slow
def test_resume_with_another_global_batch_continues_the_schedule_at_its_epoch(tmp_path):
    """An end-of-epoch checkpoint at batch 8 resumed at batch 16 (half the updates per epoch): from there the lr
    is the batch-16 run's at the same epoch (its global step, counted in batch-8 updates, would be an epoch ahead)."""
    common = [*TINY, "train.epochs=3", "sched.name=cosine", "optim.lr=0.1"]
    assert report_errors(train.main, [*common, "train.batch_size=16", f"output_dir={tmp_path}/straight"]) == 0
    resumed = f"output_dir={tmp_path}/resumed"
    assert report_errors(train.main, [*common, "train.batch_size=8", "train.max_steps=4", resumed]) == 0
    assert report_errors(train.main, [*common, "train.batch_size=16", resumed]) == 0
    lrs = [[row["lr"] for row in read_jsonl(tmp_path / name / "metrics.jsonl")] for name in ("straight", "resumed")]
    assert lrs[1][1:] == pytest.approx(lrs[0][1:]) and lrs[0][1] > 0.01  # cosine, still far from its end


@pytest.mark.parametrize("world, accum, expected", [(1, 1, 24), (2, 1, 12), (3, 2, 4)])
def test_global_batch_size_sets_the_batch_per_process(world, accum, expected):
    cfg = load_config(None, ["train.global_batch_size=24", f"train.accum_steps={accum}"])
    assert with_derived(cfg, **batch_and_lr(cfg, world)).train.batch_size == expected
    five = load_config(None, ["train.batch_size=5"])
    assert with_derived(five, **batch_and_lr(five, world)).train.batch_size == 5  # 0: off


@pytest.mark.parametrize("overrides, message", [
    (["train.global_batch_size=20"], r"is 20, which does not give a whole batch per process on 3 process\(es\) x "
                                     r"train.accum_steps=1; use a multiple of 3"),
    (["train.global_batch_size=9", "data.mixup_alpha=0.2"], r"an even number of images per process \(mixing pairs "
                                                             r"them\) .* use a multiple of 6"),
])
def test_global_batch_size_that_does_not_divide_is_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        batch_and_lr(load_config(None, overrides), 3)


def optimizer_for(overrides: list[str], model: nn.Module | None = None) -> torch.optim.Optimizer:
    """The optimizer fit() builds for `overrides`, after the start-up check of the optim section."""
    from engine.optim import check_optimizer

    cfg = load_config(None, overrides)
    check_optimizer(cfg.optim)
    return build_optimizer(model or nn.Linear(2, 2), cfg.optim)


def test_betas_eps_and_nesterov_reach_the_optimizer():
    adamw = optimizer_for(["optim.name=adamw", "optim.betas=[0.9, 0.95]", "optim.eps=1e-6"])
    assert adamw.defaults["betas"] == (0.9, 0.95) and adamw.defaults["eps"] == 1e-6
    assert optimizer_for(["optim.name=adamw"]).defaults["betas"] == (0.9, 0.999)  # unset: the optimizer's own
    assert optimizer_for(["optim.name=sgd"]).defaults["nesterov"] is True  # timm's sgd is Nesterov SGD
    assert optimizer_for(["optim.name=sgd", "optim.nesterov=false"]).defaults["nesterov"] is False
    assert optimizer_for(["optim.name=momentum", "optim.nesterov=true"]).defaults["nesterov"] is True


@pytest.mark.parametrize("overrides, message", [
    (["optim.betas=[0.9]"], "config key 'optim.betas' must be [beta1, beta2]"),
    (["optim.betas=[0.9, 1.5]"], "config key 'optim.betas' must be [beta1, beta2]"),
    (["optim.eps=-1"], "config key 'optim.eps' must be > 0"),
    (["optim.layer_decay=1.5"], "config key 'optim.layer_decay' must be in [0, 1]"),
    (["optim.lr_base_scale=cube"], "config key 'optim.lr_base_scale' is 'cube'; choose one of linear, sqrt"),
    (["optim.lr_base=0.1", "optim.lr_base_size=0"], "config key 'optim.lr_base_size' must be > 0"),
    (["optim.nesterov=maybe"], "config key 'optim.nesterov' must be bool or null, got 'maybe'"),
])
def test_optimizer_config_mistakes(overrides, message):
    with pytest.raises(UserError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["optim.name=sgd", "optim.betas=[0.9, 0.99]"], "optim.betas: optimizer 'sgd' has no betas"),
    (["optim.name=sgd", "optim.eps=1e-8"], "optim.eps: optimizer 'sgd' has no eps"),
    (["optim.name=adamw", "optim.nesterov=true"], "optim.nesterov: optimizer 'adamw' has no Nesterov option"),
    (["optim.name=adamz"], "optim.name 'adamz' is not a timm optimizer"),
])
def test_optimizer_option_it_does_not_take_is_a_start_up_error(overrides, message, tmp_path, capsys):
    """Found before the data is built, so --dry-run finds it too."""
    argv = ["--dry-run", *TINY, f"output_dir={tmp_path / 'run'}", *overrides]
    assert report_errors(train.main, argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err.strip().splitlines()[-1], err


def test_layer_decay_scales_the_lr_per_block_of_a_vit():
    from models.factory import create_model

    cfg = load_config(None, ["model.name=vit_tiny_patch16_224", "model.kwargs.img_size=32", "optim.name=adamw",
                             "optim.layer_decay=0.5"])
    optimizer = optimizer_for(["optim.name=adamw", "optim.layer_decay=0.5"], create_model(cfg.model, 3))
    scales = sorted({group["lr_scale"] for group in optimizer.param_groups})
    assert scales == pytest.approx([0.5 ** k for k in range(13, -1, -1)])  # embeddings, 12 blocks, head


@pytest.mark.parametrize("world, accum, scale, expected", [
    (1, 1, "linear", 0.025), (2, 1, "linear", 0.05), (2, 2, "linear", 0.1), (1, 1, "sqrt", 0.05),
    (2, 1, "sqrt", 0.1 * 0.5 ** 0.5),
])
def test_lr_base_scales_with_the_global_batch(world, accum, scale, expected):
    """optim.lr = lr_base x (batch_size x world size x accum_steps / lr_base_size), or its square root."""
    cfg = load_config(None, ["optim.lr_base=0.1", "train.batch_size=64", f"train.accum_steps={accum}",
                             f"optim.lr_base_scale={scale}"])
    assert with_derived(cfg, **batch_and_lr(cfg, world)).optim.lr == pytest.approx(expected)
    given = load_config(None, ["optim.lr=0.3"])
    assert with_derived(given, **batch_and_lr(given, world)).optim.lr == 0.3  # lr_base=0: lr as given


def lr_of_a_run(rank: int, world: int, out: str) -> dict:
    """Train TINY for one step on this rank with optim.lr_base; return the lr the optimizer used and the log."""
    import logging

    from core.dist import DistInfo
    from assembly.fit import fit

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("engine.optim").addHandler(handler)  # the lr rule says how it got the lr (rank 0 only)
    logging.getLogger("engine.optim").setLevel(logging.INFO)
    cfg = load_config("dummy", [*TINY[2:], "train.max_steps=1", "optim.lr_base=0.1", "optim.lr_base_size=32",
                                "sched.name=constant", f"output_dir={out}"])
    fit(cfg, DistInfo(rank, world, rank, world, torch.device("cpu")))
    ckpt = torch.load(f"{out}/last.pth", weights_only=True)
    return {"lr": ckpt["optimizer"]["param_groups"][0]["lr"], "config_lr": ckpt["config"]["optim"]["lr"],
            "log": [line for line in lines if "optim.lr" in line]}


@pytest.mark.slow
def test_lr_base_in_one_and_two_rank_runs(tmp_path):
    """A real 2-process gloo group trains at lr_base x 16 / 32 (8 per rank): rank 0 logs it, the checkpoint keeps it."""
    from tests.helpers import run_ranks

    one = lr_of_a_run(0, 1, str(tmp_path / "one"))
    two = run_ranks(lr_of_a_run, 2, tmp_path, str(tmp_path / "two"))
    assert (one["lr"], one["config_lr"]) == (pytest.approx(0.025), pytest.approx(0.025))  # 8 / 32 x 0.1
    assert [(r["lr"], r["config_lr"]) for r in two] == [(pytest.approx(0.05), pytest.approx(0.05))] * 2
    assert len(two[0]["log"]) == 1 and two[1]["log"] == []
    assert "optim.lr 0.05 = optim.lr_base 0.1 x global batch 16 / 32 (linear)" in two[0]["log"][0]


def test_a_schedule_timm_refuses_is_found_by_dry_run(tmp_path, capsys):
    """wsd's decay phase longer than the run: timm raises when the schedule is built, which --dry-run now does."""
    argv = ["--dry-run", *TINY, f"output_dir={tmp_path / 'run'}", "train.epochs=2", "sched.name=wsd",
            "sched.decay_epochs=5"]
    assert report_errors(train.main, argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "sched.name 'wsd' is not usable" in err.strip().splitlines()[-1], err


# ---- schedule shape and stepping as the recipes' sources run them (issue 31) ------------------------------


def timm_step_lrs(epochs: int, updates_per_epoch: int, step_on_epochs: bool, **kwargs) -> list[list[float]]:
    """The lr of every optimizer step from timm's own create_scheduler_v2, driven as timm's train.py drives it:
    per epoch, `step(epoch)` before the epoch's steps; per update, `step_update(num_updates)` after each."""
    from timm.scheduler import create_scheduler_v2

    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler, _ = create_scheduler_v2(optimizer, step_on_epochs=step_on_epochs, updates_per_epoch=updates_per_epoch,
                                       **kwargs)
    lrs, step = [], 0
    for epoch in range(epochs):
        if step_on_epochs:
            scheduler.step(epoch)
        lrs.append([])
        for _ in range(updates_per_epoch):
            lrs[-1].append(optimizer.param_groups[0]["lr"])
            step += 1
            if not step_on_epochs:
                scheduler.step_update(num_updates=step)
    return lrs


@pytest.mark.parametrize("step_on_epochs", [False, True])
@pytest.mark.parametrize("prefix", [False, True])
def test_cosine_with_warmup_prefix_and_epoch_stepping_is_timms(prefix, step_on_epochs):
    """sched.warmup_prefix (cosine over the epochs after warmup: ConvNeXt, torchvision, NVIDIA) and
    sched.step_on_epochs (DeiT, RSB, torchvision, NVIDIA) give timm's schedule for the same settings."""
    epochs, per_epoch, warmup = 10, 4, 3
    got = step_lrs(["sched.name=cosine", f"sched.warmup_epochs={warmup}", "sched.warmup_lr=0.01", "sched.min_lr=0.001",
                    f"sched.warmup_prefix={str(prefix).lower()}", f"sched.step_on_epochs={str(step_on_epochs).lower()}"],
                   epochs, per_epoch)
    expected = timm_step_lrs(epochs, per_epoch, step_on_epochs, sched="cosine", warmup_epochs=warmup, warmup_lr=0.01,
                             min_lr=0.001, warmup_prefix=prefix, num_epochs=epochs - warmup if prefix else epochs)
    assert sum(got, []) == pytest.approx(sum(expected, []), rel=1e-12, abs=0)
    assert all(len(set(epoch)) == 1 for epoch in got) == step_on_epochs
    assert (got[warmup][0] == pytest.approx(0.1)) == prefix  # with the prefix the cosine starts at the peak


def test_step_schedule_stepped_per_epoch_is_timms():
    got = step_lrs(["sched.name=step", "sched.decay_epochs=2", "sched.decay_rate=0.5", "sched.warmup_epochs=1",
                    "sched.step_on_epochs=true"], epochs=6, updates_per_epoch=3)
    expected = timm_step_lrs(6, 3, True, sched="step", decay_epochs=2, decay_rate=0.5, warmup_epochs=1,
                             warmup_lr=1e-5, num_epochs=6)
    assert sum(got, []) == pytest.approx(sum(expected, []), rel=1e-12, abs=0)


def test_nvidia_warmup_and_cosine_are_deeplearningexamples_policy():
    """configs/resnet50.yaml's schedule: lr/8 in epoch 0 up to lr in epoch 7, then cosine over the other 82."""
    got = epoch_lrs(["sched.name=cosine", "sched.warmup_epochs=8", "sched.warmup_prefix=true",
                     "sched.step_on_epochs=true", "sched.warmup_shape=nvidia", "sched.min_lr=0"], epochs=90,
                    updates_per_epoch=2)
    assert got == pytest.approx([nvidia_cosine_lr(0.1, 8, 90, e) for e in range(90)], rel=1e-12, abs=1e-18)


def test_epoch_stepped_schedule_resumes_mid_epoch():
    """A resumed run rebuilds the schedule and calls step_update(global_step): the lr is the uninterrupted one."""
    overrides = ["sched.warmup_epochs=2", "sched.warmup_prefix=true", "sched.step_on_epochs=true",
                 "sched.warmup_shape=nvidia"]
    lrs = [lr for epoch in step_lrs(overrides, epochs=6, updates_per_epoch=5) for lr in epoch]
    cfg = load_config(None, ["optim.lr=0.1", "train.epochs=6", *overrides])
    for global_step in (7, 12, 23):
        optimizer = build_optimizer(nn.Linear(2, 2), cfg.optim)
        build_scheduler(optimizer, cfg.sched, 6, 5).step_update(num_updates=global_step)
        assert optimizer.param_groups[0]["lr"] == lrs[global_step]


def deit_epoch_lrs(epochs: int, **kwargs) -> list[float]:
    """The lr of each epoch from timm's own create_scheduler_v2, driven as DeiT's main.py drives it: the epoch
    trains, then `lr_scheduler.step(epoch)`."""
    from timm.scheduler import create_scheduler_v2

    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler, _ = create_scheduler_v2(optimizer, num_epochs=epochs, **kwargs)
    lrs = []
    for epoch in range(epochs):
        lrs.append(optimizer.param_groups[0]["lr"])  # train_one_epoch
        scheduler.step(epoch)
    return lrs


def test_epoch_lag_is_deits_step_after_each_epoch():
    """sched.epoch_lag=1 with sched.step_on_epochs (configs/deit_small*.yaml): every step of epoch e trains at the
    value for max(e - 1, 0), the lr of timm's scheduler with DeiT's settings (cosine, warmup from 1e-6, min 1e-5)
    stepped after each epoch; the lr is a function of the global step, so a mid-epoch resume continues it."""
    epochs, per_epoch = 10, 3
    settings = ["sched.name=cosine", "sched.warmup_epochs=5", "sched.warmup_lr=1e-6", "sched.min_lr=1e-5",
                "sched.step_on_epochs=true"]
    expected = deit_epoch_lrs(epochs, sched="cosine", warmup_epochs=5, warmup_lr=1e-6, min_lr=1e-5)
    got = epoch_lrs([*settings, "sched.epoch_lag=1"], epochs, per_epoch)
    assert got == pytest.approx(expected, rel=1e-12, abs=0)
    plain = epoch_lrs(settings, epochs, per_epoch)  # timm's train.py: epoch e at e's value
    assert got[0] == got[1] == plain[0] == 1e-6 and got[2:] == plain[1:-1] and got != plain
    steps = [lr for lr in got for _ in range(per_epoch)]
    cfg = load_config(None, ["optim.lr=0.1", f"train.epochs={epochs}", *settings, "sched.epoch_lag=1"])
    for global_step in (1, 4, 7, 14, 29):
        optimizer = build_optimizer(nn.Linear(2, 2), cfg.optim)
        build_scheduler(optimizer, cfg.sched, epochs, per_epoch).step_update(num_updates=global_step)
        assert optimizer.param_groups[0]["lr"] == steps[global_step]


@pytest.mark.parametrize("overrides, message", [
    (["sched.warmup_shape=nvidia", "sched.warmup_epochs=2"], "sched.warmup_shape=nvidia is NVIDIA's per-epoch "
                                                             "warmup; set sched.step_on_epochs=true"),
    (["sched.step_on_epochs=true", "sched.warmup_steps=10"], "with sched.step_on_epochs=true give sched.warmup_epochs"),
    (["sched.epoch_lag=1"], "sched.epoch_lag=1 shifts a schedule stepped once per epoch; set "
                            "sched.step_on_epochs=true"),
    (["sched.warmup_prefix=true", "sched.warmup_epochs=10"], "sched.warmup_prefix=true: sched.warmup_epochs 10 "
                                                             "leaves no epoch of train.epochs 10"),
])
def test_schedule_option_mistakes_are_config_errors(overrides, message):
    with pytest.raises(UserError) as err:
        load_config(None, ["train.epochs=10", *overrides])
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("overrides, warning", [
    (["sched.warmup_epochs=5"], "sched.warmup_epochs 5 is not below train.epochs 2: the lr rises for the whole run "
                                "and never reaches optim.lr"),
    (["sched.warmup_steps=100"], "sched.warmup_steps 100 is more than the run's 8 optimizer steps"),
    (["sched.name=multistep", "sched.decay_milestones=[1, 3, 4]"],
     "sched.decay_milestones 3, 4 are beyond the last epoch (train.epochs 2): those decays never happen"),
    (["sched.name=step", "sched.decay_epochs=2"], "sched.decay_epochs 2 is not below train.epochs 2"),
])
def test_a_schedule_longer_than_the_run_is_warned_at_start(overrides, warning, capsys):
    """issue 23 item 24: accepted, with one warning line giving the numbers (also under --dry-run)."""
    assert report_errors(train.main, ["--dry-run", *TINY, "train.epochs=2", *overrides, "output_dir=/nonexistent/x"]) == 0
    err = capsys.readouterr().err
    assert warning in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("drop", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["drop_last_accum", "last-group-steps"])
def test_steps_per_epoch_with_accumulation_follow_convnexts_rule_when_dropping(drop, tmp_path):
    """train.drop_last_accum: ConvNeXt's main.py takes num_training_steps_per_epoch = len(dataset_train) //
    (batch_size x update_freq x world size) and its engine.py skips every micro-batch with data_iter_step //
    update_freq >= it; 40 images in batches of 4 with accum 3 (10 micro-batches): 3 steps of 36 images there,
    where the default steps a last group of one micro-batch too (ceil: 4 steps, 40 images)."""
    images, batch, accum = 40, 4, 3
    out = tmp_path / "run"
    argv = [*TINY, f"data.dummy_train_size={images}", f"train.batch_size={batch}", f"train.accum_steps={accum}",
            f"train.drop_last_accum={str(drop).lower()}", f"output_dir={out}"]
    assert report_errors(train.main, argv) == 0
    steps = torch.load(out / "last.pth", weights_only=True)["global_step"]
    trained = read_jsonl(out / "metrics.jsonl")[0]["train_images"]
    num_training_steps_per_epoch = images // (batch * accum * 1)  # ConvNeXt main.py, world size 1
    micro_batches = sum(1 for data_iter_step in range(images // batch)  # engine.py's skip
                        if data_iter_step // accum < num_training_steps_per_epoch)
    if drop:
        assert (steps, trained) == (num_training_steps_per_epoch, micro_batches * batch) == (3, 36)
    else:
        assert (steps, trained) == (4, images)  # ceil(10 / 3) steps, every image


def test_drop_last_accum_without_a_whole_group_is_one_line():
    from torch.utils.data import DataLoader

    from data.loader import steps_per_epoch

    with pytest.raises(UserError, match=r"train.drop_last_accum=true: each process gets 2 batches per epoch, fewer "
                                        r"than train.accum_steps=3"):
        steps_per_epoch(DataLoader(range(2)), 3, drop_last_accum=True)


def test_raising_epochs_on_a_finished_cosine_run_says_the_tail_lr():
    """Issue 61: train.epochs 10 -> 12 on a finished run rebuilds the cosine over 12 epochs from epoch 10 on: the
    extra epochs train at its tail, whose lr (timm's own CosineLRScheduler, side by side) the warning gives with the
    way to a whole schedule instead; not raised: nothing to say."""
    from timm.scheduler import CosineLRScheduler

    from core.config import SchedConfig
    from engine.optim import extension_warning

    reference = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    cosine = CosineLRScheduler(reference, t_initial=60, lr_min=0.0, t_in_epochs=False)  # 12 epochs x 5 updates
    tail = []
    for update in (50, 59):
        cosine.step_update(num_updates=update)
        tail.append(reference.param_groups[0]["lr"])
    assert 0 < tail[1] < tail[0] < 0.1 * 0.07  # near zero: the tail of the rebuilt cosine
    assert extension_warning(SchedConfig(name="cosine"), 0.1, 10, 12, 5, "runs/x/last.pth") == (
        f"train.epochs 10 -> 12 continues a finished run: sched.name=cosine is rebuilt over 12 epochs from epoch 10 "
        f"on, so the extra epochs train at lr {tail[0]:.3g} falling to {tail[1]:.3g} (optim.lr 0.1); for a whole "
        "schedule instead, start a new run from these weights: model.init_from=runs/x/last.pth resume=none in "
        "another output_dir")
    assert extension_warning(SchedConfig(name="cosine"), 0.1, 10, 10, 5, "runs/x/last.pth") is None


@pytest.mark.parametrize("settings", [
    {"pct_start": 0.25, "div_factor": 10.0, "final_div_factor": 100.0, "anneal_strategy": "cos"},
    {"pct_start": 0.4, "anneal_strategy": "linear", "three_phase": True, "cycle_momentum": [0.8, 0.9]},
])
def test_onecycle_is_torchs_one_cycle_lr_at_every_step(settings):
    """sched.name=onecycle: the lr (and with sched.cycle_momentum the momentum) of every optimizer step is torch's
    OneCycleLR's with the same settings, stepped after each optimizer step as torch's documentation does; a resumed
    run's schedule, rebuilt and put at its global step, continues it exactly."""
    epochs, per_epoch = 4, 5
    overrides = ["sched.name=onecycle", *(f"sched.{k}={v}" for k, v in settings.items())]
    got = sum(step_lrs(overrides, epochs, per_epoch), [])
    param = nn.Parameter(torch.zeros(1))
    reference = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    moms = settings.pop("cycle_momentum", None)
    torch_schedule = torch.optim.lr_scheduler.OneCycleLR(
        reference, max_lr=0.1, total_steps=epochs * per_epoch, cycle_momentum=moms is not None,
        **({"base_momentum": moms[0], "max_momentum": moms[1]} if moms else {}), **settings)
    expected, momenta = [], []
    for _ in range(epochs * per_epoch):
        expected.append(reference.param_groups[0]["lr"])
        momenta.append(reference.param_groups[0]["momentum"])
        reference.step()
        torch_schedule.step()
    assert got == expected
    cfg = load_config(None, ["optim.lr=0.1", f"train.epochs={epochs}", *overrides])
    for global_step in (0, 7, 13, 19):
        optimizer = build_optimizer(nn.Linear(2, 2), cfg.optim)
        build_scheduler(optimizer, cfg.sched, epochs, per_epoch).step_update(num_updates=global_step)
        assert optimizer.param_groups[0]["lr"] == expected[global_step]
        assert optimizer.param_groups[0]["momentum"] == (momenta[global_step] if moms else 0.9)


def test_plateau_is_torchs_reduce_lr_on_plateau_and_survives_a_checkpoint(tmp_path):
    """sched.name=plateau: after each counted validation the lr is torch's ReduceLROnPlateau's (factor
    sched.decay_rate, patience, threshold, cooldown, min_lr; mode min for val_loss) fed the same values, and the row
    shows it; its state, saved mid-way as a checkpoint holds it and loaded (weights_only) into a rebuilt schedule,
    continues it exactly. A train.max_steps stop's validation is not counted: the resumed run validates that epoch
    again at its end."""
    from engine.hooks import EpochEnd, StepOnMetric

    values = [2.0, 1.5, 1.49, 1.6, 1.5, 1.2, 1.3, 1.3, 1.3, 1.3, 1.3, 1.3, 1.1]
    overrides = ["optim.lr=0.1", "sched.name=plateau", "sched.decay_rate=0.5", "sched.plateau_patience=1",
                 "sched.plateau_threshold=0.05", "sched.plateau_cooldown=1", "sched.min_lr=0.02",
                 "train.best_metric=val_loss"]
    reference = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    torch_schedule = torch.optim.lr_scheduler.ReduceLROnPlateau(reference, mode="min", factor=0.5, patience=1,
                                                                threshold=0.05, cooldown=1, min_lr=0.02)
    expected = []
    for value in values:
        torch_schedule.step(value)
        expected.append(reference.param_groups[0]["lr"])
    assert len(set(expected)) == 4  # decays, cooldown and the floor all reached

    def rows(first: int, last: int, state: dict | None = None) -> tuple[list[float], dict]:
        cfg = load_config(None, overrides)
        optimizer = build_optimizer(nn.Linear(2, 2), cfg.optim)
        schedule = build_scheduler(optimizer, cfg.sched, 10, 3, lower_is_better=True)
        if state is not None:
            optimizer.param_groups[0]["lr"] = state["lr"]  # the checkpoint's optimizer state holds it
            schedule.load_state_dict(state["scheduler"])
        hook, lrs = StepOnMetric(schedule, "val_loss", optimizer), []
        for value in values[first:last]:
            hook.after_epoch(None, EpochEnd({"val_loss": 9.9, "lr": -1.0}, False, finished=False))  # a max_steps stop
            end = EpochEnd({"val_loss": value, "lr": -1.0}, False, finished=True)
            hook.after_epoch(None, end)
            lrs.append(end.row["lr"])
        return lrs, {"lr": optimizer.param_groups[0]["lr"], "scheduler": schedule.state_dict()}

    assert rows(0, len(values))[0] == expected
    first, state = rows(0, 5)
    torch.save(state, tmp_path / "state.pth")
    second, _ = rows(5, len(values), torch.load(tmp_path / "state.pth", weights_only=True))
    assert first + second == expected


@pytest.mark.slow  # three tiny runs in this process (~12 s)
def test_plateau_run_resumed_continues_its_counters(tmp_path):
    """A real run stopped after epoch 0 and resumed: its lr column is the uninterrupted run's. The threshold no value
    can beat makes every validation a bad one (whatever the tiny run's values): with patience 1 the lr halves after
    epochs 1 and 3, which a resumed run that forgot epoch 0's count would do after epochs 2 and 4."""
    common = [*TINY, "train.epochs=4", "optim.lr=0.1", "sched.name=plateau", "sched.plateau_patience=1",
              "sched.decay_rate=0.5", "sched.plateau_threshold=10", "train.best_metric=val_loss"]
    assert report_errors(train.main, [*common, f"output_dir={tmp_path}/straight"]) == 0
    resumed = f"output_dir={tmp_path}/resumed"
    assert report_errors(train.main, [*common, "train.max_steps=4", resumed]) == 0
    assert report_errors(train.main, [*common, resumed]) == 0
    lrs = [[row["lr"] for row in read_jsonl(tmp_path / name / "metrics.jsonl")] for name in ("straight", "resumed")]
    assert lrs[0] == lrs[1] == [0.1, 0.05, 0.05, 0.025]
