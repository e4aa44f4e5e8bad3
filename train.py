"""Train a timm image classifier, one process per device, with DDP.

    python train.py --config configs/digits.yaml                       # one process
    torchrun --nproc_per_node=N train.py --config resnet50 optim.lr=0.2  # N processes, overrides

Arguments are parsed here; everything else is one call, assembly.launch.train: the run is assembly/fit.py's `fit`
(start-up in assembly/start.py, the parts it trains with in assembly/parts.py). docs/architecture.md draws the rest.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: a SIGTERM or SIGUSR1 during the imports below (seconds) gets handled
    from core.signals import handle_early

    handle_early()

import argparse

from core.startup import openmp_waits_passively

openmp_waits_passively()  # before torch loads OpenMP, which reads its environment once (core/startup.py)

from assembly import launch  # torch, timm and the rest load once the config is read (assembly/launch.py)
from core.cli import GivenOnce, parse_with_overrides, run_main
from core.config import keys_help

USAGE = """Train a timm image classifier: one process, or one per GPU under torchrun.

    python train.py --config finetune data.root=photos            # your photos: photos/{train,val}/<class>/*
    python train.py --config digits                               # the quickstart (no download)
    torchrun --nproc_per_node=8 train.py --config resnet50 data.root=/data/imagenet
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=USAGE, epilog=keys_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, action=GivenOnce,
                        help="YAML file, or a bare name looked up in configs/ (finetune, digits, resnet50, ...; "
                             "default: digits, the quickstart)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (defaults, then --config, then overrides) and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="make every check a run makes before training (config, resume checkpoint, data folders "
                             "and classes, model, output_dir writable), write nothing, and exit")
    parser.add_argument("--find-lr", action="store_true",
                        help="run an LR range test (tune.lr_min to tune.lr_max over tune.steps steps) on a fresh "
                             "model, write lr_find.json and lr_find.png with a suggested optim.lr to output_dir, "
                             "and exit: no checkpoint is written or read (docs/tuning.md)")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for user errors")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="e.g. optim.lr=0.2 train.epochs=3 (or --optim.lr=0.2, --optim.lr 0.2), anywhere among the "
                             "flags")
    return parse_with_overrides(parser, argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    return launch.train(args.config, args.overrides, args.print_config, args.dry_run, args.find_lr)


if __name__ == "__main__":
    run_main(main, after_sigterm="with resume=auto the same command continues from the last checkpoint in "
                               "output_dir")
