"""Data and runs on object storage, against moto's S3-compatible server: a real HTTP server in a subprocess
(tests/helpers.s3_server), reached through the standard environment only (AWS_ENDPOINT_URL, test credentials).
Shards read from s3:// as from disk; a run written to s3://, SIGKILLed after its first epoch and run again, equals an
uninterrupted one bit for bit; evaluate.py reads s3://.../best.pth; the server gone and wrong credentials are one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
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
import predict
import train
from assembly import launch
from assembly.export import is_model_folder_export
from core import store
from core.cli import report_errors
from core.config import DataConfig
from core.errors import UserError
from data import make_shards
from data.hf import hub_repo
from data.loader import build_datasets, prepare_data
from data.mirror import local_root, mirror_folder
from data.loader import shard_bounds
from data.shard_order import ByRankSampler, ShardPlan
from data.shards import ShardDataset
from data.split import run_split
from engine.checkpoint import run_store
from engine.checkpoint.formats import load_checkpoint, read_checkpoint
from engine.checkpoint.run_store import RunStore, fetched, fetched_folder, mirror_of, put_folder
from engine.hooks import Hook
from tests.compare import as_file_checkpoint, assert_same, assert_same_model
from tests.helpers import (COMMON, HANG, NO_BN_MODEL, REPO, TINY, CuttableLink, check_one_line, free_port,
                           last_error, make_image_folder, run_on_ranks, run_ranks, s3_auth, script_env, train_here)

COUNTS = {"train": {"a": 7, "b": 5, "c": 6}, "val": {"a": 3, "b": 4, "c": 4}}  # 18 train, 11 val images


@pytest.mark.parametrize("args, expected", [
    (["--config", "digits", "data.root=s3://nobucket/x"],
     "data.root=s3://nobucket/x: data.name=digits writes its images into data.root, which must be a local folder"),
    (["data.name=imagefolder", "data.root=pipe:cat x"],
     "data.root=pipe:cat x: a pipe: command is read for WebDataset shards only (data.name=wds)")])
def test_a_data_root_url_a_format_cannot_read_is_refused_and_never_made_a_local_folder(args, expected, tmp_path,
                                                                                      capsys, monkeypatch):
    """data.root at a URL is read by the formats that can, else refused in one line before anything is written: the
    digits export once went into a local folder named s3:/nobucket/x (the URL read as a relative path)."""
    check_one_line([*args, "--dry-run"], expected, tmp_path, tmp_path, capsys, monkeypatch)


def test_make_shards_and_audit_refuse_a_url_where_they_write_a_local_folder(tmp_path, monkeypatch, capsys):
    """python -m data.make_shards <folder> s3://... and audit.py --out s3://... (or its folds' output_dir there) write
    local folders: a URL is refused in one line, before a local folder named s3:/... is made."""
    import audit

    make_image_folder(tmp_path / "folder", {"train": {"a": 1, "b": 1}}, size=8)
    monkeypatch.chdir(tmp_path)
    assert make_shards.run(["folder", "s3://b/shards", "--splits", "train"]) == 2
    assert capsys.readouterr().err.startswith("error: the output folder s3://b/shards is a URL, and only a local "
                                              "folder is read or written here; write the shards to a local folder")
    for args in (["--out", "s3://b/audit", *TINY], [*TINY, "output_dir=s3://b/run"]):
        line = last_error(capsys, report_errors(audit.main, args))
        assert " is a URL, and only a local folder is read or written here" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]


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


@pytest.fixture(scope="module")
def folders(s3_env, bucket, shards) -> Path:
    """The image folder the shards were made from, with list files (train.tsv by index, classes.txt; val.csv by name)
    and as Parquet files beside it (parquet/<split>.parquet: PNG bytes, class names), put in the bucket under folder/
    and parquet/: the local folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder, classes = shards.parent / "folder", sorted(COUNTS["train"])
    (folder / "classes.txt").write_text("\n".join(classes) + "\n")
    (shards.parent / "parquet").mkdir()
    for split, suffix, sep in (("train", ".tsv", "\t"), ("val", ".csv", ",")):
        files = [(f"{split}/{c}/{i:03d}.png", c) for c in classes for i in range(COUNTS[split][c])]
        rows = [f"{path}{sep}{classes.index(c) if split == 'train' else c}" for path, c in files]
        (folder / f"{split}{suffix}").write_text(f"path{sep}label\n" + "\n".join(rows) + "\n")
        pq.write_table(pa.table({"image": [(folder / path).read_bytes() for path, _ in files],
                                 "label": [c for _, c in files]}), shards.parent / "parquet" / f"{split}.parquet")
    fs = s3fs_for(s3_env)
    fs.put(str(folder), f"{bucket}/folder", recursive=True)
    fs.put(str(shards.parent / "parquet"), f"{bucket}/parquet", recursive=True)
    return folder


