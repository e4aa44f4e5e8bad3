"""data.size_schedule (progressive resizing): each epoch's training crops at its size, decided in the loader's
workers by the epoch the sampler gives them; a run stopped inside the schedule resumes to the uninterrupted run's
bits; bad schedules are one line. (1 process against 2 ranks: tests/test_correctness.py's BatchNorm runs train
with a schedule.)"""

from __future__ import annotations

import pytest
import torch

from core.config import DataConfig, train_size
from core.config_load import config_from_dict, load_config
from core.dist import DistInfo
from core.errors import UserError
from data.loader import build_datasets, build_train_loader
from engine.checkpoint.formats import load_checkpoint
from tests.compare import allow_best_of_the_stop, assert_same, rows_without_timing
from tests.helpers import TINY, read_jsonl, train_here

SCHEDULE = [[0, 8], [1, 12], [3, 16]]  # epoch 2 keeps epoch 1's 12 px


def test_train_size_follows_the_schedule_and_ends_at_img_size():
    cfg = DataConfig(img_size=16, size_schedule=SCHEDULE)
    assert [train_size(cfg, epoch) for epoch in range(5)] == [8, 12, 12, 16, 16]
    assert train_size(DataConfig(img_size=16), 3) == 16  # no schedule: data.img_size throughout


def test_loader_workers_crop_each_epoch_at_its_size():
    """One persistent worker, started in epoch 0, serves epochs 1 and 3 at their sizes (nothing set in this process
    reaches it after it started); timm's RandAugment translates by 0.45 of each epoch's crop."""
    cfg = load_config("dummy", [*TINY[2:], f"data.size_schedule={SCHEDULE}", "data.num_workers=1",
                                "data.auto_augment=rand-m9-mstd0.5-inc1", "train.epochs=4"]).data
    train, _ = build_datasets(cfg, seed=0)
    loader = build_train_loader(train, cfg, 8, seed=0, info=DistInfo(0, 1, 0, 1, torch.device("cpu")))
    seen = {}
    for epoch in (0, 1, 3):
        loader.sampler.set_epoch(epoch)
        seen[epoch] = {tuple(images.shape[-2:]) for images, _ in loader}
    assert seen == {0: {(8, 8)}, 1: {(12, 12)}, 3: {(16, 16)}}
    translate = {size: policy.transforms[0].policy.ops[0].hparams["translate_const"]
                 for size, (_, policy) in train.sized.by_size.items()}
    assert translate == {8: 3, 12: 5, 16: 7}


@pytest.mark.parametrize("schedule, message", [
    ([[1, 8], [2, 16]], "its epochs must start at 0 and rise"),
    ([[0, 8], [0, 16]], "its epochs must start at 0 and rise"),
    ([[0, 8, 1]], "use [[epoch, size], ...]"),
    ([[0, 8], [4, 16]], "epoch 4 is never trained (train.epochs=4, the last epoch is 3)"),
    ([[0, 8], [2, 12]], "it ends at 12 px and data.img_size is 16; set data.img_size=12"),
    ([[0, 24], [2, 16]], "every size must be > 0 and at most data.img_size=16"),
    ([[0, 0], [2, 16]], "every size must be > 0"),
])
def test_a_bad_schedule_is_one_line_naming_the_key(schedule, message):
    with pytest.raises(UserError) as err:
        config_from_dict({"data": {"img_size": 16, "size_schedule": schedule}, "train": {"epochs": 4}})
    text = str(err.value)
    assert text.startswith(f"config key 'data.size_schedule' is {schedule}") and message in text and "\n" not in text


def test_a_run_stopped_inside_the_schedule_resumes_to_the_uninterrupted_bits(tmp_path, capsys):
    """4 epochs of 4 steps at 8, 12, 12, 16 px, with a loader worker, augmentation and an EMA (whose BatchNorm
    buffers follow the sizes too); stopped at step 6 (inside epoch 1, at 12 px), then resumed: last.pth and
    metrics.jsonl are the uninterrupted run's (best.pth may be the stop's evaluation, as in tests/test_resume.py). Each size change is said once."""
    args = [*TINY, f"data.size_schedule={SCHEDULE}", "train.epochs=4", "data.num_workers=1", "model.ema_decay=0.9"]
    train_here(*args, f"output_dir={tmp_path / 'straight'}")
    said = [line.split(" INFO ")[1] for line in capsys.readouterr().err.splitlines() if "data.size_schedule" in line]
    assert said == [f"epoch {epoch}: training crops of {size} px from here (data.size_schedule; evaluation at 16 px)"
                    for epoch, size in SCHEDULE]
    out = tmp_path / "stopped"
    train_here(*args, f"output_dir={out}", "train.max_steps=6")
    partial = load_checkpoint(out / "last.pth")
    assert (partial["epoch"], partial["epoch_step"]) == (1, 2)  # mid-epoch 1
    stop_top1 = read_jsonl(out / "metrics.jsonl")[-1][partial["best_metric"]]  # the evaluation at the stop
    train_here(*args, f"output_dir={out}")
    expected, resumed = load_checkpoint(tmp_path / "straight" / "last.pth"), load_checkpoint(out / "last.pth")
    allow_best_of_the_stop(expected, resumed, stop_top1, partial["epoch"])
    assert_same(expected, resumed)
    assert rows_without_timing(out) == rows_without_timing(tmp_path / "straight")


def test_a_model_of_one_input_size_fed_others_is_one_line_at_the_start(capsys):
    """A ViT built for one size (timm's strict patch embedding) stopped training at its first batch with timm's
    assertion; the start now refuses it naming the keys and what to set, which then trains."""
    import timm

    import train
    from core.cli import report_errors
    from models.factory import check_input_sizes, sizes_fed

    fixed = timm.create_model("test_vit", dynamic_img_size=False)  # 160 px only
    cfg = load_config("dummy", ["model.name=test_vit", "data.img_size=16", f"data.size_schedule={SCHEDULE}",
                                "train.epochs=4"])
    with pytest.raises(UserError, match=r"takes 160x160 images only .* data.size_schedule gives 8, 12, 16 px; .*"
                                        r"set model.kwargs.dynamic_img_size=true"):
        check_input_sizes(fixed, cfg.model, sizes_fed(cfg.data))
    with pytest.raises(UserError, match=r"data.val_img_size gives 16 px; evaluate at data.val_img_size=160$"):
        check_input_sizes(fixed, cfg.model, sizes_fed(cfg.data, training=False))
    check_input_sizes(timm.create_model("test_vit", dynamic_img_size=True), cfg.model, sizes_fed(cfg.data))
    check_input_sizes(timm.create_model("test_vit", dynamic_img_size=False, img_size=16), cfg.model,
                      sizes_fed(cfg.data, training=False))
    assert report_errors(train.main, [*TINY, "model.name=test_vit", "model.kwargs.dynamic_img_size=false"]) != 0
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith("error: model.name=test_vit takes 160x160 images only") and said.endswith(
        "set model.kwargs.img_size=16 (timm builds the model for that size, resampling pretrained position "
        "embeddings) or data.img_size=160")
