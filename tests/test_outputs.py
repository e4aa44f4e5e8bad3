"""What the app writes for the user (exports, predictions, evaluations, shards) never costs the user a file.

An output replaces only an earlier output of the same tool, atomically, through a temp name unique to the
process; anything else at the path is refused with one line and left byte for byte (core/files.py).
The checkpoint is the session's tiny run; refusals happen before any export work, so most cases cost no export.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import evaluate
import export
import predict
from assembly.export import is_model_folder_export
from core.cli import report_errors
from data import make_shards
from tests.helpers import REPO, make_image_folder, script_env

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")


def snapshot(path: Path) -> dict[str, bytes | None]:
    """Every file under `path` (or the file itself) with its bytes; folders as None."""
    if not path.is_dir():
        return {".": path.read_bytes()}
    return {str(p.relative_to(path)): None if p.is_dir() else p.read_bytes() for p in sorted(path.rglob("*"))}


def one_line(capsys) -> str:
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("error: ") and "Traceback" not in error, error
    return error


@pytest.fixture
def run_copy(tiny_run, tmp_path) -> Path:
    """A copy of the tiny run folder that a test may hand to a careless command."""
    return Path(shutil.copytree(tiny_run, tmp_path / "run"))


@pytest.mark.parametrize("fmt, target", [
    ("safetensors", "run"),            # issue 23.1: the run folder itself
    ("onnx", "run/best.pth"),          # 23.2: the checkpoint being exported
    ("torchscript", "run/last.pth"),   # a zip archive, but not a TorchScript one
    ("torchscript", "images"),         # 23.3: a dataset root
    ("onnx", "notes.onnx"),            # a file named like an export that is not one
    ("safetensors", "hf-plus"),        # a model folder with a file an export does not write
])
def test_export_refuses_what_is_not_an_earlier_export_and_leaves_it_byte_identical(run_copy, tmp_path, capsys,
                                                                                    fmt, target):
    make_image_folder(tmp_path / "images", {"train": {"a": 2, "b": 1}})
    (tmp_path / "notes.onnx").write_text("my notes\n")
    hf = tmp_path / "hf-plus"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architecture": "test_resnet", "num_classes": 10}))
    (hf / "model.safetensors").write_bytes(b"weights")
    (hf / "README.md").write_text("my model card\n")
    out = tmp_path / target
    before = snapshot(out)
    assert report_errors(export.main, [str(run_copy / "best.pth"), "--format", fmt, "--output", str(out)]) == 2
    error = one_line(capsys)
    assert str(out) in error and "choose another --output" in error, error
    assert snapshot(out) == before
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]


def test_export_replaces_its_own_earlier_export_and_spares_other_processes_temp_files(run_copy, tmp_path, capsys):
    """Issue 23.4: the temp name is unique per process, so an export in flight beside this one keeps its file."""
    import torch

    ckpt = str(run_copy / "best.pth")
    for fmt, out in (("torchscript", tmp_path / "model.ts"), ("safetensors", tmp_path / "model-hf")):
        assert report_errors(export.main, [ckpt, "--format", fmt, "--output", str(out)]) == 0
        first = snapshot(out)
        others = [out.with_name(f".{out.name}.tmp"), out.with_name(f".{out.name}.999.0a1b2c3d.tmp")]
        for other in others:  # what another export's temp file would be named (today's and the new scheme)
            other.write_bytes(b"another export, still being written")
        assert report_errors(export.main, [ckpt, "--format", fmt, "--output", str(out)]) == 0
        assert "wrote" in capsys.readouterr().out
        for other in others:
            assert other.read_bytes() == b"another export, still being written"
            other.unlink()
        assert snapshot(out).keys() == first.keys()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp or set-aside folder left
    assert isinstance(torch.jit.load(str(tmp_path / "model.ts")), torch.jit.ScriptModule)


def test_export_into_a_missing_folder_names_the_folder(run_copy, tmp_path, capsys):
    """Issue 23.25 (and 23.28: a file where the folder should be stops root too)."""
    ckpt = str(run_copy / "best.pth")
    out = tmp_path / "missing" / "model.ts"
    assert report_errors(export.main, [ckpt, "--format", "torchscript", "--output", str(out)]) == 2
    error = one_line(capsys)
    assert f"folder {tmp_path / 'missing'} does not exist" in error, error
    (tmp_path / "file").write_text("x")
    assert report_errors(export.main, [ckpt, "--format", "onnx", "--output", str(tmp_path / "file" / "m.onnx")]) == 2
    error = one_line(capsys)
    assert f"{tmp_path / 'file'} is a file, not a folder" in error, error
    assert not (tmp_path / "missing").exists()


@pytest.mark.slow  # two export.py processes
@pytest.mark.parametrize("fmt", ["torchscript", "safetensors"])
def test_export_over_the_file_size_limit_is_one_line_and_leaves_no_temp(tiny_run, tmp_path, fmt):
    """Issue 23.14: RLIMIT_FSIZE with SIGXFSZ ignored (as Python does): writes fail with EFBIG."""
    out = tmp_path / "export"
    limited = ["bash", "-c", "trap '' XFSZ; ulimit -f 256; exec \"$@\"", "bash"]  # 256 KiB; the model is ~1.5 MB
    proc = subprocess.run([*limited, sys.executable, str(REPO / "export.py"), str(tiny_run / "best.pth"),
                           "--format", fmt, "--output", str(out)], cwd=REPO, env=script_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: cannot write ") and "(File too large)" in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tool, name", [("predict", "predictions.csv"), ("predict", "predictions.json"),
                                        ("evaluate", "eval.json"), ("evaluate", "predictions.csv")])
def test_an_output_file_that_is_a_folder_or_not_ours_is_one_line(tiny_run, tmp_path, capsys, tool, name):
    """Issue 23.17: `D/predictions.csv` a folder gave IsADirectoryError; a user's own file there is spared too."""
    images = make_image_folder(tmp_path / "images", {"val": {"a": 2}}) / "val"
    main, inputs = (predict.main, [str(images)]) if tool == "predict" else (evaluate.main, [])
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    (out / name / "mine.txt").write_text("mine\n")
    before = snapshot(out)
    assert report_errors(main, [str(tiny_run / "best.pth"), *inputs, "--output-dir", str(out)]) == 2
    error = one_line(capsys)
    assert f"{out / name} is a folder" in error and "choose another --output-dir" in error, error
    assert snapshot(out) == before
    shutil.rmtree(out / name)
    (out / name).write_text("my own notes\n")
    assert report_errors(main, [str(tiny_run / "best.pth"), *inputs, "--output-dir", str(out)]) == 2
    error = one_line(capsys)
    assert f"{out / name} is a file" in error and "choose another --output-dir" in error, error
    assert (out / name).read_text() == "my own notes\n"


