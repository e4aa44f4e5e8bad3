"""How fast is a model here: inference and training img/s, step-time percentiles, peak memory, parameters.

    python benchmark.py --model resnet50 --batch-size 128 --amp bf16          # the device train.py would use
    python benchmark.py --config resnet50 --json runs/bench.json             # model, batch, amp... from a config
    python benchmark.py --config digits --data --workers 1 2 --target-img-s 2000   # the input pipeline alone
    python benchmark.py --model resnet50 --amp bf16 --sweep-batch             # the largest batch that fits

The model is timm's (random weights, nothing downloaded), placed and stepped as train.py does it
(prepare_model, the app's Precision and optimizer; torch.compile with --compile). Inputs are random batches
already on the device: this times the model, not the data pipeline (a run's own input wait says whether the
loader keeps up: docs/performance.md, "Speed"). Each mode runs --warmup untimed steps, then --steps timed ones, each
ended by a device synchronize; img/s is batch / the median step time, with min and max from the slowest and
fastest step; step-time percentiles interpolate linearly between steps (numpy.percentile).
Peak memory: CUDA's max_memory_allocated, or on CPU the process's peak RSS (which includes the interpreter
and torch itself, and is the maximum since the process started).

--data times the input pipeline alone: train.py's own train loader (build_data, build_train_loader) from the
config and its overrides, once per --workers count: one untimed warm-up batch (workers start), then
--data-batches timed ones, no model. img/s per worker is img/s / workers (0 workers: the training process
loads, counted as one), and workers needed = ceil(target / img/s per worker), which assumes loading scales
linearly with workers; the target is --target-img-s, else the training img/s measured in the same call.
--sweep-batch runs one training step at batch 2, 4, 8, ... up to --max-batch and reports the largest that ran:
on CUDA the next one ran out of memory (torch.cuda.OutOfMemoryError); on CPU host RAM is not probed, so the
sweep stops at --max-batch, which it then requires.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: a SIGTERM or SIGUSR1 during the imports below (seconds) gets handled
    from core.signals import handle_early

    handle_early()

import argparse
from pathlib import Path

from core.startup import import_timm_without_wandb, openmp_waits_passively

openmp_waits_passively()  # before torch loads OpenMP: steps timed as train.py runs them
import_timm_without_wandb()  # first: the imports below reach timm, which would import wandb (core/startup.py)

from assembly.benchmark import CUDA_MAX_BATCH, benchmark_command
from core.cli import GivenOnce, run_main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action=GivenOnce,
                        help="take model, batch size, image size, amp, channels_last, compile from this config (YAML "
                             "file or a name in configs/); the options below override it")
    parser.add_argument("--model", help="timm model name (default: the config's, else resnet18)")
    parser.add_argument("--batch-size", type=int, help="images per step (default: the config's train.batch_size)")
    parser.add_argument("--img-size", type=int, help="input side in pixels (default: the config's data.img_size)")
    parser.add_argument("--amp", choices=("auto", "bf16", "fp16", "off"), help="precision (default: the config's)")
    parser.add_argument("--channels-last", choices=("true", "false"), help="NHWC memory format (default: config's)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--num-classes", type=int, default=1000, help="classifier outputs (default 1000)")
    parser.add_argument("--mode", choices=("both", "inference", "train"),
                        help="model steps to time (default both; with --data or --sweep-batch: none unless given)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--data", action="store_true", help="time the input pipeline alone (train.py's train "
                                                             "loader from the config) for each --workers count")
    parser.add_argument("--workers", type=int, nargs="+", help="data.num_workers values for --data "
                                                               "(default: 0, then powers of two up to the CPU count)")
    parser.add_argument("--data-batches", type=int, default=20, help="timed batches per worker count (default 20)")
    parser.add_argument("--target-img-s", type=float, help="img/s the loader must deliver, for --data's workers "
                                                           "needed (default: the training img/s measured here)")
    parser.add_argument("--sweep-batch", action="store_true", help="find the largest power-of-two batch whose "
                                                                   "training step fits in device memory")
    parser.add_argument("--max-batch", type=int, help=f"--sweep-batch's cap (default {CUDA_MAX_BATCH} on CUDA; "
                                                      "required on CPU, where host RAM is not probed)")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as train.py's")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    return benchmark_command(parse_args(argv))


if __name__ == "__main__":
    run_main(main, after_sigterm="run it again")
