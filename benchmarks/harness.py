"""Shared plumbing for the benchmarks: alternate the sides, repeat, print min/median/max and the ratio.

Every benchmark compares two (or more) sides in one invocation. Each repetition runs every side once,
in an order that reverses every repetition (A B, B A, A B, ...), so slow drift on a shared machine
hits both sides alike; the headline ratio is the ratio of the medians.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/x.py` puts benchmarks/, not the repo, on the path
    sys.path.insert(0, str(REPO))

from tests.helpers import script_env  # noqa: E402  (the tests' launch environment, shared)


def cpu_model() -> str:
    """The CPU's name as /proc/cpuinfo gives it, with its AVX-512 BF16 / AMX flags."""
    name, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    extras = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(extras) or 'no bf16 instructions'})"


def machine_line() -> str:
    """One line naming what the numbers were measured on."""
    import torch

    return (f"machine: {cpu_model()}, {len(os.sched_getaffinity(0))} cores, torch {torch.__version__}, "
            f"python {platform.python_version()}, load average {os.getloadavg()[0]:.2f}")


def alternate(sides: dict[str, Callable[[], float]], repeats: int, warmup: int = 0) -> dict[str, list[float]]:
    """Call each side `repeats` times (after `warmup` untimed rounds), reversing the order every round."""
    names = list(sides)
    results: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + repeats):
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            value = sides[name]()
            if round_ >= warmup:
                results[name].append(value)
                print(f"  round {round_ - warmup + 1}/{repeats} {name}: {value:.4g}", file=sys.stderr, flush=True)
    return results


def cpu_and_wall(run: Callable[[], int], wall: list[float]) -> Callable[[], float]:
    """Wrap `run` (returns items processed) to return items per CPU-second; items per wall second go to `wall`.

    For a single-threaded process CPU time is what the work costs on a core of its own: unlike wall time
    it barely moves when other jobs share the machine (it still includes their cache and memory pressure).
    """

    def timed() -> float:
        start, cpu_start = time.perf_counter(), time.process_time()
        items = run()
        wall.append(items / (time.perf_counter() - start))
        return items / (time.process_time() - cpu_start)

    return timed


def print_table(title: str, results: dict[str, list[float]], unit: str) -> None:
    """A markdown table: one row per side with min / median / max."""
    print(f"\n### {title}\n")
    print(f"| side | min | median | max | runs |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, values in results.items():
        print(f"| {name} | {min(values):.4g} | {statistics.median(values):.4g} | {max(values):.4g} | {len(values)} |")
    print(f"\n({unit})")


def ratio_line(results: dict[str, list[float]], num: str, den: str, target: float | None = None,
               higher_is_better: bool = True) -> float:
    """Print median(num) / median(den), the range of per-round ratios, and whether the target is met."""
    ratio = statistics.median(results[num]) / statistics.median(results[den])
    paired = [a / b for a, b in zip(results[num], results[den])]
    verdict = ""
    if target is not None:
        met = ratio >= target if higher_is_better else ratio <= target
        verdict = f"; target {'>=' if higher_is_better else '<='} {target}: {'met' if met else 'MISSED'}"
    print(f"- ratio {num} / {den} = **{ratio:.3f}** (per-round ratios {min(paired):.3f} .. {max(paired):.3f})"
          f"{verdict}")
    return ratio


def has_taskset() -> bool:
    return shutil.which("taskset") is not None


def launch(script: str | Path, args: list[str], nproc: int = 1, pin_core: int | None = None,
           timeout: float = 900) -> subprocess.CompletedProcess:
    """`python script args` (optionally pinned to one core with taskset), or torchrun with nproc processes."""
    if nproc == 1:
        cmd = [sys.executable, str(script), *args]
        if pin_core is not None:
            cmd = ["taskset", "-c", str(pin_core), *cmd]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(script), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def train_py_epoch(overrides: list[str], nproc: int = 1, pin_core: int | None = None) -> dict:
    """Run train.py (through train_py_epoch.py) for 2 epochs; the second epoch's img/s and img/CPU-s.

    The first epoch is warmup. img_per_s is train.py's own metrics.jsonl figure (over all ranks);
    img_per_cpu_s is per rank.
    """
    with tempfile.TemporaryDirectory(prefix="bench-train-") as out:
        proc = launch(REPO / "benchmarks" / "train_py_epoch.py",
                      ["--config", "configs/dummy.yaml", "amp=bf16", *overrides, "train.epochs=2", "logging.progress=false",
                       f"output_dir={out}"], nproc, pin_core)
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    result = last_json_line(proc)
    assert abs(result["img_per_s"] - rows[-1]["train_img_per_s"]) < 1e-6 * rows[-1]["train_img_per_s"]
    return result


def last_json_line(proc: subprocess.CompletedProcess) -> dict:
    """The result a helper script prints as its last stdout line."""
    return json.loads(proc.stdout.strip().splitlines()[-1])
