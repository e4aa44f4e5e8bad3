"""Time to accuracy: the app's train.py and timm's own train.py, on the same images and strong recipe (issue 52).

Both sides are vs_timm_train.py's commands (`--recipe strong`: mixup 0.2, cutmix 1.0, RandAugment m9, random
erasing 0.25, EMA 0.99, both evaluated every epoch) on scikit-learn's digits upscaled to 32 px (the PNGs that
data.name=digits exports), run as whole commands. While a run goes, this script polls its per-epoch results
file every 0.1 s (ours: metrics.jsonl; timm: summary.csv) and records the wall seconds since the command
started at which each epoch's validation row appeared: start-up, training and validation, the same clock for
both sides. An epoch's top-1 is the better of its plain and EMA figures.

Each round runs both sides (in an order that reverses every round). Its target is the lower of the two runs'
final best top-1; each side's figure is the wall time at which it first reached that target, and the round's
ratio is ours / timm's (issue 52's target: <= 0.8, median of the rounds). Both runs' final accuracies are
printed beside it.

    python benchmarks/time_to_accuracy.py --timm-train /tmp/timm52/train.py     # 3 rounds, ~8 min on 2 cores
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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timm-train", type=Path, required=True, help="timm's train.py, from a clone of its repo")
    parser.add_argument("--model", default="resnet10t", help="the quickstart's model (both sides)")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers, both sides")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--root", type=Path, default=REPO / ".cache" / "digits", help="the digits export")
    parser.add_argument("--json", type=Path, help="also write every run's per-epoch times and top-1s here")
    args = parser.parse_args()
    args.recipe = "strong"  # vs_timm_train's commands read it
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


def one_round(args: argparse.Namespace, reverse: bool) -> dict:
    """Both sides once; the round's target, each side's time to it, and their final best top-1s."""
    sides = {"ours": (lambda out: ours_command(args, out), ours_epochs),
             "timm": (lambda out: timm_command(args, out), timm_epochs)}
    runs = {}
    for name in (list(sides)[::-1] if reverse else list(sides)):
        command, read = sides[name]
        with tempfile.TemporaryDirectory(prefix="time-to-acc-") as tmp:
            runs[name] = timed_run(command(Path(tmp) / "out"), read, Path(tmp) / "out")
        best = max(epoch[1] for epoch in runs[name])
        print(f"  {name}: best top-1 {best:.2f}, {len(runs[name])} epochs in {runs[name][-1][0]:.1f} s",
              file=sys.stderr, flush=True)
    best = {name: max(epoch[1] for epoch in epochs) for name, epochs in runs.items()}
    target = min(best.values())
    reached = {name: first_reached(epochs, target) for name, epochs in runs.items()}
    return {"target": target, "best": best, "seconds_to_target": reached, "ratio": reached["ours"] / reached["timm"],
            "epochs": {name: [list(e) for e in epochs] for name, epochs in runs.items()}}


def spread(values: list[float], digits: int = 1) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}..{max(values):.{digits}f})"


def main() -> None:
    args = parse_args()
    export_digits(args.root)
    rounds = []
    for index in range(args.rounds):
        print(f"round {index + 1}/{args.rounds}, {machine_line().split(', ')[-1]}", file=sys.stderr, flush=True)
        rounds.append(one_round(args, reverse=index % 2 == 1))
    print(f"{machine_line()}\n{args.model}, 32 px, batch 64, {args.epochs} epochs, {args.workers} worker(s), strong "
          f"recipe, {args.rounds} round(s)\n")
    print("| round | target top-1 | ours: s to target | timm: s to target | ours / timm | final best top-1 ours / timm "
          "| whole run s ours / timm |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for index, r in enumerate(rounds, 1):
        print(f"| {index} | {r['target']:.2f} | {r['seconds_to_target']['ours']:.1f} | "
              f"{r['seconds_to_target']['timm']:.1f} | {r['ratio']:.2f} | {r['best']['ours']:.2f} / "
              f"{r['best']['timm']:.2f} | {r['epochs']['ours'][-1][0]:.1f} / {r['epochs']['timm'][-1][0]:.1f} |")
    ratios = [r["ratio"] for r in rounds]
    print(f"\n- time to the same top-1, ours / timm: **{statistics.median(ratios):.2f}** median "
          f"(per-round {min(ratios):.2f}..{max(ratios):.2f}; target <= 0.8, issue 52)")
    for name in ("ours", "timm"):
        print(f"- {name}: s to target {spread([r['seconds_to_target'][name] for r in rounds])}, final best top-1 "
              f"{spread([r['best'][name] for r in rounds], 2)}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_line(), "args": {k: str(v) for k, v in vars(args).items()},
                                         "rounds": rounds}, indent=2) + "\n")


if __name__ == "__main__":
    main()
