"""Distributed training computes what single-process training computes (docs/correctness.md).

The training runs are train.py's main in this process or on real ranks with torchrun's variables
(helpers.run_on_ranks; gloo on CPU), and two real torchrun launchers for guarantee 5; the tests compare the
last.pth and metrics.jsonl they leave behind. Each configuration is trained once per
session and shared by the tests that need it. The sampling tests call train.py's `fit` on real ranks
with a spy that records which samples the training loop reads.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.compare import (TOL, assert_same_model, differing_tensors, load_weights, model_rows,
                           relative_differences, worst_tensor)
from tests.helpers import (COMMON, EPOCHS, GLOBAL_BATCH, NO_BN_MODEL, REPO, STEPS, TRAIN_SIZE, VAL_SIZE, free_port,
                           read_jsonl, run_on_ranks, run_ranks, script_env, train_here)

pytestmark = pytest.mark.slow  # every test trains with real process groups

# 14 BatchNorm layers, trained at 12 px in epoch 0 and 16 px in epoch 1 (data.size_schedule): each rank crops its
# images at the epoch's size and the BatchNorm statistics follow the change on 1, 2 and 3 processes alike
BN_MODEL = ("model.name=resnet10t", "data.size_schedule=[[0, 12], [1, 16]]")
# train.val_every_steps=3 with the EMA, 4 steps an epoch: validations at steps 3, 4 (the epoch's), 6 and 8 (the epoch's)
EVERY = ("train.val_every_steps=3", "model.ema_decay=0.9")

# name: (processes, overrides). Per-process batch x processes x accum_steps = GLOBAL_BATCH everywhere.
RUNS = {
    "single": (1, (*BN_MODEL, "train.batch_size=12")),
    "sync2": (2, (*BN_MODEL, "train.batch_size=6", "model.sync_bn=true")),
    "sync2_again": (2, (*BN_MODEL, "train.batch_size=6", "model.sync_bn=true")),
    "sync3": (3, (*BN_MODEL, "train.batch_size=4", "model.sync_bn=true")),
    "nosync2": (2, (*BN_MODEL, "train.batch_size=6", "model.sync_bn=false")),
    # EVERY on gn_single and gn_ddp_accum, not on gn_accum: their equal weights also show that a validation inside
    # an epoch leaves training as it was
    "gn_single": (1, (NO_BN_MODEL, "train.batch_size=12", *EVERY)),
    "gn_accum": (1, (NO_BN_MODEL, "train.batch_size=6", "train.accum_steps=2")),
    "gn_ddp_accum": (2, (NO_BN_MODEL, "train.batch_size=3", "train.accum_steps=2", *EVERY)),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """run(name) trains RUNS[name] once (in this process, or on its ranks) and returns its output folder."""
    done: dict[str, Path] = {}

    def train(name: str) -> Path:
        if name not in done:
            nproc, overrides = RUNS[name]
            out = tmp_path_factory.mktemp(name)
            if nproc == 1:
                train_here(*COMMON, *overrides, f"output_dir={out}")
            else:
                run_on_ranks("train.py", *COMMON, *overrides, f"output_dir={out}", nproc=nproc)
            done[name] = out
        return done[name]

    return train


@pytest.mark.parametrize("name", ["sync2", "sync3"])
def test_ddp_with_sync_bn_trains_the_single_process_model(run, name):
    """Guarantee 1: W ranks x B/W images with SyncBN == 1 process x B images, weights and BN buffers."""
    assert_same_model(run("single"), run(name))


def test_issue_acceptance_command_one_process_equals_two_ranks(tmp_path):
    """Guarantee 1 as users run it: configs/dummy.yaml as shipped (resnet18, 32 px, fp32, lr 0.01), 5 steps."""
    common = ("--config", "configs/dummy.yaml", "model.sync_bn=true", "data.augment=false", "train.max_steps=5",
              "logging.progress=false")
    train_here(*common, "train.batch_size=16", f"output_dir={tmp_path}/one")
    run_on_ranks("train.py", *common, "train.batch_size=8", f"output_dir={tmp_path}/two", nproc=2)
    assert_same_model(tmp_path / "one", tmp_path / "two", steps=5)


@pytest.mark.parametrize("name", ["gn_accum", "gn_ddp_accum"])
def test_gradient_accumulation_equals_one_big_step(run, name):
    """Guarantee 1: 2 micro-batches of B/2 (1 rank), or 2 of B/4 on each of 2 ranks, == 1 step of B."""
    assert_same_model(run("gn_single"), run(name))


def test_two_rank_mid_epoch_checkpoint_resumes_on_one_process(run, tmp_path):
    """Guarantee 8: 2 ranks stopped mid-epoch continue on 1 process with the same global batch (twice the batch,
    or accum_steps=2): the uninterrupted run's weights, and metrics.jsonl has each epoch once.

    The batch comes from train.global_batch_size, as in an elastic restart: the same command on 2 processes
    (6 per process) and on 1 (12, or 6 x 2 micro-batches)."""
    partial, fixed = tmp_path / "partial", [*COMMON, NO_BN_MODEL, f"train.global_batch_size={GLOBAL_BATCH}"]
    run_on_ranks("train.py", *fixed, "train.max_steps=3", f"output_dir={partial}", nproc=2)
    first = torch.load(partial / "last.pth", weights_only=True)
    assert (first["epoch_step"], first["config"]["train"]["batch_size"]) == (3, 6)  # 3 of 4 steps: mid-epoch 0
    for name, overrides in {"batch12": [], "accum2": ["train.accum_steps=2"]}.items():
        out = tmp_path / name
        shutil.copytree(partial, out)
        train_here(*fixed, *overrides, f"output_dir={out}")
        assert_same_model(run("gn_single"), out)
        assert [row["epoch"] for row in read_jsonl(out / "metrics.jsonl")] == list(range(EPOCHS))


def test_without_sync_bn_the_model_differs(run):
    """Guarantee 2: plain BatchNorm on 2 ranks normalizes each half-batch alone; measure how far that goes."""
    weights_a, weights_b = load_weights(run("single")), load_weights(run("nosync2"))
    diffs = relative_differences(weights_a, weights_b)
    print("without SyncBN:", ", ".join(f"{g} {v:.1e}" for g, v in diffs.items()),
          "| worst single tensor %.1e (%s)" % worst_tensor(weights_a, weights_b))
    # Measured: parameters 9e-3, running means and variances 5e-2 (docs/correctness.md).
    assert min(diffs.values()) > 50 * TOL


@pytest.mark.parametrize("name", ["sync2", "sync3"])
def test_train_metrics_are_all_reduced(run, name):
    """Guarantee 3: train_loss / train_top1 of W ranks == 1 process on the same global batches."""
    single, multi = read_jsonl(run("single") / "metrics.jsonl"), read_jsonl(run(name) / "metrics.jsonl")
    assert len(single) == len(multi) == EPOCHS
    for a, b in zip(single, multi):
        assert a["train_top1"] == b["train_top1"]  # exact: the same images are classified the same way
        # The loss sums W per-rank sums instead of one; its float error is that of the weights (TOL).
        assert math.isclose(a["train_loss"], b["train_loss"], rel_tol=TOL)


@pytest.mark.parametrize("name", ["sync2", "sync3"])
def test_validation_counts_every_image_once(run, name):
    """Guarantee 4 (train.py): val metrics on 23 images are the same for 1, 2 and 3 ranks."""
    single, multi = read_jsonl(run("single") / "metrics.jsonl"), read_jsonl(run(name) / "metrics.jsonl")
    for a, b in zip(single, multi):
        assert a["val_count"] == b["val_count"] == VAL_SIZE
        assert a["val_top1"] == b["val_top1"] and a["val_top5"] == b["val_top5"]
        assert math.isclose(a["val_loss"], b["val_loss"], rel_tol=TOL)


def test_validation_every_n_steps_is_the_same_on_one_and_two_ranks(run):
    """Guarantee 4 for train.val_every_steps=3: the model and its EMA validated inside the epochs (steps 3, 6) and
    after each (4, 8: a step is validated once), the same rows on 1 process and on 2 ranks (with accumulation);
    best.pth is the best of all of them."""
    single, two = (read_jsonl(run(name) / "metrics.jsonl") for name in ("gn_single", "gn_ddp_accum"))
    for rows in (single, two):
        assert [(r["epoch"], r["step"], "epoch_time_s" in r) for r in rows] == [
            (0, 3, False), (0, 4, True), (1, 6, False), (1, 8, True)]
    for a, b in zip(single, two):
        assert a["val_count"] == b["val_count"] == VAL_SIZE and a["lr"] == b["lr"]
        for key in ("val_top1", "val_top5", "ema_val_top1", "ema_val_top5", "train_top1"):
            assert a[key] == b[key], key  # exact: the same images are classified the same way
        for key in ("val_loss", "ema_val_loss", "train_loss"):
            assert math.isclose(a[key], b[key], rel_tol=TOL), key  # float summation order only (TOL)
    best = max(single, key=lambda r: r["ema_val_top1"])  # the first of the best (a tie is no improvement)
    assert torch.load(run("gn_single") / "best.pth", weights_only=True)["global_step"] == best["step"]


def test_validation_every_n_steps_resumed_after_stops_gives_the_uninterrupted_rows(run, tmp_path):
    """A run of train.val_every_steps=3 stopped at step 2 (its stop's validation is dropped at the resume), resumed
    across the epoch's end and stopped at step 6 (a step of the schedule, validated once), then resumed to the end,
    holds the uninterrupted run's rows, each once (its weights: tests/test_resume.py)."""
    out = tmp_path / "run"
    args = [*COMMON, *RUNS["gn_single"][1], f"output_dir={out}"]
    train_here(*args, "train.max_steps=2")
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [2]
    train_here(*args, "train.max_steps=6")
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [3, 4, 6]
    train_here(*args)
    assert model_rows(read_jsonl(out / "metrics.jsonl")) == model_rows(read_jsonl(run("gn_single") / "metrics.jsonl"))


def test_two_launchers_on_loopback_equal_one_launcher(run, tmp_path):
    """Guarantee 5: 2 nodes x 1 process (two torchrun launchers, c10d rendezvous) == 1 node x 2 processes,
    bitwise, once every process runs with as many threads as in the one-launcher run."""
    two_launchers = tmp_path / "two_nodes"
    _, overrides = RUNS["sync2"]
    port = free_port()
    # The app gives each process cores / processes-per-node threads. Each launcher gets half the cores, so
    # its one process has the thread count of a process of the 2-per-node run: the same kernels, the same
    # float summation order. (With all cores each, the weights still agree within TOL, not bitwise.)
    cores = sorted(os.sched_getaffinity(0))
    half = max(len(cores) // 2, 1)
    node_cores = [cores[:half], cores[half:2 * half] or cores[:half]]
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    launchers = []
    try:
        for node, log in enumerate(logs):
            with log.open("w") as stdout:
                launchers.append(subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                     f"--node_rank={node}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                     str(REPO / "train.py"), *COMMON, *overrides, f"output_dir={two_launchers}"],
                    cwd=REPO, env=script_env(), stdout=stdout, stderr=subprocess.STDOUT,
                    preexec_fn=lambda node=node: os.sched_setaffinity(0, node_cores[node])))
        codes = [launcher.wait(timeout=300) for launcher in launchers]
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.terminate()  # torchrun passes SIGTERM on to its workers
                launcher.wait()
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    assert "2 process(es)" in "".join(log.read_text() for log in logs)
    one_launcher = run("sync2")
    assert torch.load(two_launchers / "last.pth", weights_only=True)["global_step"] == STEPS
    assert differing_tensors(load_weights(one_launcher), load_weights(two_launchers)) == []
    assert (model_rows(read_jsonl(one_launcher / "metrics.jsonl"))
            == model_rows(read_jsonl(two_launchers / "metrics.jsonl")))


def test_same_seed_and_world_size_give_bitwise_identical_weights(run):
    """Guarantee 6: two 2-rank SyncBN runs with the same seed are equal in every bit, metrics included."""
    first, second = run("sync2"), run("sync2_again")
    assert differing_tensors(load_weights(first), load_weights(second)) == []
    assert model_rows(read_jsonl(first / "metrics.jsonl")) == model_rows(read_jsonl(second / "metrics.jsonl"))


def keys_read_by_fit(rank: int, world: int, runs: list[list[str]]) -> list[list[tuple[int, int]]]:
    """Call train.py's fit once per override list on this rank; return the (epoch, index) keys that each
    call's training loop read, in order."""
    from core.config_load import load_config
    from core.dist import DistInfo
    from data.datasets import AugmentedDataset
    from assembly.fit import fit

    calls: list[list[tuple[int, int]]] = []
    read = AugmentedDataset.__getitem__

    def recording_getitem(self, key):
        if isinstance(key, tuple):  # training samplers yield (epoch, index); evaluation plain indices
            calls[-1].append(key)
        return read(self, key)

    AugmentedDataset.__getitem__ = recording_getitem  # a spy: the data returned is unchanged
    base = [*COMMON[2:], "model.name=test_efficientnet_gn", "logging.level=WARNING",
            f"train.batch_size={GLOBAL_BATCH // world}"]
    for overrides in runs:
        calls.append([])
        fit(load_config("dummy", [*base, *overrides]), DistInfo(rank, world, rank, world, torch.device("cpu")))
    return calls


def test_each_epoch_uses_every_index_once_and_reshuffles(tmp_path):
    """Guarantee 7: fit's training loop, on 1, 2 and 3 real ranks, reads every index once per epoch
    (drop_last leaves TRAIN_SIZE % GLOBAL_BATCH out), in a new order every epoch, and the same global
    batches whatever the world size."""
    steps = TRAIN_SIZE // GLOBAL_BATCH
    global_batches = {}
    for world in (1, 2, 3):
        runs = [["train.epochs=3", f"output_dir={tmp_path}/world{world}"]]
        per_rank = [calls[0] for calls in run_ranks(keys_read_by_fit, world, tmp_path, runs)]
        batch = GLOBAL_BATCH // world
        assert all(sorted({e for e, _ in seen}) == [0, 1, 2] for seen in per_rank)  # set_epoch every epoch
        batches = []  # batches[epoch][step] = set of indices read by all ranks for that optimizer step
        for epoch in range(3):
            keys = [[i for e, i in seen if e == epoch] for seen in per_rank]
            assert all(len(k) == steps * batch for k in keys)  # every rank did every step of the epoch
            used = [i for k in keys for i in k]
            assert len(used) == len(set(used)) == steps * GLOBAL_BATCH  # none twice, 2 of 50 left out
            batches.append([{i for k in keys for i in k[s * batch:(s + 1) * batch]} for s in range(steps)])
        orders = [[i for e, i in per_rank[0] if e == epoch] for epoch in range(3)]
        assert orders[0] != orders[1] != orders[2] != orders[0]  # set_epoch reshuffles
        left_out = [set(range(TRAIN_SIZE)) - set().union(*epoch) for epoch in batches]
        assert left_out[0] != left_out[1] or left_out[1] != left_out[2]  # not always the same images
        global_batches[world] = batches
    assert global_batches[1] == global_batches[2] == global_batches[3]


def test_resumed_run_reads_the_same_samples_in_the_same_order(tmp_path):
    """Guarantee 7: 2 ranks stopped in the middle of the second epoch and resumed from last.pth read
    exactly the uninterrupted sequence of samples (bitwise-equal weights: tests/test_resume.py)."""
    stop_at = TRAIN_SIZE // GLOBAL_BATCH + 2
    runs = [[f"output_dir={tmp_path}/straight"],
            [f"output_dir={tmp_path}/resumed", f"train.max_steps={stop_at}"],
            [f"output_dir={tmp_path}/resumed", "resume=auto", "train.max_steps=0"]]
    per_step = GLOBAL_BATCH // 2
    for rank, (straight, first, second) in enumerate(run_ranks(keys_read_by_fit, 2, tmp_path, runs)):
        assert len(straight) == STEPS * per_step and len(first) == stop_at * per_step, rank
        assert first + second == straight, rank  # nothing read twice, nothing skipped, same order
