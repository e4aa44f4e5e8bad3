"""Export a trained model for use outside this app: ONNX, TorchScript, or a timm / Hugging Face model folder.

    python export.py runs/digits/best.pth --format onnx            # runs/digits/best.onnx
    python export.py runs/digits/best.pth --format torchscript     # runs/digits/best.torchscript.pt
    python export.py runs/digits/best.pth --format safetensors     # runs/digits/best-hf/ (config.json, weights, card)
    python export.py runs/digits/best.pth --format onnx --ema --output model.onnx

ONNX and TorchScript take a float32 NCHW batch of any size, already resized, centre-cropped and normalized as
the stored config says (its mean, std, image size and crop_pct are in the ONNX metadata and in the TorchScript
file's config.json); they return logits. Before it reports success the command runs the exported model and
the PyTorch model on real images (--images, else the checkpoint's validation set, a data.val_fraction run's val.txt
beside it; random pixels if neither can be read) in batches of 1 and --check-batch, prints the largest absolute
difference of the logits, and fails above --atol. A run's data.eval_transform file goes with the export (the model
folder's eval_transform.yaml, the ONNX / TorchScript metadata), and a model folder read back must preprocess the
check images as the checkpoint does. The model folder (config.json: architecture, num_classes, label_names, pretrained_cfg with
the preprocessing; model.safetensors; README.md, the model card the Hugging Face Hub shows) loads with
`timm.create_model("local-dir:FOLDER")`, with `timm.create_model(arch, pretrained=True, num_classes=N,
pretrained_cfg_overlay=dict(file="FOLDER/model.safetensors", num_classes=N))`, with predict.py and as
model.init_from; its weights are checked to load back into timm bitwise.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: a SIGTERM or SIGUSR1 during the imports below (seconds) gets handled
    from core.signals import handle_early

    handle_early()

import argparse

from core.startup import import_timm_without_wandb

import_timm_without_wandb()  # first: the imports below reach timm, which would import wandb (core/startup.py)

from assembly.export import SUFFIXES, export_command
from core.cli import parse_without_overrides, run_main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="export.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint written by train.py")
    parser.add_argument("--format", required=True, choices=sorted(SUFFIXES), help="what to write")
    parser.add_argument("--output", help="the file (folder for safetensors) to write, or a URL (s3://...: written "
                                         "here, then uploaded) (default: beside the checkpoint, named after it)")
    parser.add_argument("--ema", action="store_true", help="export the checkpoint's EMA weights")
    parser.add_argument("--images", help="an image, folder or list file to check the export on (default: the "
                                         "checkpoint's validation images)")
    parser.add_argument("--check-batch", type=int, default=8, help="images in the larger check batch (default 8)")
    parser.add_argument("--atol", type=float, default=1e-4, help="largest allowed |logit difference| (default 1e-4)")
    parser.add_argument("--opset", type=int, default=18, help="ONNX opset version (default 18)")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for user errors")
    why = "it exports and checks the fp32 model on the CPU and records the run's eval_amp for predict.py"
    return parse_without_overrides(parser, argv, f"{why}; give amp=... to evaluate.py or predict.py")


def main(argv: list[str]) -> int:
    return export_command(parse_args(argv))


if __name__ == "__main__":
    run_main(main, after_sigterm="run the same command again to export")
