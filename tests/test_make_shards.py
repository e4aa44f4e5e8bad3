"""make_shards over an existing output: a re-run killed between two shards leaves the old set whole and read with
its own labels, the labels of an index are checked against the tars' .cls members, and an output that is not
ours (inside a split folder it reads, a file in the index's place) is refused before anything is made."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from data import make_shards
from data.datasets import ImageFolderDataset
from data.shards import ShardDataset
from tests.helpers import REPO, make_image_folder, script_env

# Run as `python -c`: make_shards that SIGKILLs itself while it writes its 3rd shard (shard size 1: two done).
KILLED_AT_THE_THIRD_SHARD = """
import os, signal, sys
from data import make_shards
real, labels = make_shards.add_member, []
def add_member(tar, name, data):
    if name.endswith(".cls"):
        labels.append(name)
        if len(labels) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
    real(tar, name, data)
make_shards.add_member = add_member
sys.exit(make_shards.run(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def two_folders(tmp_path_factory) -> tuple[Path, Path]:
    """Two ImageFolder trees with other images and, sample by sample, other labels."""
    root = tmp_path_factory.mktemp("make_shards")
    old = make_image_folder(root / "old", {"train": {"a": 2, "b": 4}, "val": {"a": 1, "b": 1}}, size=8, seed=0)
    new = make_image_folder(root / "new", {"train": {"a": 5, "b": 1}, "val": {"a": 1, "b": 1}}, size=8, seed=1)
    return old, new


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def assert_holds(out: Path, folder: Path) -> None:
    """Every sample of out/train.json is the folder's: image bytes, path and label (the .cls members checked)."""
    shards, images = ShardDataset(str(out / "train.json"), None, 0), ImageFolderDataset(folder / "train", None, 0)
    assert len(shards) == len(images) and shards.labels.tolist() == images.labels.tolist()
    for i in range(len(images)):
        assert shards.path(i) == images.path(i) and shards.member(i, 0) == Path(images.path(i)).read_bytes(), i


def test_a_rerun_killed_between_shards_leaves_the_old_set_whole(two_folders, tmp_path):
    # Was: the killed run had replaced train-000000.tar and -000001.tar, and the old index read them (same padded
    # sizes) under the old labels, without a word.
    old, new = two_folders
    out = tmp_path / "shards"
    assert make_shards.run([str(old), str(out), "--shard-size", "1"]) == 0
    before = files(out)
    killed = subprocess.run([sys.executable, "-c", KILLED_AT_THE_THIRD_SHARD, str(new), str(out), "--shard-size", "1"],
                            cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    after = files(out)
    assert {name: after.get(name) for name in before} == before  # every old file byte for byte
    assert sorted(set(after) - set(before)) == [".train-g2-000002.tar.tmp", "train-g2-000000.tar",
                                                "train-g2-000001.tar"]  # the killed run's
    assert_holds(out, old)
    # The next run replaces the old set and removes what the killed one left.
    assert make_shards.run([str(new), str(out), "--shard-size", "1"]) == 0
    assert sorted(files(out)) == [*(f"train-g2-00000{i}.tar" for i in range(6)), "train.json",
                                  "val-g2-000000.tar", "val-g2-000001.tar", "val.json"]
    assert_holds(out, new)


def test_labels_that_disagree_with_the_shards_are_refused_when_written(two_folders, tmp_path, monkeypatch, capsys):
    old, new = two_folders
    out = tmp_path / "shards"
    assert make_shards.run([str(old), str(out), "--shard-size", "4"]) == 0
    before = files(out)
    real = make_shards.add_member

    def add_member(tar, name: str, data: bytes) -> None:  # a .cls member that is not the label (a writer's bug)
        real(tar, name, b"1" if name == "00000002.cls" else data)

    monkeypatch.setattr(make_shards, "add_member", add_member)
    assert make_shards.run([str(new), str(out), "--shard-size", "4"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: shard {out}/train-g2-000000.tar as written disagrees with its index (sample 00000002 has '1' in its "
        f".cls member, the index 0); {out}/train.json was left as it was: check the disk and run again")
    assert {name: data for name, data in files(out).items() if name in before} == before


def test_an_output_that_is_not_ours_is_refused_before_anything_is_made(two_folders, tmp_path, capsys):
    # Was: make_shards ROOT ROOT/train/newclass made the class folder, refused because of it and left it there;
    # a train.json of the user's was overwritten.
    old, _ = two_folders
    assert make_shards.run([str(old), str(old / "train" / "newclass")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: output folder {old}/train/newclass is inside "
                                                    f"{old}/train, which make_shards reads; choose a folder outside "
                                                    f"it (e.g. {old}/shards)"]
    assert sorted(p.name for p in (old / "train").iterdir()) == ["a", "b"]
    out = tmp_path / "shards"
    out.mkdir()
    (out / "train.json").write_text("my notes\n")
    assert make_shards.run([str(old), str(out)]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"error: {out}/train.json exists and is not a shard "
                                                               "index (")
    assert files(out) == {"train.json": b"my notes\n"}
