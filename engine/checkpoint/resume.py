"""Resuming a run: which checkpoint to continue, whether it fits this run, and putting its state back.

`resume=auto` continues from <output_dir>/last.pth or last.dcp/ (train.ckpt_format=sharded; the newer of the two
when both exist), `resume=<path>` from that file or folder, `resume=none` never. resume=auto continues the folder's
run only with its config, but for the keys a continuation may change (CONTINUATION_KEYS: those whose schema field
says continues=True: train.epochs, logging, checkpoint writing, processes, ...). A fresh run (resume=none, or auto
without last.pth) refuses an output_dir that holds another run's record, naming its files. A checkpoint that does
not fit (another model, other classes, another optimizer) stops the run before anything in output_dir is touched.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from timm.scheduler.scheduler import Scheduler
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

from core.config import Config, ModelConfig, global_batch, key_facts, mixing, reads_by_rank, to_dict
from core.dist import DistInfo, is_fsdp
from core.errors import UnreadableCheckpoint, UserError
from engine.checkpoint import sharded
from engine.checkpoint.formats import PLAIN, is_sharded, read_checkpoint, set_aside
from engine.checkpoint.run_store import url_of
from engine.checkpoint.saver import EPOCH_FILE
from engine.checkpoint.weights import Pretrained, check_architecture, load_weights, read_pretrained

log = logging.getLogger(__name__)
TRAINING_KEYS = ("model", "optimizer", "epoch", "global_step", "config", "class_names", "rng")
RUN_FILES = ("config.yaml", "metrics.jsonl", "last.pth", "last.dcp", "best.pth")  # and epoch_NNNN.pth
OPTIMIZER_KEYS = ("name", "no_decay_norm_bias", "layer_decay")  # what the optimizer state's layout depends on
# The keys a run continued by resume=auto may change (continues=True on their schema field, core/config.py): how
# long it goes on, the global batch over processes (a mid-epoch checkpoint keeps it: check_global_batch; at an epoch
# boundary it may change and the schedule continues at its epoch, tests/test_schedule.py), how it reads data, writes
# checkpoints and logs, how its processes meet and talk, what best.pth follows from now on, the speed and memory of
# the same model, output_dir named another way, model.init_from (not read by a resumed run),
# distill.teacher_sha256 (recorded at start-up; engine/distill.py checks the teacher against it) and tune.* (--find-lr
# never trains this run). Any other change (optim.lr, an augmentation, the seed, the data) makes another run, which
# resume=auto refuses (resume=<path> continues or branches it on purpose).
CONTINUATION_KEYS = tuple(key for key, facts in key_facts().items() if facts.continues)


class LoopState(Protocol):
    """What a checkpoint's loop state is put back into (engine/state.TrainState, made by fit), through its methods."""

    epoch: int
    epoch_step: int
    global_step: int
    unvalidated: dict[str, Any] | None

    def load_state_dict(self, ckpt: dict[str, Any]) -> None: ...

    def forget_best(self) -> None: ...

    def schedule_position(self, updates_per_epoch: int) -> int: ...


def decide_resume(resume: str, out_dir: Path) -> str | None:
    """The checkpoint path to continue, or None: a fresh run only in a folder holding no run record (decided by rank
    0 in the start-up's one decision, assembly/start.decide_start, and told to all)."""
    last = last_checkpoint(out_dir)
    found = run_files(out_dir)
    if resume == "auto":
        if last is not None:
            return str(last)
        if found:
            raise UserError(f"output_dir {out_dir} holds a run ({', '.join(found)}) but no last.pth to continue; "
                            f"{way_out(out_dir)}")
        return None
    if resume == "none":
        if not found:
            return None
        problem = f"output_dir {out_dir} already holds a run ({', '.join(found)}) and resume=none"
        if last is None:
            raise UserError(f"{problem}; {way_out(out_dir)}")
        try:
            read_checkpoint(last)
        except UserError:
            raise UserError(f"{problem}; {last} cannot be read: {way_out(out_dir, last)}") from None
        raise UserError(f"{problem}; use resume=auto to continue it, or another output_dir to start over")
    if not Path(resume).is_file() and not (is_sharded(resume) and Path(resume).is_dir()):
        raise UserError(f"resume={resume}: no such checkpoint file; use auto, none or an existing .pth path (or "
                        ".dcp folder)")
    if found and Path(resume).resolve().parent != out_dir.resolve():
        raise UserError(f"output_dir {out_dir} already holds another run ({', '.join(found)}); to continue "
                        f"{resume} choose an output_dir that holds no run")
    return resume


