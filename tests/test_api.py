"""The Python entry (assembly/api.py): train and evaluate in this process, as a notebook calls them, return the numbers
train.py and evaluate.py write and print."""

from __future__ import annotations

import json

import pytest

from tests.helpers import read_jsonl


def test_train_and_evaluate_from_python_return_the_run_folders_numbers(tmp_path):
    """The digits quickstart's config with the smallest settings: train() returns metrics.jsonl's rows as written and
    best.pth's value; evaluate() returns eval.json's contents, best.pth scored on the same validation images as the
    run's own validation (the same loss and top-1); a mistake is train.py's one-line UserError."""
    from assembly.api import evaluate, train
    from core.errors import UserError

    out = tmp_path / "run"
    result = train("digits", {"model.name": "test_resnet", "train.epochs": 1, "train.max_steps": 1,
                              "train.batch_size": 16, "data.num_workers": 0, "logging.progress": False,
                              "logging.curves": False, "output_dir": str(out)})
    written = read_jsonl(out / "metrics.jsonl")
    assert result.output_dir == out and result.rows == written and len(written) == 1
    assert result.best_metric == "val_top1" and result.best_value == written[0]["val_top1"]
    scored = evaluate(out / "best.pth", batch_size=64)
    assert scored == {**json.loads((out / "eval-best" / "eval.json").read_text()), "output_dir": str(out / "eval-best")}
    assert scored["n"] == 361 and scored["top1"] == pytest.approx(written[0]["val_top1"], abs=1e-9)
    assert scored["loss"] == pytest.approx(written[0]["val_loss"], rel=1e-6)
    with pytest.raises(UserError, match="config key 'train.epochs' must be > 0, got 0"):
        train("digits", ["train.epochs=0", f"output_dir={tmp_path / 'other'}"])


def test_evaluate_takes_evaluate_pys_arguments_with_its_defaults():
    """assembly/api.evaluate builds evaluate.py's arguments itself: each option evaluate.py parses, with its default,
    and dict overrides as the command line's strings."""
    import evaluate as evaluate_py
    from assembly.api import evaluate_args

    assert vars(evaluate_args("ckpt.pth")) == vars(evaluate_py.parse_args(["ckpt.pth"]))
    given = evaluate_args("ckpt.pth", "photos", {"data.val_split": "test", "data.mean": [0.5, 0.5, 0.5]},
                          tta_flip=True, batch_size=4)
    parsed = evaluate_py.parse_args(["ckpt.pth", "--data-dir", "photos", "--tta-flip", "--batch-size", "4",
                                     "data.val_split=test", "data.mean=[0.5, 0.5, 0.5]"])
    assert vars(given) == vars(parsed)


def test_a_config_dict_is_read_as_a_file_and_an_overrides_dict_as_the_command_line():
    """train()'s dict config takes the file's place (its keys given, not typed: a start-up rule may derive over them)
    and its dict overrides are train.py's key=value strings, each value the type it was."""
    from assembly.api import as_overrides
    from core.config_load import load_config

    overrides = as_overrides({"output_dir": "runs/x #1", "data.mean": [0.5, 0.5, 0.5], "amp": "off",
                              "train.epochs": 3, "model.pretrained": False})
    cfg = load_config({"optim": {"lr": 0.3}, "train": {"epochs": 5}}, overrides)
    assert (cfg.optim.lr, cfg.train.epochs, cfg.output_dir, cfg.amp, cfg.data.mean, cfg.model.pretrained) == (
        0.3, 3, "runs/x #1", "off", [0.5, 0.5, 0.5], False)
    assert "optim.lr" in cfg.given and "optim.lr" not in cfg.from_command_line
    assert "train.epochs" in cfg.from_command_line
