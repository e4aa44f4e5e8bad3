"""The two schedules torch defines and timm does not drive as the others: sched.name=onecycle (torch's OneCycleLR)
and sched.name=plateau (torch's ReduceLROnPlateau, Keras' ReduceLROnPlateau). Each is torch's own scheduler behind
the interface the loop drives every schedule with (engine/optim.build_scheduler): `step_update(global position)`
after each optimizer step, `state_dict()` into the checkpoint; plateau also takes each validation's metric
(`step_metric`, the StepOnMetric hook) and is put back from the checkpoint on resume (engine/checkpoint/resume.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.lr_scheduler import OneCycleLR, ReduceLROnPlateau

from core.config import SchedConfig
from core.errors import UserError


def scaled_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    """Each group's peak lr: optim.lr times the group's timm lr_scale (optim.layer_decay), which timm's schedulers
    apply at every step and torch's know nothing of."""
    return [group["lr"] * group.get("lr_scale", 1.0) for group in optimizer.param_groups]


class OneCycle:
    """torch's OneCycleLR over `total_steps` optimizer steps, peaking at optim.lr (each group's, times its lr_scale).

    The loop drives a schedule by position (`step_update(n)`, also on resume); one step on is torch's step(), any
    other position rebuilds torch's scheduler there (`last_epoch`, torch's own way to resume it), so the lr of every
    step is the one OneCycleLR gives when stepped after each optimizer step from the start.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: SchedConfig, total_steps: int) -> None:
        momentum = cfg.cycle_momentum or [0.85, 0.95]  # torch's defaults, unused when cycle_momentum is []
        self.optimizer = optimizer
        self.options = dict(max_lr=scaled_lrs(optimizer), total_steps=total_steps, pct_start=cfg.pct_start,
                            anneal_strategy=cfg.anneal_strategy, cycle_momentum=bool(cfg.cycle_momentum),
                            base_momentum=momentum[0], max_momentum=momentum[1], div_factor=cfg.div_factor,
                            final_div_factor=cfg.final_div_factor, three_phase=cfg.three_phase)
        try:
            self.scheduler = OneCycleLR(optimizer, **self.options)
        except ValueError as err:  # an optimizer with neither momentum nor betas, with sched.cycle_momentum
            raise UserError(f"sched.name=onecycle: {err}; set sched.cycle_momentum=[] for this optimizer") from None

    def step_update(self, num_updates: int) -> None:
        if num_updates == self.scheduler.last_epoch + 1:
            self.scheduler.step()
        elif num_updates != self.scheduler.last_epoch:
            self.scheduler = OneCycleLR(self.optimizer, **self.options, last_epoch=num_updates - 1)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()


class Plateau:
    """torch's ReduceLROnPlateau on `metric` (the column best.pth follows, train.best_metric; `lower_is_better` for a
    loss): after each validation whose value has not improved on the best by sched.plateau_threshold (relative) for
    more than sched.plateau_patience validations, every group's lr is multiplied by sched.decay_rate, never below
    sched.min_lr. Its state (the best value, the counters, the lr) is the run's: checkpointed and put back."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: SchedConfig, lower_is_better: bool) -> None:
        for group, lr in zip(optimizer.param_groups, scaled_lrs(optimizer)):
            group["lr"] = lr  # optim.layer_decay's scale, once: torch's scheduler multiplies the lr it finds
        self.scheduler = ReduceLROnPlateau(optimizer, mode="min" if lower_is_better else "max",
                                           factor=cfg.decay_rate, patience=cfg.plateau_patience,
                                           threshold=cfg.plateau_threshold, cooldown=cfg.plateau_cooldown,
                                           min_lr=cfg.min_lr)

    def step_update(self, num_updates: int) -> None:
        """The lr changes at validations only."""

    def step_metric(self, value: float) -> None:
        """One validation's value of the metric (the same on every rank: validation all-reduces it)."""
        self.scheduler.step(value)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)
