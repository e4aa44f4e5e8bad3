"""What is wrong with my data: suspected label errors, near-duplicates and train/val leaks, file problems.

    python audit.py --config digits                        # k-fold cross-validation of the config's recipe
    torchrun --nproc_per_node=8 audit.py --config finetune data.root=photos --folds 5
    python audit.py runs/finetune/best.pth                 # a finished run's own predictions: weaker evidence

With --config, each of --folds runs trains the config's recipe on every training image but one fold's and predicts
that fold: cleanlab ranks the images whose out-of-fold probabilities disagree with their label. Written to --out
(default <output_dir>/audit): label_issues.csv, duplicates.csv, folds.json, audit.json and report.html, one page
that opens offline. Run the same command again to continue an interrupted audit. docs/data.md says how to read it.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: a SIGTERM or SIGUSR1 during the imports below (seconds) gets handled
    from core.signals import handle_early

    handle_early()

import argparse

from core.startup import import_timm_without_wandb, openmp_waits_passively

openmp_waits_passively()  # before torch loads OpenMP, which reads its environment once (core/startup.py)
from core.cli import GivenOnce, is_config_override, parse_with_overrides, run_main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", help="a finished run's checkpoint (best.pth, last.pth): audit from "
                        "its own predictions instead of k folds")
    parser.add_argument("--config", default=None, action=GivenOnce,
                        help="YAML file, or a name in configs/ (as train.py's --config)")
    parser.add_argument("--folds", type=int, default=5, help="k of the k-fold cross-validation (default 5)")
    parser.add_argument("--out", help="the audit folder (default: <output_dir>/audit, or audit/ beside the "
                        "checkpoint)")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for user errors")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as train.py's")
    args = parse_with_overrides(parser, argv)
    if args.checkpoint and is_config_override(args.checkpoint):  # the first override, not a checkpoint
        args.overrides, args.checkpoint = [args.checkpoint, *args.overrides], None
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)  # --help and a wrong argument answer before the imports below (seconds)
    import_timm_without_wandb()  # first: the import below reaches timm, which would import wandb (core/startup.py)
    from assembly.audit import audit_command

    return audit_command(args)


if __name__ == "__main__":
    run_main(main, after_sigterm="run the same command again to continue the audit")