def run_files(out_dir: Path) -> list[str]:
    """The files of a run's record in out_dir (checkpoints, metrics.jsonl, config.yaml), by name."""
    if not out_dir.is_dir():
        return []
    return sorted(p.name for p in out_dir.iterdir() if p.name in RUN_FILES or EPOCH_FILE.fullmatch(p.name))


def way_out(out_dir: Path, unreadable: Path | None = None) -> str:
    """What to do when out_dir's run cannot be continued from `unreadable` (its last checkpoint, or none): the run's
    other checkpoints that read, newest first, else start over."""
    options = readable_checkpoints(out_dir, unreadable)
    if not options:
        return ("no other readable checkpoint (last.pth, last.dcp, best.pth, epoch_NNNN.pth) is left to continue "
                "from: choose another output_dir to start over")
    named = ", ".join(f"resume={path} (global step {step})" for path, step in options)
    return f"to continue from another checkpoint of this run: {named}; or choose another output_dir to start over"


def readable_checkpoints(out_dir: Path, unreadable: Path | None) -> list[tuple[Path, int]]:
    """(path, global step) of each training checkpoint in out_dir that reads, newest first: last.pth, last.dcp,
    best.pth and the newest readable epoch file; `unreadable` is left out."""
    numbered = sorted((int(m.group(1)), p) for p in out_dir.glob("epoch_*.pth") if (m := EPOCH_FILE.fullmatch(p.name)))
    candidates = [out_dir / "last.pth", set_aside(out_dir / "last.dcp") or out_dir / "last.dcp", out_dir / "best.pth",
                  *(path for _, path in reversed(numbered))]
    found = []
    for path in candidates:
        if path == unreadable or not path.exists():
            continue
        try:
            step = read_checkpoint(path).get("global_step")
        except (UserError, AttributeError):  # AttributeError: a file that holds no dict
            continue
        if isinstance(step, int):
            found.append((path, step))
            if EPOCH_FILE.fullmatch(path.name):
                break  # the newest readable epoch file is enough
    return sorted(found, key=lambda option: -option[1])


def load_resume_checkpoint(path: Path) -> dict[str, Any]:
    """read_checkpoint; for a file or folder that cannot be read, also name the way out."""
    try:
        return read_checkpoint(path)
    except UnreadableCheckpoint as err:
        raise UserError(f"{err}; {way_out(path.parent, path)}") from None


def check_resumable(ckpt: dict[str, Any], path: Path, cfg: Config, class_names: list[str],
                    world_size: int) -> None:
    """Refuse a checkpoint this run cannot continue, naming the mismatch."""
    optimizer = "optimizer_rest" if ckpt.get("format") == "sharded" else "optimizer"  # a folder keeps its tensors
    absent = [key for key in TRAINING_KEYS if key.replace("optimizer", optimizer) not in ckpt]
    if absent:
        raise UserError(f"checkpoint {path} is not a training checkpoint of this app (no {', '.join(absent)}); "
                        "to start from its weights use model.init_from and resume=none")
    old_model = ckpt["config"].get("model", {}).get("name")
    if old_model != cfg.model.name:
        raise UserError(f"checkpoint {path} is a {old_model} but model.name is {cfg.model.name}; "
                        f"resume with model.name={old_model}, or use another output_dir")
    old_optim = ckpt["config"].get("optim", {})
    for key in OPTIMIZER_KEYS:
        then, now = old_optim.get(key, getattr(cfg.optim, key)), getattr(cfg.optim, key)
        if yaml_value(then).lower() != yaml_value(now).lower():
            raise UserError(f"checkpoint {path} was trained with optim.{key}={yaml_value(then)}, this run has "
                            f"optim.{key}={yaml_value(now)}, so its optimizer state does not fit; resume with "
                            f"optim.{key}={yaml_value(then)}, or start from its weights with model.init_from={path} "
                            "in another output_dir")
    old_classes = list(ckpt["class_names"])
    if len(old_classes) != len(class_names):
        raise UserError(f"checkpoint {path} has {len(old_classes)} classes but the data has {len(class_names)}; "
                        "resume on the same data, or use another output_dir")
    if old_classes != class_names:
        first = next(i for i, (a, b) in enumerate(zip(old_classes, class_names)) if a != b)
        raise UserError(f"checkpoint {path} has other class names than the data (class {first}: "
                        f"{old_classes[first]!r} vs {class_names[first]!r}); resume on the same data")
    if ckpt.get("epoch_step", 0) > 0:
        check_global_batch(ckpt, path, cfg, world_size)


