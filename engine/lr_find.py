"""Smith's LR range test (train.py --find-lr): which optim.lr to train with, read from one short ramp.

The run's own training loop (engine/trainer.py train_one_epoch) steps the run's model, optimizer, precision,
loss and data order, with the lr raised exponentially from tune.lr_min to tune.lr_max over tune.steps optimizer
steps. After every step the loop all-reduces the step's loss (logging interval 1), so every rank records the same
curve and stops at the same step: when the smoothed loss passes DIVERGED x its lowest value, or is inf/NaN.
The suggestion is the lr of the smoothed loss's minimum (the rule and why: suggest()). Nothing is
trained for keeps: the caller starts from a fresh model and optimizer and writes only lr_find.json and lr_find.png.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from core.config import TuneConfig
from core.dist import DistInfo
from core.files import replace_with, starts_with, temp_beside, write_output
from engine.hooks import Hook
from engine.state import TrainState
from engine.trainer import LoopConfig, TrainParts, train_one_epoch

log = logging.getLogger(__name__)

# The loss's exponential moving average (debiased). Not fastai's and Lightning's 0.98: over 100 steps and 7 decades of
# lr its ~49-step lag put the digits' smoothed minimum at lr 0.17 where the raw loss was lowest at 0.06 and rising
# by 0.12, and the spike at lr 0.9 never passed DIVERGED; 0.8 lags 4 steps (a quarter of a decade).
BETA = 0.8
DIVERGED = 4.0  # stop once the smoothed loss exceeds this many times its lowest value (Lightning's threshold)
RULE = ("minimum (Smith's max_lr): the lr where the smoothed loss is lowest, the largest lr swept at which it still "
        "fell; a peak lr for a schedule that warms up to it and decays (sched.warmup_epochs, cosine)")
LABEL = "the smoothed loss's minimum, Smith's max_lr"  # the rule in the plot's legend and train.py's log
OUTPUTS = {"lr_find.json": starts_with(b'{\n  "lr_find": '), "lr_find.png": starts_with(b"\x89PNG\r\n\x1a\n")}


class Diverged(Exception):
    """The smoothed loss passed DIVERGED x its lowest value (or was inf/NaN): the ramp ends at this step."""


class LrRamp(Hook):
    """The lr schedule of the test (the loop calls step_update as it calls a timm scheduler's) and the hook that
    records each step's all-reduced loss against the lr that step used; raises Diverged on every rank alike."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: TuneConfig) -> None:
        self.optimizer, self.cfg = optimizer, cfg
        self.lrs: list[float] = []
        self.losses: list[float] = []  # raw, as all-reduced
        self.smoothed: list[float] = []
        self.average = 0.0
        self.step_update(0)

    def lr_at(self, step: int) -> float:
        """The lr of optimizer step `step` (0-based): exponential from lr_min to lr_max at step tune.steps - 1."""
        return self.cfg.lr_min * (self.cfg.lr_max / self.cfg.lr_min) ** (step / (self.cfg.steps - 1))

    def step_update(self, num_updates: int) -> None:
        """Set the lr of the next step; layer-wise lr decay (timm's lr_scale per group) scales it as timm does."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(num_updates) * group.get("lr_scale", 1.0)

    def after_interval(self, state: TrainState, stats: dict[str, float]) -> None:
        loss = stats["train_loss"]
        if not math.isfinite(loss):
            raise Diverged(f"the loss was {loss} at lr {self.lr_at(state.global_step - 1):.3g}")
        self.average = BETA * self.average + (1 - BETA) * loss
        smoothed = self.average / (1 - BETA ** (len(self.losses) + 1))
        self.lrs.append(self.lr_at(state.global_step - 1))
        self.losses.append(loss)
        self.smoothed.append(smoothed)
        if smoothed > DIVERGED * min(self.smoothed):
            raise Diverged(f"the smoothed loss {smoothed:.4g} passed {DIVERGED:g} x its lowest "
                           f"{min(self.smoothed):.4g} at lr {self.lrs[-1]:.3g}")


def range_test(parts: TrainParts, loader: DataLoader, loop: LoopConfig, info: DistInfo,
               cfg: TuneConfig) -> dict[str, Any]:
    """Step the run's loop under the lr ramp until tune.steps or divergence; the curve and the suggestion."""
    ramp = LrRamp(parts.optimizer, cfg)
    parts = replace(parts, scheduler=ramp)
    loop = replace(loop, log_interval=1, max_steps=cfg.steps, total_steps=cfg.steps, show_progress=False)
    state, stopped = TrainState(), f"tune.steps={cfg.steps} reached"
    try:
        while state.global_step < cfg.steps:
            loader.sampler.set_epoch(state.epoch)
            train_one_epoch(parts, loader, state, loop, info, [ramp])
            state.finish_epoch()
    except Diverged as diverged:
        stopped = str(diverged)
    return {"lr_find": "train.py --find-lr", **suggest(ramp.lrs, ramp.smoothed),
            "lr_min": cfg.lr_min, "lr_max": cfg.lr_max, "steps": len(ramp.lrs), "stopped": stopped,
            "lrs": ramp.lrs, "losses": ramp.losses, "smoothed_losses": ramp.smoothed}


def suggest(lrs: list[float], smoothed: list[float]) -> dict[str, Any]:
    """The suggested lr and the rule that chose it (RULE), with the steepest descent's lr beside it as a lower bound.

    Why the minimum: Smith (2017, section 3.3) takes the lr where the loss stops falling as a cyclical schedule's
    max_lr, and optim.lr is the peak of a warmup + decay schedule. On the digits (configs/digits.yaml, 8 epochs,
    val_top1 last epoch, one seed, trained on 1 process) it suggested 0.0756 (1 process) and 0.0643 (2), which gave
    99.17 and 99.17, as the hand-tuned 0.1 did; lower lrs fell short: Lightning's steepest descent (0.0175) 98.06,
    the geometric mean of steepest and minimum (0.0335) 98.89, 0.0394 98.34 (fastai's minimum / 10: 0.0076). Always
    one of the lrs swept; the test stops only once the smoothed loss passes DIVERGED x this minimum, never before it.
    A minimum at the first lr (the loss never fell) or no loss at all is no minimum: no suggestion, and why.
    """
    if not smoothed:
        return no_suggestion("no finite loss was recorded (the first step's loss was not a number)")
    lowest = int(np.argmin(smoothed))
    if lowest == 0:  # the loss never fell below the sweep's first value: no lr at which it still fell
        return no_suggestion(f"the smoothed loss never fell below its value at the sweep's first lr {lrs[0]:.3g} "
                             f"({smoothed[0]:.4g})")
    falling = smoothed[:lowest + 1]
    steepest = int(np.argmin(np.gradient(falling, np.log10(lrs[:lowest + 1])))) if len(falling) > 1 else 0
    return {"suggested_lr": lrs[lowest], "rule": RULE, "steepest_lr": lrs[steepest], "min_loss_lr": lrs[lowest],
            "min_smoothed_loss": smoothed[lowest]}


def no_suggestion(why: str) -> dict[str, Any]:
    """The result without a usable minimum: suggesting the sweep's first lr would pass for a finding."""
    return {"suggested_lr": None, "no_suggestion": why, "rule": RULE, "steepest_lr": None, "min_loss_lr": None,
            "min_smoothed_loss": None}


def write_results(result: dict[str, Any], out: Path) -> None:
    """lr_find.json and lr_find.png into the run folder (rank 0), each replacing only an earlier one of ours."""
    out.mkdir(parents=True, exist_ok=True)
    write_output(out / "lr_find.json", (json.dumps(result, indent=2) + "\n").encode(), OUTPUTS["lr_find.json"],
                 "an earlier lr_find.json of train.py --find-lr", "output_dir")
    plot(result, out / "lr_find.png")


def plot(result: dict[str, Any], path: Path) -> None:
    """The loss against the lr (log scale), raw and smoothed, with the suggestion and the steepest descent marked."""
    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font-cache notice is not ours to print
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    ax.plot(result["lrs"], result["losses"], color="0.75", linewidth=1, label="loss (all ranks)")
    ax.plot(result["lrs"], result["smoothed_losses"], color="C0", linewidth=2, label="smoothed loss")
    if result["suggested_lr"] is not None:
        ax.axvline(result["suggested_lr"], color="C3", linestyle="--",
                   label=f"suggested optim.lr {result['suggested_lr']:.3g} ({LABEL})")
        ax.axvline(result["steepest_lr"], color="0.5", linestyle=":",
                   label=f"steepest descent {result['steepest_lr']:.3g} (a lower bound)")
    ax.set_xscale("log")
    low, high = min(result["smoothed_losses"], default=0.0), max(result["smoothed_losses"], default=1.0)
    ax.set_ylim(low - 0.05 * (high - low), high + 0.05 * (high - low) + 1e-12)  # the smoothed curve, whole
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.set_title("LR range test (train.py --find-lr)")
    ax.legend()
    fig.tight_layout()
    with temp_beside(path) as tmp:
        fig.savefig(tmp, format="png")
        replace_with(tmp, path, OUTPUTS[path.name], "an earlier lr_find.png of train.py --find-lr", "output_dir")
    plt.close(fig)
