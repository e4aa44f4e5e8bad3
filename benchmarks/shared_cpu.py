"""The digits quickstart on a shared CPU: quiet, beside busy co-tenants, and limited to fewer cores (issue 52).

Each run is a whole command: the app's `python train.py --config configs/digits.yaml train.epochs=E` and, with
`--timm-train`, timm's own train.py on the same images, model (resnet10t), schedule and augmentations
(benchmarks/vs_timm_train.py's commands, plain recipe). Conditions:

- `quiet`: nothing else started;
- `busy1`, `busy2`: 1 or 2 co-tenants, each a plain Python busy loop (`while True: pass`) on the same cores,
  started just before the run and killed after it;
- `app2`: beside a second copy of the app (the same quickstart command, more epochs), started and training before
  the run starts and killed after it;
- `taskset1`: the run limited to core 0 by its affinity mask (`taskset -c 0`), quiet;
- `quota1`: the run inside a cgroup v1 `cpu` group with a quota of 1 CPU (cpu.cfs_quota_us = cfs_period_us),
  quiet; skipped, and said, where the machine does not let this process create one.

The headline per side is images trained per wall second of the whole command (E epochs of the 1,436 training
images over the command's wall time: start-up and validation included, the same definition for both sides);
the app's own last-epoch `train_img_per_s` (metrics.jsonl, first step left out) follows. Rounds are interleaved:
every round runs every condition, and within it every side, in an order that reverses every time.
`--side KEY=VALUE ...` adds a side: the app with those environment variables (an A/B of an OpenMP setting) and
config overrides (a key with a dot: `data.num_workers=0`); `--side GOMP_SPINCOUNT=300000` is main before issue
52's waiting policy (libgomp's default spinning: the app leaves the waiting alone when the user tuned it).

The acceptance lines (issue 52) follow the tables: beside N busy loops, ours' img/s over its quiet img/s against
0.6 x its fair share of the cores (quiet it keeps every core busy, its threads and its loader worker: beside N
loops each of its C cores' worth of work gets C / (C + N) of them, at most 1; the same whatever thread count the
app picks), and
ours / timm's img/s under the same co-tenants (>= 1.5 beside 2 busy loops).

    python benchmarks/shared_cpu.py --timm-train /tmp/timm52/train.py      # every condition, 3 rounds, ~12 min quiet
    python benchmarks/shared_cpu.py --quick                                # ours only, quiet and busy2, ~1 min
    python benchmarks/shared_cpu.py --conditions quiet busy2 --no-timm --rounds 3 \\
        --side OMP_WAIT_POLICY=ACTIVE --side GOMP_SPINCOUNT=300000          # waiting policy: passive, active, default
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from functools import partial
from pathlib import Path
from typing import Callable

from harness import REPO, machine_line
from vs_timm_train import ours_command, timm_command

from core.config_load import load_config
from core.startup import compute_threads
from data.digits import export_digits
from tests.helpers import script_env

CONDITIONS = ("quiet", "busy1", "busy2", "app2", "taskset1", "quota1")
BUSY_LOOPS = {"busy1": 1, "busy2": 2}
TRAIN_IMAGES = 1436  # the digits export's training split
CGROUP = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller, where this machine mounts it


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timm-train", type=Path, help="timm's train.py, from a clone of its repository")
    parser.add_argument("--no-timm", action="store_true", help="the app's sides only")
    parser.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=list(CONDITIONS))
    parser.add_argument("--epochs", type=int, default=1, help="per run (1 keeps a full run near 15 min)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--side", action="append", nargs="+", metavar="KEY=VALUE", default=[],
                        help="one more side: the app with these environment variables and (keys with a dot) config "
                             "overrides (repeatable)")
    parser.add_argument("--quick", action="store_true", help="1 round, quiet and busy2, ours only")
    parser.add_argument("--root", type=Path, default=REPO / ".cache" / "digits", help="the digits export")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.conditions, args.no_timm = 1, ["quiet", "busy2"], True
    if not args.no_timm and (args.timm_train is None or not args.timm_train.is_file()):
        parser.error(f"--timm-train {args.timm_train} is not a file: clone timm's repository (vs_timm_train.py "
                     "says how), or pass --no-timm")
    return args


class Stopped(Exception):
    """SIGTERM or SIGINT: stop the rounds, keep what was measured."""


def stop(signum: int, frame: object) -> None:
    raise Stopped


def start_cotenants(condition: str, app: Callable[[Path], list[str]], out: Path) -> list[subprocess.Popen]:
    """The condition's co-tenants on this process's cores, running: busy loops, or a copy of the app (`app`, writing
    into `out`) once it trains (config.yaml is its first write, after its imports and set-up; 120 s at most)."""
    if condition == "app2":
        copy = subprocess.Popen(app(out), cwd=REPO, env=script_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)  # its loader worker goes with it
        deadline = time.monotonic() + 120
        while not (out / "config.yaml").exists() and copy.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return [copy]
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(BUSY_LOOPS.get(condition, 0))]
    time.sleep(0.5 if loops else 0)  # the loops are running before the run starts
    return loops


def quota_group(cpus: float) -> Path | None:
    """A fresh cgroup v1 cpu group with a quota of `cpus` CPUs, or None where this machine does not allow one."""
    group = CGROUP / f"shared-cpu-bench-{os.getpid()}"
    try:
        group.mkdir()
        period = int((group / "cpu.cfs_period_us").read_text())
        (group / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
    except OSError:
        if group.is_dir():
            group.rmdir()
        return None
    return group


def wrapped(command: list[str], condition: str, group: Path | None) -> list[str]:
    """The command as the condition runs it: pinned to core 0, or moved into the quota group first."""
    if condition == "taskset1":
        return ["taskset", "-c", "0", *command]
    if condition == "quota1":
        assert group is not None
        return ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *command]
    return command


def one_run(command: list[str], condition: str, group: Path | None, env: dict[str, str],
            app: Callable[[Path], list[str]], scratch: Path) -> tuple[float, Path]:
    """Run `command` once under `condition`; its wall seconds (the output folder stays for the caller to read)."""
    cotenants = start_cotenants(condition, app, scratch / "cotenant")
    try:
        start = time.perf_counter()
        proc = subprocess.run(wrapped(command, condition, group), cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
    finally:
        for cotenant in cotenants:
            if condition == "app2":
                os.killpg(cotenant.pid, signal.SIGKILL)  # the copy and its loader worker
            else:
                cotenant.kill()
            cotenant.wait()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command[:3])} under {condition} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return wall, proc


def last_epoch_img_s(out: Path) -> float:
    """The app's own figure for its last epoch (metrics.jsonl's train_img_per_s)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows[-1]["train_img_per_s"]


