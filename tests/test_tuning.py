"""train.py --find-lr (the LR range test) and train.batch_size=auto (the batch finder's search), on the CPU.

The range test runs train.py itself on real data, one process in this one and two through a real gloo group; the
batch search is driven through its decision function with injected "fits" rules (the real CUDA rule: test_gpu.py).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch

from core.config import TrainConfig, TuneConfig
from core.dist import min_over_ranks
from core.errors import UserError
from engine.batch_size import (MARGIN, Capacity, capacity, headroom_note, input_bytes_per_image, kept_batch,
                               largest_batch, resolved_batch, whole_groups)
from engine.lr_find import RULE, Diverged, LrRamp, suggest
from engine.state import TrainState
from tests.helpers import TINY, check_one_line, run_on_ranks, run_ranks, train_here

RUN_FILES = ("last.pth", "best.pth", "metrics.jsonl", "config.yaml")


def check_lr_find(out: Path, tune: TuneConfig) -> dict:
    """lr_find.json and a readable lr_find.png in `out`; the suggestion is one of the lrs swept, its minimum's."""
    result = json.loads((out / "lr_find.json").read_text())
    assert matplotlib.image.imread(out / "lr_find.png").shape[2] in (3, 4)
    lrs = result["lrs"]
    assert len(lrs) == len(result["losses"]) == len(result["smoothed_losses"]) == result["steps"] <= tune.steps
    assert lrs[0] == pytest.approx(tune.lr_min) and lrs == sorted(lrs) and lrs[-1] <= tune.lr_max * (1 + 1e-9)
    assert result["suggested_lr"] in lrs and result["rule"] == RULE
    assert result["steepest_lr"] <= result["suggested_lr"] == result["min_loss_lr"]
    assert all(math.isfinite(loss) for loss in result["losses"])
    return result


