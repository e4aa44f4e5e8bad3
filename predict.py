"""Run a trained model on images nobody has labelled: top-k classes and probabilities per image.

    python predict.py runs/digits/best.pth photo.png                   # one image
    python predict.py runs/digits/best.pth images/                     # every image under a folder, at any depth
    python predict.py runs/digits/best.pth list.txt --topk 3           # a text file of paths, one per line
    python predict.py runs/digits/best.pth images/ --tta-flip          # test-time augmentation (also --tta-crops 5)
    torchrun --nproc_per_node=N predict.py runs/digits/best.pth images/    # N processes, same output

The model is a checkpoint written by train.py or a model folder written by `export.py --format safetensors`;
the images go through the eval pipeline stored with it (resize, centre crop, mean/std, interpolation; a
data.eval_transform file from the run folder's or model folder's copy, its sha256 checked); with
--tta-flip / --tta-crops 5 the probabilities are the mean softmax probabilities over the views (models/tta.py).
Writes predictions.csv (index, path, class_1, prob_1, ..., class_k, prob_k) and predictions.json (the same,
plus the unreadable files) to --output-dir. An unreadable file is reported and skipped; the others are predicted.
Relative paths in a list file are relative to the list file's folder. Under torchrun each rank predicts a
block of whole batches (as evaluate.py) and rank 0 merges the rows in input order.
A multi-label model (data.multi_label) gives each image's sigmoid probabilities instead (predictions.csv:
index, path, labels, probs) and the classes at or above the threshold (data.multi_label_threshold, --threshold,
or per class: --thresholds with an eval.json of `evaluate.py --tune-thresholds`), labels separated by `|`.
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
    parser.add_argument("checkpoint", help="a checkpoint written by train.py, or a model folder from export.py")
    parser.add_argument("inputs", help="an image, a folder of images (searched at any depth) or a text file of paths")
    parser.add_argument("--output-dir", help="where predictions.csv/.json go (default: <checkpoint folder>/"
                                             "predict-<inputs name>)")
    parser.add_argument("--topk", type=int, default=5, help="classes per image (default 5, at most the class count)")
    parser.add_argument("--batch-size", type=int, help="per process (default: the checkpoint's train.batch_size)")
    parser.add_argument("--ema", action="store_true", help="use the checkpoint's EMA weights")
    parser.add_argument("--tta-flip", action="store_true", help="test-time augmentation: average the softmax "
                        "probabilities of each image and its horizontal mirror")
    parser.add_argument("--tta-crops", type=int, default=1, help="1: the centre crop (default); 5: average the "
                        "softmax probabilities of the centre and four corner crops of the resized image")
    parser.add_argument("--threshold", type=float, help="multi-label: a class is predicted at sigmoid >= this "
                        "(default: the model's data.multi_label_threshold)")
    parser.add_argument("--thresholds", help="multi-label: per-class thresholds, from an eval.json written by "
                        "evaluate.py --tune-thresholds")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for user errors")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. data.num_workers=0 amp=off")
    return parse_with_overrides(parser, argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)  # --help and a wrong argument answer before the imports below (seconds)
    import_timm_without_wandb()  # first: the import below reaches timm, which would import wandb (core/startup.py)
    from assembly.predict import predict_command

    return predict_command(args)


if __name__ == "__main__":
    run_main(main, after_sigterm="run the same command again to predict from the start")
