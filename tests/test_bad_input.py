"""Each mistake a new user can make ends with one stderr line naming the culprit and a non-zero exit.

The entry points run in-process through report_errors (what `python train.py` runs), so each case
costs milliseconds; tests/test_distributed.py runs one such error through real `python train.py`
and torchrun processes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import evaluate
import train
from data.loader import build_eval_loader
from data.datasets import DummyDataset
from data.transforms import eval_transform
from engine.cli import report_errors
from engine.config import DataConfig
from engine.dist import DistInfo
from engine.errors import UserError
from tests.helpers import make_image_folder, read_jsonl

TINY = ["--config", "configs/dummy.yaml", "model.name=test_resnet", "model.channels_last=false", "amp='off'",
        "data.img_size=16", "data.dummy_image_size=20", "data.dummy_train_size=32", "data.dummy_val_size=10",
        "data.num_workers=0", "train.batch_size=8", "train.epochs=1", "logging.progress=false"]


def last_error(capsys, code: int) -> str:
    """The one line the user sees; asserts the exit code and that no traceback was printed."""
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    """An image folder with a corrupt training image, a val set missing a class, an empty class folder."""
    root = tmp_path_factory.mktemp("data")
    make_image_folder(root / "good", {"train": {"a": 8, "b": 8}, "val": {"a": 2, "b": 2}}, size=20)
    make_image_folder(root / "corrupt", {"train": {"a": 8, "b": 8}, "val": {"a": 2, "b": 2}}, size=20)
    (root / "corrupt/train/b/003.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    make_image_folder(root / "differ", {"train": {"a": 2, "b": 2}, "val": {"a": 2, "c": 2}}, size=20)
    make_image_folder(root / "empty", {"train": {"a": 2}, "val": {"a": 2}}, size=20)
    (root / "empty/train/b").mkdir()
    (root / "empty/val/b").mkdir()
    (root / "noclasses/train").mkdir(parents=True)
    (root / "noclasses/val").mkdir()
    (root / "notes.txt").write_text("a regular file")
    return root


CASES = {  # name: (arguments after TINY, text the last line must contain)
    "missing config": (["--config", "nope.yaml"], "config file 'nope.yaml' not found"),
    "unknown key": (["optim.lrr=0.1"], "unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),
    "wrong type": (["train.batch_size=eight"], "config key 'train.batch_size' must be int, got 'eight'"),
    "negative lr": (["optim.lr=-0.1"], "config key 'optim.lr' must be >= 0, got -0.1"),
    "batch size 0": (["train.batch_size=0"], "config key 'train.batch_size' must be > 0, got 0"),
    "unknown amp": (["amp=fp8"], "config key 'amp' is 'fp8'; choose one of auto, bf16, fp16, off"),
    "yes is not a boolean": (["model.sync_bn=yes"], "config key 'model.sync_bn' must be bool, got 'yes'"),
    "unknown model": (["model.name=resnet181"], "resnet18"),
    "data root missing": (["data.name=imagefolder", "data.root={root}/missing"], "{root}/missing/val does not exist"),
    "no class folders": (["data.name=imagefolder", "data.root={root}/noclasses"], "has no class folders"),
    "empty class folder": (["data.name=imagefolder", "data.root={root}/empty"], "class folder {root}/empty/val/b has no images"),
    "class sets differ": (["data.name=imagefolder", "data.root={root}/differ"], "different class folders (differing: b, c)"),
    "corrupt image": (["data.name=imagefolder", "data.root={root}/corrupt", "train.batch_size=4"],
                      "cannot read image {root}/corrupt/train/b/003.png"),
    "resume path missing": (["resume={root}/none.pth"], "resume={root}/none.pth: no such checkpoint file"),
    "init_from missing": (["model.init_from={root}/none.pth"], "{root}/none.pth does not exist"),
    "shard smaller than a batch": (["data.dummy_train_size=4"], "each rank gets 4 training images but "
                                                               "train.batch_size is 8"),
    "output_dir under a file": (["output_dir={root}/notes.txt/run"], "output_dir {root}/notes.txt/run is not writable"),
}


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_one_line_naming_the_culprit(name, folders, tmp_path, capsys):
    args, expected = CASES[name]
    args = [a.format(root=folders) for a in args]
    out = [] if any(a.startswith("output_dir=") for a in args) else [f"output_dir={tmp_path / 'run'}"]
    line = last_error(capsys, report_errors(train.main, [*TINY, *out, *args]))
    assert line.startswith("error: ") and expected.format(root=folders) in line, line
    assert not (tmp_path / "run").exists()  # the corrupt image too: found while training, before the first write


def test_yaml_syntax_error_names_the_line(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("optim:\n  lr: 0.1\n train:\n  epochs: 2\n")
    line = last_error(capsys, report_errors(train.main, ["--config", str(config)]))
    assert f"{config}: line 3 is not valid YAML" in line


def test_skip_corrupt_trains_and_counts_the_skipped_image(folders, tmp_path, capsys):
    out = tmp_path / "run"
    argv = [*TINY, "data.name=imagefolder", f"data.root={folders}/corrupt", "train.batch_size=4", "train.epochs=2",
            "data.skip_corrupt=true", f"output_dir={out}"]
    assert report_errors(train.main, argv) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [(r["skipped_images"], r["train_images"]) for r in rows] == [(1, 15), (1, 15)]
    assert "epoch 1: 1 unreadable training image(s) skipped" in capsys.readouterr().err


def test_more_processes_than_validation_images():
    dataset = DummyDataset(2, 2, 8, eval_transform(DataConfig(img_size=8)), seed=0)
    with pytest.raises(UserError, match="the validation set has 2 images, fewer than the 3 processes"):
        build_eval_loader(dataset, DataConfig(), 1, DistInfo(2, 3, 2, 3, torch.device("cpu")))


class Payload:
    """A pickle that runs code when loaded: Path.touch(marker)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


@pytest.fixture
def booby_trapped(tmp_path) -> tuple[Path, Path]:
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil" / "last.pth"
    path.parent.mkdir()
    torch.save({"model": {}, "payload": Payload(marker)}, path)
    # Sanity check that the payload is live: the unsafe loader would run it.
    torch.load(path, weights_only=False)
    assert marker.exists()
    marker.unlink()
    return path, marker


@pytest.mark.parametrize("entry", ["evaluate.py", "resume=<path>", "model.init_from"])
def test_checkpoint_that_would_run_code_is_refused(entry, booby_trapped, tmp_path, capsys):
    path, marker = booby_trapped
    if entry == "evaluate.py":
        code = report_errors(evaluate.main, [str(path), "--output-dir", str(tmp_path / "eval")])
    else:
        arg = f"resume={path}" if entry == "resume=<path>" else f"model.init_from={path}"
        code = report_errors(train.main, [*TINY, f"output_dir={tmp_path / 'run'}", arg])
    line = last_error(capsys, code)
    assert f"checkpoint {path} was refused" in line and "could run code" in line, line
    assert not marker.exists()


def test_truncated_checkpoint(booby_trapped, tmp_path, capsys):
    path = tmp_path / "half.pth"
    torch.save({"model": {"w": torch.zeros(10000)}}, path)
    path.write_bytes(path.read_bytes()[:5000])
    line = last_error(capsys, report_errors(evaluate.main, [str(path), "--output-dir", str(tmp_path / "eval")]))
    assert f"checkpoint {path} cannot be read" in line and "truncated" in line
