"""Each mistake a new user can make ends with one stderr line naming the culprit and a non-zero exit.

The entry points run in-process through report_errors (what `python train.py` runs), so each case
costs milliseconds; tests/test_distributed.py runs one such error through real `python train.py`
and torchrun processes.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

import pytest
import torch

import evaluate
import train
from core.cli import report_errors
from core.config import DataConfig
from core.dist import DistInfo
from core.errors import UserError
from data.datasets import DummyDataset
from data.loader import build_eval_loader
from data.transforms import eval_transform
from tests.helpers import TINY, check_one_line, last_error, make_image_folder, png_header, read_jsonl, write_jpeg


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    """An image folder with a corrupt training image and a val set with a class train lacks."""
    root = tmp_path_factory.mktemp("data")
    make_image_folder(root / "good", {"train": {"a": 8, "b": 8}, "val": {"a": 2, "b": 2}}, size=20)
    make_image_folder(root / "corrupt", {"train": {"a": 8, "b": 8}, "val": {"a": 2, "b": 2}}, size=20)
    (root / "corrupt/train/b/003.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    make_image_folder(root / "differ", {"train": {"a": 2, "b": 2}, "val": {"a": 2, "c": 2}}, size=20)
    (root / "noclasses/train").mkdir(parents=True)
    (root / "noclasses/val").mkdir()
    (root / "notes.txt").write_text("a regular file")
    make_image_folder(root / "truncjpeg", {"train": {"a": 8, "b": 8}, "val": {"a": 2, "b": 2}}, size=20)
    whole = write_jpeg(root / "truncjpeg/val/a/002.jpg")
    (root / "truncjpeg/val/a/002.jpg").write_bytes(whole[:len(whole) // 3])
    make_image_folder(root / "huge", {"train": {"a": 8, "b": 8}, "val": {"a": 2, "b": 2}}, size=20)
    (root / "huge/train/a/007.png").write_bytes(png_header(40000, 40000))  # over OpenCV's 2**30 pixels too
    make_image_folder(root / "fileloop", {"train": {"a": 8, "b": 8}, "val": {"a": 2, "b": 2}}, size=20)
    os.symlink("loop.png", root / "fileloop/train/a/loop.png")
    make_image_folder(root / "classloop", {"train": {"a": 8, "b": 8}, "val": {"a": 2, "b": 2}}, size=20)
    os.symlink("c", root / "classloop/val/c")
    make_image_folder(root / "dangling", {"train": {"a": 8, "b": 8}, "val": {"a": 2, "b": 2}}, size=20)
    os.symlink("moved-away.png", root / "dangling/val/a/gone.png")
    make_image_folder(root / "dangling_train", {"train": {"a": 8, "b": 8}, "val": {"a": 2, "b": 2}}, size=20)
    os.symlink("moved-away.png", root / "dangling_train/train/a/gone.png")
    make_image_folder(root / "newline", {"photos": {"a": 4, "b": 4}}, size=20)
    (root / "newline/photos/a/001.png").rename(root / "newline/photos/a/two\nlines.png")
    return root


CASES = {  # name: (arguments after TINY, text the last line must contain)
    "missing config": (["--config", "nope.yaml"], "config file 'nope.yaml' not found"),
    "unknown key": (["optim.lrr=0.1"], "unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),
    "wrong type": (["train.epochs=eight"], "config key 'train.epochs' must be int, got 'eight'"),
    "negative lr": (["optim.lr=-0.1"], "config key 'optim.lr' must be >= 0, got -0.1"),
    "batch size 0": (["train.batch_size=0"], "config key 'train.batch_size' must be > 0, or auto (the largest batch that "
                                            "fits: docs/tuning.md), got 0"),
    "unknown amp": (["amp=fp8"], "config key 'amp' is 'fp8'; choose one of auto, bf16, fp16, off"),
    "yes is not a boolean": (["model.sync_bn=yes"], "config key 'model.sync_bn' must be bool, got 'yes'"),
    "unknown model": (["model.name=resnet181"], "resnet18"),
    "data root missing": (["data.name=imagefolder", "data.root={root}/missing"], "{root}/missing/train does not exist"),
    "no class folders": (["data.name=imagefolder", "data.root={root}/noclasses"], "has no class folders"),
    "val has a class train lacks": (["data.name=imagefolder", "data.root={root}/differ"],
                                    "{root}/differ/val has classes that are not among the 2 training classes (c)"),
    "split folder missing": (["data.name=imagefolder", "data.root={root}/good", "data.val_split=test"],
                             "data folder {root}/good/test does not exist"),
    "resume path missing": (["resume={root}/none.pth"], "resume={root}/none.pth: no such checkpoint file"),
    "init_from missing": (["model.init_from={root}/none.pth"], "{root}/none.pth does not exist"),
    "shard smaller than a batch": (["data.dummy_train_size=4"], "each rank gets 4 training images but "
                                                               "train.batch_size is 8"),
    "output_dir under a file": (["output_dir={root}/notes.txt/run"], "output_dir {root}/notes.txt/run is not writable"),
    "empty output_dir": (["output_dir="], "config key 'output_dir' is empty"),
    "comment in a number": (["train.epochs=1 #2"], "config key 'train.epochs' must be int, got '1 #2'"),
    "seed above 2**32 - 1": (["seed=4294967296"], "config key 'seed' must be in [0, 4294967295], got 4294967296"),
    "negative seed": (["seed=-1"], "config key 'seed' must be in [0, 4294967295], got -1"),
    "negative split seed": (["data.split_seed=-1"], "config key 'data.split_seed' must be in [0, 4294967295], got -1"),
    "underscore in a float": (["optim.lr=1_0"], "config key 'optim.lr' must be float, got '1_0'"),
    "Arabic-Indic digits in a float": (["optim.lr=\u0661\u0660"], "config key 'optim.lr' must be float, got "
                                       "'\u0661\u0660'"),
    "drop rate above 1": (["model.drop_rate=2"], "config key 'model.drop_rate' must be in [0, 1), got 2.0"),
    "flip probability above 1": (["data.hflip=5"], "config key 'data.hflip' must be in [0, 1], got 5.0"),
    "NaN learning rate": (["optim.lr=.nan"], "config key 'optim.lr' must be a finite number, got nan"),
    "validation on the training split": (["data.name=imagefolder", "data.root={root}/good", "data.val_split=train"],
                                         "data.val_split=train is data.train_split: each epoch's validation, and the "
                                         "choice of best.pth, would score the images the model trains on"),
    "data.val_fraction on a root split already": (["data.name=imagefolder", "data.root={root}/good",
                                                   "data.val_fraction=0.2"],
                                                  "data.root {root}/good holds train/, val/, the splits of a dataset "
                                                  "split already"),
    "a split name beside data.val_fraction": (["data.name=imagefolder", "data.root={root}/good/train",
                                               "data.val_fraction=0.2", "data.val_split=test"],
                                              "data.val_split=test is not read with data.val_fraction=0.2"),
    "an image name holding a newline, split": (["data.name=imagefolder", "data.root={root}/newline/photos",
                                                "data.val_fraction=0.5"],
                                               "image '{root}/newline/photos/a/two\\nlines.png' has a line break in "
                                               "its name"),
    "--config twice (read the second alone)": (["--config", "dummy", "--config", "digits"],
                                               "--config given twice ('dummy', then 'digits')"),
}
DATA_CASES = {  # name: (arguments after TINY, text the last line must contain)
    "corrupt image": (["data.root={root}/corrupt"], "cannot read image {root}/corrupt/train/b/003.png"),
    "JPEG truncated to a third": (["data.root={root}/truncjpeg"], "cannot read image {root}/truncjpeg/val/a/002.jpg"),
    "image over data.max_image_pixels": (["data.root={root}/huge"], "image {root}/huge/train/a/007.png is "
                                         "40000x40000 pixels, more than data.max_image_pixels=89478485"),
    "symlink loop": (["data.root={root}/fileloop"], "{root}/fileloop/train/a/loop.png is a broken symbolic link "
                     "(Too many levels of symbolic links)"),
    "class folder symlink loop": (["data.root={root}/classloop"], "{root}/classloop/val/c is a broken symbolic link"),
    "dangling symlink in val": (["data.root={root}/dangling", "data.skip_corrupt=true"],
                                "{root}/dangling/val/a/gone.png is a broken symbolic link (No such file"),
    "dangling symlink in train": (["data.root={root}/dangling_train"],
                                  "{root}/dangling_train/train/a/gone.png is a broken symbolic link"),
}


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_one_line_naming_the_culprit(name, folders, tmp_path, capsys, monkeypatch):
    args, expected = CASES[name]
    check_one_line(args, expected, folders, tmp_path, capsys, monkeypatch)
    assert not (tmp_path / "run").exists()  # stopped before its first write: the folder it made is gone again


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name", DATA_CASES)
def test_bad_data_is_one_line_naming_the_file(name, workers, folders, tmp_path, capsys, monkeypatch):
    """The same line with DataLoader workers, where torch re-raises a worker's error with its traceback inside."""
    args, expected = DATA_CASES[name]
    args = ["data.name=imagefolder", "train.batch_size=4", f"data.num_workers={workers}", *args]
    check_one_line(args, expected, folders, tmp_path, capsys, monkeypatch)
    # Found while training or before: the run stopped before its first write, and the folder it made is gone.
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
@pytest.mark.parametrize("under, expected", [
    ("", "data.root {root}/notes.txt is a file; for data.name=digits choose a new or empty folder"),
    ("/digits", "data.root {root}/notes.txt/digits is under {root}/notes.txt, which is a file; for data.name=digits "
                "choose a new or empty folder"),
])
def test_digits_root_at_or_under_a_file_is_one_line_and_writes_nothing(under, expected, dry_run, folders, tmp_path,
                                                                        capsys):
    """Was NotADirectoryError / FileExistsError, with a 7 MB hidden staging folder left beside the user's file,
    even under --dry-run."""
    before = sorted(p.name for p in folders.iterdir())
    argv = [*dry_run, *TINY, f"output_dir={tmp_path / 'run'}", "data.name=digits", f"data.root={folders}/notes.txt{under}"]
    line = last_error(capsys, report_errors(train.main, argv))
    assert line == f"error: {expected.format(root=folders)}", line
    assert sorted(p.name for p in folders.iterdir()) == before and not (tmp_path / "run").exists()


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
@pytest.mark.parametrize("key", ["amp", "eval_amp"])
def test_a_precision_this_device_cannot_use_is_refused_before_the_data(key, dry_run, tmp_path, capsys):
    """fp16 on the CPU: refused in one line, by --dry-run as by the run (--dry-run passed eval_amp=fp16, which the run
    then refused), before any data is read (data.root does not exist here: its error would come first)."""
    argv = [*dry_run, *TINY, f"output_dir={tmp_path / 'run'}", f"{key}=fp16", "data.name=imagefolder",
            f"data.root={tmp_path / 'no_images'}"]
    line = last_error(capsys, report_errors(train.main, argv))
    assert line.startswith(f"error: {key}=fp16 on CPU is far slower than fp32"), line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("empty", [["--config", ""], ["--config=  "]])