@pytest.mark.slow  # a 12-step range test after the shared tiny run
def test_find_lr_writes_its_curve_and_leaves_the_run_folder_alone(tiny_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(tiny_run, out)  # a finished run: --find-lr must neither resume it nor change it
    before = {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()}
    # 4 classes from 1e-2: a loss that falls, then rises (at 10 classes from 1e-4 the smoothed loss never fell
    # below its first value in 12 steps, and the suggestion was the sweep's first lr: issue 51 item 5).
    train_here("--find-lr", *TINY, f"output_dir={out}", "data.dummy_num_classes=4", "tune.steps=12",
               "tune.lr_min=1e-2", "tune.lr_max=1.0")
    result = check_lr_find(out, TuneConfig(lr_min=1e-2, lr_max=1.0, steps=12))
    assert result["lrs"][0] < result["suggested_lr"] < result["lrs"][-1]
    after = {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()}
    assert set(after) - set(before) == {"lr_find.json", "lr_find.png"}
    assert all(after[name] == data for name, data in before.items())


@pytest.mark.slow  # two ranks on the digits: ~10 s
def test_find_lr_on_the_digits_on_two_ranks_with_the_batch_found_on_the_cpu(tmp_path):
    out = tmp_path / "run"
    run_on_ranks("train.py", "--find-lr", "--config", "digits", f"data.root={tmp_path / 'digits'}", f"output_dir={out}",
                 "model.name=test_resnet", "amp=off", "data.num_workers=0", "logging.progress=false",
                 "tune.steps=10", "train.batch_size=auto", "train.global_batch_size=256", nproc=2)
    result = check_lr_find(out, TuneConfig(steps=10))
    # auto on the CPU: 64 per process, so 2 accumulation steps keep the global batch of 256
    assert (result["world_size"], result["batch_size"], result["accum_steps"]) == (2, 64, 2)
    assert not any((out / name).exists() for name in RUN_FILES)


def test_the_ramp_is_exponential_scales_layer_decay_groups_and_stops_on_divergence():
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([{"params": [weight]}, {"params": [], "lr_scale": 0.5}], lr=0.1)
    ramp, state = LrRamp(optimizer, TuneConfig(lr_min=1e-3, lr_max=10.0, steps=5)), TrainState()
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([1e-3, 5e-4])
    with pytest.raises(Diverged, match="passed 4 x its lowest"):
        for loss in (2.0, 1.0, 1.0, 9.0, 40.0):
            state.step_done(0.0)
            ramp.after_interval(state, {"train_loss": loss})
            ramp.step_update(state.global_step)
    assert ramp.lrs == pytest.approx([1e-3, 1e-2, 1e-1, 1.0, 10.0][:len(ramp.lrs)])
    assert ramp.losses[-1] == 40.0 and ramp.smoothed[-1] > 4 * min(ramp.smoothed)
    with pytest.raises(Diverged, match="nan"):
        ramp.after_interval(state, {"train_loss": math.nan})


def test_the_suggestion_is_the_smoothed_minimum_not_the_steepest_descent():
    lrs = [10 ** (-4 + step / 10) for step in range(41)]  # 1e-4 to 1, ten steps a decade, as LrRamp's ramp
    drops = [0.3 if step in (10, 11) else 0.02 for step in range(1, 31)]  # fastest fall at step 10, lowest at 30
    rise = [1.0 + 0.3 * step * (-1) ** step for step in range(1, 11)]  # a diverging run's spikes and recoveries
    smoothed = [*(2.0 - np.cumsum([0.0, *drops])), *(max(loss, 1.1) for loss in rise)]
    result = suggest(lrs, smoothed)
    assert result["suggested_lr"] == result["min_loss_lr"] == lrs[30]  # not the steepest descent's 1e-3
    assert result["steepest_lr"] == lrs[10]
    # No usable minimum, no suggestion (issue 51 items 5, 11): rising from the start, flat (one class: every loss
    # 0), no finite loss at all (the first step NaN). Each said to be the sweep's first lr or raised ValueError.
    for curve, why in (([1.0, 2.0, 3.0], "never fell below"), ([0.0, 0.0, 0.0], "never fell below"),
                       ([], "no finite loss was recorded")):
        result = suggest(lrs[:len(curve)], curve)
        assert result["suggested_lr"] is None and why in result["no_suggestion"], result


def test_find_lr_without_a_minimum_says_so_and_suggests_nothing(tmp_path, capsys):
    """tune.lr_min=1e30: the loss is NaN from the second step, so its only value is the first lr's; --find-lr
    suggested 1e+30 with exit code 0 (issue 51 item 5). Now one line, exit 2, and the curve kept for a look."""
    from core.cli import report_errors
    import train

    argv = ["--find-lr", *TINY, f"output_dir={tmp_path}", "tune.steps=10", "tune.lr_min=1e30", "tune.lr_max=1e35"]
    assert report_errors(train.main, argv) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: --find-lr has no suggestion: the smoothed loss never fell below its value at "
                           "the sweep's first lr 1e+30") and "lower tune.lr_min" in line, line
    assert json.loads((tmp_path / "lr_find.json").read_text())["suggested_lr"] is None


@pytest.mark.parametrize("limit", [2, 3, 37, 64, 1000, 4096, 5000])
def test_largest_batch_finds_the_largest_even_batch_that_fits_in_few_probes(limit):
    probes = []

    def fits(batch: int) -> bool:
        probes.append(batch)
        return batch <= limit

    found = largest_batch(fits, cap=4096)
    assert found == min(limit, 4096) // 2 * 2
    assert len(probes) <= 2 * math.log2(4096) + 1 and all(batch % 2 == 0 and batch <= 4096 for batch in probes)
    assert largest_batch(lambda batch: False, cap=4096) == 0  # not even 2 fits: train.py says so in one line


GIB, MIB = 2**30, 2**20


