"""EMA warmup (timm ModelEmaV3 use_warmup) and best.pth chosen on the EMA's val_top1 (train.best_on_ema)."""

from __future__ import annotations

import pytest
import torch

import evaluate
import train
from core.cli import report_errors
from tests.helpers import TINY, read_jsonl


def ema_after_two_steps(out, *overrides: str) -> tuple[dict, dict, dict]:
    """One optimizer step per epoch, two epochs: (model after step 1, model after step 2, EMA after step 2)."""
    argv = [*TINY, "data.dummy_train_size=8", "train.epochs=2", "train.keep_last_k=2", "model.ema_decay=0.99",
            f"output_dir={out}", *overrides]
    assert report_errors(train.main, argv) == 0
    first, second = (torch.load(out / f"epoch_000{i}.pth", weights_only=True) for i in (0, 1))
    return first["model"], second["model"], second["ema"]


@pytest.mark.parametrize("warmup, decay", [pytest.param(False, 0.99, marks=pytest.mark.slow),
                                           (True, 1 - 2 ** (-2 / 3))])
def test_ema_warmup_uses_timm_warmup_decay(warmup, decay, tmp_path):
    """Step 1 copies the model (timm: decay 0 at the first update); step 2 averages with 0.99, or with
    warmup with 1 - (1 + 1)^(-2/3) (timm's use_warmup, gamma 1, power 2/3): global step drives it, so a resume
    continues it."""
    w1, w2, ema = ema_after_two_steps(tmp_path / "run", f"model.ema_warmup={str(warmup).lower()}")
    for name, value in ema.items():
        if value.is_floating_point() and "running" not in name:
            assert torch.allclose(value, decay * w1[name] + (1 - decay) * w2[name], atol=1e-6), name


@pytest.mark.parametrize("best_on_ema", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_best_pth_is_chosen_on_the_ema_metric(best_on_ema, tmp_path, capsys):
    out = tmp_path / "run"
    argv = [*TINY, "train.epochs=3", "model.ema_decay=0.5", "optim.lr=0.1", f"output_dir={out}",
            f"train.best_on_ema={str(best_on_ema).lower()}"]
    assert report_errors(train.main, argv) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    chosen = "ema_val_top1" if best_on_ema else "val_top1"
    other = "val_top1" if best_on_ema else "ema_val_top1"
    best_row = max(rows, key=lambda row: row[chosen])  # the first of equals, as the run keeps the first
    best = torch.load(out / "best.pth", weights_only=True)
    assert [r[chosen] for r in rows] != [r[other] for r in rows]  # else this test could not tell them apart
    assert (best["metric_value"], best["best_value"], best["best_epoch"], best["epoch"] - 1) == (
        best_row[chosen], best_row[chosen], best_row["epoch"], best_row["epoch"])
    assert best["best_metric"] == chosen and "ema" in best and "model" in best
    if best_on_ema:  # evaluate.py --ema on best.pth gives the top-1 it was chosen on; without --ema it says so
        assert report_errors(evaluate.main, [str(out / "best.pth"), "--ema", "--output-dir", str(tmp_path / "e")]) == 0
        assert evaluate_top1(tmp_path / "e") == best["metric_value"]
        capsys.readouterr()
        assert report_errors(evaluate.main, [str(out / "best.pth"), "--output-dir", str(tmp_path / "m")]) == 0
        assert "add --ema" in capsys.readouterr().err


def evaluate_top1(out) -> float:
    import json

    return json.loads((out / "eval.json").read_text())["top1"]


@pytest.mark.slow
def test_a_resume_that_changes_the_best_metric_restarts_the_best(tmp_path, capsys):
    """best_value measured the model's val_top1; a resume choosing on ema_val_top1 must not compare the two."""
    out = tmp_path / "run"
    base = [*TINY, "model.ema_decay=0.5", f"output_dir={out}"]
    assert report_errors(train.main, [*base, "train.best_on_ema=false"]) == 0
    last = torch.load(out / "last.pth", weights_only=True)
    assert last["best_metric"] == "val_top1"
    last["best_value"] = 100.0  # unbeatable, were it compared with the EMA's top-1
    torch.save(last, out / "last.pth")
    assert report_errors(train.main, [*base, "train.epochs=2", "train.best_on_ema=true"]) == 0
    best = torch.load(out / "best.pth", weights_only=True)
    row = read_jsonl(out / "metrics.jsonl")[-1]
    assert (best["epoch"], best["best_metric"], best["metric_value"]) == (2, "ema_val_top1", row["ema_val_top1"])
    assert "best.pth is now chosen on ema_val_top1" in capsys.readouterr().err


def _bn_stack(blocks: int) -> torch.nn.Module:
    torch.manual_seed(blocks)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3, padding=1), torch.nn.BatchNorm2d(3))
                                 for _ in range(blocks)])


