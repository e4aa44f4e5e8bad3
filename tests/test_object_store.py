"""Data and runs on object storage, against moto's S3-compatible server: a real HTTP server in a subprocess
(tests/helpers.s3_server), reached through the standard environment only (AWS_ENDPOINT_URL, test credentials).
Shards read from s3:// as from disk; a run written to s3://, SIGKILLed after its first epoch and run again, equals an
uninterrupted one bit for bit; evaluate.py reads s3://.../best.pth; the server gone and wrong credentials are one line.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import evaluate
import export
import train
from assembly import launch
from assembly.export import is_model_folder_export
from core import store
from core.cli import report_errors
from core.errors import UserError
from data import make_shards
from data.loader import shard_bounds
from data.shard_order import ByRankSampler, ShardPlan
from data.shards import ShardDataset
from engine.checkpoint.formats import load_checkpoint
from engine.checkpoint.run_store import fetched, fetched_folder, mirror_of
from engine.hooks import Hook
from tests.compare import assert_same
from tests.helpers import (COMMON, HANG, NO_BN_MODEL, REPO, TINY, CuttableLink, free_port, last_error,
                           make_image_folder, run_on_ranks, s3_auth, script_env, train_here)

COUNTS = {"train": {"a": 7, "b": 5, "c": 6}, "val": {"a": 3, "b": 4, "c": 4}}  # 18 train, 11 val images


def s3fs_for(env: dict[str, str], **options):
    """A filesystem on the server `env` names (fsspec caches one per process: a fresh one, for this endpoint)."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    return s3fs.S3FileSystem(endpoint_url=env["AWS_ENDPOINT_URL"], key="testing", secret="testing", **options)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """The digits-like image folder as tar shards of 4 samples (several per split, the last one short)."""
    root = tmp_path_factory.mktemp("s3data")
    folder = make_image_folder(root / "folder", COUNTS, size=20)
    assert report_errors(make_shards.main, [str(folder), str(root / "shards"), "--shard-size", "4"]) == 0
    return root / "shards"


@pytest.fixture(scope="module")
def bucket(s3_env, shards) -> str:
    """A bucket holding the shards under shards/: its name."""
    fs, name = s3fs_for(s3_env), f"b{free_port()}"
    fs.mkdir(name)
    fs.put(str(shards), f"{name}/shards", recursive=True)
    return name


@pytest.fixture
def on_s3(s3_env, monkeypatch, tmp_path) -> dict[str, str]:
    """This process pointed at the server through the environment, working in an empty folder (the staging
    folder, .cache/object_store, lands there)."""
    import s3fs

    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    s3fs.S3FileSystem.clear_instance_cache()
    yield s3_env
    s3fs.S3FileSystem.clear_instance_cache()


def run_args(bucket: str, out: str, *extra: str) -> list[str]:
    return [*TINY, "data.name=wds", f"data.root=s3://{bucket}/shards", "data.shard_cache=cache",
            "train.batch_size=4", "train.epochs=3", "model.drop_rate=0.2", f"output_dir=s3://{bucket}/{out}", *extra]


def test_shards_from_s3_are_the_local_shards_and_a_missing_bucket_is_one_line(on_s3, bucket, shards):
    """Every sample and label read from s3:// equals the local shard's; no such bucket: one line naming the URL."""
    local = ShardDataset(str(shards / "val.json"), None, seed=0)
    remote = ShardDataset(f"s3://{bucket}/shards/val.json", None, seed=0, cache_dir="cache")
    assert len(remote) == len(local) == 11 and (remote.labels == local.labels).all()
    for i in range(len(local)):
        assert (remote.load_image(i) == local.load_image(i)).all() and remote.path(i) == local.path(i)
    with pytest.raises(UserError, match=r"^cannot read shard index s3://nobucket/shards/val.json \(The specified "
                                        r"bucket does not exist\); check the URL and the credentials"):
        ShardDataset("s3://nobucket/shards/val.json", None, seed=0, cache_dir="cache")