def saved_global_batch(ckpt: dict[str, Any]) -> int:
    """The global batch the checkpoint's run trained with."""
    old = ckpt["config"]["train"]
    return global_batch(ckpt["world_size"], old["batch_size"], old["accum_steps"])


def check_global_batch(ckpt: dict[str, Any], path: Path, cfg: Config, world_size: int) -> None:
    """A mid-epoch checkpoint continues on any number of processes whose global batch is the checkpoint's.

    The epoch's sample order is the same for every world size and step j covers global positions
    [j G, (j + 1) G) (data/loader.EpochSampler), so with the same G the run trains on exactly the samples
    the interrupted one had not reached; with another G the steps would split the epoch elsewhere. Shards read by
    rank (data.shard_order) are dealt by the number of processes, so that must be the checkpoint's too.
    """
    processes = ckpt["world_size"]
    if processes != world_size and reads_by_rank(cfg.data):
        kept = f"{processes} process(es)"
        raise UserError(f"checkpoint {path} stopped mid-epoch on {kept} reading WebDataset shards by rank "
                        f"(data.shard_order={cfg.data.shard_order}: which shards each process reads depends on their "
                        f"number), this run has {world_size}; resume it on {kept}, or {epoch_boundary(ckpt, path, kept)}")
    then, now = saved_global_batch(ckpt), global_batch(world_size, cfg.train.batch_size, cfg.train.accum_steps)
    if then == now:
        check_draw_group(ckpt, path, cfg)
        return
    per_process = then // world_size
    fits = (f"with {world_size} process(es) set train.batch_size x train.accum_steps = {per_process} (e.g. "
            f"train.batch_size={per_process} train.accum_steps=1)" if then % world_size == 0 else
            f"no batch size fits on {world_size} process(es): use a number of processes that divides {then}")
    old = ckpt["config"]["train"]
    boundary = epoch_boundary(ckpt, path, "that global batch")
    raise UserError(f"checkpoint {path} stopped mid-epoch with a global batch of {then} images ({ckpt['world_size']} "
                    f"process(es) x train.batch_size={old['batch_size']} x train.accum_steps={old['accum_steps']}), "
                    f"this run's is {now}: {fits}, so no sample is skipped or repeated; or {boundary}")


def check_draw_group(ckpt: dict[str, Any], path: Path, cfg: Config) -> None:
    """data.mix_group=0 draws once per train.batch_size images, which also lays out the epoch's order
    (data/loader.EpochSampler): a mid-epoch continuation needs the checkpoint's train.batch_size."""
    old = ckpt["config"]["train"]["batch_size"]
    if (mixing(cfg.data) and cfg.data.mix_mode == "batch" and not cfg.data.mix_group
            and old != cfg.train.batch_size):
        raise UserError(f"checkpoint {path} stopped mid-epoch with train.batch_size={old} and data.mix_group=0 (one "
                        f"mixing draw per {old} images, which also orders the epoch); resume it with "
                        f"train.batch_size={old}, or {epoch_boundary(ckpt, path, f'train.batch_size={old}')}")


def epoch_boundary(ckpt: dict[str, Any], path: Path, kept: str) -> str:
    """The way out of a mid-epoch refusal that exists: the folder's newest epoch_NNNN.pth, else the end of the epoch
    reached with the checkpoint's `kept` setting (a checkpoint from an epoch's end resumes with any batch)."""
    numbered = sorted((int(m.group(1)), p) for p in path.parent.glob("epoch_*.pth")
                      if (m := EPOCH_FILE.fullmatch(p.name)))
    if numbered and ckpt.get("format") != "sharded":
        return f"resume={numbered[-1][1]} (an end-of-epoch checkpoint, where the batch may change)"
    why = ("train.ckpt_format=sharded writes no epoch_NNNN.pth" if ckpt.get("format") == "sharded" else
           f"{path.parent} holds no epoch_NNNN.pth: train.keep_last_k keeps them")
    return (f"let the run reach the end of epoch {ckpt['epoch']} with {kept} first ({why}; a "
            f"{'last.dcp' if ckpt.get('format') == 'sharded' else 'last.pth'} from an epoch's end resumes with any "
            "global batch)")


