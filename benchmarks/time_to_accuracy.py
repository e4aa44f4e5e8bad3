"""Time to accuracy: the app's train.py and timm's own train.py, on the same images and strong recipe (issues 52, 64).

Three sides, run as whole commands: timm's train.py and the app's train.py with vs_timm_train.py's strong recipe
(`--recipe strong`: mixup 0.2, cutmix 1.0, RandAugment m9, random erasing 0.25, EMA 0.99, both evaluated every
epoch) at --img-size, and the app's accuracy-per-hour recipe (`fast`: configs/digits_fast.yaml, the same strong
recipe trained at rising resolutions below --img-size by data.size_schedule, evaluated at its measured best size),
on scikit-learn's digits upscaled to --img-size (64 px by default: data/digits.export_digits at that size, bicubic
from the 8x8 originals: images whose training resolution sets the cost, though not the information). While a run
goes, this script polls its per-epoch results file every 0.1 s (ours: metrics.jsonl; timm: summary.csv) and
records the wall seconds since the command started at which each epoch's validation row appeared: start-up,
training and validation, the same clock for every side. An epoch's top-1 is the better of its plain and EMA figures.

Each round runs every side (in an order that reverses every round). For each of the app's sides the target is
the lower of its run's and timm's final best top-1; each side's figure is the wall time at which it first reached
that target, and the ratio is the app side's / timm's (issue 64's target for `fast`: <= 0.5, median of the rounds,
with fast's final best top-1 >= timm's in every round; `ours`, the plain strong recipe, shows what the levers add).
Every run's final best top-1 is printed beside it.

    python benchmarks/time_to_accuracy.py --timm-train /tmp/timm-repo/train.py   # 3 rounds, ~20 min on 2 cores
    python benchmarks/time_to_accuracy.py --timm-train ... --img-size 32 --epochs 12 --sides ours timm  # issue 52's
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from harness import REPO, machine_line
from vs_timm_train import ours_command, timm_command

from data.digits import export_digits
from tests.helpers import script_env

POLL_S = 0.1  # how often the results files are read: the resolution of every time below
TIMM_SIDES = ("timm", "timm-bf16")
SIDES = ("fast", "ours", *TIMM_SIDES)
TIMM_BF16 = ["--amp", "--amp-dtype", "bfloat16", "--channels-last"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timm-train", type=Path, required=True, help="timm's train.py, from a clone of its repo")
    parser.add_argument("--model", default="resnet10t", help="the quickstart's model (both sides)")
    parser.add_argument("--epochs", type=int, default=10, help="every side's")
    parser.add_argument("--img-size", type=int, default=64, help="the digits export's size; timm's and ours' crops")
    parser.add_argument("--fast-config", default="configs/digits_fast.yaml", help="the fast side's config")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=["fast", "ours", "timm"],
                        help="timm-bf16: timm's train.py with --amp --amp-dtype bfloat16 --channels-last, the precision "
                             "and memory format the app's amp=auto and model.channels_last choose on a bf16 CPU")
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers, every side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--root", type=Path, help="the digits export (default: .cache/digits<img-size>)")
    parser.add_argument("--json", type=Path, help="also write every run's per-epoch times and top-1s here")
    args = parser.parse_args()
    args.recipe = "strong"  # vs_timm_train's commands read it
    args.root = args.root or REPO / ".cache" / ("digits" if args.img_size == 32 else f"digits{args.img_size}")
    if not set(args.sides) & set(TIMM_SIDES):
        parser.error("--sides: timm (or timm-bf16) is every ratio's denominator")
    if not args.timm_train.is_file():
        parser.error(f"--timm-train {args.timm_train} is not a file: clone timm's repository (vs_timm_train.py "
                     "says how)")
    return args


PLAIN_TEST = re.compile(r"^.*Test: \[\s*(\d+)/(\d+)\].*Acc@1:\s*[\d.]+ \(\s*([\d.]+)\)", re.MULTILINE)


def ours_epochs(out: Path, log: str) -> list[tuple[float, float]]:
    """Each validated epoch's plain and EMA top-1 in metrics.jsonl so far."""
    path = out / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.is_file() else []  # a line still being written is left out
    rows = [json.loads(line) for line in lines if line.strip()]
    return [(r["val_top1"], r.get("ema_val_top1", 0.0)) for r in rows if "val_top1" in r]


def timm_epochs(out: Path, log: str) -> list[tuple[float, float]]:
    """Each epoch's plain and EMA top-1 as timm's train.py reports them so far: with --model-ema, timm's
    train.py writes only the EMA's figure there (eval_metrics = ema_eval_metrics), so the plain model's is read
    from its log (the last batch's running Acc@1 of each "Test:" pass, printed before the EMA's "Test (EMA):")."""
    path = out / "run" / "summary.csv"
    text = path.read_text() if path.is_file() else ""
    rows = list(csv.DictReader(io.StringIO(text[:text.rfind("\n") + 1])))
    plain = [float(m[3]) for m in PLAIN_TEST.finditer(log) if m[1] == m[2]]
    return [(plain[i] if i < len(plain) else 0.0, float(r["eval_top1"])) for i, r in enumerate(rows)]


def timed_run(command: list[str], read: Callable[[Path, str], list[tuple[float, float]]],
              out: Path) -> list[tuple[float, float, float, float]]:
    """Run `command`; for each epoch, (wall seconds since its start when its row appeared, top-1 (the better of
    plain and EMA), plain, EMA)."""
    seen: list[tuple[float, float, float, float]] = []
    log = out.parent / "log.txt"
    with log.open("w") as sink:
        start = time.perf_counter()
        proc = subprocess.Popen(command, cwd=REPO, env=script_env(), stdout=sink, stderr=subprocess.STDOUT, text=True)
        while True:
            done = proc.poll() is not None
            now = time.perf_counter() - start
            seen += [(now, max(plain, ema), plain, ema) for plain, ema in read(out, log.read_text())[len(seen):]]
            if done:
                break
            time.sleep(POLL_S)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command[:2])} exited {proc.returncode}:\n{log.read_text()[-4000:]}")
    return seen


