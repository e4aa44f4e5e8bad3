"""The README's main command, as a new user runs it: the digits quickstart reaches val_top1 >= 99, computing with the
CPUs its loader worker leaves (core/startup.compute_threads)."""

from __future__ import annotations

import pytest

from core.startup import cpu_share
from tests.helpers import read_jsonl, run_script

pytestmark = pytest.mark.slow  # the README's quickstart: 8 epochs of digits


def test_digits_quickstart_reaches_99(tmp_path):
    out = tmp_path / "digits"
    proc = run_script("train.py", "--config", "configs/digits.yaml", f"output_dir={out}",
               f"data.root={tmp_path / 'cache'}", "logging.progress=false")
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == list(range(8))
    assert max(r["val_top1"] for r in rows) >= 99.0
    assert all(r["val_count"] == 361 for r in rows)
    threads = max(1, cpu_share(1) - 1)  # digits.yaml: data.num_workers=1
    assert f"CPU: {threads} thread(s) per process (its share less its loader workers)" in proc.stderr + proc.stdout