def side_runner(name: str, make: Callable[[Path], list[str]], env: dict[str, str], epochs: int,
                results: dict, epoch_rates: dict, group: Path | None,
                app: Callable[[Path], list[str]]) -> Callable[[str], float]:
    """A function that runs side `name` once under a condition and records its img/s."""
    def run(condition: str) -> float:
        with tempfile.TemporaryDirectory(prefix="shared-cpu-") as tmp:
            out = Path(tmp) / "out"
            wall, _ = one_run(make(out), condition, group, env, app, Path(tmp))
            if name != "timm":
                epoch_rates[(condition, name)].append(last_epoch_img_s(out))
        rate = TRAIN_IMAGES * epochs / wall
        results[(condition, name)].append(rate)
        print(f"  {condition:9s} {name}: {rate:.0f} img/s ({wall:.1f} s), load average {os.getloadavg()[0]:.2f}",
              file=sys.stderr, flush=True)
        return rate
    return run


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}..{max(values):.0f})"


def print_tables(results: dict, epoch_rates: dict, conditions: list[str], names: list[str]) -> None:
    """Median (min..max) per condition and side, and each side's ratio to timm and to its own quiet figure."""
    for title, table in (("whole command, training images per wall second", results),
                         ("the app's own last-epoch train_img_per_s", epoch_rates)):
        shown = [n for n in names if any((c, n) in table for c in conditions)]
        print(f"\n### {title}: median (min..max)\n")
        print("| condition | " + " | ".join(shown) + " |")
        print("| --- |" + " ---: |" * len(shown))
        for condition in conditions:
            print(f"| {condition} | " + " | ".join(spread(table[(condition, n)]) if table.get((condition, n)) else "-"
                                                  for n in shown) + " |")
    print()
    for condition in conditions:
        ours = results.get((condition, "ours"))
        for name in names:
            other = results.get((condition, name))
            if name == "ours" or not ours or not other:
                continue
            paired = [a / b for a, b in zip(ours, other)]
            print(f"- {condition}: ours / {name} = **{statistics.median(ours) / statistics.median(other):.2f}** "
                  f"(per-round {min(paired):.2f}..{max(paired):.2f})")