@pytest.fixture(scope="module")
def mirrors(tmp_path_factory) -> str:
    """A data.shard_cache for the module's tests: a root mirrored by one is there for the next (listed, not copied)."""
    return str(tmp_path_factory.mktemp("mirrors"))


def assert_same_images(remote: DataConfig, local: DataConfig) -> None:
    """Both configs' train and val sets hold the same classes, labels and decoded images."""
    for have, want in zip(build_datasets(remote, seed=0), build_datasets(local, seed=0)):
        assert len(have) == len(want) and have.classes == want.classes and (have.labels == want.labels).all()
        assert all((have.load_image(i) == want.load_image(i)).all() for i in range(len(want)))


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


def test_an_image_folder_at_a_url_is_read_from_its_mirror_kept_to_the_url_and_its_bound(on_s3, bucket, folders,
                                                                                         mirrors):
    """data.root=s3://... for an image folder: the same images as on disk, and the same auto split (data.val_fraction);
    the URL is the truth (a file changed there is copied again, one removed there goes, an unchanged one stays as it
    was copied); an unreadable image is named by its URL; a root larger than data.shard_cache_gb is one line naming
    the URL (a missing bucket: the two-rank test below)."""
    url = f"s3://{bucket}/folder"
    assert_same_images(DataConfig(name="imagefolder", root=url, shard_cache=mirrors),
                       DataConfig(name="imagefolder", root=str(folders)))
    split = DataConfig(name="imagefolder", root=f"{url}/train", val_fraction=0.3, shard_cache="cache")
    prepare_data(split, local_rank=0)
    assert run_split(split, None, None, True) == run_split(dataclasses.replace(split, root=str(folders / "train")),
                                                           None, None, True)
    fs, changing = s3fs_for(on_s3), DataConfig(name="imagefolder", root=f"s3://{bucket}/changing", shard_cache="cache")
    for side in COUNTS:
        fs.put(str(folders / side), f"{bucket}/changing/{side}", recursive=True)
    build_datasets(changing, seed=0)
    kept = mirror_folder(changing) / "train" / "b" / "000.png"
    copied = kept.stat().st_mtime_ns
    fs.rm([f"{bucket}/changing/{side}/c" for side in COUNTS], recursive=True)
    fs.pipe(f"{bucket}/changing/train/a/000.png", b"not an image")
    train_set, _ = build_datasets(changing, seed=0)
    assert train_set.classes == ["a", "b"] and kept.stat().st_mtime_ns == copied
    with pytest.raises(UserError, match=rf"^cannot read image s3://{bucket}/changing/train/a/000.png \(corrupt"):
        train_set[(0, 0)]
    with pytest.raises(UserError, match=rf"^data.root {url} holds [0-9.e-]+ GB, more than data.shard_cache_gb=1e-06 "
                                        r"lets its local copy hold; write it as WebDataset shards \(python -m "
                                        r"data.make_shards"):
        build_datasets(DataConfig(name="imagefolder", root=url, shard_cache="small", shard_cache_gb=1e-6), seed=0)
    assert not Path("small").exists()


def mirror_on_rank(rank: int, world: int, env: dict[str, str], root: str, cache: str) -> dict:
    """prepare_mirror on a rank of a real group (its own local rank, as on one node) for `root`, then for a missing
    bucket: the files it copied, the mirror's images, the error."""
    import os

    import s3fs

    from data import mirror

    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()
    copied = []
    mirror.download = lambda url, local, what: copied.append(url) or store.download(url, local, what)
    cfg = DataConfig(name="imagefolder", root=root, shard_cache=cache)
    mirror.prepare_mirror(cfg, local_rank=rank)
    folder = mirror.mirror_folder(cfg)
    try:
        mirror.prepare_mirror(DataConfig(name="imagefolder", root="s3://nobucket/x", shard_cache=cache), rank)
    except UserError as err:
        return {"copied": copied, "files": sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.png")),
                "error": str(err)}
    return {}


