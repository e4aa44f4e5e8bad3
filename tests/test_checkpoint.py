"""Checkpoint files on real disks: atomic writes, RNG round trips, weight loading, resume bookkeeping."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import timm
import torch
import torchvision

from core.config import Config, DataConfig, ModelConfig, TrainConfig, to_dict
from core.dist import DistInfo
from core.errors import UserError
from core.files import save_atomic
from core.logs import MetricsFile, run_summary
from data.loader import EpochSampler, ShardSampler
from engine.checkpoint.formats import load_checkpoint
from engine.checkpoint.inference import load_trained
from engine.checkpoint.resume import check_resumable, set_rng_state
from engine.checkpoint.saver import Checkpointer, rng_state
from engine.checkpoint.weights import load_weights, read_pretrained
from engine.state import TrainState
from tests.helpers import as_written_before_the_rename, start_from, REPO, script_env


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this")


def test_failed_save_keeps_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "last.pth"
    save_atomic({"w": torch.arange(5)}, path)
    with pytest.raises(RuntimeError, match="cannot pickle"):
        save_atomic({"w": torch.zeros(1000), "bad": Unpicklable()}, path)
    assert torch.equal(load_checkpoint(path)["w"], torch.arange(5))
    assert [p.name for p in tmp_path.iterdir()] == ["last.pth"]


def test_process_killed_mid_save_leaves_the_old_file_loadable(tmp_path):
    path = tmp_path / "last.pth"
    save_atomic({"w": torch.arange(5)}, path)
    # The child starts writing a new checkpoint and stalls inside torch.save until it is killed.
    child = textwrap.dedent(f"""
        import sys, time, torch
        sys.path.insert(0, {str(REPO)!r})
        from core.files import save_atomic

        class Stall:
            def __reduce__(self):
                print("writing", flush=True)
                time.sleep(120)

        save_atomic({{"w": torch.ones(1_000_000), "stall": Stall()}}, {str(path)!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True, env=script_env())
    try:
        assert proc.stdout.readline().strip() == "writing"
        temps = [p for p in tmp_path.iterdir() if p.name != "last.pth"]
        assert len(temps) == 1  # the half-written temp file exists right now
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert torch.equal(load_checkpoint(path)["w"], torch.arange(5))
    with pytest.raises(UserError, match="is not a checkpoint|cannot be read"):
        load_checkpoint(temps[0])  # what the crash left is not a checkpoint, and last.pth never pointed to it
    # The next save removes it, and what an older version left (no pid in the name); nothing else that is hidden.
    older, others = tmp_path / ".best.pth.0a1b2c3d.tmp", [".last.pth.keep", ".config.yaml.1.0a1b2c3d.tmp", ".notes"]
    for name in [older.name, *others]:
        (tmp_path / name).write_bytes(b"x")
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    Checkpointer(tmp_path, DistInfo(0, 1, 0, 1, torch.device("cpu")), 0, model=model, optimizer=optimizer,
                 scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1), scaler=None, config={},
                 class_names=["a", "b"]).save(TrainState(global_step=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["last.pth", *others])


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    torch.rand(7), np.random.rand(3), random.random()
    save_atomic({"rng": [rng_state()]}, tmp_path / "rng.pth")
    expected = (torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)])
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    set_rng_state(load_checkpoint(tmp_path / "rng.pth")["rng"][0])
    assert torch.equal(torch.rand(5), expected[0])
    assert np.array_equal(np.random.rand(5), expected[1])
    assert [random.random() for _ in range(5)] == expected[2]



def test_init_from_a_torchvision_state_dict_resets_only_the_head(tmp_path, caplog):
    torch.manual_seed(0)
    source = torchvision.models.resnet18(num_classes=1000).state_dict()
    torch.save(source, tmp_path / "tv.pth")
    with caplog.at_level("INFO"):
        model = start_from(tmp_path / "tv.pth", "resnet18", 7)
    assert "classifier fc.weight, fc.bias freshly initialised" in caplog.text
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in source.items() if not k.startswith("fc."))
    assert loaded["fc.weight"].shape == (7, 512)


def test_init_from_our_checkpoint_and_wrong_architectures(tmp_path):
    torch.manual_seed(0)
    ours = timm.create_model("resnet10t", num_classes=5)
    ddp_style = {f"module.{k}": v for k, v in ours.state_dict().items()}
    torch.save({"model": ddp_style, "epoch": 3}, tmp_path / "ours.pth")
    fresh = start_from(tmp_path / "ours.pth", "resnet10t", 5)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in ours.state_dict().items())  # head too: 5 classes
    with pytest.raises(UserError, match=r"model.init_from=.*ours.pth does not fit .*missing: "):
        start_from(tmp_path / "ours.pth", "resnet18", 5)
    with pytest.raises(UserError, match=r"checkpoint x does not fit this model \(shape differs: fc.weight: "
                                        r"file \[5, 512\] vs model \[3, 512\]"):
        load_weights(timm.create_model("resnet10t", num_classes=3), ours.state_dict(), "checkpoint x")
    torch.save([1, 2, 3], tmp_path / "list.pth")
    with pytest.raises(UserError, match="holds no model state dict"):
        read_pretrained(tmp_path / "list.pth")


