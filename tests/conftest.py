"""Fixtures shared by the test files: a tiny training run trained once per session and reused.

The pytest process imports timm the way the entry points do (without wandb), so importing the app's
modules here costs what it costs in train.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.startup import import_timm_without_wandb
from tests.helpers import TINY, run_script

import_timm_without_wandb()


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """The output folder of one finished TINY training (last.pth, best.pth, metrics.jsonl, config.yaml).

    Read it, never write into it: tests that change a run copy it or train their own.
    """
    out = tmp_path_factory.mktemp("tiny") / "run"
    run_script("train.py", *TINY, f"output_dir={out}")
    return out
