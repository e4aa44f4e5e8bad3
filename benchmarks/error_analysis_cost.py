"""The per-validation error analysis' cost (issue 48) on the digits quickstart, W&B offline in both runs:

    python benchmarks/error_analysis_cost.py --rounds 3 [--data-root .cache/digits] [--epochs N] [--json out.json]

on:  the defaults -- logging.wandb_errors=16 (each validation's worst-images table and confusion chart in W&B),
     logging.curves=true (curves.png redrawn), and logging.tensorboard=true (its confusion figure per validation);
off: logging.wandb_errors=0, logging.curves=false, logging.tensorboard=false (no per-image gather either).

The sides alternate (on off, off on, on off: benchmarks/harness.alternate). Each run is `train.main` in a fresh
process (this script with --one); in it, the error analysis is timed where it happens with perf_counter around
each call of ImageOutcomes (per validation batch) and its gather, WandbTracker.log_errors,
TensorBoardWriter.log_confusion and Curves.after_epoch (TensorBoard's import and scalar writes and W&B's own
processes are not in that sum, but are in the differences). The table gives each run's wall time (the parent's
clock around the whole process), that in-run sum and its share of the wall, the paired wall difference (on - off)
of the round, which load on a shared machine makes noisy (training steps slow down 2-3x as other jobs come and
go), and the paired difference of what is outside the training steps (wall minus the epochs' epoch_time_s:
start-up, validations and what follows them, the end), which leaves the steps' noise out.
docs/benchmarks.md holds the figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SIDES = {"on": ["logging.tensorboard=true"],  # wandb_errors and curves: their defaults
         "off": ["logging.wandb_errors=0", "logging.curves=false", "logging.tensorboard=false"]}
TIMED = ("engine.evaluation:ImageOutcomes.__call__", "engine.evaluation:ImageOutcomes.gather",
         "engine.tracking:WandbTracker.log_errors",
         "engine.tracking:TensorBoardWriter.log_confusion", "engine.hooks:Curves.after_epoch")


def timed_calls() -> dict[str, float]:
    """Wrap each TIMED method with a perf_counter sum; return the sums (filled in as the run calls them)."""
    import importlib

    spent: dict[str, float] = {}
    for target in TIMED:
        module_name, qualname = target.split(":")
        cls_name, method = qualname.split(".")
        cls = getattr(importlib.import_module(module_name), cls_name)
        original = getattr(cls, method)
        spent[qualname] = 0.0

        @functools.wraps(original)
        def wrapper(*args, __original=original, __name=qualname, **kwargs):
            start = time.perf_counter()
            try:
                return __original(*args, **kwargs)
            finally:
                spent[__name] += time.perf_counter() - start

        setattr(cls, method, wrapper)
    return spent


def one(side: str, out: str, data_root: str, epochs: int | None) -> None:
    """One quickstart run of `side` in this process; prints the timed sums as JSON."""
    import train
    from core.cli import report_errors

    spent = timed_calls()
    argv = ["--config", "digits", f"output_dir={out}", f"data.root={data_root}", "logging.progress=false",
            "logging.wandb=true", *SIDES[side], *([f"train.epochs={epochs}"] if epochs else [])]
    if report_errors(train.main, argv) != 0:
        raise SystemExit(f"train.py {' '.join(argv)} failed")
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    print(json.dumps({"spent": spent, "validations": len(rows), "val_top1": rows[-1]["val_top1"],
                      "trained_s": sum(row["epoch_time_s"] for row in rows)}))


def run_side(side: str, data_root: str, epochs: int | None) -> dict:
    """`side` in a fresh process, W&B offline in a temporary folder; its wall time and in-run sums."""
    from tests.helpers import script_env

    with tempfile.TemporaryDirectory(prefix="errors-cost-") as tmp:
        env = script_env(WANDB_MODE="offline", WANDB_DIR=tmp, WANDB_DATA_DIR=tmp)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--one", side, "--out", f"{tmp}/run", "--data-root",
                               data_root, *(["--epochs", str(epochs)] if epochs else [])],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{side} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"wall": wall, "analysis": sum(result["spent"].values()), "load": os.getloadavg()[0], **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-root", default=".cache/digits")
    parser.add_argument("--epochs", type=int, help="train.epochs (default: the quickstart's)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", choices=list(SIDES))
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.one:
        return one(args.one, args.out, args.data_root, args.epochs)
    from benchmarks.harness import machine_line

    print(machine_line())
    rounds = []
    for round_ in range(args.rounds):
        order = ["on", "off"] if round_ % 2 == 0 else ["off", "on"]
        results = {}
        for side in order:
            results[side] = run_side(side, args.data_root, args.epochs)
            print(f"  round {round_ + 1} {side}: {json.dumps(results[side])}", file=sys.stderr, flush=True)
        rounds.append(results)
    print("| round | on: wall s | on: error analysis s (share of wall) | off: wall s | on - off s (share) | "
          "outside training steps s: on, off | their difference s (share) | load (1 min) after on, off |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, r in enumerate(rounds, 1):
        on, off = r["on"], r["off"]
        extra = on["wall"] - off["wall"]
        outside = [side["wall"] - side["trained_s"] for side in (on, off)]
        more = outside[0] - outside[1]
        print(f"| {i} | {on['wall']:.1f} | {on['analysis']:.2f} ({100 * on['analysis'] / on['wall']:.2f}%) | "
              f"{off['wall']:.1f} | {extra:+.1f} ({100 * extra / on['wall']:+.1f}%) | {outside[0]:.1f}, "
              f"{outside[1]:.1f} | {more:+.1f} ({100 * more / on['wall']:+.1f}%) | "
              f"{on['load']:.1f}, {off['load']:.1f} |")
    print(f"{rounds[0]['on']['validations']} validations a run")
    shares = [100 * r["on"]["analysis"] / r["on"]["wall"] for r in rounds]
    print(f"in-run share: median {statistics.median(shares):.2f}%, max {max(shares):.2f}% (bound: 5%)")
    print("in-run seconds by call, summed over the rounds: " + ", ".join(
        f"{name} {sum(r['on']['spent'][name] for r in rounds):.2f}" for name in rounds[0]["on"]["spent"]))
    if args.json:
        args.json.write_text(json.dumps(rounds, indent=1))


if __name__ == "__main__":
    main()