def _train_a_little(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    model(torch.randn(4, 3, 8, 8))  # running stats and num_batches_tracked move, in place


@pytest.mark.parametrize("warmup", [False, True])
def test_cached_ema_equals_timm_model_ema_v3(warmup):
    from timm.utils import ModelEmaV3

    from models.ema import create_ema

    model = _bn_stack(3).train()
    ours, timms = create_ema(model, 0.9, warmup), ModelEmaV3(model, decay=0.9, use_warmup=warmup)
    for step in range(1, 5):
        _train_a_little(model)
        ours.update(model, step=step)
        timms.update(model, step=step)
    expected = timms.module.state_dict()
    for name, value in ours.module.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_ema_update_costs_the_same_for_any_number_of_layers():
    """A fixed number of ops per update (two foreach calls), where timm's ModelEmaV3 walks two state_dicts."""
    from timm.utils import ModelEmaV3

    from models.ema import create_ema
    from tests.helpers import op_counter

    def ops_per_update(make_ema, blocks: int) -> int:
        model = _bn_stack(blocks)
        ema = make_ema(model)
        ema.update(model, step=1)  # the first update may build what later ones reuse
        with op_counter() as count:
            ema.update(model, step=2)
        return sum(count.ops.values())

    ours = [ops_per_update(lambda m: create_ema(m, 0.9), blocks) for blocks in (2, 8)]
    theirs = [ops_per_update(lambda m: ModelEmaV3(m, decay=0.9), blocks) for blocks in (2, 8)]
    assert ours[0] == ours[1] <= 2, ours
    assert theirs[1] > theirs[0], theirs  # the count does see a per-layer cost


def test_ema_reset_epochs_is_torchvisions_warmup_reset():
    """model.ema_reset_epochs=2 is torchvision's rule (references/classification/train.py, train_one_epoch):
    `model_ema.update_parameters(model)`, then `if epoch < args.lr_warmup_epochs: model_ema.n_averaged.fill_(0)`,
    with its ExponentialMovingAverage (utils.py: AveragedModel(..., ema_avg, use_buffers=True), ema_avg =
    decay * avg_model_param + (1 - decay) * model_param), updated every step (--model-ema-steps 1). The first
    step of epoch 2 copies too (n_averaged is 0 there): a reset only inside the warmup epochs misses it."""
    from torch.optim.swa_utils import AveragedModel

    from engine.hooks import EmaUpdate
    from engine.state import TrainState
    from models.ema import create_ema

    torch.manual_seed(0)
    decay, warmup_epochs = 0.5, 2
    model = _bn_stack(2).train()
    ours = create_ema(model, decay)
    source = AveragedModel(model, avg_fn=lambda avg, param, n: decay * avg + (1 - decay) * param, use_buffers=True)
    hook, state = EmaUpdate(ours, model, reset_epochs=warmup_epochs), TrainState()
    for epoch in range(4):
        for _ in range(3):
            _train_a_little(model)
            state.step_done(0.0)
            hook.after_step(state)
            source.update_parameters(model)
            if epoch < warmup_epochs:
                source.n_averaged.fill_(0)
            expected = source.module.state_dict()
            for name, value in ours.module.state_dict().items():
                if value.is_floating_point():  # torchvision averages num_batches_tracked as well (ints)
                    torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-6, msg=name)
        state.finish_epoch()