def test_an_empty_config_is_one_line_not_the_bare_defaults(empty, capsys):
    line = last_error(capsys, report_errors(train.main, [*empty, "--print-config"]))
    assert line.startswith("error: --config is empty; give a YAML file, or one of configs/: ") and "digits" in line


def test_yaml_syntax_error_names_the_line(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("optim:\n  lr: 0.1\n train:\n  epochs: 2\n")
    line = last_error(capsys, report_errors(train.main, ["--config", str(config)]))
    assert f"{config}: line 3 is not valid YAML" in line


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_corrupt_trains_and_counts_the_skipped_image(workers, folders, tmp_path, capsys):
    out = tmp_path / "run"
    argv = [*TINY, "data.name=imagefolder", f"data.root={folders}/corrupt", "train.batch_size=4", "train.epochs=2",
            "data.skip_corrupt=true", f"data.num_workers={workers}", f"output_dir={out}"]
    assert report_errors(train.main, argv) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [(r["skipped_images"], r["train_images"]) for r in rows] == [(1, 15), (1, 15)]
    assert "epoch 1: 1 unreadable training image(s) skipped" in capsys.readouterr().err


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_corrupt_skips_truncated_huge_and_dangling_images(workers, tmp_path, capsys):
    """A truncated JPEG and an image over data.max_image_pixels are skipped and counted; a dangling link is named."""
    root = make_image_folder(tmp_path / "data", {"train": {"a": 7, "b": 7}, "val": {"a": 2, "b": 2}}, size=20)
    whole = write_jpeg(root / "train/a/cut.jpg")
    (root / "train/a/cut.jpg").write_bytes(whole[:len(whole) // 3])
    (root / "train/b/huge.png").write_bytes(png_header(40000, 40000))
    os.symlink("moved-away.png", root / "train/b/gone.png")
    out = tmp_path / "run"
    argv = [*TINY, "data.name=imagefolder", f"data.root={root}", "train.batch_size=4", "train.epochs=2",
            "data.skip_corrupt=true", f"data.num_workers={workers}", f"output_dir={out}"]
    assert report_errors(train.main, argv) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [(r["skipped_images"], r["train_images"]) for r in rows] == [(2, 14), (2, 14)]
    err = capsys.readouterr().err
    assert f"{root}/train/b/gone.png is a broken symbolic link" in err and "epoch 1: 2 unreadable" in err


@pytest.mark.parametrize("workers", [0, 2])
def test_file_and_class_names_that_are_not_utf8_train(workers, tmp_path, capsys):
    """Linux names are bytes: a name that is not UTF-8 must train like any other (surrogateescape, as os.fsdecode)."""
    root = make_image_folder(tmp_path / "data", {"train": {"a": 8, "b": 8}, "val": {"a": 2, "b": 2}}, size=20)
    for split in ("train", "val"):
        os.rename(root / split / "a" / "000.png", os.fsencode(root / split / "a") + b"/caf\xe9.png")  # latin-1
        os.rename(root / split / "b", os.fsencode(root / split) + b"/b\xff")
    out = tmp_path / "run"
    argv = [*TINY, "data.name=imagefolder", f"data.root={root}", "train.batch_size=4", f"data.num_workers={workers}",
            f"output_dir={out}"]
    assert report_errors(train.main, argv) == 0, capsys.readouterr().err
    assert [r["train_images"] for r in read_jsonl(out / "metrics.jsonl")] == [16]
    assert torch.load(out / "last.pth", weights_only=True)["class_names"] == ["a", os.fsdecode(b"b\xff")]
    if workers == 0:  # evaluate.py writes such paths into predictions.csv byte for byte
        assert report_errors(evaluate.main, [str(out / "last.pth"), "--output-dir", str(tmp_path / "eval")]) == 0
        written = (tmp_path / "eval" / "predictions.csv").read_bytes()
        assert b"/caf\xe9.png" in written and b"/b\xff/" in written


def train_with_config_file(config: Path, tmp_path: Path) -> int:
    """train.py --config <config> with TINY's overrides (a tiny run should the file be accepted)."""
    return report_errors(train.main, ["--config", str(config), *TINY[2:], "data.name=dummy",
                                      f"output_dir={tmp_path / 'run'}"])


def test_config_file_that_is_not_utf8_is_named(tmp_path, capsys):
    config = tmp_path / "latin1.yaml"
    config.write_bytes("optim:\n  lr: 0.1  # r\u00e9glage\n".encode("latin-1"))
    line = last_error(capsys, train_with_config_file(config, tmp_path))
    assert f"config file {config} is not UTF-8 text (line 2, byte 0xe9)" in line, line


def test_duplicate_yaml_key_names_both_lines(tmp_path, capsys):
    config = tmp_path / "twice.yaml"
    config.write_text("optim:\n  lr: 0.1\ntrain:\n  epochs: 2\noptim:\n  momentum: 0.8\n")
    line = last_error(capsys, train_with_config_file(config, tmp_path))
    assert f"{config}: line 5 is not valid YAML (duplicate key 'optim', first on line 1)" in line, line
    assert not (tmp_path / "run").exists()


def test_more_processes_than_validation_images():
    dataset = DummyDataset(2, 2, 8, eval_transform(DataConfig(img_size=8)), seed=0)
    with pytest.raises(UserError, match="the validation set has 2 images, fewer than the 3 processes"):
        build_eval_loader(dataset, DataConfig(), 1, DistInfo(2, 3, 2, 3, torch.device("cpu")))


class Payload:
    """A pickle that runs code when loaded: Path.touch(marker) (torch: "Unsupported global")."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


class ShellCommand(Payload):
    """A pickle that runs a shell command when loaded: os.system (torch 2.14: "... whose module posix is blocked")."""

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


@pytest.fixture(params=[Payload, ShellCommand], ids=["Path.touch", "os.system"])
def booby_trapped(request, tmp_path) -> tuple[Path, Path]:
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil" / "last.pth"
    path.parent.mkdir()
    torch.save({"model": {}, "payload": request.param(marker)}, path)
    # Sanity check that the payload is live: the unsafe loader would run it.
    torch.load(path, weights_only=False)
    assert marker.exists()
    marker.unlink()
    return path, marker


def sharded_folder_around(plain: Path) -> Path:
    """A last.dcp folder whose train_state.pth is `plain` (its DCP index and shard real, from dcp.save)."""
    import torch.distributed.checkpoint as dcp

    from engine.checkpoint.formats import quiet_single_process

    folder = plain.parent / "last.dcp"
    with quiet_single_process():
        dcp.save({"model.w": torch.zeros(2)}, checkpoint_id=folder, no_dist=True)
    plain.rename(folder / "train_state.pth")
    return folder


@pytest.mark.parametrize("entry", ["evaluate.py", "resume=<path>", "model.init_from", "distill.teacher_weights",
                                   "resume=<last.dcp>"])
def test_checkpoint_that_would_run_code_is_refused(entry, booby_trapped, tmp_path, capsys):
    """The three readers of pickles (a checkpoint file, a teacher file, a sharded folder's train_state.pth) refuse
    every global torch refuses, in either of its wordings, as code; the code does not run."""
    path, marker = booby_trapped
    if entry == "resume=<last.dcp>":
        folder = sharded_folder_around(path)
        path = folder / "train_state.pth"
        code = report_errors(train.main, [*TINY, f"output_dir={tmp_path / 'run'}", f"resume={folder}"])
    elif entry == "evaluate.py":
        code = report_errors(evaluate.main, [str(path), "--output-dir", str(tmp_path / "eval")])
    else:
        arg = {"resume=<path>": "resume", "model.init_from": "model.init_from"}.get(entry, entry)
        code = report_errors(train.main, [*TINY, f"output_dir={tmp_path / 'run'}", f"{arg}={path}"])
    line = last_error(capsys, code)
    assert f"checkpoint {path} was refused: it would run code when loaded" in line, line
    assert "\x1b" not in line and "only load files you trust" in line
    assert not marker.exists()


def test_truncated_checkpoint(tmp_path, capsys):
    path = tmp_path / "half.pth"
    torch.save({"model": {"w": torch.zeros(10000)}}, path)
    path.write_bytes(path.read_bytes()[:5000])
    line = last_error(capsys, report_errors(evaluate.main, [str(path), "--output-dir", str(tmp_path / "eval")]))
    assert f"checkpoint {path} cannot be read" in line and "truncated" in line


def test_an_inference_override_error_names_the_override_not_the_checkpoint():
    """`evaluate.py last.pth amp=BF16` said `checkpoint .../last.pth: config key 'amp' is 'BF16'` (issue 51 item 17);
    a stored config that is itself wrong still names the checkpoint."""
    from engine.checkpoint.inference import Trained, inference_config

    trained = Trained({"model": {"name": "test_resnet"}}, {}, ["a", "b"], "checkpoint x.pth")
    for override, message in ((("amp", "BF16"), "command-line override amp=BF16: config key 'amp' is 'BF16'"),
                              (("ampp", "bf16"), "command-line override ampp=bf16: unknown config key 'ampp'"),
                              (("data.val_img_size", -3), "command-line override data.val_img_size=-3: config key")):
        with pytest.raises(UserError, match=f"^{message}"):
            inference_config(trained, [("seed", 1), override])
    broken = Trained({"model": {"name": "test_resnet"}, "seed": -1}, {}, ["a", "b"], "checkpoint x.pth")
    with pytest.raises(UserError, match="^checkpoint x.pth: config key 'seed'"):
        inference_config(broken, [("amp", "bf16")])


EVAL_SPLIT_CASES = {  # evaluate.py arguments after split_pipeline_run's best.pth: the text its one line must hold
    "a new split seed and fraction": (["data.split_seed=5", "data.val_fraction=0.5"],
                                      "data.val_fraction=0.5 data.split_seed=5: evaluate.py never splits data anew"),
    "a new fraction": (["data.val_fraction=0.5"], "data.val_fraction=0.5: evaluate.py never splits data anew (a new "
                       "split of the run's images would score images it trained on); it scores the run's validation "
                       "list, val.txt beside"),
    "a fraction with --data-dir": (["--data-dir", "{data}", "data.val_fraction=0.25"],
                                   "data.val_fraction=0.25: evaluate.py never splits data anew"),
}


@pytest.mark.parametrize("name", EVAL_SPLIT_CASES)
def test_split_overrides_evaluate_would_ignore_are_one_line(name, split_pipeline_run, tmp_path, capsys):
    """Issue 65 item 8: `evaluate.py best.pth data.split_seed=5 data.val_fraction=0.5` scored the run's own val.txt
    without a word; what evaluate.py would not follow is refused (data.val_fraction=0 it follows: data.val_split)."""
    args, expected = EVAL_SPLIT_CASES[name]
    args = [arg.format(data=split_pipeline_run.parent / "data" / "photos") for arg in args]
    line = last_error(capsys, report_errors(evaluate.main, [str(split_pipeline_run / "best.pth"), *args,
                                                            "--output-dir", str(tmp_path / "eval")]))
    assert line.startswith(f"error: {expected}") and "drop" in line and "--data-dir FOLDER" in line, line
    assert not (tmp_path / "eval").exists()


def test_a_changed_or_missing_copy_of_the_eval_pipeline_is_one_line(split_pipeline_run, tmp_path, capsys):
    """Issue 65 item 1: evaluate.py, predict.py and export.py read a run's eval pipeline from its copy in the run
    folder, checked against the sha256 the run recorded: a changed copy (evaluate.py scored it without a word) or a
    missing one is one line naming it and the way out (export.py takes no data.eval_transform=FILE)."""
    import export
    import predict

    run = tmp_path / "run"
    shutil.copytree(split_pipeline_run, run)
    copy, checkpoint, images = run / "eval_transform.yaml", str(run / "best.pth"), str(tmp_path)
    copy.write_text(copy.read_text().replace("16", "8"))  # CenterCrop(8, 8)
    changed = f"error: {copy}, the run's copy of its data.eval_transform, has sha256 "
    for main, args in ((evaluate.main, []), (predict.main, [images]), (export.main, ["--format", "onnx"])):
        line = last_error(capsys, report_errors(main, [checkpoint, *args]))
        assert line.startswith(changed) and "it was changed after training; restore it" in line, line
        assert ("data.eval_transform=FILE" in line) == (main is not export.main), line
    copy.unlink()
    line = last_error(capsys, report_errors(evaluate.main, [checkpoint]))
    assert f"the run's copy of it, {copy}, is missing: put it back" in line and "data.eval_transform=FILE" in line
    assert sorted(path.name for path in run.iterdir()) == sorted(path.name for path in split_pipeline_run.iterdir()
                                                                 if path.name != copy.name)  # nothing written


class FailsAtFive(torch.utils.data.Dataset):
    """Index 5 raises a UserError, as a dataset reading a bad file does."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 5:
            raise UserError("image 5 is unreadable")
        return torch.zeros(3)


def test_a_worker_error_ends_the_loaders_workers_at_once():
    """The one line, and no worker left running for the cycle collector to join (5 s per worker in torch)."""
    import multiprocessing

    from data.loader import OneLineErrorLoader

    others = set(multiprocessing.active_children())  # other tests' workers not yet collected
    loader = OneLineErrorLoader(FailsAtFive(), batch_size=4, num_workers=2, persistent_workers=True)
    with pytest.raises(UserError, match="^image 5 is unreadable$"):
        for _ in loader:
            pass
    assert set(multiprocessing.active_children()) - others == set()
