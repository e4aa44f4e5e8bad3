"""Optimizer and LR schedule from timm, configured by the optim and sched sections."""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import torch
from timm.optim import create_optimizer_v2, get_optimizer_class, get_optimizer_info
from timm.scheduler import create_scheduler_v2
from timm.scheduler.scheduler import Scheduler
from torch import nn
from torchvision.ops._utils import split_normalization_params  # torchvision's own norm/other split (pinned 0.29.1)

from core.config import Config, OptimConfig, SchedConfig, TrainConfig, global_batch, mixing
from core.errors import UserError
from engine.schedules import OneCycle, Plateau

log = logging.getLogger(__name__)

# torch optimizers with a fused step on both CPU and CUDA (one kernel per step instead of one per tensor).
FUSED_CLASSES = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def fused_kwargs(name: str, grad_scaler: bool = False, sharded: bool = False, unfreezes: bool = False) -> dict:
    """{"fused": True} when timm maps `name` to a torch optimizer with a fused step, else {}.

    It is the same arithmetic, rounded differently in the last bits (not bitwise equal to the per-tensor
    step), and faster (benchmarks/optimizer_step.py). Never fused SGD under a GradScaler: the fused kernel
    takes the scaler's found_inf flag instead of being skipped, and on a skipped first step it keeps momentum
    buffers made with empty_like, uninitialised (fused Adam/AdamW zero theirs: tests/test_gpu_path.py).
    Nor for sharded (FSDP2, DTensor) parameters: DTensor has no sharding rule for fused SGD's kernel (it has
    for fused Adam/AdamW). Nor when some parameters start stepping later than others (`unfreezes`:
    model.freeze_epochs): fused SGD takes a group's momentum buffers all made or none, and raises on a mix.
    """
    try:
        cls = get_optimizer_class(name, bind_defaults=False)
    except Exception:  # unknown name, or an optimizer needing CUDA libraries: timm's own error comes later
        return {}
    if cls is torch.optim.SGD and (grad_scaler or sharded or unfreezes):
        return {}
    return {"fused": True} if cls in FUSED_CLASSES else {}


def check_optimizer(cfg: OptimConfig) -> None:
    """Refuse an unknown optimizer, or betas/eps/nesterov it does not take, at start-up (also under --dry-run)."""
    try:
        info = get_optimizer_info(cfg.name)
    except ValueError as err:
        raise UserError(f"optim.name {cfg.name!r} is not a timm optimizer ({err})") from None
    if cfg.betas and not info.has_betas:
        raise UserError(f"optim.betas: optimizer {cfg.name!r} has no betas; remove optim.betas or use an "
                        "Adam-family optimizer (adamw, lamb, ...)")
    if cfg.eps is not None and not info.has_eps:
        raise UserError(f"optim.eps: optimizer {cfg.name!r} has no eps; remove optim.eps")
    if cfg.nesterov is not None:
        try:
            takes_it = "nesterov" in inspect.signature(get_optimizer_class(cfg.name, bind_defaults=False)).parameters
        except Exception:  # an optimizer needing CUDA libraries: building it reports that
            takes_it = True
        if not takes_it:
            raise UserError(f"optim.nesterov: optimizer {cfg.name!r} has no Nesterov option; remove optim.nesterov "
                            "(SGD-family optimizers take it: sgd, momentum, sgdw, lars)")


def say(speak: bool) -> Callable[..., None]:
    """How a start-up rule says what it did: in the log on rank 0 (`speak`), not at all elsewhere."""
    return log.info if speak else (lambda *_: None)


def batch_and_lr(cfg: Config, world_size: int, speak: bool = True) -> dict[str, dict[str, Any]]:
    """The batch per process and the lr the run uses on `world_size` processes, as values for core/config.with_derived
    ({"train": ..., "optim": ...}: global_batch_values, then scaled_lr_values); train.batch_size=auto's are found once
    the model is built (assembly/start.with_auto_batch)."""
    if cfg.train.batch_size == "auto":
        return {}
    train = global_batch_values(cfg.train, mixing(cfg.data), cfg.from_command_line, world_size, speak)
    return {"train": train, "optim": lr_for_batch(cfg, train, world_size, speak)}


def lr_for_batch(cfg: Config, train: dict[str, Any], world_size: int, speak: bool = True) -> dict[str, Any]:
    """scaled_lr_values for the global batch that `train` (derived train.* values, over cfg's own) gives: the lr
    follows the batch both where it is derived from train.global_batch_size and where train.batch_size=auto finds it."""
    images = global_batch(world_size, train.get("batch_size", cfg.train.batch_size),
                          train.get("accum_steps", cfg.train.accum_steps))
    return scaled_lr_values(cfg.optim, images, cfg.from_command_line, cfg.given, speak)


