"""benchmark.py on the CPU: the table and the JSON carry every figure, and --json replaces only its own files."""

from __future__ import annotations

import json

import pytest

import assembly.benchmark
import benchmark
from core.cli import report_errors

FIELDS = {"benchmark", "model", "device", "batch_size", "img_size", "amp", "channels_last", "compile", "params_m",
          "warmup_steps", "timed_steps", "inference", "train", "peak_memory_mib", "peak_memory_kind"}
MODE_FIELDS = {"img_per_s", "img_per_s_min", "img_per_s_max", "step_ms_p50", "step_ms_p90", "step_ms_p99",
               "peak_memory_mib"}  # each mode's own peak (reset between them on CUDA)


def test_benchmark_prints_a_table_and_writes_json_with_every_field(monkeypatch, tmp_path, capsys):
    import timm
    import torch

    threads = torch.get_num_threads()
    monkeypatch.setattr(assembly.benchmark, "compute_threads", lambda processes_per_node, workers: 1)
    out = tmp_path / "bench.json"
    argv = ["--model", "resnet18", "--batch-size", "8", "--img-size", "32", "--warmup", "1", "--steps", "2",
            "--amp", "off", "--json", str(out)]
    try:
        assert report_errors(benchmark.main, argv) == 0
        printed = capsys.readouterr().out
        result = json.loads(out.read_text())
        assert set(result) == FIELDS and set(result["inference"]) == set(result["train"]) == MODE_FIELDS
        assert (result["model"], result["batch_size"], result["img_size"], result["amp"]) == ("resnet18", 8, 32, "fp32")
        expected_params = sum(p.numel() for p in timm.create_model("resnet18", num_classes=1000).parameters())
        assert result["params_m"] == expected_params / 1e6  # timm's own model, counted the same way
        for mode in ("inference", "train"):
            figures = result[mode]
            assert figures["img_per_s_min"] <= figures["img_per_s"] <= figures["img_per_s_max"], figures
            assert 0 < figures["step_ms_p50"] <= figures["step_ms_p90"] <= figures["step_ms_p99"], figures
            assert f"| {mode} | {figures['img_per_s']:.1f} |" in printed, printed
        assert result["peak_memory_mib"] > 0 and "peak memory" in printed
        assert report_errors(benchmark.main, argv) == 0  # an earlier result of its own is replaced
        notes = tmp_path / "notes.json"
        notes.write_text("{}\n")
        assert report_errors(benchmark.main, [*argv[:-1], str(notes)]) == 2  # anything else is left alone
        assert notes.read_text() == "{}\n" and "not an earlier benchmark.py JSON" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)


DATA_FIELDS = {"batch_size", "dataset", "timed_batches", "target_img_per_s", "target_source", "workers"}
ROW_FIELDS = {"num_workers", "img_per_s", "img_per_s_per_worker", "workers_needed", "warmup_batch_s", "images"}


def check_data_rows(data: dict, printed: str, target: float) -> None:
    """Every worker count's figures, and workers needed computed from them: ceil(target / img/s per worker)."""
    import math

    assert set(data) == DATA_FIELDS and data["target_img_per_s"] == target
    for row in data["workers"]:
        assert set(row) == ROW_FIELDS and row["images"] == data["batch_size"] * data["timed_batches"], row
        assert row["img_per_s_per_worker"] == row["img_per_s"] / max(row["num_workers"], 1)
        assert row["workers_needed"] == math.ceil(target / row["img_per_s_per_worker"]) >= 1
        assert (f"| {row['num_workers']} | {row['img_per_s']:.1f} | {row['img_per_s_per_worker']:.1f} | "
                f"{row['workers_needed']} |") in printed, printed


def test_data_mode_times_the_train_loader_per_worker_count(monkeypatch, tmp_path, capsys):
    import torch

    threads = torch.get_num_threads()
    monkeypatch.setattr(assembly.benchmark, "compute_threads", lambda processes_per_node, workers: 1)
    out, root = tmp_path / "data.json", f"data.root={tmp_path / 'digits'}"
    try:
        argv = ["--config", "digits", "--data", "--workers", "1", "2", "--data-batches", "2", "--target-img-s",
                "1000.5", "--json", str(out), root]
        assert report_errors(benchmark.main, argv) == 0
        result = json.loads(out.read_text())
        assert set(result) == {"benchmark", "device", "data"}  # no model run unless --mode asks for one
        assert [row["num_workers"] for row in result["data"]["workers"]] == [1, 2]
        assert (result["data"]["batch_size"], result["data"]["dataset"]) == (64, "digits")  # the config's
        check_data_rows(result["data"], capsys.readouterr().out, 1000.5)
        # without --target-img-s, the training img/s measured in the same call is the target
        argv = ["--config", "digits", "--model", "test_resnet", "--batch-size", "8", "--mode", "train", "--warmup",
                "0", "--steps", "1", "--data", "--workers", "0", "--data-batches", "2", "--json", str(out), root]
        assert report_errors(benchmark.main, argv) == 0
        result = json.loads(out.read_text())
        assert result["data"]["target_source"] == "training img/s measured above" and "inference" not in result
        check_data_rows(result["data"], capsys.readouterr().out, result["train"]["img_per_s"])
        too_many = ["--config", "digits", "--data", "--data-batches", "22", "--target-img-s", "9", root]
        assert report_errors(benchmark.main, too_many) == 2  # an epoch of 1,436 images holds 22 batches of 64
        assert "needs 23 batches (one to warm up) but an epoch has 22" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)


def test_sweep_batch_on_the_cpu_stops_at_max_batch(monkeypatch, tmp_path, capsys):
    import torch

    threads = torch.get_num_threads()
    monkeypatch.setattr(assembly.benchmark, "compute_threads", lambda processes_per_node, workers: 1)
    out = tmp_path / "sweep.json"
    argv = ["--model", "test_resnet", "--img-size", "32", "--amp", "off", "--sweep-batch", "--max-batch", "4",
            "--json", str(out)]
    try:
        assert report_errors(benchmark.main, argv) == 0
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text())["sweep_batch"] == {"max_batch": 4, "cap": 4, "stopped_by": "--max-batch 4"}
    assert "largest batch that fits: 4 " in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--sweep-batch"], "--sweep-batch on the CPU needs --max-batch"),
    (["--sweep-batch", "--max-batch", "1"], "--max-batch must be >= 2"),
    (["--data"], "--data needs --target-img-s"),
    (["--data", "--mode", "inference"], "--data needs --target-img-s"),
    (["--data", "--target-img-s", "0"], "--target-img-s must be a number > 0, got 0.0"),
    (["--data", "--target-img-s", "inf"], "--target-img-s must be a number > 0, got inf"),
    (["--data", "--target-img-s", "9", "--workers", "1", "-1"], "--workers must be >= 0, got 1 -1"),
    (["--data", "--target-img-s", "9", "--data-batches", "0"], "--data-batches must be >= 1, got 0"),
])
def test_bad_data_and_sweep_values_are_one_line(argv, message, capsys):
    assert report_errors(benchmark.main, argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