def test_the_shard_cache_keeps_to_its_bound(on_s3, bucket, shards):
    """data.shard_cache_gb: past it the least recently used shard copies go first (read in order, with room for two
    of the five shards: the last two alone stay; no shard is copied ahead, which would push out one still to read)."""
    tars = sorted(shards.glob("train-*.tar"))
    limit = sum(p.stat().st_size for p in tars[-2:])
    data = ShardDataset(f"s3://{bucket}/shards/train.json", None, seed=0, cache_dir="cache", cache_gb=(limit + 1) / 1e9)
    for i in range(len(data)):
        data.load_image(i)  # shard by shard, each copied on its first sample
    assert len(tars) == 5 and cached("cache") == [p.name for p in tars[-2:]]


def cached(folder: str | Path) -> list[str]:
    """The names of the shards copied into a data.shard_cache folder (their URLs' last parts), sorted."""
    return sorted(p.name.rsplit("%2F", 1)[1] for p in Path(folder).iterdir() if p.is_file())


def test_by_rank_copies_its_own_shards_alone_in_its_order_from_the_start(shards, tmp_path):
    """A rank's shards at a URL (file://: the same fsspec copy as s3://) under data.shard_order=by_rank: the copies of
    its first shards start when its plan is given (the loader built), before any sample is asked for; each shard read
    copies the next in this rank's order; an epoch read leaves its shards alone in the cache. Without a plan, the
    copies ahead go in index order."""
    data = ShardDataset(f"file://{shards}/train.json", None, seed=0, cache_dir=str(tmp_path / "cache"))
    plan = ShardPlan(np.diff(data.starts), seed=0, rank=1, world=2)
    assert data.ahead(0) == [1, 2, 3, 4] and len(plan.mine) == 2  # 4 + 4 of the 5 shards (4, 4, 4, 4, 2)
    data.follow(plan)
    first, then = plan.shards(0)
    assert sorted(data.copies[2]) == [first, then]  # under way before a sample is read
    assert data.ahead(first) == [then] and data.ahead(then) == []
    sampler = ByRankSampler(plan)
    sampler.set_epoch(0)
    for _, index in sampler:
        data.load_image(index)
    assert cached(tmp_path / "cache") == sorted(Path(data.urls[shard]).name for shard in plan.mine)