def global_batch_values(train: TrainConfig, mixes: bool, typed: frozenset[str], world_size: int,
                        speak: bool = True) -> dict[str, Any]:
    """train.batch_size from train.global_batch_size, if set: a run restarted on another number of processes
    (torchrun --nnodes=MIN:MAX) keeps its global batch, so its mid-epoch checkpoints stay resumable. A
    train.batch_size given on the command line (`typed`) wins over the config file's global batch (said in the log).
    `mixes`: mixing pairs the images of a batch."""
    if not train.global_batch_size:
        return {}
    if "train.batch_size" in typed and "train.global_batch_size" not in typed:
        say(speak)("train.batch_size=%s given: the config file's train.global_batch_size=%d is not applied (global "
                 "batch %s x %d process(es) x train.accum_steps=%d)", train.batch_size, train.global_batch_size,
                 train.batch_size, world_size, train.accum_steps)
        return {"global_batch_size": 0}
    per_step = world_size * train.accum_steps
    batch, left = divmod(train.global_batch_size, per_step)
    if left or (batch % 2 and mixes):
        what = "an even number of images per process (mixing pairs them)" if not left else "a whole batch per process"
        raise UserError(f"config key 'train.global_batch_size' is {train.global_batch_size}, which does not give "
                        f"{what} on {world_size} process(es) x train.accum_steps={train.accum_steps}; use a multiple "
                        f"of {per_step * (2 if mixes else 1)}")
    if "train.batch_size" in typed and train.batch_size != batch:  # both given, and they disagree
        raise UserError(f"train.batch_size={train.batch_size} and train.global_batch_size={train.global_batch_size} "
                        f"are both given, but the global batch sets {batch} per process on {world_size} process(es) "
                        f"x train.accum_steps={train.accum_steps}; give one of the two")
    return {"batch_size": batch}


def scaled_lr_values(optim: OptimConfig, images: int, typed: frozenset[str], given: frozenset[str],
                     speak: bool = True) -> dict[str, Any]:
    """optim.lr computed from optim.lr_base for a global batch of `images` (timm's train.py rule), if lr_base is set;
    the start-up log says how. The computed lr replaces optim.lr, so config.yaml and the checkpoints show the lr the
    run used, but never an optim.lr given on the command line (`typed`): that one is used, lr_base set to 0 (said in
    the log); both given there is refused. `given`: the keys the config file or the command line set."""
    if not optim.lr_base:
        return {}
    if "optim.lr" in typed:
        if "optim.lr_base" in typed:
            raise UserError(f"optim.lr={optim.lr:g} and optim.lr_base={optim.lr_base:g} are both given; optim.lr_base "
                            "derives optim.lr from the global batch: give one of the two")
        say(speak)("optim.lr %g as given: the config file's optim.lr_base %g (scaled by the global batch) is not "
                 "applied", optim.lr, optim.lr_base)
        return {"lr_base": 0.0}
    ratio = images / optim.lr_base_size
    lr = optim.lr_base * (ratio ** 0.5 if optim.lr_base_scale == "sqrt" else ratio)
    replaced = f"; the config file's optim.lr {optim.lr:g} is not used" if "optim.lr" in given else ""
    say(speak)("optim.lr %g = optim.lr_base %g x global batch %d / %d (%s)%s", lr, optim.lr_base, images,
             optim.lr_base_size, optim.lr_base_scale, replaced)
    return {"lr": lr}


def build_optimizer(model: nn.Module, cfg: OptimConfig, grad_scaler: bool = False, sharded: bool = False,
                    unfreezes: bool = False) -> torch.optim.Optimizer:
    """timm optimizer (fused when that is safe); norm weights and biases get no weight decay if no_decay_norm_bias.

    `grad_scaler`: the run steps through a GradScaler (fp16), `sharded`: the parameters are FSDP2's DTensors,
    `unfreezes`: frozen parameters join the steps later (model.freeze_epochs); each rules out fused SGD.
    """
    knobs = {"betas": tuple(cfg.betas) if cfg.betas else None, "eps": cfg.eps, "nesterov": cfg.nesterov}
    knobs = {key: value for key, value in knobs.items() if value is not None}  # unset: the optimizer's default
    params = (named_decay_groups(model, cfg.no_decay_match, cfg.weight_decay) if cfg.no_decay_match else
              norm_layer_groups(model, cfg.weight_decay) if cfg.no_decay_norm_layers else model)
    try:
        return create_optimizer_v2(params, opt=cfg.name, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                   momentum=cfg.momentum, filter_bias_and_bn=cfg.no_decay_norm_bias,
                                   layer_decay=cfg.layer_decay or None,
                                   **{**fused_kwargs(cfg.name, grad_scaler, sharded, unfreezes), **knobs,
                                      **cfg.kwargs})
    except (AssertionError, ValueError) as err:
        raise UserError(f"optim.name {cfg.name!r} is not a timm optimizer ({err})") from None
    except TypeError as err:  # an optim.kwargs entry this optimizer does not take
        raise UserError(f"optimizer {cfg.name!r} rejected optim.kwargs {cfg.kwargs} ({err}); "
                        "remove or rename the option") from None