VAL_IMAGES = 361  # the digits export's validation split: a top-1 is a count of these


def correct(top1: float) -> int:
    """The validation images a top-1 (in %) counts: timm's summary.csv rounds to 3 decimals (98.338 for 355 of 361,
    which the app writes as 98.33795...), so top-1s are compared as image counts, not as floats."""
    return round(top1 * VAL_IMAGES / 100)


def first_reached(epochs: list[tuple[float, float, float, float]], target: float) -> float:
    """The wall seconds at which an epoch first reached `target` (as many correct images, or more)."""
    return next(seconds for seconds, top1, *_ in epochs if correct(top1) >= correct(target))


def fast_command(args: argparse.Namespace, out: Path) -> list[str]:
    """train.py with the accuracy-per-hour recipe: its own sizes and evaluation size, the others' data and epochs."""
    return [sys.executable, str(REPO / "train.py"), "--config", args.fast_config, f"model.name={args.model}",
            f"data.root={args.root}", f"train.epochs={args.epochs}", f"data.num_workers={args.workers}",
            "logging.progress=false", f"output_dir={out}"]


def one_round(args: argparse.Namespace, reverse: bool) -> dict:
    """Every side once; per app side its target (the lower of its best and timm's), its and timm's time to it, and
    every run's final best top-1."""
    sides = {"fast": (lambda out: fast_command(args, out), ours_epochs),
             "ours": (lambda out: ours_command(args, out), ours_epochs),
             "timm": (lambda out: timm_command(args, out), timm_epochs),
             "timm-bf16": (lambda out: timm_command(args, out) + TIMM_BF16, timm_epochs)}
    runs = {}
    for name in (args.sides[::-1] if reverse else args.sides):
        command, read = sides[name]
        with tempfile.TemporaryDirectory(prefix="time-to-acc-") as tmp:
            runs[name] = timed_run(command(Path(tmp) / "out"), read, Path(tmp) / "out")
        print(f"  {name}: best top-1 {max(e[1] for e in runs[name]):.2f}, {len(runs[name])} epochs in "
              f"{runs[name][-1][0]:.1f} s", file=sys.stderr, flush=True)
    best = {name: max(epoch[1] for epoch in epochs) for name, epochs in runs.items()}
    versus = {}
    for app, timm in pairs(args.sides):
        target = min(best[app], best[timm])
        seconds = {side: first_reached(runs[side], target) for side in (app, timm)}
        versus[f"{app} / {timm}"] = {"target": target, "seconds_to_target": seconds,
                                     "ratio": seconds[app] / seconds[timm]}
    return {"versus": versus, "best": best, "epochs": {name: [list(e) for e in epochs] for name, epochs in runs.items()}}


def pairs(sides: list[str]) -> list[tuple[str, str]]:
    """(app side, timm side) for every ratio: each of the app's sides against each of timm's."""
    return [(app, timm) for app in sides if app not in TIMM_SIDES for timm in sides if timm in TIMM_SIDES]


def spread(values: list[float], digits: int = 1) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}..{max(values):.{digits}f})"


def main() -> None:
    args = parse_args()
    export_digits(args.root, args.img_size)
    rounds = []
    for index in range(args.rounds):
        print(f"round {index + 1}/{args.rounds}, {machine_line().split(', ')[-1]}", file=sys.stderr, flush=True)
        rounds.append(one_round(args, reverse=index % 2 == 1))
    print(f"{machine_line()}\n{args.model}, digits at {args.img_size} px, batch 64, {args.epochs} epochs, "
          f"{args.workers} worker(s), strong recipe, fast = {args.fast_config}, {args.rounds} round(s)\n")
    print("| round | app / timm | target top-1 | app: s to target | timm: s to it | ratio |\n| --- | --- |"
          + " ---: |" * 4)
    for index, r in enumerate(rounds, 1):
        for name, v in r["versus"].items():
            app, timm = name.split(" / ")
            print(f"| {index} | {name} | {v['target']:.2f} | {v['seconds_to_target'][app]:.1f} | "
                  f"{v['seconds_to_target'][timm]:.1f} | {v['ratio']:.2f} |")
    print("\n| round | " + " | ".join(f"{s}: best top-1 / whole run s" for s in args.sides) + " |\n| --- |"
          + " ---: |" * len(args.sides))
    for index, r in enumerate(rounds, 1):
        print(f"| {index} | " + " | ".join(f"{r['best'][s]:.2f} / {r['epochs'][s][-1][0]:.1f}" for s in args.sides)
              + " |")
    print()
    for app, timm in pairs(args.sides):
        ratios = [r["versus"][f"{app} / {timm}"]["ratio"] for r in rounds]
        at_least = all(r["best"][app] >= r["best"][timm] for r in rounds)
        print(f"- {app} / {timm}, time to the same top-1: **{statistics.median(ratios):.2f}** median (per-round "
              f"{min(ratios):.2f}..{max(ratios):.2f}); {app}'s final best top-1 >= {timm}'s in every round: "
              f"{at_least}")
    for name in args.sides:
        print(f"- {name}: final best top-1 {spread([r['best'][name] for r in rounds], 2)}, whole run s "
              f"{spread([r['epochs'][name][-1][0] for r in rounds])}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_line(), "args": {k: str(v) for k, v in vars(args).items()},
                                         "rounds": rounds}, indent=2) + "\n")


if __name__ == "__main__":
    main()