@pytest.mark.slow
def test_on_two_ranks_local_rank_0_alone_copies_and_an_error_is_every_ranks(on_s3, bucket, folders, tmp_path):
    """Two ranks of a real gloo group, one node: local rank 0 copies every file, rank 1 waits and reads the same
    mirror; a missing bucket is the same one line on both ranks."""
    first, second = run_ranks(mirror_on_rank, 2, tmp_path, on_s3, f"s3://{bucket}/folder/val", str(tmp_path / "c"))
    images = sorted(p.relative_to(folders / "val").as_posix() for p in (folders / "val").rglob("*.png"))
    assert len(first["copied"]) == len(images) and second["copied"] == []
    assert first["files"] == second["files"] == images
    assert first["error"] == second["error"] and first["error"].startswith("cannot list s3://nobucket/x (The "
                                                                           "specified bucket"), first["error"]


def test_list_files_at_a_url_name_the_images_beside_them_and_a_missing_one_by_its_url(on_s3, bucket, folders,
                                                                                      mirrors):
    """data.name=listfile at s3://: the list files and the images they name read as on disk; a list file relabelled at
    the URL at the same size is copied anew (its ETag changed); a row naming an image the URL lacks is one line naming
    the image's URL."""
    url = f"s3://{bucket}/folder"
    assert_same_images(DataConfig(name="listfile", root=url, shard_cache=mirrors),
                       DataConfig(name="listfile", root=str(folders)))
    fs, gone = s3fs_for(on_s3), DataConfig(name="listfile", root=f"s3://{bucket}/gone", train_split="val",
                                           shard_cache="cache")
    fs.pipe(f"{bucket}/gone/val.csv", b"path,label\nval/a/999.png,a\n")
    assert build_datasets(gone, seed=0)[1].classes == ["a"]
    fs.pipe(f"{bucket}/gone/val.csv", b"path,label\nval/a/999.png,b\n")  # relabelled: the same size, copied anew
    _, val = build_datasets(gone, seed=0)
    assert val.classes == ["b"]
    with pytest.raises(UserError, match=rf"^cannot read image s3://{bucket}/gone/val/a/999.png \(No such file"):
        val[0]


