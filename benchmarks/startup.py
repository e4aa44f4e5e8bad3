"""What a command costs before it does anything: `train.py --help`, a refused config key, and a run's first line.

Each side is a whole command in a fresh process, timed from its launch: to its exit for `--help` and for the
refusal (`optim.lr=-1`), to the first line on stderr for a run of the digits quickstart (then stopped). With
`--before PATH` (another checkout of the app, e.g. `git worktree add /tmp/before <commit>`) each command runs in
both checkouts, alternating, so the table compares them under the same load. Wall seconds are what a user waits;
CPU seconds (user + system of the process and its children) barely move with other jobs on the machine.

    python benchmarks/startup.py [--before PATH] [--rounds 5]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # noqa: F401  (puts the repo on sys.path)
from harness import REPO, alternate, machine_line, print_table, ratio_line, script_env

COMMANDS = {  # what each side runs, from the checkout's root
    "--help": (["train.py", "--help"], False),
    "refusal": (["train.py", "--config", "finetune", "optim.lr=-1"], False),
    "first line": (["train.py", "--config", "digits", "train.epochs=1"], True),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="another checkout to compare with (its root folder)")
    parser.add_argument("--rounds", type=int, default=5)
    return parser.parse_args()


def timed(root: Path, argv: list[str], first_line: bool, cpu: list[float]) -> float:
    """Wall seconds from launch to exit (or, `first_line`, to the first stderr line, the process then stopped);
    the process's CPU seconds go to `cpu`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as out:
        args = [sys.executable, *argv] + ([f"output_dir={out}/run"] if first_line else [])
        start = time.perf_counter()
        process = subprocess.Popen(args, cwd=root, env=script_env(), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        if first_line:
            process.stderr.readline()
            wall = time.perf_counter() - start
            process.terminate()
        process.stderr.read()
        process.wait()
        wall = wall if first_line else time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return wall


def main() -> None:
    args = parse_args()
    print(machine_line(), file=sys.stderr)
    roots = {"this checkout": REPO} | ({"before": Path(args.before).resolve()} if args.before else {})
    for name, (argv, first_line) in COMMANDS.items():
        cpu: dict[str, list[float]] = {side: [] for side in roots}
        sides = {side: (lambda root=root, side=side: timed(root, argv, first_line, cpu[side]))
                 for side, root in roots.items()}
        wall = alternate(sides, args.rounds)
        print_table(f"`python {' '.join(argv)}`: wall seconds to {'its first line' if first_line else 'exit'}",
                    wall, "seconds, wall")
        print_table(f"`python {' '.join(argv)}`: CPU seconds", cpu, "seconds, user + system")
        if args.before:
            ratio_line(wall, "before", "this checkout")
    print(f"\n{machine_line()}")


if __name__ == "__main__":
    main()