def yaml_value(value: Any) -> str:
    """A config value as a user types it (true, not True; "" for an emptied key, which would print as nothing)."""
    return str(value).lower() if isinstance(value, bool) else '""' if value == "" else str(value)


def check_optimizer_state(saved: dict[str, Any], optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Refuse optimizer state laid out for other parameter groups (torch would fail half-way through loading)."""
    then = [len(group["params"]) for group in saved["param_groups"]]
    now = [len(group["params"]) for group in optimizer.param_groups]
    if then != now:
        raise UserError(f"checkpoint {path} holds optimizer state for {len(then)} parameter group(s) of {then} "
                        f"tensors, this run's optimizer has {len(now)} of {now}; resume with the optim settings "
                        f"it was trained with, or start from its weights with model.init_from={path} in another "
                        "output_dir")


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted keys whose value differs, as "key old -> new" (logged when a run resumes)."""
    return [f"{key} {a!r} -> {b!r}" for key, a, b in config_diff(old, new)]


def config_diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) of every key whose value differs, but resume (how the run was started)."""
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += config_diff(a, b, f"{prefix}{key}.")
        elif a != b and f"{prefix}{key}" != "resume":
            changes.append((f"{prefix}{key}", a, b))
    return changes


def continuation_changes(saved: dict[str, Any], cfg: Config) -> list[str]:
    """The changes from the checkpoint's config that make another run: keys outside CONTINUATION_KEYS, and optim.lr
    unless optim.lr_base derives it from the global batch. A key the checkpoint's app did not have yet counts
    at the schema's default."""
    new = to_dict(cfg)
    derived = ("optim.lr",) if cfg.optim.lr_base else ()
    return [f"{key} {yaml_value(a)} -> {yaml_value(b)}" for key, a, b in config_diff(with_defaults(saved), new)
            if not any(key == k or key.startswith(f"{k}.") for k in (*CONTINUATION_KEYS, *derived))]