def training_checkpoint(model: str, classes: list[str], epoch_step: int = 0) -> dict:
    config = Config(model=ModelConfig(name=model), train=TrainConfig(batch_size=8))
    return {"model": {}, "optimizer": {}, "epoch": 1, "global_step": 8, "epoch_step": epoch_step,
            "config": to_dict(config), "class_names": classes, "rng": [{}], "world_size": 1}


def test_check_resumable_names_the_mismatch(tmp_path):
    cfg = Config(model=ModelConfig(name="resnet10t"), train=TrainConfig(batch_size=8))
    classes = ["a", "b", "c"]
    check_resumable(training_checkpoint("resnet10t", classes), tmp_path, cfg, classes, 1)
    with pytest.raises(UserError, match="is a resnet18 but model.name is resnet10t"):
        check_resumable(training_checkpoint("resnet18", classes), tmp_path, cfg, classes, 1)
    with pytest.raises(UserError, match="has 2 classes but the data has 3"):
        check_resumable(training_checkpoint("resnet10t", ["a", "b"]), tmp_path, cfg, classes, 1)
    with pytest.raises(UserError, match="other class names .*'x' vs 'c'"):
        check_resumable(training_checkpoint("resnet10t", ["a", "b", "x"]), tmp_path, cfg, classes, 1)
    mid_epoch = training_checkpoint("resnet10t", classes, epoch_step=3)
    check_resumable(mid_epoch, tmp_path, cfg, classes, 1)
    # The same global batch of 8 on 2 processes continues it; 16 on 2, or 8 on 3, would split the epoch elsewhere.
    check_resumable(mid_epoch, tmp_path, Config(model=cfg.model, train=TrainConfig(batch_size=4)), classes, 2)
    check_resumable(mid_epoch, tmp_path, Config(model=cfg.model, train=TrainConfig(batch_size=2, accum_steps=2)),
                    classes, 2)
    with pytest.raises(UserError, match=r"stopped mid-epoch with a global batch of 8 .* this run's is 16: with 2 "
                                        r"process\(es\) set train.batch_size x train.accum_steps = 4 "):
        check_resumable(mid_epoch, tmp_path, cfg, classes, 2)
    with pytest.raises(UserError, match=r"this run's is 24: no batch size fits on 3 process\(es\): use a number "
                                        r"of processes that divides 8"):
        check_resumable(mid_epoch, tmp_path, cfg, classes, 3)
    check_resumable(training_checkpoint("resnet10t", classes), tmp_path, cfg, classes, 3)  # epoch boundary: any
    by_rank = Config(model=cfg.model, train=TrainConfig(batch_size=4), data=DataConfig(name="wds", root="s3://b/s"))
    with pytest.raises(UserError, match=r"stopped mid-epoch on 1 process\(es\) reading WebDataset shards by rank "
                                        r"\(data.shard_order=auto: .*this run has 2; resume it on 1 process\(es\)"):
        check_resumable(mid_epoch, tmp_path, by_rank, classes, 2)  # same global batch, another deal of the shards
    check_resumable(training_checkpoint("resnet10t", classes), tmp_path, by_rank, classes, 2)  # epoch boundary
    with pytest.raises(UserError, match="not a training checkpoint .*no optimizer"):
        check_resumable({"model": {}}, tmp_path, cfg, classes, 1)


