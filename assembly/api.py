"""Train and evaluate from Python (a notebook, a script): fastai's `learn.fit`, Lightning's `trainer.fit`, with
train.py's and evaluate.py's own config, checks, outputs and numbers.

    from assembly.api import train, evaluate
    result = train("digits", {"train.epochs": 2, "output_dir": "runs/nb"})  # a config name, path or dict
    result.rows[-1]["val_top1"], result.best_value                         # metrics.jsonl's rows, best.pth's value
    evaluate(result.output_dir / "best.pth")["top1"]                       # eval.json's contents

A user mistake raises core.errors.UserError with train.py's one-line message; the run folder is the one train.py
writes (same resume, same refusals). Run it in one process: torchrun launches train.py itself.
"""

from __future__ import annotations

from core.startup import import_timm_without_wandb, openmp_waits_passively

openmp_waits_passively()  # as the entry points do, before torch is loaded (no-op once it is)
import_timm_without_wandb()  # before the imports below reach timm (core/startup.py)

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from assembly.evaluate import evaluated
from assembly.fit import fit
from assembly.launch import config_file, run_folder, start_training
from core.config_load import load_config
from core.dist import cleanup
from engine.hooks import EpochEnd, Hook
from engine.state import TrainState, best_metric

Overrides = Mapping[str, Any] | Sequence[str]  # {"optim.lr": 0.1} or ["optim.lr=0.1"]


@dataclass
class TrainResult:
    """What train() trained: each validation's metrics.jsonl row as the run made it (empty when the run in
    output_dir was already finished), and the best value of the metric best.pth follows."""

    output_dir: Path
    best_metric: str  # the metrics.jsonl column best.pth follows (train.best_metric)
    best_value: float | None = None  # None: no validation gave a number (or nothing was trained)
    best_epoch: int | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def last(self) -> dict[str, Any]:
        """The last validation's row ({} when nothing was trained)."""
        return self.rows[-1] if self.rows else {}


class KeepRows(Hook):
    """Last of the run's hooks: a copy of each validation's row, as the other hooks saw it."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def after_epoch(self, state: TrainState, end: EpochEnd) -> None:
        self.rows.append(dict(end.row))


def as_overrides(overrides: Overrides) -> list[str]:
    """`key=value` strings, as train.py's command line takes them; a mapping's values are written as YAML, which
    those strings are read as (a string stays a string, a list a list)."""
    if isinstance(overrides, Mapping):
        return [f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"
                for key, value in overrides.items()]
    return list(overrides)


def train(config: str | Path | dict[str, Any] | None = None, overrides: Overrides = ()) -> TrainResult:
    """train.py's run in this process: `config` a config file, a name in configs/ (digits, finetune, ...) or a dict of
    its sections (None: the digits quickstart), then `overrides`. Continues the run in output_dir as train.py would."""
    given = as_overrides(overrides)
    source = str(config) if isinstance(config, Path) else config
    cfg = load_config(config_file(source, given), given)
    kept = KeepRows()
    try:
        info, cfg = start_training(cfg, source)
        with run_folder(cfg) as lock:
            state = fit(cfg, info, lock, [kept])
    finally:
        cleanup()  # a process group of its own (none in one process) does not outlive the call
    if state is None or not math.isfinite(state.best_value):  # a finished run, or no validation gave a number
        return TrainResult(Path(cfg.output_dir), best_metric(cfg), rows=kept.rows)
    return TrainResult(Path(cfg.output_dir), best_metric(cfg), state.best_value, state.best_epoch, kept.rows)


def evaluate(checkpoint: str | Path, data_dir: str | Path | None = None, overrides: Overrides = (),
             **options: Any) -> dict[str, Any]:
    """evaluate.py in this process, its options as keywords (evaluate_args): eval.json's contents (top1, loss,
    per_class, ...) with the folder it was written to (output_dir)."""
    try:
        result = evaluated(evaluate_args(checkpoint, data_dir, overrides, **options))
    finally:
        cleanup()
    assert result is not None  # one process: rank 0's
    return result


def evaluate_args(checkpoint: str | Path, data_dir: str | Path | None = None, overrides: Overrides = (), *,
                  batch_size: int | None = None, output_dir: str | Path | None = None, ema: bool = False,
                  tta_flip: bool = False, tta_crops: int = 1, tune_thresholds: bool = False) -> argparse.Namespace:
    """evaluate.py's parsed arguments, with its defaults (tests/test_api.py holds them to its parser's)."""
    return argparse.Namespace(checkpoint=str(checkpoint), data_dir=None if data_dir is None else str(data_dir),
                              batch_size=batch_size, output_dir=None if output_dir is None else str(output_dir),
                              ema=ema, tta_flip=tta_flip, tta_crops=tta_crops, tune_thresholds=tune_thresholds,
                              debug=False, overrides=as_overrides(overrides))