def test_predict_and_evaluate_replace_their_own_earlier_outputs(tiny_run, tmp_path, capsys):
    images = make_image_folder(tmp_path / "images", {"val": {"a": 2}}) / "val"
    for main, inputs in ((predict.main, [str(images)]), (evaluate.main, [])):
        out = tmp_path / main.__module__
        for _ in range(2):
            assert report_errors(main, [str(tiny_run / "best.pth"), *inputs, "--output-dir", str(out)]) == 0
        assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
    capsys.readouterr()


@pytest.mark.parametrize("folder, message", [
    ("weights-only", "a model folder needs config.json beside model.safetensors"),  # 23.26
    ("empty", "holds no checkpoint (.pth) and no config.json"),                     # 23.27: no best.pth to give
])
def test_a_folder_given_as_model_names_only_what_can_exist(tmp_path, capsys, folder, message):
    model = tmp_path / folder
    model.mkdir()
    if folder == "weights-only":
        (model / "model.safetensors").write_bytes(b"x")
    image = make_image_folder(tmp_path / "images", {"val": {"a": 1}}) / "val"
    for main, argv in ((predict.main, [str(model), str(image)]), (evaluate.main, [str(model)])):
        assert report_errors(main, [*argv, "--output-dir", str(tmp_path / "out")]) == 2
        error = one_line(capsys)
        assert "best.pth" not in error, error
        if main is predict.main:
            assert message in error, error
    assert not (tmp_path / "out").exists()


