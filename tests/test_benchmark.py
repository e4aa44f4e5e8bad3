"""benchmark.py on the CPU: the table and the JSON carry every figure, and --json replaces only its own files."""

from __future__ import annotations

import json

import benchmark
from engine.cli import report_errors

FIELDS = {"benchmark", "model", "device", "batch_size", "img_size", "amp", "channels_last", "compile", "params_m",
          "warmup_steps", "timed_steps", "inference", "train", "peak_memory_mib", "peak_memory_kind"}
MODE_FIELDS = {"img_per_s", "img_per_s_min", "img_per_s_max", "step_ms_p50", "step_ms_p90", "step_ms_p99"}


def test_benchmark_prints_a_table_and_writes_json_with_every_field(monkeypatch, tmp_path, capsys):
    import timm
    import torch

    threads = torch.get_num_threads()
    monkeypatch.setattr(benchmark, "cpu_share", lambda processes_per_node: 1)
    out = tmp_path / "bench.json"
    argv = ["--model", "test_resnet", "--batch-size", "4", "--img-size", "32", "--warmup", "1", "--steps", "2",
            "--amp", "off", "--json", str(out)]
    try:
        assert report_errors(benchmark.main, argv) == 0
        printed = capsys.readouterr().out
        result = json.loads(out.read_text())
        assert set(result) == FIELDS and set(result["inference"]) == set(result["train"]) == MODE_FIELDS
        assert (result["model"], result["batch_size"], result["img_size"], result["amp"]) == ("test_resnet", 4, 32,
                                                                                           "fp32")
        expected_params = sum(p.numel() for p in timm.create_model("test_resnet", num_classes=1000).parameters())
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