def test_a_sharded_mid_epoch_checkpoint_is_not_sent_to_epoch_files(tmp_path):
    """train.ckpt_format=sharded writes no epoch_NNNN.pth: the way out of a global batch that does not fit its
    mid-epoch last.dcp is the end of that epoch (a file-format checkpoint still names its epoch files)."""
    cfg = Config(model=ModelConfig(name="resnet10t"), train=TrainConfig(batch_size=8))
    folder = {**training_checkpoint("resnet10t", ["a"], epoch_step=3), "format": "sharded", "optimizer_rest": {}}
    del folder["optimizer"]
    with pytest.raises(UserError) as caught:
        check_resumable(folder, tmp_path / "last.dcp", cfg, ["a"], 2)
    assert "resume from an end-of-epoch checkpoint" not in str(caught.value)
    assert str(caught.value).endswith("; or let the run reach the end of epoch 1 with that global batch first "
                                      "(train.ckpt_format=sharded writes no epoch_NNNN.pth; a last.dcp from an "
                                      "epoch's end resumes with any global batch)")
    # Issue 51 item 16: a file-format checkpoint was sent to `epoch_NNNN.pth` whether the folder held one or not.
    mid_epoch = training_checkpoint("resnet10t", ["a"], epoch_step=3)
    with pytest.raises(UserError) as caught:
        check_resumable(mid_epoch, tmp_path / "last.pth", cfg, ["a"], 2)
    assert str(caught.value).endswith(f"; or let the run reach the end of epoch 1 with that global batch first "
                                      f"({tmp_path} holds no epoch_NNNN.pth: train.keep_last_k keeps them; a last.pth "
                                      "from an epoch's end resumes with any global batch)"), caught.value
    for name in ("epoch_0000.pth", "epoch_0001.pth"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(UserError) as caught:
        check_resumable(mid_epoch, tmp_path / "last.pth", cfg, ["a"], 2)
    assert str(caught.value).endswith(f"; or resume={tmp_path / 'epoch_0001.pth'} (an end-of-epoch checkpoint, where "
                                      "the batch may change)"), caught.value


def test_epoch_sampler_start_skips_exactly_the_consumed_samples():
    full = EpochSampler(range(103), num_replicas=2, rank=1, shuffle=True, seed=5, drop_last=True)
    full.set_epoch(4)
    order = list(full)
    resumed = EpochSampler(range(103), num_replicas=2, rank=1, shuffle=True, seed=5, drop_last=True)
    state = TrainState(epoch=4, epoch_step=3)
    resumed.set_epoch(4, start=state.samples_done(accum_steps=2, batch_size=4, batches_per_epoch=12))
    assert len(resumed) == len(order) - 24 and list(resumed) == order[24:]
    resumed.set_epoch(5)  # the next epoch starts from the beginning again
    assert len(list(resumed)) == len(order)


def test_a_mid_epoch_resume_continues_each_ranks_own_batches():
    """The training loaders of 2 ranks (dealt as on 2 processes; no group needed), 3 optimizer steps of 2
    micro-batches done: TrainState.set_loader_epoch points each at exactly the batches that rank had not reached, so
    the position counts this rank's samples, not the global batch's."""
    from core.config import DataConfig
    from core.dist import DistInfo
    from data.loader import build_datasets, build_train_loader

    cfg = DataConfig(name="dummy", img_size=16, dummy_image_size=16, dummy_train_size=64, dummy_val_size=2,
                     num_workers=0)
    train, _ = build_datasets(cfg, seed=0)
    for rank in (0, 1):
        loader = build_train_loader(train, cfg, 4, seed=0, info=DistInfo(rank, 2, rank, 2, torch.device("cpu")))
        TrainState(epoch=2).set_loader_epoch(loader, accum_steps=2)
        whole = list(loader.batch_sampler)  # (epoch, index) keys of each batch: what the DataLoader loads
        TrainState(epoch=2, epoch_step=3).set_loader_epoch(loader, accum_steps=2)
        assert len(whole) == 8 and list(loader.batch_sampler) == whole[6:]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_eval_shards_are_whole_batches(world):
    size, batch = 101, 8
    shards = [ShardSampler(size, r, world, batch) for r in range(world)]
    assert [i for s in shards for i in s] == list(range(size))
    assert all(s.start % batch == 0 for s in shards)


def test_metrics_rows_of_resumed_epochs_are_dropped(tmp_path):
    metrics = MetricsFile(tmp_path / "metrics.jsonl")
    metrics.keep_only(lambda row: row["epoch"] < 0)  # no file yet: nothing to do
    for epoch in range(4):
        metrics.append({"epoch": epoch, "val_top1": 10.0 * epoch + 0.1})
    metrics.keep_only(lambda row: row["epoch"] < 2)
    assert metrics.rows() == [{"epoch": 0, "val_top1": 0.1}, {"epoch": 1, "val_top1": 10.1}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_checkpoint_written_before_the_rename_loads_with_todays_names(tiny_run, tmp_path):
    """best_top1 and val_top1 of an older checkpoint (the best and the last value of train.best_metric, whatever the
    metric) are read as best_value and metric_value: by the loop state, and by evaluate/predict/export."""
    today = load_checkpoint(tiny_run / "best.pth")
    torch.save(as_written_before_the_rename(today), tmp_path / "best.pth")
    old = load_checkpoint(tmp_path / "best.pth")
    assert (old["best_value"], old["metric_value"]) == (today["best_value"], today["metric_value"])
    assert not {"best_top1", "val_top1"} & set(old)
    state = TrainState()
    state.load_state_dict(old)
    assert (state.epoch, state.best_value, state.best_epoch) == (today["epoch"], today["best_value"], None)
    recorded = load_trained(tmp_path / "best.pth").metrics
    assert recorded == load_trained(tiny_run / "best.pth").metrics
    assert recorded[f"best {today['best_metric']} of the run"] == round(today["best_value"], 4)


def test_run_summary_names_the_best_metric_its_epoch_and_the_speed():
    rows = [{"epoch": 0, "train_loss": 2.0, "val_loss": 1.5, "val_top1": 40.0, "val_top5": 90.0, "ema_val_loss": 1.6,
             "train_images": 1000, "epoch_time_s": 10.0, "train_img_per_s": 100.0},
            {"epoch": 1, "train_loss": 1.0, "val_loss": 1.25, "val_top1": 50.0, "val_top5": 95.0, "ema_val_loss": 1.2,
             "train_images": 1000, "epoch_time_s": 30.0, "train_img_per_s": 33.3}]
    text = run_summary(rows, "ema_val_loss", 1.2, 1, 3725.0, "runs/x")
    assert text.splitlines() == [
        "*** best ema_val_loss 1.2000 at epoch 1 (best.pth)",
        "*** last epoch 1: train_loss 1.0000 val_loss 1.2500 val_top1 50.00 val_top5 95.00 ema_val_loss 1.2000",
        "*** 2 whole epoch(s) in metrics.jsonl, training at 50 img/s; wall time 1:02:05; outputs in runs/x"]  # 2000 / 40 s
    assert run_summary([], "val_top1", float("-inf"), None, 1.0, "runs/x").splitlines() == [
        "*** no best val_top1: no evaluation gave a number", "*** no epoch in metrics.jsonl; wall time 0:00:01; "
        "outputs in runs/x"]


def test_run_summary_counts_an_epoch_cut_short_apart():
    """A train.max_steps=27 stop on 22 steps an epoch said "2 epoch(s)" with one finished; a stop at a validation
    inside the first epoch (train.val_every_steps) said "training at img/s n/a"."""
    whole = {"epoch": 0, "step": 22, "val_top1": 40.0, "train_images": 1408, "epoch_time_s": 10.0}
    short = {"epoch": 1, "step": 27, "val_top1": 45.0, "train_images": 320, "epoch_time_s": 2.0}
    text = run_summary([whole, short], "val_top1", 45.0, 1, 12.0, "runs/x", cut_short=True)
    assert text.splitlines()[-1] == ("*** 1 whole epoch(s), epoch 1 cut short at step 27 in metrics.jsonl, training "
                                     "at 144 img/s; wall time 0:00:12; outputs in runs/x")  # 1728 / 12 s
    inside = [{"epoch": 0, "step": 5, "val_top1": 40.0}, {"epoch": 0, "step": 10, "val_top1": 42.0}]
    text = run_summary(inside, "val_top1", 42.0, 0, 3.0, "runs/x", cut_short=True)
    assert text.splitlines()[-1] == ("*** 0 whole epoch(s), epoch 0 cut short at step 10 and 2 validation(s) inside "
                                     "epochs in metrics.jsonl, no training speed (measured at an epoch's end, which "
                                     "this run did not reach); wall time 0:00:03; outputs in runs/x")


def test_an_early_stop_says_which_epoch_or_step_it_came_after():
    """Checked before epoch 1 (state.epoch is already 1), the stop came after epoch 0's last step: it said "stopping
    early at epoch 1, step 22"; inside an epoch it names the step of that epoch."""
    from core.config import TrainConfig
    from engine.state import stop_reason

    state = TrainState()
    state.epoch, state.global_step, state.validations_without_best, state.best_value = 1, 22, 3, 80.0
    reason = stop_reason(TrainConfig(early_stop_patience=3), state, "val_top1")
    assert reason == ("stopping early after epoch 0 (global step 22): val_top1 has not improved for 3 validations "
                      "(train.early_stop_patience=3 counts validations); best val_top1 80.0000"), reason
    state.epoch_step, state.global_step = 5, 27
    assert stop_reason(TrainConfig(early_stop_patience=3), state, "val_top1").startswith(
        "stopping early after step 5 of epoch 1 (global step 27): ")


@pytest.mark.parametrize("content", [b"hello", bytes(np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8)),
                                     b"PK\x03\x04" + b"\x00" * 100, b"\x80\x02\x8a\x0a" + b"\x00" * 100])
def test_a_file_that_is_not_a_checkpoint_is_named_in_one_line(content, tmp_path):
    path = tmp_path / "notes.pth"
    path.write_bytes(content)
    with pytest.raises(UserError) as caught:
        load_checkpoint(path)
    message = str(caught.value)
    assert message.startswith(f"checkpoint {path} ") and "not a checkpoint" in message, message
    assert "could run code" not in message


def test_an_old_legacy_format_state_dict_still_loads(tmp_path):
    path = tmp_path / "old.pth"  # e.g. torchvision's 2017 weights files
    torch.save({"w": torch.arange(3.0)}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(load_checkpoint(path)["w"], torch.arange(3.0))