def acceptance(results: dict, epoch_rates: dict, conditions: list[str]) -> None:
    """Issue 52's lines: ours beside busy loops against 0.6 x quiet x its fair share of the cores, and against timm."""
    workers = load_config(str(REPO / "configs" / "digits.yaml")).data.num_workers
    cores, threads = len(os.sched_getaffinity(0)), compute_threads(1, workers)
    print(f"\n### acceptance (issue 52): ours runs {threads} thread(s) and {workers} loader worker(s) on {cores} core(s)\n")
    for condition in (c for c in conditions if c in BUSY_LOOPS):
        share = min(1.0, cores / (cores + BUSY_LOOPS[condition]))
        for title, table in (("whole command", results), ("last epoch", epoch_rates)):
            quiet, busy = table.get(("quiet", "ours")), table.get((condition, "ours"))
            if quiet and busy:
                got = statistics.median(busy) / statistics.median(quiet)
                print(f"- {condition}, {title}: ours / ours quiet = **{got:.2f}**, target 0.6 x fair share {share:.2f} "
                      f"= {0.6 * share:.2f}: {'met' if got >= 0.6 * share else 'not met'}")
        ours, timm = results.get((condition, "ours")), results.get((condition, "timm"))
        if ours and timm:
            got = statistics.median(ours) / statistics.median(timm)
            print(f"- {condition}: ours / timm = **{got:.2f}**, target >= 1.5: {'met' if got >= 1.5 else 'not met'}")


def main() -> None:
    args = parse_args()
    export_digits(args.root)
    group = quota_group(1.0) if "quota1" in args.conditions else None
    conditions = [c for c in args.conditions if c != "quota1" or group is not None]
    if "quota1" in args.conditions and group is None:
        print(f"quota1 skipped: this process cannot create a cgroup under {CGROUP}", file=sys.stderr)
    settings = Namespace(model="resnet10t", root=args.root, epochs=args.epochs, workers=1, recipe="plain",
                         timm_train=args.timm_train)
    results: dict = {(c, n): [] for c in conditions for n in ["ours", "timm"] + [" ".join(e) for e in args.side]}
    epoch_rates: dict = {key: [] for key in results}
    app = partial(ours_command, Namespace(**{**vars(settings), "epochs": 1000}))  # app2's co-tenant, killed after
    side = partial(side_runner, epochs=args.epochs, results=results, epoch_rates=epoch_rates, group=group, app=app)
    sides = {"ours": side("ours", lambda out: ours_command(settings, out), script_env())}
    if not args.no_timm:
        sides["timm"] = side("timm", lambda out: timm_command(settings, out), script_env())
    for extra in args.side:
        name, overrides = " ".join(extra), [kv for kv in extra if "." in kv.split("=", 1)[0]]
        env = script_env(**dict(kv.split("=", 1) for kv in extra if kv not in overrides))
        sides[name] = side(name, lambda out, o=overrides: ours_command(settings, out) + o, env)
    signal.signal(signal.SIGTERM, stop)  # `kill` ends the rounds early: co-tenants killed, the tables printed
    signal.signal(signal.SIGINT, stop)  # also in a background job, where SIGINT starts out ignored
    done = 0
    try:
        for round_ in range(args.rounds):
            print(f"round {round_ + 1}/{args.rounds}, load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
            for index, condition in enumerate(conditions):  # each condition's order reverses from round to round
                order = list(sides) if (round_ + index) % 2 == 0 else list(sides)[::-1]
                for name in order:
                    sides[name](condition)
            done += 1
    except Stopped:
        print("stopped early: the tables hold the runs that finished", file=sys.stderr)
    finally:
        if group is not None:
            group.rmdir()
    print(f"{machine_line()}\ndigits quickstart (resnet10t, 32 px, batch 64, 1 worker), {args.epochs} epoch(s), "
          f"{done} round(s) of {args.rounds}; busy co-tenants: `python -c 'while True: pass'` each")
    print_tables(results, epoch_rates, conditions, list(sides))
    acceptance(results, epoch_rates, conditions)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_line(), "args": {k: str(v) for k, v in vars(args).items()},
                                         "img_per_s": {f"{c} | {n}": v for (c, n), v in results.items()},
                                         "epoch_img_per_s": {f"{c} | {n}": v for (c, n), v in epoch_rates.items()}},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