def named_decay_groups(model: nn.Module, match: str, weight_decay: float) -> list[dict]:
    """optim.no_decay_match: NVIDIA's rule (image_classification/optimizers.py get_sgd_optimizer), no decay for the
    parameters whose names contain `match` ("bn"), decay for the rest: a downsample BatchNorm (downsample.1) and
    fc.bias are decayed there, not under timm's 1-D rule. Frozen parameters are left out, as timm's groups do."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for name, p in named if match in name], "weight_decay": 0.0},
            {"params": [p for name, p in named if match not in name], "weight_decay": weight_decay}]


def norm_layer_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """optim.no_decay_norm_layers: torchvision's rule (references/classification, --norm-weight-decay 0), no decay
    for the parameters of normalization layers, decay for the rest (a classifier's bias included), split by
    torchvision's own split_normalization_params."""
    norm, other = split_normalization_params(model)
    return [{"params": norm, "weight_decay": 0.0}, {"params": other, "weight_decay": weight_decay}]


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedConfig, epochs: int, updates_per_epoch: int,
                    lower_is_better: bool = False) -> Scheduler | EpochSteps | OneCycle | Plateau:
    """timm scheduler stepped every optimizer update (`step_update`), so warmup is smooth; with
    sched.step_on_epochs, the same schedule counted in epochs (EpochSteps), the lr changing once per epoch;
    sched.name=onecycle and plateau are torch's schedulers (engine/schedules.py; plateau follows a metric that
    `lower_is_better` or not: train.best_metric's).

    Every length is converted to the schedule's unit here, in one place (timm then counts in that unit:
    updates_per_epoch=1), which lets warmup be given in steps as well as in epochs.
    """
    if cfg.name == "onecycle":
        return OneCycle(optimizer, cfg, epochs * updates_per_epoch)
    if cfg.name == "plateau":
        return Plateau(optimizer, cfg, lower_is_better)
    per_epoch = 1 if cfg.step_on_epochs else updates_per_epoch
    # timm applies a multistep milestone m at update m - 1 (its convention, kept for old recipes): + 1 starts
    # the decay with epoch m's first update, as torch's MultiStepLR does.
    milestones = [m * per_epoch + 1 for m in cfg.decay_milestones]
    decay = cfg.decay_epochs
    if not (cfg.name in ("wsd", "rsqrt") and 0 < decay < 1):  # wsd/rsqrt: a decay below 1 is a fraction
        decay = decay * per_epoch or None  # None: timm's default (wsd/rsqrt only: step needs decay_epochs)
    warmup = cfg.warmup_steps or cfg.warmup_epochs * per_epoch
    length = (epochs - cfg.cooldown_epochs) * per_epoch - (warmup if cfg.warmup_prefix else 0)
    try:
        scheduler, _ = create_scheduler_v2(optimizer, sched=cfg.name, num_epochs=length, warmup_epochs=warmup,
                                           warmup_lr=cfg.warmup_lr, warmup_prefix=cfg.warmup_prefix,
                                           min_lr=cfg.min_lr, decay_epochs=decay, decay_milestones=milestones,
                                           decay_rate=cfg.decay_rate, step_on_epochs=False, updates_per_epoch=1)
    except (AssertionError, ValueError) as err:
        raise UserError(f"sched.name {cfg.name!r} is not usable ({err})") from None
    if scheduler is None:
        raise UserError(f"sched.name {cfg.name!r} is not a timm scheduler; try cosine, step or multistep")
    if cfg.step_on_epochs:
        nvidia_warmup = cfg.warmup_epochs if cfg.warmup_shape == "nvidia" else 0
        return EpochSteps(scheduler, updates_per_epoch, nvidia_warmup, cfg.epoch_lag)
    return scheduler