def test_hugging_face_parquet_at_a_url_reads_as_the_image_folder(on_s3, bucket, folders, monkeypatch):
    """data.name=hf at s3://: Parquet files mirrored, then read by datasets (offline, its own Arrow cache) as on disk;
    hf://datasets/<org>/<name> stays a Hub name, read through the Hugging Face cache, never mirrored."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", Path("hf-cache").absolute())
    assert_same_images(DataConfig(name="hf", root=f"s3://{bucket}/parquet", shard_cache="cache"),
                       DataConfig(name="imagefolder", root=str(folders)))
    hub = DataConfig(name="hf", root="hf://datasets/org/name")
    assert hub_repo(hub.root) == "org/name" and local_root(hub) == hub.root


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
    assert line.startswith(f"error: cannot write s3://{bucket}/gone/.lock: no answer after {store.ATTEMPTS} tries"), \
        line  # the run's first request: the lock object's conditional put
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
    assert line == (f"error: cannot write s3://{bucket}/denied/.lock (access denied: The AWS Access Key Id you "
                    "provided does not exist in our records.); check the URL and the credentials in the environment "
                    "(AWS_ACCESS_KEY_ID, AWS_PROFILE, ...)"), line


def test_a_checkpoint_at_a_url_is_read_through_a_local_copy_with_its_run_files(on_s3, bucket):
    """What evaluate.py, predict.py, export.py (fetched) and average_checkpoints.py (fetched_folder) read from a URL:
    the checkpoint copied byte for byte with its run folder's small files, not its other checkpoints; a local path as
    it is."""
    fs = s3fs_for(on_s3)
    files = {"best.pth": b"B" * 100, "last.pth": b"L" * 100, "config.yaml": b"seed: 0\n", "epoch_0001.pth": b"E"}
    for name, data in files.items():
        fs.pipe(f"{bucket}/run/{name}", data)
    local = Path(fetched(f"s3://{bucket}/run/best.pth"))
    assert local.read_bytes() == files["best.pth"] and (local.parent / "config.yaml").read_bytes() == b"seed: 0\n"
    assert sorted(p.name for p in local.parent.iterdir()) == ["best.pth", "config.yaml"]
    assert fetched("runs/x/best.pth") == "runs/x/best.pth"
    epochs = fetched_folder(f"s3://{bucket}/run", lambda name, size: name.startswith("epoch_"))
    assert epochs == local.parent and (epochs / "epoch_0001.pth").read_bytes() == b"E"


def test_model_init_from_a_url_reads_the_checkpoint_named_by_its_url(on_s3, bucket, tiny_run, tmp_path,
                                                                     monkeypatch):
    """model.init_from (and the advice of the refusals that name it, written with the URL) takes a checkpoint at a
    URL: its weights through the local copy, named by the URL; a missing one is one line naming the URL (it was read
    as the local path s3:/..., which does not exist)."""
    from engine.checkpoint.weights import read_pretrained

    monkeypatch.chdir(tmp_path)
    s3fs_for(on_s3).put_file(str(tiny_run / "best.pth"), f"{bucket}/init/best.pth")
    pretrained = read_pretrained(f"s3://{bucket}/init/best.pth")
    assert pretrained.source == f"model.init_from=s3://{bucket}/init/best.pth"
    assert_same(pretrained.state_dict, load_checkpoint(tiny_run / "best.pth")["model"])
    with pytest.raises(UserError, match=f"s3://{bucket}/init/none.pth"):
        read_pretrained(f"s3://{bucket}/init/none.pth")
    assert not Path("s3:").exists()


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


def test_a_run_at_a_url_names_the_url_in_its_lines_not_its_staging_folder(on_s3, bucket, capsys):
    """The run's lines name output_dir as the user gave it: the start, the resume notice, the last line (`outputs
    in s3://...`) and a finished run's notice; only the line that says where the run works names the staging
    folder (a run stopped by train.max_steps, continued, then started once more)."""
    url, staging = f"s3://{bucket}/named", str(mirror_of(f"s3://{bucket}/named"))
    argv = [*TINY, "data.dummy_train_size=16", f"output_dir={url}"]
    for extra in (["train.max_steps=1"], [], []):
        assert report_errors(train.main, [*argv, *extra]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert [line for line in lines if staging in line] == [line for line in lines if " the run works in " in line]
    said = [line for line in lines if f" {url}" in line]
    for words in ("output_dir", "outputs in", "resuming from", "is finished"):
        assert any(words in line for line in said), words
    assert f"resuming from {url}/last.pth (epoch 0, step 1 of it, global step 1)" in "\n".join(said)
    assert sum(line.endswith(f"; outputs in {url}") for line in lines) == 2
    assert lines[-1].endswith(f"INFO the run in {url} is finished (all 1 epochs of train.epochs done): nothing was "
                              "trained or written; raise train.epochs (or train.max_steps, train.early_stop_patience) "
                              "to continue it, or use another output_dir for a new run"), lines[-1]


class SecondStarter:
    """The real filesystem, on which another run starts (a whole LockObject acquire) just before the first put of the
    lock object that `first(kwargs)` picks: two starters that both looked at the lock before either wrote it."""

    def __init__(self, fs, url: str, first) -> None:
        self.fs, self.url, self.first, self.other = fs, url, first, None

    def __getattr__(self, name: str):
        return getattr(self.fs, name)

    def pipe_file(self, path: str, data: bytes, **kwargs):
        if self.other is None and self.first(kwargs):
            self.other = "starting"  # (its own puts go straight through)
            self.other = run_store.LockObject(self.url)
        return self.fs.pipe_file(path, data, **kwargs)


@pytest.mark.parametrize("before", ["none", "stale"])
def test_of_two_runs_starting_at_once_exactly_one_takes_the_lock(on_s3, bucket, monkeypatch, before):
    """The lock object is a conditional put (S3 If-None-Match, and If-Match on a stale lock's ETag): a second run that
    starts between the first one's look at <url>/.lock and its put takes the lock, and the first is refused in one
    line (written and read back, both believed they held it), with no lock before and with a dead run's stale one."""
    url, stale = f"s3://{bucket}/race-{before}", {"host": "elsewhere", "pid": 1, "time": 0.0, "token": "dead"}
    fs, path = store.filesystem(f"{url}/.lock")
    if before == "stale":
        fs.pipe_file(path, json.dumps(stale).encode())
    starter = SecondStarter(fs, url, (lambda kwargs: True) if before == "none" else
                            (lambda kwargs: kwargs.get("mode") != "create"))  # the put that replaces the stale lock
    monkeypatch.setattr(run_store, "filesystem", lambda _: (starter, path))
    refusal = "is in use by another run" if before == "none" else "was locked by another run at the same moment"
    with pytest.raises(UserError, match=f"^output_dir {url} {refusal}"):
        run_store.LockObject(url)
    assert json.loads(fs.cat_file(path))["token"] == starter.other.token
    starter.other.release()
    assert not fs.exists(path)


def test_a_run_whose_lock_was_taken_over_keeps_off_the_others_files(on_s3, bucket, tmp_path):
    """A run silent past LOCK_STALE_S whose lock another run took over: its next refresh (a put on its own ETag) keeps
    the other's lock object instead of writing over it, and its next upload is one line and uploads nothing."""
    url = f"s3://{bucket}/taken"
    fs, path = store.filesystem(f"{url}/.lock")
    mine = run_store.LockObject(url)
    mine.stop.set()  # this test beats the refresh itself
    mine.beat()  # a refresh while it holds the lock
    fs.rm_file(path)
    mine.beat()  # a refresh after its lock object was removed: made anew
    assert json.loads(fs.cat_file(path))["token"] == mine.token and mine.lost is None
    other = {"host": "elsewhere", "pid": 7, "time": 1.0, "token": "other"}
    fs.pipe_file(path, json.dumps(other).encode())  # the run that judged this one stale
    mine.beat()
    assert json.loads(fs.cat_file(path)) == other and mine.lost == other
    runs = RunStore(url, tmp_path / "staging")
    runs.lock = mine
    (runs.local / "last.pth").parent.mkdir(parents=True)
    (runs.local / "last.pth").write_bytes(b"mine")
    with pytest.raises(UserError, match=f"^output_dir {url}: another run \\(process 7 on elsewhere\\) took over "
                                        "this run's lock, .* this run stops without uploading"):
        runs.push()
    assert not fs.exists(f"{bucket}/taken/last.pth") and runs.broken
    mine.release()
    assert json.loads(fs.cat_file(path)) == other  # released: the other's lock stays


def test_a_lock_object_without_conditional_puts_is_written_and_read_back():
    """Where puts take no condition (any scheme but s3://; memory:// here) the lock is written and read back: a second
    run is refused in one line while the first holds it, and takes it once released."""
    url = f"memory://lock{free_port()}/run"
    first = run_store.LockObject(url)
    with pytest.raises(UserError, match=f"^output_dir {url} is in use by another run \\(process {os.getpid()} "):
        run_store.LockObject(url)
    first.release()
    run_store.LockObject(url).release()


def sharded_folder(folder: Path, save: str) -> Path:
    """A stand-in sharded folder (DCP's file names, `save` in every file): what put_folder moves as it is."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        (folder / name).write_text(f"{save} {name}")
    return folder


class CutAfterPuts:
    """The real filesystem, whose uploads fail (access denied) after the first `n`: an upload killed halfway."""

    def __init__(self, fs, n: int) -> None:
        self.fs, self.left = fs, n

    def __getattr__(self, name: str):
        return getattr(self.fs, name)

    def put_file(self, *args, **kwargs):
        self.left -= 1
        if self.left < 0:
            raise PermissionError("cut")
        return self.fs.put_file(*args, **kwargs)


def test_a_sharded_folder_at_a_url_reads_whole_however_its_upload_was_cut_short(on_s3, bucket, monkeypatch):
    """put_folder: last.dcp/ at the URL replaced by way of last.dcp.next/ (S3 renames no folder); fetched (evaluate.py)
    and a run's pull read one whole save in each state a kill can leave, never a mix of two: the new folder's upload
    cut short (no .metadata yet: the old one), the old folder half replaced (its .metadata gone: the new one whole
    in .next), the next save's upload cut short from there (the new one), and done (the newest, .next gone)."""
    fs, url = s3fs_for(on_s3), f"s3://{bucket}/cut/last.dcp"
    put_folder(sharded_folder(Path("old"), "old"), url)
    new = sharded_folder(Path("new"), "new")

    def read() -> set[str]:
        for each in (fs, store.filesystem(url)[0]):  # listed anew, as by a reader in another process
            each.invalidate_cache()
        for way in (Path(fetched(url)), pulled_run()):
            assert sorted(p.name for p in way.iterdir()) == sorted(p.name for p in new.iterdir())
            yield {p.read_text().split()[0] for p in way.iterdir()}

    def pulled_run() -> Path:
        run = RunStore(url.rsplit("/", 1)[0], Path("staging"))
        run.pull()
        return run.local / "last.dcp"

    fs.put_file(str(new / "__0_0.distcp"), f"{bucket}/cut/last.dcp.next/__0_0.distcp")  # killed mid-upload
    assert list(read()) == [{"old"}] * 2
    for name in ("__1_0.distcp", ".metadata"):  # the upload done, .metadata last
        fs.put_file(str(new / name), f"{bucket}/cut/last.dcp.next/{name}")
    fs.rm_file(f"{bucket}/cut/last.dcp/.metadata")  # killed while replacing the old folder
    fs.copy(f"{bucket}/cut/last.dcp.next/__0_0.distcp", f"{bucket}/cut/last.dcp/__0_0.distcp")
    assert list(read()) == [{"new"}] * 2
    fs.rm(f"{bucket}/cut/last.dcp", recursive=True)  # killed between the old folder's removal and the copies
    assert list(read()) == [{"new"}] * 2
    fs.copy(f"{bucket}/cut/last.dcp.next/__0_0.distcp", f"{bucket}/cut/last.dcp/__0_0.distcp")
    monkeypatch.setattr(run_store, "filesystem", lambda at: (CutAfterPuts(store.filesystem(at)[0], 1),
                                                             store.filesystem(at)[1]))
    with pytest.raises(UserError, match=r"^cannot write s3://.*/cut/last.dcp.next \(access denied: cut\)"):
        put_folder(sharded_folder(Path("newer"), "newer"), url)  # the next save's, killed mid-upload: the swap
    assert list(read()) == [{"new"}] * 2  # left unfinished was finished first (else no whole save was left)
    monkeypatch.setattr(run_store, "filesystem", store.filesystem)  # the server back
    put_folder(sharded_folder(Path("newer"), "newer"), url)  # the next save's put_folder, done
    assert list(read()) == [{"newer"}] * 2 and not fs.exists(f"{bucket}/cut/last.dcp.next")


def test_predict_writes_its_output_to_a_url_and_refuses_one_that_holds_something_else(on_s3, bucket, tiny_run,
                                                                                      folders, capsys):
    """predict.py of a checkpoint at a URL writes beside it there by default (as evaluate.py, whose --output-dir at a
    URL the SIGKILL test below reads): a local mirror, uploaded file by file (no temporary key left, the mirror gone);
    a URL holding something that is not an earlier output is refused in one line naming it, and left as it was."""
    fs, checkpoint, images = s3fs_for(on_s3), f"s3://{bucket}/outs/best.pth", str(folders / "val" / "a")
    for name in ("best.pth", "config.yaml"):
        fs.put_file(str(tiny_run / name), f"{bucket}/outs/{name}")
    fs.pipe(f"{bucket}/notes/predictions.json", b"my notes\n")
    line = last_error(capsys, report_errors(predict.main, [checkpoint, images, "--output-dir", f"s3://{bucket}/notes"]))
    assert f"s3://{bucket}/notes/predictions.json" in line and "--output-dir" in line, line
    assert fs.find(f"{bucket}/notes") == [f"{bucket}/notes/predictions.json"]
    assert fs.cat(f"{bucket}/notes/predictions.json") == b"my notes\n"
    assert report_errors(predict.main, [checkpoint, images]) == 0
    assert f"predictions.json to s3://{bucket}/outs/predict-a" in capsys.readouterr().out
    assert json.loads(fs.cat(f"{bucket}/outs/predict-a/predictions.json"))["n"] == COUNTS["val"]["a"]
    assert sorted(fs.ls(f"{bucket}/outs/predict-a")) == [f"{bucket}/outs/predict-a/{name}" for name in
                                                          ("predictions.csv", "predictions.json")]
    assert not mirror_of(f"s3://{bucket}/outs/predict-a", "outputs").exists()


@pytest.mark.slow
def test_a_run_on_s3_killed_after_its_first_epoch_continues_bitwise_and_evaluates_its_best(on_s3, bucket, tmp_path,
                                                                                         capsys):
    """output_dir=s3://: the run, and a copy SIGKILLed once its first epoch's last.pth is on the server then run again
    (its lock object left behind: the dead process's, taken over), equal bit for bit; while the copy ran a second run
    into its URL was refused in one line naming the owner; another config is refused in one line naming the URL;
    evaluate.py on s3://.../best.pth, its --output-dir at s3:// too, finds the run's best val_top1."""
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
    assert report_errors(evaluate.main, [f"s3://{bucket}/straight/best.pth", "--output-dir",
                                         f"s3://{bucket}/straight/eval"]) == 0
    assert json.loads(fs.cat(f"{bucket}/straight/eval/eval.json"))["top1"] == max(row["val_top1"] for row in rows)
    assert not mirror_of(f"s3://{bucket}/straight/eval", "outputs").exists()


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
    once per improvement of its own val_top1 (the ranks' order is not the one process's). With
    train.ckpt_format=sharded (last.dcp/ up whole by put_folder, no last.dcp.next left), the run stopped after its
    first epoch (train.max_steps) and run again ends bit for bit where the 2-rank last.pth does (weights, optimizer,
    RNG, counters), and evaluate.py on s3://.../last.dcp prints its last val_top1."""
    fs, out = s3fs_for(on_s3), f"v{free_port()}"
    fs.mkdir(out)
    fs.make_bucket_versioned(out)
    args = ["--config", "dummy", *COMMON[2:], NO_BN_MODEL, "data.name=wds", f"data.root=s3://{bucket}/shards"]
    train_here(*args, "data.shard_cache=cache", "train.batch_size=6", f"output_dir=s3://{out}/one")
    env = {**on_s3, "WIDS_CACHE": str(tmp_path / "cache-{rank}")}  # data.shard_cache="": $WIDS_CACHE
    run_on_ranks("train.py", *args, "train.batch_size=3", f"output_dir=s3://{out}/two", nproc=2, cwd=tmp_path, env=env)
    train, val = (ShardDataset(str(shards / f"{split}.json"), None, seed=0) for split in ("train", "val"))
    for rank in range(2):
        mine = ShardPlan(np.diff(train.starts), seed=0, rank=rank, world=2).mine
        start, stop = shard_bounds(len(val), rank, 2, 3)
        block = range(val.locate(start)[0], val.locate(stop - 1)[0] + 1)
        names = [Path(train.urls[shard]).name for shard in mine] + [Path(val.urls[shard]).name for shard in block]
        assert cached(tmp_path / f"cache-{rank}") == sorted(names), rank
    assert len(mine) < len(train.urls)  # rank 1 left shards to rank 0
    two_ranks = load_checkpoint(fetch(fs, f"{out}/two/last.pth", tmp_path / "two" / "last.pth"))
    assert two_ranks["epoch"] == 2
    rows = [json.loads(row)["val_top1"] for row in fs.cat(f"{out}/two/metrics.jsonl").decode().splitlines()]
    bests = sum(value > max(rows[:epoch], default=-1) for epoch, value in enumerate(rows))  # best.pth writes
    one, two = versions(on_s3, out, "one"), versions(on_s3, out, "two")
    assert two == {**one, "best.pth": bests} and one["last.pth"] == 2, (one, two)  # last.pth after each validation
    per_epoch = two_ranks["global_step"] // 2
    for extra in ([f"train.max_steps={per_epoch}"], []):  # the first epoch, then the rest
        run_on_ranks("train.py", *args, "train.batch_size=3", "train.ckpt_format=sharded", *extra,
                     f"output_dir=s3://{bucket}/dcp", nproc=2, env=env, cwd=tmp_path)
        assert read_checkpoint(fetched(f"s3://{bucket}/dcp/last.dcp"))["global_step"] == per_epoch * (2 - len(extra))
    assert_same(two_ranks, as_file_checkpoint(Path(fetched(f"s3://{bucket}/dcp/last.dcp"))))
    assert not fs.exists(f"{bucket}/dcp/last.dcp.next")
    rows = [json.loads(row) for row in fs.cat(f"{bucket}/dcp/metrics.jsonl").decode().splitlines()]
    assert [row["epoch"] for row in rows] == [0, 1]
    assert report_errors(evaluate.main, [f"s3://{bucket}/dcp/last.dcp", "--output-dir", "eval"]) == 0
    assert json.loads(Path("eval/eval.json").read_text())["top1"] == rows[-1]["val_top1"]


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