def with_defaults(saved: dict[str, Any], defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """A saved config with the schema's default for each key it lacks (written before the key existed)."""
    defaults = to_dict(Config()) if defaults is None else defaults
    return {key: with_defaults(section(saved, key), value) if isinstance(value, dict) and not key.endswith("kwargs")
            else saved.get(key, value) for key, value in defaults.items()}


def section(saved: dict[str, Any], key: str) -> dict[str, Any]:
    """saved[key] if it is a section (a mapping), else an empty one."""
    value = saved.get(key)
    return value if isinstance(value, dict) else {}


class Resume:
    """What a run starts from: the checkpoint it continues (found, checked and put back here), or nothing.

    fit() calls, in order: `open`, `pretrained` (model.init_from's weights, which the model is created with),
    `load_model` (after the data gave the class names), `load_ema`, `load_training`. A fresh run passes through
    the last three as no-ops.
    """

    def __init__(self, path: Path | None, ckpt: dict[str, Any] | None, auto: bool = False) -> None:
        self.path, self.ckpt, self.auto = path, ckpt, auto

    @classmethod
    def open(cls, path: str | None, auto: bool = False) -> Resume:
        """The checkpoint decide_resume chose (None: a fresh run), read on every rank; `auto`: resume=auto chose it."""
        return cls(Path(path), load_resume_checkpoint(Path(path)), auto) if path else cls(None, None, auto)

    def check_continuation(self, cfg: Config) -> None:
        """resume=auto continues the folder's run only as it was made: refuse a config that changes any key
        but CONTINUATION_KEYS, naming the changes and the ways out (every rank decides alike)."""
        saved = self.ckpt.get("config") if self.ckpt is not None and self.auto else None
        changes = continuation_changes(saved, cfg) if isinstance(saved, dict) else []
        if changes:
            raise UserError(f"output_dir {cfg.output_dir} holds a run made with another config ({', '.join(changes)}), "
                            f"which resume=auto does not continue; use another output_dir for a new run, or "
                            f"resume={self.path} to continue that run with these changes (with another output_dir: "
                            "a branch of it in a new folder)", all_ranks=True)

    @property
    def wandb_id(self) -> str | None:
        """The W&B run the checkpoint belongs to (None: fresh run, or tracking was off)."""
        value = self.ckpt.get("wandb_id") if self.ckpt else None
        return value if isinstance(value, str) and value else None

    @property
    def run_id(self) -> str | None:
        """The id of the run the checkpoint belongs to (None: a fresh run, or a checkpoint from before run ids)."""
        value = self.ckpt.get("run_id") if self.ckpt else None
        return value if isinstance(value, str) and value else None

    def step_range(self, epochs: int, updates_per_epoch: int, max_steps: int) -> tuple[int, int]:
        """(the global step the run starts from, the last it reaches unless it stops early): train.epochs and
        train.max_steps counted from the checkpoint's position."""
        ckpt = self.ckpt or {}
        first = ckpt.get("global_step", 0)
        last = first + max((epochs - ckpt.get("epoch", 0)) * updates_per_epoch - ckpt.get("epoch_step", 0), 0)
        return first, min(last, max_steps) if max_steps else last

    def pretrained(self, cfg: ModelConfig) -> Pretrained | None:
        """model.init_from's weights for a fresh run (None when resuming, or without init_from)."""
        if self.ckpt is not None or not cfg.init_from:
            return None
        pretrained = read_pretrained(cfg.init_from)
        check_architecture(pretrained, cfg.name)
        return pretrained

    def started_from(self, pretrained: Pretrained | None, hub: dict[str, Any] | None) -> dict[str, Any] | None:
        """The run's starting weights as its checkpoints record them (the model card says them): a resumed run keeps its
        checkpoint's record (None: written before runs kept one), a fresh one names model.init_from's file and sha256,
        timm's weights (`hub`: models.factory.hub_origin), or a random initialisation."""
        if self.ckpt is not None:
            return self.ckpt.get("started_from")
        if pretrained is not None:
            return {"kind": "file", "path": pretrained.path, "sha256": pretrained.sha256}
        return hub or {"kind": "random"}

    def load_model(self, model: nn.Module, cfg: Config, class_names: list[str], world_size: int) -> None:
        """The checkpoint's weights, exactly, once it is known to fit this run (a fresh run: nothing to do)."""
        if self.ckpt is None:
            return
        check_resumable(self.ckpt, self.path, cfg, class_names, world_size)
        load_weights(model, self.ckpt["model"], f"checkpoint {self.path}")
        if cfg.model.init_from:
            log.info("resuming from %s: model.init_from is not used", url_of(self.path))

    def load_ema(self, ema: nn.Module | None) -> None:
        """The checkpoint's EMA weights; a run that turns the EMA on at resume starts it from the model."""
        if ema is None or self.ckpt is None:
            return
        if "ema" in self.ckpt:
            load_weights(ema, self.ckpt["ema"], f"checkpoint {self.path} (EMA weights)")
        else:
            log.info("checkpoint %s has no EMA weights: the EMA starts from the resumed model", url_of(self.path))

    def load_training(self, state: LoopState, cfg: Config, info: DistInfo, updates_per_epoch: int, *,
                      model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Scheduler,
                      scaler: torch.amp.GradScaler | None, chosen_on: str) -> None:
        """The loop state (into fit's `state`), optimizer, scheduler position, GradScaler and this rank's RNG states
        (a fresh run: nothing to do). `model` is the module as trained (DDP / compiled / sharded); `chosen_on`: the
        metrics.jsonl column this run chooses best.pth on (engine/state.best_metric)."""
        if self.ckpt is None:
            return
        ckpt, path = self.ckpt, self.path
        shown = url_of(path)  # in the lines below: as the user named output_dir
        if ckpt.get("format") != "sharded":  # a .pth file
            check_optimizer_state(ckpt["optimizer"], optimizer, path)
            load_optimizer_state(model, optimizer, ckpt["optimizer"])  # sharded (fsdp) or whole
        else:  # a .dcp folder
            if ckpt["optimizer_rest"]["param_groups"] is not None:  # None: saved before the first optimizer step
                check_optimizer_state(ckpt["optimizer_rest"], optimizer, path)
            sharded.load(path, model, optimizer, ckpt["optimizer_rest"])  # resharded to this run's processes
        if scaler is not None and ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        state.load_state_dict(ckpt)
        then, now = ckpt.get("best_metric", "val_top1"), chosen_on
        if then != now:  # best_value measured another metric: comparing the two would pick best.pth wrongly
            state.forget_best()
            if info.is_main:
                log.info("checkpoint %s chose best.pth on %s; best.pth is now chosen on %s, from the next evaluation "
                         "on", shown, then, now)
        # The schedule is a function of the config and the step (timm's schedulers and onecycle keep no other
        # state): rebuilt from the config, a resumed run may extend train.epochs, or change the global batch
        # at an epoch boundary (the schedule continues at the same epoch). sched.name=plateau follows the
        # validations of train.best_metric: its state (best value, counters) is the checkpoint's, its lr the
        # optimizer's; on another metric it counts from the next validation on.
        scheduler.step_update(num_updates=state.schedule_position(updates_per_epoch))
        if hasattr(scheduler, "step_metric") and then == now:
            scheduler.load_state_dict(ckpt["scheduler"])
        then = saved_global_batch(ckpt)
        now = global_batch(info.world_size, cfg.train.batch_size, cfg.train.accum_steps)
        if then != now and info.is_main:
            log.info("checkpoint %s trained with a global batch of %d images, this run's is %d: the lr schedule "
                     "continues at epoch %d with %d updates per epoch; optim.lr is %g (optim.lr_base scales it "
                     "with the global batch)", shown, then, now, state.epoch, updates_per_epoch, cfg.optim.lr)
        rng = ckpt["rng"]
        if info.rank < len(rng):
            set_rng_state(rng[info.rank])
        if len(rng) != info.world_size:
            log.warning("checkpoint %s was written by %d process(es), this run has %d: training continues, "
                        "but dropout and drop-path draws differ from an uninterrupted run", shown, len(rng),
                        info.world_size)
        changes = config_changes(ckpt["config"], to_dict(cfg))
        where = f"epoch {state.epoch}, step {state.epoch_step} of it" if state.epoch_step else f"start of epoch {state.epoch}"
        owed = "; first the validation a stop cut short there" if state.unvalidated is not None else ""
        log.info("resuming from %s (%s, global step %d)%s%s", shown, where, state.global_step, owed,
                 f"; config changes: {', '.join(changes)}" if changes else "")


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """A saved (whole, numbered) optimizer state into `optimizer`; for a sharded model each rank keeps its shards.

    Whole: each state tensor is laid out like its parameter. torch's fused Adam/AdamW/SGD step the state in the
    parameter's memory layout, and load_state_dict keeps the file's: state from contiguous weights (an fsdp run,
    or model.channels_last=false) resumed into channels-last weights would be stepped scrambled.
    """
    if not is_fsdp(model):
        optimizer.load_state_dict(saved)
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == param.shape and value.stride() != param.stride():
                    state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)
        return
    names = {id(param): name for name, param in model.named_parameters()}
    numbered = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
    by_name = {"state": {numbered[i]: value for i, value in saved["state"].items()},
               "param_groups": [{**group, "params": [numbered[i] for i in group["params"]]}
                                for group in saved["param_groups"]]}
    if saved["state"]:  # else saved before the first step: nothing to put back but the settings
        set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):  # DCP's copy made tuples lists
        group.update({key: value for key, value in saved_group.items() if key != "params"})


def last_checkpoint(out_dir: Path) -> Path | None:
    """out_dir's last.pth or last.dcp/ (sharded), the newer by modification time when both exist (a run that
    switched train.ckpt_format leaves the other behind); None when neither is there. A sharded save killed between
    its two renames left the previous last.dcp aside under a temp name: that folder is the one to continue."""
    folder = out_dir / "last.dcp"
    folder = set_aside(folder) or folder
    kept = [(mark.stat().st_mtime, path) for path, mark in ((out_dir / "last.pth", out_dir / "last.pth"),
                                                           (folder, folder / PLAIN)) if mark.is_file()]
    if folder.is_dir() and not (folder / PLAIN).is_file():
        kept.append((0.0, folder))  # not a whole folder: named, so that reading it says what is wrong
    return max(kept)[1] if kept else None


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back what rng_state() captured."""
    torch.set_rng_state(state["torch"])
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_name, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    py_version, py_internal, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_internal), py_gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
