"""Where a run's time goes: the input wait share (engine/speed.py) and the profiler switch (engine/profiling.py).

Real tiny trainings through train.main: the slow dataset is the app's DummyDataset with a sleep in its
image loading (its __getitem__ path), patched before the DataLoader forks its workers or, with
num_workers=0, read in this process.
"""

from __future__ import annotations

import ast
import json
import re
import time

import pytest
import torch

import train
from assembly import launch, run
from core.cli import report_errors
from core.config import OptimConfig, SchedConfig
from core.dist import DistInfo
from data.datasets import DummyDataset
from data.transforms import DeviceNormalize
from engine.metrics import SumMeter
from engine.optim import build_optimizer, build_scheduler
from engine.precision import Precision
from engine.speed import INPUT_BOUND
from engine.state import TrainState
from engine.trainer import LoopConfig, TrainParts, train_one_epoch
from tests.helpers import REPO, TINY, last_error, read_jsonl, run_ranks

SLOW_IMAGE_S = 0.1  # per image: 0.2 s per batch of 2, many times a tiny step


@pytest.fixture
def one_thread(monkeypatch):
    """train.main computes with one thread: on a loaded 2-core machine two threads make a tiny step's time erratic
    (seen: 15 ms per step with one thread, 0.5-2.5 s with two), and these tests measure waiting, not compute."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(launch, "compute_threads", lambda processes_per_node, workers: 1)  # the process's threads
    monkeypatch.setattr(run, "cpu_share", lambda processes_per_node: 1)  # the input advice's count of cores
    yield
    torch.set_num_threads(threads)


def test_a_slow_dataset_is_reported_input_bound_with_the_advice_once(one_thread, monkeypatch, tmp_path, capsys):
    load = DummyDataset.load_image

    def slow_load(self, index):
        time.sleep(SLOW_IMAGE_S)
        return load(self, index)

    monkeypatch.setattr(DummyDataset, "load_image", slow_load)
    out = tmp_path / "run"
    argv = [*TINY, "data.dummy_train_size=8", "data.dummy_val_size=2", "train.batch_size=2", "train.epochs=2",
            "logging.progress=true", "logging.interval=1", f"output_dir={out}"]
    assert report_errors(train.main, argv) == 0
    err = capsys.readouterr().err
    rows = read_jsonl(out / "metrics.jsonl")
    assert all(row["train_input_wait"] > 0.5 and row["train_step_s"] > 0 for row in rows), rows
    assert err.count("input-bound:") == 1, err[-3000:]  # once per run, not once per epoch
    advice = next(line for line in err.splitlines() if "input-bound:" in line)
    assert "epoch 0 waited for its next batch" in advice and "data.num_workers=0" in advice, advice
    assert "data.prefetch_factor (now 2)" in advice and "data.make_shards" in advice, advice
    waits = [int(w) for w in re.findall(r"input wait (\d+)%", err)]
    assert len(waits) == 8 and waits[0] == waits[4] == 0 and min(waits[1:4]) > 50, err[-3000:]  # epochs' first steps: 0


def test_dummy_data_with_two_workers_is_not_input_bound_and_writes_no_profile(one_thread, tmp_path, capsys):
    out = tmp_path / "run"
    # A step of resnet10t at 64 px (~0.1 s) outlasts what each worker needs per batch, even on a loaded machine
    # (test_resnet's ~20 ms steps are input-bound here with 2 workers: rightly so, and not what this test is about).
    argv = [*TINY, "model.name=resnet10t", "data.num_workers=2", "data.dummy_train_size=64", "data.img_size=64",
            "data.dummy_image_size=64", f"output_dir={out}"]
    assert report_errors(train.main, argv) == 0
    [row] = read_jsonl(out / "metrics.jsonl")
    assert 0 <= row["train_input_wait"] < INPUT_BOUND, row
    assert "input-bound" not in capsys.readouterr().err
    assert not (out / "profile").exists()


def test_profile_steps_write_a_chrome_trace_with_shapes(one_thread, tmp_path):
    out = tmp_path / "run"
    assert report_errors(train.main, [*TINY, "logging.profile_steps=[2, 3]", f"output_dir={out}"]) == 0
    [trace] = (out / "profile").iterdir()
    assert trace.name == "rank0.steps2-3.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    convs = [e for e in events if e.get("name") == "aten::convolution"]
    assert convs and all("Input Dims" in e["args"] for e in convs)  # record_shapes
    assert any(e.get("name") == "[memory]" for e in events)  # profile_memory
    assert not list((out / "profile").glob(".*"))  # no temp file left
    # A range past the run's end: the trace holds the steps that ran, and its name says which.
    assert report_errors(train.main, [*TINY, "logging.profile_steps=[3, 100]", f"output_dir={tmp_path / 'end'}"]) == 0
    assert [p.name for p in (tmp_path / "end" / "profile").iterdir()] == ["rank0.steps3-4.pt.trace.json"]


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_file_named_profile_in_output_dir_is_refused_before_anything_is_written(dry_run, tmp_path, capsys):
    """The trace folder's place taken by a user's file: one line at start-up (it was met only when the trace was
    written, blamed on disk space, after config.yaml had made the folder a run that resume=auto refused)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "profile").write_text("my notes\n")
    args = [*TINY, "logging.profile_steps=[2, 3]", f"output_dir={out}", *(["--dry-run"] if dry_run else [])]
    line = last_error(capsys, report_errors(train.main, args))
    assert line == (f"error: logging.profile_steps: {out}/profile is a file, not a folder; the profile trace is "
                    f"written into {out}/profile/: move the file away, choose another output_dir, or set "
                    "logging.profile_steps=[]")
    assert [p.name for p in out.iterdir()] == ["profile"] and (out / "profile").read_text() == "my notes\n"


