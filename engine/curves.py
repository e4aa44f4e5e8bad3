"""curves.png: a run's training curves drawn from its metrics.jsonl, for a user without W&B or TensorBoard.

Training redraws it after each validation (engine/hooks.Curves, rank 0); `python -m engine.curves RUN_DIR`
redraws it for a finished run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from core.cli import report_errors
from core.config_load import load_config
from core.errors import UserError
from core.logs import MetricsFile
from engine.plots import PNG, pyplot, save_png
from engine.state import best_metric

NAME = "curves.png"


def draw_curves(rows: list[dict[str, Any]], path: Path, metric: str) -> None:
    """Loss (train, val, EMA val), `metric` (and its train and EMA counterparts) and lr against the epoch, or
    against the global step when the rows hold validations inside epochs (train.val_every_steps)."""
    plt = pyplot()
    x = "epoch" if len({row["epoch"] for row in rows}) == len(rows) or any("step" not in r for r in rows) else "step"
    base = metric.removeprefix("ema_").removeprefix("val_")
    panels = (("loss", ["train_loss", "val_loss", "ema_val_loss"]),
              (metric, [f"train_{base}", f"val_{base}", f"ema_val_{base}"]), ("lr", ["lr"]))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), dpi=100)
    for ax, (title, columns) in zip(axes, panels):
        for column in dict.fromkeys(columns):  # a metric that is itself a loss appears once
            points = [(row[x], row[column]) for row in rows if row.get(column) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=column)
        ax.set_xlabel("epoch" if x == "epoch" else "optimizer step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path, PNG, f"an earlier {NAME} of training", "output_dir")


def redraw(folder: Path) -> Path:
    """curves.png of a run folder, from its metrics.jsonl, with the metric its config.yaml chose best.pth on."""
    rows = MetricsFile(folder / "metrics.jsonl").rows()
    if not rows:
        raise UserError(f"{folder} has no metrics.jsonl rows to draw; give a training run's output_dir")
    config = folder / "config.yaml"
    metric = best_metric(load_config(str(config))) if config.is_file() else "val_top1"
    draw_curves(rows, folder / NAME, metric)
    return folder / NAME


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.curves", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a training run's output_dir (holding metrics.jsonl)")
    print(f"wrote {redraw(parser.parse_args(argv).run_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(report_errors(main, sys.argv[1:]))