def test_a_server_gone_is_retried_counted_and_one_line(on_s3, bucket, monkeypatch, capsys):
    """Connection refused is transient: retried ATTEMPTS times with backoff (counted), then one line naming the URL
    (with the real waits, 2 + 4 + 8 s: well inside two minutes)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setattr(store, "BACKOFF_S", 0.01)
    before = store.RETRIES["s3"]
    line = last_error(capsys, report_errors(train.main, run_args(bucket, "gone")))
    assert line.startswith(f"error: cannot read s3://{bucket}/gone/.lock: no answer after {store.ATTEMPTS} tries"), \
        line
    assert store.RETRIES["s3"] - before == store.ATTEMPTS - 1


def test_a_shard_copy_that_loses_the_server_is_retried_counted_and_reads_the_shard(on_s3, bucket, shards,
                                                                                    monkeypatch):
    """The shard copy path (not only the index's): the link to the server cut after the index was read, and back
    during the first retry's wait: the copy is retried once (counted) and the sample read equals the local one."""
    link = CuttableLink(int(on_s3["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{link.port}")
    s3fs_for(on_s3)  # (fsspec's cached filesystem names the server itself)
    back = []
    monkeypatch.setattr(store, "BACKOFF_S", 0.01)
    monkeypatch.setattr(store, "time", SimpleNamespace(sleep=lambda s: back.append(CuttableLink(link.target,
                                                                                               link.port))))
    remote = ShardDataset(f"s3://{bucket}/shards/val.json", None, seed=0, cache_dir="cache", cache_gb=1e-9)
    link.cut()
    before = store.RETRIES["s3"]
    image = remote.load_image(0)  # a cache too small to copy ahead: this one copy alone
    assert store.RETRIES["s3"] - before == 1 and len(back) == 1
    assert (image == ShardDataset(str(shards / "val.json"), None, seed=0).load_image(0)).all()


def test_wrong_credentials_are_one_line(on_s3, bucket, capsys):
    """A key the server does not know is permanent: one line at once, naming the URL and what to check."""
    s3_auth(on_s3, True)
    try:
        line = last_error(capsys, report_errors(train.main, run_args(bucket, "denied")))
    finally:
        s3_auth(on_s3, False)
    assert line == (f"error: cannot read s3://{bucket}/denied/.lock (access denied: Forbidden); check the URL and the "
                    "credentials in the environment (AWS_ACCESS_KEY_ID, AWS_PROFILE, ...)"), line


def test_a_checkpoint_at_a_url_is_read_through_a_local_copy_with_its_run_files(on_s3, bucket):
    """What evaluate.py, predict.py, export.py (fetched) and average_checkpoints.py (fetched_folder) read from a URL:
    the checkpoint copied byte for byte with its run folder's small files, not its other checkpoints; a local path as
    it is; a sharded folder refused in one line."""
    fs = s3fs_for(on_s3)
    files = {"best.pth": b"B" * 100, "last.pth": b"L" * 100, "config.yaml": b"seed: 0\n", "epoch_0001.pth": b"E"}
    for name, data in files.items():
        fs.pipe(f"{bucket}/run/{name}", data)
    fs.pipe(f"{bucket}/run/last.dcp/.metadata", b"M")
    local = Path(fetched(f"s3://{bucket}/run/best.pth"))
    assert local.read_bytes() == files["best.pth"] and (local.parent / "config.yaml").read_bytes() == b"seed: 0\n"
    assert sorted(p.name for p in local.parent.iterdir()) == ["best.pth", "config.yaml"]
    assert fetched("runs/x/best.pth") == "runs/x/best.pth"
    with pytest.raises(UserError, match=rf"^s3://{bucket}/run/last.dcp is a folder \(a sharded checkpoint\)"):
        fetched(f"s3://{bucket}/run/last.dcp")
    epochs = fetched_folder(f"s3://{bucket}/run", lambda name, size: name.startswith("epoch_"))
    assert epochs == local.parent and (epochs / "epoch_0001.pth").read_bytes() == b"E"


def test_export_to_a_url_uploads_the_checked_folder_and_refuses_what_is_not_an_earlier_export(on_s3, bucket,
                                                                                                tiny_run, capsys):
    """export.py of a checkpoint at a URL writes beside it there by default: the model folder written and checked in
    a local mirror, then uploaded file by file (no temporary key left, the mirror gone), holding the checkpoint's
    weights; an --output URL holding something else is refused in one line naming it, and left as it was."""
    from safetensors.torch import load_file

    fs = s3fs_for(on_s3)
    for name in ("best.pth", "config.yaml"):
        fs.put_file(str(tiny_run / name), f"{bucket}/tiny/{name}")
    fs.pipe(f"{bucket}/notes-hf/README.md", b"my notes\n")
    argv = [f"s3://{bucket}/tiny/best.pth", "--format", "safetensors"]
    line = last_error(capsys, report_errors(export.main, [*argv, "--output", f"s3://{bucket}/notes-hf"]))
    assert line.startswith(f"error: s3://{bucket}/notes-hf is ") and "choose another --output" in line, line
    assert fs.find(f"{bucket}/notes-hf") == [f"{bucket}/notes-hf/README.md"]
    assert report_errors(export.main, argv) == 0
    assert f"wrote s3://{bucket}/tiny/best-hf (" in capsys.readouterr().out
    assert sorted(fs.ls(f"{bucket}/tiny/best-hf")) == [f"{bucket}/tiny/best-hf/{name}" for name in
                                                        ("README.md", "config.json", "model.safetensors")]
    assert not mirror_of(f"s3://{bucket}/tiny/best-hf", "outputs").exists()
    fs.get(f"{bucket}/tiny/best-hf", "downloaded", recursive=True)
    assert is_model_folder_export(Path("downloaded"))
    assert_same(load_checkpoint(tiny_run / "best.pth")["model"], load_file("downloaded/model.safetensors"))


def test_a_sharded_checkpoint_to_a_url_is_refused_in_one_line(on_s3, bucket, capsys):
    """train.ckpt_format=sharded (last.dcp/, a folder of files) is not written to object storage yet: one line."""
    line = last_error(capsys, report_errors(train.main, run_args(bucket, "dcp", "train.ckpt_format=sharded")))
    assert line == (f"error: train.ckpt_format=sharded with output_dir s3://{bucket}/dcp: a sharded last.dcp/ is not "
                    "written to object storage yet; use train.ckpt_format=file there"), line


@pytest.mark.slow
def test_a_run_on_s3_killed_after_its_first_epoch_continues_bitwise_and_evaluates_its_best(on_s3, bucket, tmp_path,
                                                                                         capsys):
    """output_dir=s3://: the run, and a copy SIGKILLed once its first epoch's last.pth is on the server then run again
    (its lock object left behind: the dead process's, taken over), equal bit for bit; while the copy ran a second run
    into its URL was refused in one line naming the owner; another config is refused in one line naming the URL;
    evaluate.py on s3://.../best.pth prints the run's best val_top1."""
    fs = s3fs_for(on_s3)
    assert report_errors(train.main, run_args(bucket, "straight")) == 0
    (tmp_path / "killed").mkdir()
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *run_args(bucket, "killed")],
                            cwd=tmp_path / "killed", env=script_env(**on_s3), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + HANG
        while not fs.exists(f"{bucket}/killed/.lock"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
            time.sleep(0.02)
        line = last_error(capsys, report_errors(train.main, run_args(bucket, "killed")))  # a second run meanwhile
        assert line.startswith(f"error: output_dir s3://{bucket}/killed is in use by another run (process {proc.pid} "
                               f"on {socket.gethostname()})"), line
        while not fs.exists(f"{bucket}/killed/last.pth"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()
    assert fs.exists(f"{bucket}/killed/.lock")  # the killed run's
    first = json.loads(fs.cat(f"{bucket}/killed/metrics.jsonl").decode().splitlines()[-1])
    assert first["epoch"] < 2  # killed before its last epoch
    assert report_errors(train.main, run_args(bucket, "killed")) == 0
    straight, killed = (load_checkpoint(fetch(fs, f"{bucket}/{run}/last.pth", tmp_path / run / "last.pth"))
                        for run in ("straight", "killed"))
    assert_same(straight, killed)  # every tensor equal (torch.equal): model, optimizer, RNG, counters
    assert fs.cat(f"{bucket}/killed/metrics.jsonl").count(b"\n") == 3 and not fs.exists(f"{bucket}/killed/.lock")
    line = last_error(capsys, report_errors(train.main, run_args(bucket, "straight", "optim.lr=0.5")))
    assert line.startswith(f"error: output_dir s3://{bucket}/straight holds a run made with another config"), line
    rows = [json.loads(row) for row in fs.cat(f"{bucket}/straight/metrics.jsonl").decode().splitlines()]
    assert report_errors(evaluate.main, [f"s3://{bucket}/straight/best.pth", "--output-dir", "eval"]) == 0
    assert json.loads(Path("eval/eval.json").read_text())["top1"] == max(row["val_top1"] for row in rows)


def versions(env: dict[str, str], bucket: str, run: str) -> dict[str, int]:
    """How many times each file of a run was written to its versioned bucket (its upload's temporary keys aside)."""
    fs = s3fs_for(env, version_aware=True)
    return {key.rsplit("/", 1)[1]: sum(found["Key"] == key.split("/", 1)[1] for found in fs.object_version_info(key))
            for key in fs.find(f"{bucket}/{run}")}


@pytest.mark.slow
def test_two_ranks_on_s3_read_their_own_shards_and_rank_0_alone_uploads(on_s3, bucket, shards, tmp_path):
    """data.root and output_dir at s3:// on 2 ranks (a real gloo group), each with a shard cache of its own (as on a
    node of its own): each rank copied its own training shards alone (data.shard_order=auto: by_rank for a URL root;
    the other rank's never) and the validation shards of its block; rank 0 alone uploads: in a versioned bucket each
    file was written as many times as by one process (the other rank's pushes would have added its own), and each
    validation's last.pth went up after it although written in the background (train.async_save, the default); best.pth
    once per improvement of its own val_top1 (the ranks' order is not the one process's)."""
    fs, out = s3fs_for(on_s3), f"v{free_port()}"
    fs.mkdir(out)
    fs.make_bucket_versioned(out)
    args = ["--config", "dummy", *COMMON[2:], NO_BN_MODEL, "data.name=wds", f"data.root=s3://{bucket}/shards"]
    train_here(*args, "data.shard_cache=cache", "train.batch_size=6", f"output_dir=s3://{out}/one")
    run_on_ranks("train.py", *args, "train.batch_size=3", f"output_dir=s3://{out}/two", nproc=2, cwd=tmp_path,
                 env={**on_s3, "WIDS_CACHE": str(tmp_path / "cache-{rank}")})  # data.shard_cache="": $WIDS_CACHE
    train, val = (ShardDataset(str(shards / f"{split}.json"), None, seed=0) for split in ("train", "val"))
    for rank in range(2):
        mine = ShardPlan(np.diff(train.starts), seed=0, rank=rank, world=2).mine
        start, stop = shard_bounds(len(val), rank, 2, 3)
        block = range(val.locate(start)[0], val.locate(stop - 1)[0] + 1)
        names = [Path(train.urls[shard]).name for shard in mine] + [Path(val.urls[shard]).name for shard in block]
        assert cached(tmp_path / f"cache-{rank}") == sorted(names), rank
    assert len(mine) < len(train.urls)  # rank 1 left shards to rank 0
    assert load_checkpoint(fetch(fs, f"{out}/two/last.pth", tmp_path / "two" / "last.pth"))["epoch"] == 2
    rows = [json.loads(row)["val_top1"] for row in fs.cat(f"{out}/two/metrics.jsonl").decode().splitlines()]
    bests = sum(value > max(rows[:epoch], default=-1) for epoch, value in enumerate(rows))  # best.pth writes
    one, two = versions(on_s3, out, "one"), versions(on_s3, out, "two")
    assert two == {**one, "best.pth": bests} and one["last.pth"] == 2, (one, two)  # last.pth after each validation


class CutAfter(Hook):
    """A hook that cuts the link to the server after the `n`-th validation's other hooks, before its upload."""

    def __init__(self, link: CuttableLink, n: int) -> None:
        self.link, self.left = link, n

    def after_epoch(self, state, end) -> None:
        self.left -= 1
        if self.left == 0:
            self.link.cut()


@pytest.mark.slow
def test_a_run_that_loses_the_server_mid_run_stops_in_one_line_and_the_url_keeps_a_whole_checkpoint(
        on_s3, bucket, monkeypatch, capsys, tmp_path):
    """The app reaches the server through a TCP relay, cut after the third epoch's validation (its upload fails; the
    second's last.pth is up): the upload is retried, then the run stops in one line naming the URL; the server's
    last.pth (an upload never writes the name before it is whole) loads with weights_only, and the same command
    continues from it once the server is back (the lock object the run could not remove is no obstacle)."""
    fs = s3fs_for(on_s3)
    link = CuttableLink(int(on_s3["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{link.port}")
    monkeypatch.setattr(store, "BACKOFF_S", 0.01)
    config, *overrides = run_args(bucket, "lost", "train.epochs=4")[1:]
    line = last_error(capsys, report_errors(lambda _: launch.train(config, overrides, hooks=[CutAfter(link, 3)]), []))
    assert line.startswith(f"error: cannot write s3://{bucket}/lost/") and "no answer after 4 tries" in line, line
    kept = load_checkpoint(fetch(fs, f"{bucket}/lost/last.pth", tmp_path / "last.pth"))
    assert kept["epoch"] in (1, 2)  # the first or second epoch's (a checkpoint is written in the background)
    monkeypatch.setenv("AWS_ENDPOINT_URL", on_s3["AWS_ENDPOINT_URL"])  # the server back: the run continues
    s3fs_for(on_s3)  # (fsspec's cached filesystem still names the relay)
    monkeypatch.chdir(tmp_path)
    assert report_errors(train.main, run_args(bucket, "lost", "train.epochs=4")) == 0
    assert load_checkpoint(fetch(fs, f"{bucket}/lost/last.pth", tmp_path / "end.pth"))["epoch"] == 4


def fetch(fs, key: str, local: Path) -> Path:
    local.parent.mkdir(parents=True, exist_ok=True)
    fs.get_file(key, str(local))
    return local