@pytest.mark.parametrize("per_image_mib, img_size", [(80, 224), (6, 224), (300, 512)])
def test_auto_batch_keeps_back_the_batch_read_ahead_and_the_margin(per_image_mib, img_size):
    """Issue 50 item 1 on a memory model of a GPU (80 GiB; 1.5 GiB of weights and optimizer state; each image's
    step memory): the probe's largest step sits at the memory's edge, where the batch the prefetcher reads ahead
    no longer fits; the kept batch holds it and the margin in the memory the found step proved, and is the largest
    that does."""
    limit, fixed, per_image = 80 * GIB, 1.5 * GIB, per_image_mib * MIB
    peaks: dict[int, int | None] = {}

    def fits(batch: int) -> bool:  # what DeviceFits records on CUDA
        peak = int(fixed + batch * per_image)
        peaks[batch] = peak if peak <= limit else None
        return peak <= limit

    found = capacity(largest_batch(fits, cap=16384), peaks)
    ahead = input_bytes_per_image(img_size)
    kept = kept_batch(found, ahead)

    def real_run(batch: int) -> float:  # the step, the batch read ahead, and the margin kept for NCCL
        return fixed + batch * (per_image + ahead) + MARGIN * found.batch * per_image

    assert found.limited and found.bytes_per_image == pytest.approx(per_image, rel=1e-6)
    assert fixed + found.batch * (per_image + ahead) > limit - MARGIN * found.batch * per_image  # the edge
    proven = fixed + found.batch * per_image  # the memory the found step took: it fit
    assert kept % 2 == 0 and real_run(kept) <= proven < real_run(kept + 2)
    assert f"the largest step that fit was {found.batch}" in headroom_note(found, kept, ahead)
    assert f"kept {kept}" in headroom_note(found, kept, ahead)


def test_auto_batch_capped_by_the_data_keeps_what_it_found():
    """No step ran out of memory (the images per process capped the search): the edge was never reached."""
    assert kept_batch(Capacity(256, 80 * MIB, limited=False), input_bytes_per_image(224)) == 256
    assert kept_batch(Capacity(0, 0.0, limited=True), input_bytes_per_image(224)) == 0


def test_resolved_batch_keeps_the_global_batch_with_the_fewest_accumulation_steps():
    assert resolved_batch(TrainConfig(), 48, world_size=2, even=False) == {"batch_size": 48}
    train = TrainConfig(global_batch_size=256)
    assert resolved_batch(train, 48, world_size=2, even=False) == {"batch_size": 32, "accum_steps": 4}
    assert resolved_batch(train, 200, world_size=1, even=False) == {"batch_size": 128, "accum_steps": 2}
    assert resolved_batch(TrainConfig(global_batch_size=24), 5, world_size=2, even=True) == {"batch_size": 4,
                                                                                             "accum_steps": 3}
    with pytest.raises(UserError, match="train.global_batch_size=15"):  # no even batch divides it
        resolved_batch(TrainConfig(global_batch_size=15), 4, world_size=1, even=True)


def search_on_rank(rank: int, world: int, limits: list[int]) -> int:
    """One rank's search with its own memory limit, then the smallest answer over the ranks (as train.py does)."""
    return min_over_ranks(largest_batch(lambda batch: batch <= limits[rank], cap=4096), torch.device("cpu"))


@pytest.mark.slow  # two real processes (the forkserver's imports)
def test_every_rank_takes_the_smallest_batch_any_rank_found(tmp_path):
    assert run_ranks(search_on_rank, 2, tmp_path, [300, 41]) == [40, 40]


def test_an_auto_batch_holds_whole_mixing_draws():
    """data.mix_mode=batch with data.mix_group 256: a found 300 trains 256, a found 100 trains 64 (4 per draw)."""
    assert [whole_groups(n, 256) for n in (300, 512, 600, 100, 2)] == [256, 512, 512, 64, 2]
    assert whole_groups(4, 6) == 2 and whole_groups(1, 6) == 0


def test_an_auto_batch_with_fewer_images_than_its_smallest_batch_says_so(tmp_path, capsys, monkeypatch):
    """Issue 51 item 18: one training image under train.batch_size=auto said `train.batch_size is 2; lower
    train.batch_size`, a value the user never gave."""
    check_one_line(["train.batch_size=auto", "data.dummy_train_size=1", "--dry-run"],
                   "train.batch_size=auto: each rank gets 1 training image(s), fewer than the smallest batch it tries "
                   "(2); add training images, use fewer processes, or set train.batch_size to a number",
                   tmp_path, tmp_path, capsys, monkeypatch)
