"""average_checkpoints.py (issue 27 item 4): the mean of the last K epoch checkpoints, as timm's
avg_checkpoints.py computes it, and a checkpoint evaluate.py takes. The epoch files are the session's tiny run's
checkpoint with its weights moved per epoch (real train.py checkpoints, no extra training)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import average_checkpoints
import evaluate
from core.cli import report_errors
from core.files import save_atomic
from engine.checkpoint.formats import load_checkpoint, read_checkpoint


def moved(state: dict[str, torch.Tensor], epoch: int) -> dict[str, torch.Tensor]:
    """`state` with every float tensor moved by epoch-dependent noise, integer buffers by the epoch."""
    generator = torch.Generator().manual_seed(epoch)
    return {k: v + 0.1 * epoch * torch.randn(v.shape, generator=generator) if v.is_floating_point() else v + epoch
            for k, v in state.items()}


def epoch_run(tiny_run: Path, folder: Path, epochs: int = 4) -> list[dict]:
    """A run folder with epoch_0000..epoch_{epochs-1}.pth, each holding model and EMA weights."""
    ckpt = load_checkpoint(tiny_run / "last.pth")
    written = []
    for epoch in range(epochs):
        model = moved(ckpt["model"], epoch)
        written.append({**ckpt, "model": model, "ema": moved(model, 100 + epoch), "epoch": epoch + 1})
        save_atomic(written[-1], folder / f"epoch_{epoch:04d}.pth")
    return written


def one_line_error(capsys) -> str:
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("error: ") and "Traceback" not in error, error
    return error


@pytest.mark.slow  # 5-14 s of processes: the fast tier's budget
def test_averaged_weights_are_the_mean_of_the_last_k_and_evaluate_takes_them(tiny_run, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    written = epoch_run(tiny_run, run)
    assert report_errors(average_checkpoints.main, [str(run), "--last", "3"]) == 0
    averaged = load_checkpoint(run / "averaged.pth")
    assert averaged["averaged_from"] == ["epoch_0001.pth", "epoch_0002.pth", "epoch_0003.pth"]
    for key in ("model", "ema"):
        assert averaged[key].keys() == written[0][key].keys()
        for name, tensor in averaged[key].items():
            stacked = torch.stack([ckpt[key][name].double() for ckpt in written[1:]])
            expected = stacked.mean(0).to(tensor.dtype) if tensor.is_floating_point() else stacked.mean(0).round()
            assert tensor.dtype == written[0][key][name].dtype, name
            torch.testing.assert_close(tensor.double(), expected.double(), rtol=0, atol=0, msg=f"{key}.{name}")
    assert not torch.equal(averaged["model"]["fc.weight"], written[3]["model"]["fc.weight"])
    losses = []
    for ema in ([], ["--ema"]):  # the averaged model weights, then the averaged EMA weights
        out = tmp_path / f"eval{len(ema)}"
        assert report_errors(evaluate.main, [str(run / "averaged.pth"), *ema, "--output-dir", str(out),
                                             "--batch-size", "8"]) == 0
        result = json.loads((out / "eval.json").read_text())
        assert result["n"] == 10 and result["ema"] == bool(ema)
        losses.append(result["loss"])
    assert losses[0] != losses[1]


def test_averaging_refuses_with_one_line_and_replaces_only_its_own_output(tiny_run, tmp_path, capsys):
    assert report_errors(average_checkpoints.main, [str(tiny_run)]) == 2  # trained with train.keep_last_k=0
    assert "holds no epoch_NNNN.pth checkpoints; train with train.keep_last_k=K" in one_line_error(capsys)
    run = tmp_path / "run"
    run.mkdir()
    epoch_run(tiny_run, run, epochs=2)
    assert report_errors(average_checkpoints.main, [str(run), "--last", "3"]) == 2
    assert "holds only 2 epoch checkpoint(s); lower --last or train with train.keep_last_k=3" in one_line_error(capsys)
    mine = tmp_path / "notes.pth"
    mine.write_bytes(b"the user's own file")
    assert report_errors(average_checkpoints.main, [str(run), "--output", str(mine)]) == 2
    assert "not an averaged checkpoint written by average_checkpoints.py" in one_line_error(capsys)
    assert mine.read_bytes() == b"the user's own file"
    assert report_errors(average_checkpoints.main, [str(run), "--last", "1"]) == 0
    assert report_errors(average_checkpoints.main, [str(run)]) == 0  # over its own earlier output
    assert load_checkpoint(run / "averaged.pth")["averaged_from"] == ["epoch_0000.pth", "epoch_0001.pth"]
    assert sorted(p.name for p in run.iterdir()) == ["averaged.pth", "epoch_0000.pth", "epoch_0001.pth"]


def test_files_of_another_run_are_refused_naming_the_file(tiny_run, tiny_sharded_run, tmp_path, capsys):
    """Issue 41 item 2: epoch files of two runs whose names and shapes agree were averaged (rc 0, the newest
    file's class names). Another real run's checkpoint (the sharded session run's, as a .pth) among them is refused
    by its run id; files from before run ids by their training data."""
    run = tmp_path / "run"
    run.mkdir()
    written = epoch_run(tiny_run, run, epochs=2)
    save_atomic(read_checkpoint(tiny_sharded_run / "last.dcp"), run / "epoch_0002.pth")
    assert report_errors(average_checkpoints.main, [str(run)]) == 2
    assert re.search(rf"error: checkpoint {run}/epoch_0000.pth is of another run than {run}/epoch_0002.pth: another "
                     rf"run id \(\w+ vs \w+\); average the epoch files of one run \(move the other run's out of {run}, "
                     r"or lower --last\)$", one_line_error(capsys))
    assert not (run / "averaged.pth").exists()
    older = {**written[1], "config": {**written[1]["config"], "data": {**written[1]["config"]["data"], "root": "x"}}}
    (run / "epoch_0002.pth").unlink()
    for epoch, ckpt in enumerate([written[0], older]):  # as written before run ids: none recorded
        save_atomic({k: v for k, v in ckpt.items() if k != "run_id"}, run / f"epoch_{epoch:04d}.pth")
    assert report_errors(average_checkpoints.main, [str(run)]) == 2
    assert f"epoch_0000.pth is of another run than {run}/epoch_0001.pth: other training data" in one_line_error(capsys)


def test_an_ema_switched_on_at_a_resume_averages_the_model_and_says_so(tiny_run, tmp_path, capsys):
    """Issue 41 item 6: older epoch files without `ema` were a KeyError."""
    run = tmp_path / "run"
    run.mkdir()
    written = epoch_run(tiny_run, run, epochs=3)
    save_atomic({k: v for k, v in written[0].items() if k != "ema"}, run / "epoch_0000.pth")
    assert report_errors(average_checkpoints.main, [str(run)]) == 0
    out = capsys.readouterr().out
    assert "the EMA weights are not averaged: none in epoch_0000.pth (the EMA was switched on at a resume)" in out
    averaged = load_checkpoint(run / "averaged.pth")
    assert "ema" not in averaged
    expected = torch.stack([ckpt["model"]["fc.weight"].double() for ckpt in written]).mean(0).float()
    assert torch.equal(averaged["model"]["fc.weight"], expected)
