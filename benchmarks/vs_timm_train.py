"""The app's train.py against timm's own train.py, end to end, on the same images and recipe (issue 28).

Both train the same timm model on the digits export (real PNGs, data.name=digits writes them once) with the
same schedule, batch, workers and augmentations, one after the other in alternating order; each run is
timed as a whole command (wall seconds, and the CPU seconds of it and its DataLoader workers), and each
reports its best and last validation top-1. The headline is timm's wall time over ours (above 1: ours is
faster). timm's train.py is not part of the timm wheel: pass it from a clone of timm's repository at the
pinned version (it is fetched by you, never vendored here):

    git clone --depth 1 --branch v1.0.31 https://github.com/huggingface/pytorch-image-models /tmp/timm-repo
    python benchmarks/vs_timm_train.py --timm-train /tmp/timm-repo/train.py --recipe strong --rounds 3

`--recipe plain`: cross-entropy with label smoothing 0.1, random resized crop. `--recipe strong` adds mixup 0.2,
cutmix 1.0, RandAugment m9 (magnitude std 0.5), random erasing 0.25 (per-pixel) and an EMA at 0.99 that
both evaluate every epoch.
"""

from __future__ import annotations

import argparse
import csv
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import REPO, alternate, machine_line, print_table, ratio_line

from data.digits import export_digits
from tests.helpers import script_env

STRONG_OURS = ["data.mixup_alpha=0.2", "data.cutmix_alpha=1.0", "data.auto_augment=rand-m9-mstd0.5",
               "data.random_erase=0.25", "model.ema_decay=0.99"]
STRONG_TIMM = ["--mixup", "0.2", "--cutmix", "1.0", "--aa", "rand-m9-mstd0.5", "--reprob", "0.25", "--remode", "pixel",
               "--model-ema", "--model-ema-decay", "0.99"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timm-train", type=Path, required=True, help="timm's train.py, from a clone of its repo")
    parser.add_argument("--recipe", choices=("plain", "strong"), default="strong")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--img-size", type=int, default=32, help="train and eval crop size, both sides")
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers, both sides")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each side (alternating order)")
    parser.add_argument("--root", type=Path, default=REPO / ".cache" / "digits", help="the digits export")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--also", nargs="+", metavar="KEY=VALUE",
                        help="a third side in the same rounds: ours with these config overrides (an A/B of a setting)")
    return parser.parse_args()


def ours_command(args: argparse.Namespace, out: Path, extra: list[str] | None = None) -> list[str]:
    """train.py with configs/digits.yaml's recipe (sgd lr 0.1, cosine, 1 warm-up epoch, batch 64) at args.img_size."""
    return [sys.executable, str(REPO / "train.py"), "--config", "configs/digits.yaml", f"model.name={args.model}",
            "data.name=imagefolder", f"data.root={args.root}", f"data.img_size={args.img_size}",  # main()'s export
            f"train.epochs={args.epochs}",
            f"data.num_workers={args.workers}", "logging.progress=false", f"output_dir={out}",
            *(STRONG_OURS if args.recipe == "strong" else []), *(extra or [])]


def timm_command(args: argparse.Namespace, out: Path) -> list[str]:
    """timm's train.py with the same recipe as configs/digits.yaml, flag by flag."""
    return [sys.executable, str(args.timm_train), str(args.root), "--model", args.model, "--num-classes", "10",
            "--input-size", "3", str(args.img_size), str(args.img_size), "--crop-pct", "1.0", "--scale", "0.5", "1.0", "--ratio", "0.8", "1.25",
            "--hflip", "0", "--mean", "0.5", "0.5", "0.5", "--std", "0.5", "0.5", "0.5", "-b", "64",
            "--epochs", str(args.epochs), "--opt", "sgd", "--lr", "0.1", "--momentum", "0.9",
            "--weight-decay", "5e-4", "--sched", "cosine", "--warmup-epochs", "1", "--smoothing", "0.1",
            "-j", str(args.workers), "--device", "cpu", "--log-interval", "10", "--output", str(out),
            "--experiment", "run", *(STRONG_TIMM if args.recipe == "strong" else [])]


def ours_top1(out: Path) -> tuple[float, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    column = "ema_val_top1" if "ema_val_top1" in rows[-1] else "val_top1"
    return max(r[column] for r in rows), rows[-1][column]


def timm_top1(out: Path) -> tuple[float, float]:
    with (out / "run" / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    column = "ema_eval_top1" if "ema_eval_top1" in rows[-1] else "eval_top1"
    values = [float(r[column]) for r in rows]
    return max(values), values[-1]


def timed_side(name: str, command, top1, walls: dict, cpus: dict, top1s: dict):
    """One run of a side: the whole command's wall seconds (returned), its CPU seconds and top-1s recorded."""
    def run() -> float:
        with tempfile.TemporaryDirectory(prefix="vs-timm-") as tmp:
            out = Path(tmp) / "out"
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            proc = subprocess.run(command(out), cwd=REPO, env=script_env(), capture_output=True, text=True)
            wall = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if proc.returncode != 0:
                raise SystemExit(f"{name} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
            cpus[name].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
            top1s[name].append(top1(out))
        walls[name].append(wall)
        return wall
    return run


def main() -> None:
    args = parse_args()
    if not args.timm_train.is_file():
        raise SystemExit(f"--timm-train {args.timm_train} is not a file: clone timm's repository (see --help)")
    export_digits(args.root)
    names = ["ours", "timm"] + ([f"ours {' '.join(args.also)}"] if args.also else [])
    walls: dict[str, list[float]] = {name: [] for name in names}
    cpus: dict[str, list[float]] = {name: [] for name in names}
    top1s: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    sides = {"ours": timed_side("ours", lambda out: ours_command(args, out), ours_top1, walls, cpus, top1s),
             "timm": timed_side("timm", lambda out: timm_command(args, out), timm_top1, walls, cpus, top1s)}
    if args.also:
        sides[names[2]] = timed_side(names[2], lambda out: ours_command(args, out, args.also), ours_top1, walls, cpus,
                                     top1s)
    alternate(sides, args.rounds)
    print(f"{machine_line()}\n{args.model}, {args.img_size} px, batch 64, {args.epochs} epochs, {args.workers} worker(s), "
          f"recipe {args.recipe}")
    print_table("whole command, wall seconds", walls, "seconds; lower is faster")
    ratio_line(walls, "timm", "ours", target=1.1)
    if args.also:
        ratio_line(walls, names[2], "ours")
    print_table("whole command, CPU seconds (process and its workers)", cpus, "CPU seconds")
    ratio_line(cpus, "timm", "ours")
    for name, values in top1s.items():
        print(f"- {name}: best / last val top-1 per run: " + ", ".join(f"{b:.2f} / {l:.2f}" for b, l in values))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_line(), "args": {k: str(v) for k, v in vars(args).items()},
                                         "wall_s": walls, "cpu_s": cpus, "top1_best_last": top1s}, indent=2) + "\n")


if __name__ == "__main__":
    main()