def test_a_profile_window_outside_the_run_is_said_at_start_up(one_thread, tmp_path, capsys):
    """TINY makes 4 optimizer steps: [5, 8] once wrote rank0.steps5-4.pt.trace.json (the profiler started after the
    run's last step) with no warning, [6, 8] nothing; a window that runs past the end is said too (--dry-run)."""
    out = tmp_path / "run"
    assert report_errors(train.main, [*TINY, "logging.profile_steps=[5, 8]", f"output_dir={out}"]) == 0
    assert "logging.profile_steps=[5, 8] lies outside this run's optimizer steps (1-4): no profile is written" \
        in capsys.readouterr().err
    assert not (out / "profile").exists()
    argv = ["--dry-run", *TINY, "logging.profile_steps=[3, 100]", f"output_dir={tmp_path / 'other'}"]
    assert report_errors(train.main, argv) == 0
    assert "logging.profile_steps=[3, 100] ends after this run's optimizer steps (1-4): the trace covers steps 3-4" \
        in capsys.readouterr().err


def test_no_module_imports_the_profiler_at_import_time():
    """Off by default and free when off: torch.profiler is imported only inside ProfileSteps, once asked for."""
    for path in [REPO / "train.py", *sorted((REPO / "engine").glob("*.py"))]:
        for node in ast.parse(path.read_text()).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(name.startswith("torch.profiler") for name in names), path


def _sums_and_max(rank: int, world: int) -> tuple[dict[str, float], list[float]]:
    meter = SumMeter(("loss_sum", "count"), torch.device("cpu"))
    meter.add(torch.tensor(1.5 * (rank + 1)), 4)
    return meter.global_sums_and_max((0.1 * (rank + 1), 0.3 - 0.1 * rank))


@pytest.mark.slow
def test_per_rank_values_come_back_as_their_max_in_the_sums_all_reduce(tmp_path):
    """Two real gloo ranks: the sums are sums, each host value is the largest any rank gave."""
    for sums, largest in run_ranks(_sums_and_max, 2, tmp_path):
        assert sums == {"loss_sum": 4.5, "count": 8.0}
        assert largest == pytest.approx([0.2, 0.3])


class FakeClock:
    """A host clock that moves only when told: the loader's waits and the steps' compute, in known seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class WaitingBatches:
    """`count` batches, each costing `wait` seconds of the fake clock to fetch (the host blocked in next())."""

    def __init__(self, clock: FakeClock, count: int, wait: float) -> None:
        self.clock, self.count, self.wait = clock, count, wait

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        for i in range(self.count):
            self.clock.now += self.wait
            yield torch.full((2, 3, 4, 4), i, dtype=torch.uint8), torch.tensor([0, 1])


@pytest.mark.parametrize("read_ahead", [False, True])
def test_the_first_step_counts_in_neither_the_input_wait_nor_the_step_time(read_ahead):
    """train_one_epoch on a fake clock: 5 steps, each fetch 0.25 s, each step's compute 0.5 s but the first's 8 s
    (cuDNN's autotuning, compilation). With the batches read one ahead (the CUDA path's order of loader calls)
    and without: input wait 0.75 / 2.75 s and 0.6875 s per step, over steps 1-4. The CUDA path started its clock
    before step 0 (its second loader call comes first) and both clocks counted step 0 in train_step_s."""
    clock, cpu = FakeClock(), torch.device("cpu")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 2))
    forwards = []

    def compute(module, args):  # the step's device time, as the host sees it
        clock.now += 8.0 if not forwards else 0.5
        forwards.append(1)

    model.register_forward_pre_hook(compute)
    optimizer = build_optimizer(model, OptimConfig())
    parts = TrainParts(model, optimizer, build_scheduler(optimizer, SchedConfig(), 1, 5), torch.nn.CrossEntropyLoss(),
                       Precision("cpu", None))
    loop = LoopConfig(normalize=DeviceNormalize([0.5] * 3, [0.5] * 3, cpu, False), read_ahead=read_ahead, clock=clock)
    stats = train_one_epoch(parts, WaitingBatches(clock, 5, 0.25), TrainState(), loop, DistInfo(0, 1, 0, 1, cpu))
    if read_ahead:  # batches 2-4 fetched after step 0 (batch 1 came with batch 0): 3 waits over steps 1-4
        assert stats["train_input_wait"] == 0.75 / (0.75 + 4 * 0.5) and stats["train_step_s"] == 2.75 / 4
    else:  # batches 1-4 fetched after step 0: 4 waits over steps 1-4
        assert stats["train_input_wait"] == 1.0 / (1.0 + 4 * 0.5) and stats["train_step_s"] == 3.0 / 4