class EpochSteps:
    """A timm schedule counted in epochs, driven by the optimizer step count as the trainer drives every
    schedule (`step_update(global_step)`, also on resume): epoch e trains at the schedule's value for e.

    `nvidia_warmup` W > 0: epoch e < W trains at lr x (e+1) / W instead of timm's warmup (NVIDIA
    DeepLearningExamples' lr policies), through timm's update_groups (so layer-decay scales still apply).
    `lag` L > 0 (sched.epoch_lag): epoch e trains at the value for max(e - L, 0), DeiT's main.py calling
    `lr_scheduler.step(epoch)` after epoch `epoch`; still a function of the step alone, so a resume is exact.
    """

    def __init__(self, scheduler: Scheduler, updates_per_epoch: int, nvidia_warmup: int = 0, lag: int = 0) -> None:
        self.scheduler, self.updates_per_epoch, self.nvidia_warmup = scheduler, updates_per_epoch, nvidia_warmup
        self.lag = lag
        self.step_update(0)

    def step_update(self, num_updates: int) -> None:
        epoch = max(num_updates // self.updates_per_epoch - self.lag, 0)
        self.scheduler.step_update(num_updates=epoch)
        if epoch < self.nvidia_warmup:
            self.scheduler.update_groups([base * (epoch + 1) / self.nvidia_warmup
                                          for base in self.scheduler.base_values])

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)


def lr_at(cfg: SchedConfig, lr: float, epochs: int, updates_per_epoch: int, update: int) -> float:
    """The schedule's lr at optimizer update `update` (a schedule is a function of the step), on a stand-in."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    build_scheduler(optimizer, cfg, epochs, updates_per_epoch).step_update(num_updates=update)
    return optimizer.param_groups[0]["lr"]


def extension_warning(cfg: SchedConfig, lr: float, finished_epochs: int, epochs: int, updates_per_epoch: int,
                      checkpoint: str) -> str | None:
    """What a raised train.epochs does to a finished run's schedule, rebuilt over the new length from where the run
    stopped: its extra epochs train at the rebuilt schedule's tail (a cosine's near-zero lr); None when not raised, and
    for sched.name=plateau, whose lr follows the validations, not the run's length (it continues as it was)."""
    if epochs <= finished_epochs or cfg.name == "plateau":
        return None
    now = lr_at(cfg, lr, epochs, updates_per_epoch, finished_epochs * updates_per_epoch)
    end = lr_at(cfg, lr, epochs, updates_per_epoch, epochs * updates_per_epoch - 1)
    return (f"train.epochs {finished_epochs} -> {epochs} continues a finished run: sched.name={cfg.name} is rebuilt "
            f"over {epochs} epochs from epoch {finished_epochs} on, so the extra epochs train at lr {now:.3g} falling "
            f"to {end:.3g} (optim.lr {lr:g}); for a whole schedule instead, start a new run from these weights: "
            f"model.init_from={checkpoint} resume=none in another output_dir")


def check_scheduler(cfg: SchedConfig, epochs: int, updates_per_epoch: int) -> list[str]:
    """Build the schedule once over a stand-in parameter, so start-up (and --dry-run) meets any error timm
    raises; returns warnings for a schedule longer than the run (the caller's main rank logs them)."""
    build_scheduler(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), cfg, epochs, updates_per_epoch)
    return schedule_warnings(cfg, epochs, updates_per_epoch)


def schedule_warnings(cfg: SchedConfig, epochs: int, updates_per_epoch: int) -> list[str]:
    """Parts of the schedule that the run ends before: accepted (a run may be extended on resume), said once."""
    warnings = []
    if cfg.warmup_epochs >= epochs:
        warnings.append(f"sched.warmup_epochs {cfg.warmup_epochs} is not below train.epochs {epochs}: the lr rises "
                        "for the whole run and never reaches optim.lr")
    if cfg.warmup_steps >= epochs * updates_per_epoch:
        warnings.append(f"sched.warmup_steps {cfg.warmup_steps} is more than the run's {epochs * updates_per_epoch} "
                        "optimizer steps: the lr rises for the whole run and never reaches optim.lr")
    late = [str(m) for m in cfg.decay_milestones if m >= epochs]
    if cfg.name == "multistep" and late:
        warnings.append(f"sched.decay_milestones {', '.join(late)} are beyond the last epoch (train.epochs {epochs}): "
                        "those decays never happen")
    if cfg.name == "step" and cfg.decay_epochs >= epochs:
        warnings.append(f"sched.decay_epochs {cfg.decay_epochs:g} is not below train.epochs {epochs}: the lr never "
                        "decays")
    return warnings
