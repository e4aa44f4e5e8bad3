"""Evaluate a checkpoint: exact metrics, per-image predictions and a confusion matrix.

    python evaluate.py runs/digits/best.pth                            # one process
    torchrun --nproc_per_node=N evaluate.py runs/digits/best.pth       # N processes, same results
    python evaluate.py ckpt.pth --data-dir /data/other --batch-size 256 data.val_crop_pct=1.0
    python evaluate.py ckpt.pth --tta-flip --tta-crops 5    # test-time augmentation: 10 views per image

The model and the eval pipeline are rebuilt from the config stored in the checkpoint (a data.eval_transform file
from the run folder's copy, its sha256 checked); options and dotted overrides change it. --data-dir scores that
folder's images (its val split, or every image of its class folders), never the run's val.txt looked up there; the
output says which images were scored. Every rank evaluates its block of whole batches and writes its
predictions to a part file; rank 0 merges them into predictions.csv (sorted by index), writes
eval.json and confusion_matrix.png (and, with logging.wandb=true, an "eval" W&B run), and
removes the parts. The results do not depend on the
number of processes (on CPU each process uses one thread: launch one per core for speed).
"""

from __future__ import annotations

if __name__ == "__main__":  # first: a SIGTERM or SIGUSR1 during the imports below (seconds) gets handled
    from core.signals import handle_early

    handle_early()

import argparse

from core.cli import parse_with_overrides, run_main
from core.startup import import_timm_without_wandb


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint written by train.py (last.pth, best.pth, last.dcp, ...), or a "
                        "model folder from export.py (with --data-dir)")
    parser.add_argument("--data-dir", help="score this folder's images, whatever split the run used: its "
                        "data.val_split folder (<split>/<class>/*: val; data.val_split=test for another), or with no "
                        "split folders every image under its <class>/ folders (default: the run's validation data)")
    parser.add_argument("--batch-size", type=int, help="per process (default: the checkpoint's train.batch_size)")
    parser.add_argument("--output-dir", help="where results go (default: <checkpoint folder>/eval-<checkpoint name>)")
    parser.add_argument("--ema", action="store_true", help="evaluate the checkpoint's EMA weights")
    parser.add_argument("--tta-flip", action="store_true", help="test-time augmentation: average the softmax "
                        "probabilities of each image and its horizontal mirror")
    parser.add_argument("--tta-crops", type=int, default=1, help="1: the centre crop (default); 5: average the "
                        "softmax probabilities of the centre and four corner crops of the resized image")
    parser.add_argument("--tune-thresholds", action="store_true", help="multi-label: also choose each class's "
                        "threshold maximizing its F1 on this set (eval.json per_class; predict.py --thresholds)")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for user errors")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. data.val_img_size=224 amp=bf16")
    return parse_with_overrides(parser, argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)  # --help and a wrong argument answer before the imports below (seconds)
    import_timm_without_wandb()  # first: the import below reaches timm, which would import wandb (core/startup.py)
    from assembly.evaluate import evaluate_command

    return evaluate_command(args)


if __name__ == "__main__":
    run_main(main, after_sigterm="run the same command again to evaluate from the start")
