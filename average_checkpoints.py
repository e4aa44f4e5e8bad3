"""Average the last K epoch checkpoints of a run into one checkpoint that evaluate.py, predict.py and export.py take.

    python train.py --config digits train.keep_last_k=5              # keeps epoch_NNNN.pth of the last 5 epochs
    python average_checkpoints.py runs/digits                        # all kept epoch files -> runs/digits/averaged.pth
    python average_checkpoints.py runs/digits --last 3 --output runs/digits/avg3.pth
    python evaluate.py runs/digits/averaged.pth                      # (--ema: the averaged EMA weights)

As timm's avg_checkpoints.py: every tensor of the model's state dict is summed in float64 and divided by K,
then stored in its own dtype (float32 weights; integer buffers such as BatchNorm's num_batches_tracked are
rounded). The EMA weights are averaged the same way when every checkpoint holds them (a run that switched the
EMA on at a resume has older files without: then the model weights alone, said in a line). The files must be of
one run: the same class names, model and run id (train.py records one per run, kept by its resumes). BatchNorm
running means and variances are averaged like any other tensor, as timm does, not recomputed on training data: a mean of
running variances is not exactly the variance of the averaged model's activations, which matters little for
checkpoints of neighbouring epochs late in a run (a recomputation pass is left to the user). timm picks the
top K by metric by default; here the K newest epochs, as averaging the end of a schedule does.

The result holds the newest checkpoint's config and class names, no optimizer state (it cannot be resumed;
use it as model.init_from to train on) and `averaged_from`, the files it came from. --output never replaces
a file that is not an earlier averaged checkpoint; the write is atomic.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: a SIGTERM or SIGUSR1 during the imports below (seconds) gets handled
    from core.signals import handle_early

    handle_early()

import argparse

from assembly.average import average_command
from core.cli import run_main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run's output_dir holding epoch_NNNN.pth files (train.keep_last_k)")
    parser.add_argument("--last", type=int, default=0, help="average the newest K epoch files (default: all kept)")
    parser.add_argument("--output", help="the checkpoint to write (default: <run_dir>/averaged.pth)")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for user errors")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    return average_command(parse_args(argv))


if __name__ == "__main__":
    run_main(main, after_sigterm="run the same command again to average")