def test_outputs_get_the_mode_of_other_run_files(run_copy, tmp_path, capsys):
    """Issue 23.28: 0666/0777 minus the umask, as checkpoints and metrics.jsonl (here umask 002: 0664 and 0775)."""
    old = os.umask(0o002)
    try:
        ckpt = str(run_copy / "best.pth")
        images = make_image_folder(tmp_path / "images", {"train": {"a": 2}, "val": {"a": 2}})
        assert report_errors(export.main, [ckpt, "--format", "torchscript", "--output", str(tmp_path / "m.ts")]) == 0
        assert report_errors(export.main, [ckpt, "--format", "safetensors", "--output", str(tmp_path / "hf")]) == 0
        assert report_errors(predict.main, [ckpt, str(images), "--output-dir", str(tmp_path / "pred")]) == 0
        assert report_errors(evaluate.main, [ckpt, "--output-dir", str(tmp_path / "eval")]) == 0
        assert make_shards.run([str(images), str(tmp_path / "shards")]) == 0
    finally:
        os.umask(old)
    capsys.readouterr()
    files = [tmp_path / "m.ts", *(tmp_path / "hf").iterdir(), *(tmp_path / "pred").iterdir(),
             *(tmp_path / "eval").iterdir(), *(tmp_path / "shards").iterdir()]
    modes = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {"0o664"}, modes
    for folder in ("hf", "pred", "eval", "shards"):
        assert stat.S_IMODE((tmp_path / folder).stat().st_mode) == 0o775, folder


SWAPPER = """
import json, sys
from pathlib import Path
from core.files import replace_with, temp_beside, write_new

out, tag = Path(sys.argv[1]), sys.argv[2]
def ours(path):
    return path.is_dir() and sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
for i in range(150):
    with temp_beside(out) as tmp:
        tmp.mkdir()
        write_new(tmp / "config.json", json.dumps({"by": tag}).encode())
        write_new(tmp / "model.safetensors", tag.encode() * 1000)
        replace_with(tmp, out, ours, "a model folder", "--output")
"""


def test_two_processes_replacing_one_model_folder_leave_one_whole_folder(tmp_path):
    """Issue 23.4 at the mechanism: each swap is old aside, new in, old removed, one process at a time."""
    out = tmp_path / "model-hf"
    procs = [subprocess.Popen([sys.executable, "-c", SWAPPER, str(out), tag], cwd=REPO, env=script_env(),
                              stderr=subprocess.PIPE, text=True) for tag in ("a", "b")]
    for proc in procs:
        assert proc.wait(timeout=300) == 0, proc.stderr.read()
    tag = json.loads((out / "config.json").read_text())["by"]
    assert (out / "model.safetensors").read_bytes() == tag.encode() * 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-hf"]


def test_a_failed_folder_swap_puts_the_earlier_export_back(tmp_path):
    """The new folder cannot be renamed in (here: it lies on another filesystem): the old one is put back."""
    from core.files import replace_with

    other = Path("/dev/shm")
    if not other.is_dir() or other.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's folder")
    out = tmp_path / "model-hf"
    out.mkdir()
    (out / "config.json").write_text('{"architecture": "test_resnet"}')
    (out / "model.safetensors").write_bytes(b"old weights")
    before = snapshot(out)
    new = Path(shutil.copytree(out, other / f"new-{os.getpid()}"))
    try:
        with pytest.raises(OSError):
            replace_with(new, out, is_model_folder_export, "a model folder", "--output")
    finally:
        shutil.rmtree(new)
    assert snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["model-hf"]


def test_make_shards_refuses_an_index_it_did_not_write_and_leaves_other_files_alone(tmp_path, capsys):
    """The same rule for make_shards: a file of the user's where an index would go is refused and kept; a user's
    tar named like an old-style shard is neither listed, replaced nor removed (shards get generation names)."""
    images = make_image_folder(tmp_path / "images", {"train": {"a": 2}, "val": {"a": 2}})
    out = tmp_path / "shards"
    out.mkdir()
    (out / "train.json").write_text("my own file\n")
    assert make_shards.run([str(images), str(out), "--shard-size", "1"]) == 2
    error = one_line(capsys)
    assert f"{out / 'train.json'} exists and is not a shard index" in error, error
    assert sorted(p.name for p in out.iterdir()) == ["train.json"] and (out / "train.json").read_text() == "my own file\n"
    (out / "train.json").unlink()
    for name in ("train-000000.tar", "val-000001.tar"):
        (out / name).write_text("my own file\n")
    assert make_shards.run([str(images), str(out), "--shard-size", "1"]) == 0
    assert make_shards.run([str(images), str(out), "--shard-size", "1"]) == 0  # its own outputs are replaced
    assert all((out / name).read_text() == "my own file\n" for name in ("train-000000.tar", "val-000001.tar"))
