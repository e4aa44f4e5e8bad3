"""Writing training checkpoints: what a checkpoint holds and when it is written (Checkpointer, the one writer).

A training checkpoint (`Checkpointer.save`) holds everything a resumed run needs to continue bit for bit:
model, EMA weights (if any), optimizer, scheduler, GradScaler, the loop state (any object with `state_dict()`:
epoch, global step, steps and train sums of an unfinished epoch, the best value of train.best_metric and its
epoch), that metric's value at the save (`metric_value`), the resolved config, the class names, the W&B run id,
the run's own id (made fresh, kept by resumes), every rank's RNG states and what the model card reports (images
per split, the starting weights) (`Checkpointer.plain_contents` lists the keys; engine/checkpoint/resume.py,
beside it, reads them back). The data order needs no state: the sampler is seeded by (seed, epoch) and each
augmentation by (seed, epoch, index).

Files (`last.pth`, `best.pth`, `epoch_NNNN.pth`) are written through core/files.save_atomic (a temp file moved
into place: a crash mid-write leaves the previous file intact); with train.async_save rank 0 writes a copy of
the state from a background thread while training goes on. train.ckpt_format=sharded writes `last.dcp/` from
every rank instead (engine/checkpoint/sharded.py). engine/checkpoint/formats.py reads either kind back.

Under dist.strategy=fsdp every rank joins the gathering of the sharded model, EMA and optimizer state onto
rank 0 (torch.distributed.checkpoint's full state dicts), and the files are the same single .pth as a DDP
run's: evaluate.py, predict.py, export.py and model.init_from read them as they are, and they resume with
either strategy (the optimizer state is put back shard by shard: resume.load_optimizer_state).
"""

from __future__ import annotations

import logging
import os
import random
import re
import threading
import weakref
from copy import deepcopy
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from core.dist import DistInfo, all_gather_object, is_fsdp, max_over_ranks, rank0_decides
from core.errors import UserError
from core.files import link_atomic, remove_dead_temps, save_atomic
from core.signals import sigterm_deferred
from engine.checkpoint import sharded
from engine.checkpoint.run_dir import FolderLock

log = logging.getLogger(__name__)
FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0's CPU only
EPOCH_FILE = re.compile(r"epoch_(\d+)\.pth")


class Stateful(Protocol):
    """The loop state a checkpoint stores (engine/state.TrainState): its fields as plain data."""

    def state_dict(self) -> dict[str, Any]: ...


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP and torch.compile wrappers (what a checkpoint should hold)."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def cpu_state_dict(model: nn.Module, copy: bool = False) -> dict[str, torch.Tensor]:
    """The unwrapped model's tensors, on the CPU (`copy`: memory of their own even when the model is on the CPU)."""
    return {k: v.detach().to("cpu", copy=copy) for k, v in unwrap(model).state_dict().items()}


def on_cpu(obj: Any, copy: bool = False) -> Any:
    """A copy of a state dict (nested dicts and lists) with every tensor on the CPU (`copy`: in memory of its own).

    Optimizer state lives beside the parameters (on the GPU); saved as is, the file could not be loaded
    on a machine without that device.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=copy)
    if isinstance(obj, dict):
        return {key: on_cpu(value, copy) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(on_cpu(value, copy) for value in obj)
    return obj


def optimizer_state_by_index(by_name: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """torch.distributed.checkpoint's whole optimizer state (keyed by parameter name) in Optimizer.state_dict()'s
    layout (parameters numbered in param_groups order): what DDP runs save, so either kind of run resumes it.
    The groups' settings are the optimizer's own (the same on every rank; DCP's copy turns betas into lists)."""
    index = {name: i for i, name in enumerate(n for group in by_name["param_groups"] for n in group["params"])}
    return {"state": {index[name]: value for name, value in by_name["state"].items()},
            "param_groups": optimizer.state_dict()["param_groups"]}


def gather_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, ema: nn.Module | None,
                   whole: bool = True) -> dict[str, Any]:
    """dist.strategy=fsdp: the whole model, EMA and optimizer state on rank 0's CPU, in the layout DDP runs save
    (a collective: every rank calls it; the others get empty dicts); `whole=False`: the EMA only. {} for a model
    that is not sharded."""
    if not is_fsdp(model):
        return {}
    gathered = {}
    if whole:
        gathered["model"] = get_model_state_dict(model, options=FULL_ON_RANK0)
        # Never stepped: DCP would make the state with a zero step (engine/checkpoint/sharded.py); there is none to gather.
        by_name = get_optimizer_state_dict(model, optimizer, options=FULL_ON_RANK0) if optimizer.state else {}
        gathered["optimizer"] = optimizer_state_by_index(by_name, optimizer) if by_name else optimizer.state_dict()
    if ema is not None:
        gathered["ema"] = get_model_state_dict(ema, options=FULL_ON_RANK0)
    return gathered


def nonfinite_tensors(state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Names of floating-point tensors with an inf or NaN (a NaN forward pass poisons BatchNorm statistics); of a
    sharded model's DTensors, this rank's shards. One read from the device, whatever the number of tensors."""
    local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state_dict.items()}
    floats = [(k, v) for k, v in local.items() if v.is_floating_point()]
    if not floats:
        return []
    finite = torch.stack([torch.isfinite(v).all() for _, v in floats]).tolist()
    return [k for (k, _), ok in zip(floats, finite) if not ok]


def rng_state() -> dict[str, Any]:
    """This process's RNG states as plain data (dropout and drop-path draw from torch's)."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss],
        "python": [py_version, list(py_internal), py_gauss],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def is_checkpoint_name(name: str) -> bool:
    """One of the files a Checkpointer writes."""
    return name in ("last.pth", "best.pth") or bool(EPOCH_FILE.fullmatch(name))


class Checkpointer:
    """The run's checkpoint files: last.pth, best.pth and the newest `keep_last_k` epoch_NNNN.pth.

    Every rank calls `save` (it gathers all ranks' RNG states); rank 0 writes, then every rank
    learns whether the write worked, so a full disk stops all ranks with one clear message.

    With `async_save` (train.async_save) rank 0 copies the state (host memory for one checkpoint) and a
    background thread writes the files while training goes on: the epoch no longer waits for the disk. One write
    is in flight at a time; every rank learns how it went at the next save or at `wait()` (the run's end, a
    preemption), and `close()` lets no run return before its last write is on disk.
    """

    def __init__(self, out_dir: Path, info: DistInfo, keep_last_k: int, *, model: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler, scaler: torch.amp.GradScaler | None,
                 config: dict[str, Any], class_names: list[str], ema: nn.Module | None = None,
                 wandb_id: str | None = None, best_metric: str = "val_top1", sharded: bool = False,
                 async_save: bool = False, lock: FolderLock | None = None, run_id: str | None = None,
                 data_sizes: dict[str, int] | None = None, started_from: dict[str, Any] | None = None) -> None:
        self.out_dir, self.info, self.keep_last_k = Path(out_dir), info, keep_last_k
        self.lock = lock  # rank 0's lock on out_dir (train.py): each save first checks it still holds the path
        self.sharded = sharded  # train.ckpt_format=sharded: last.dcp/ written by every rank instead of last.pth
        self.async_save = async_save and not sharded  # every rank writes a sharded folder, in step: not here
        self.writer: threading.Thread | None = None  # rank 0's write in flight (async_save)
        self.write_done = threading.Event()  # set as the writer's body ends; waited on instead of join(): a join
        # cut by a signal handler's exception (SIGTERM) marks a live thread finished in Python 3.11
        self.write_error: BaseException | None = None  # how it failed (a UserError for a failed write)
        self.last = self.out_dir / ("last.dcp" if sharded else "last.pth")
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.ema = ema
        self.best_metric = best_metric  # what metric_value and best_value measure: val_top1, ema_val_top1, val_loss...
        self.config, self.class_names = config, class_names
        self.wandb_id = wandb_id  # the W&B run a later resume continues (kept even when tracking is now off)
        self.run_id = run_id  # made by a fresh run, kept by its resumes: which files are of one run (averaging)
        self.saved_step: int | None = None  # global step of the last checkpoint this run wrote
        self.data_sizes = data_sizes  # images per split, {"train": n, "val": m}: the model card says them
        self.started_from = started_from  # the starting weights (Resume.started_from): the model card says them

    def contents(self, fields: dict[str, Any], rng: list[dict[str, Any]], metric_value: float | None,
                 gathered: dict[str, Any] | None = None, copy: bool = False) -> dict[str, Any]:
        """The checkpoint dict (`fields`: the loop state's state_dict(); `gathered`: a sharded model's gather_sharded):
        plain tensors, numbers, strings, lists, dicts; `copy`: sharing no memory with the live run."""
        gathered = gathered or {}
        return {"model": gathered["model"] if "model" in gathered else cpu_state_dict(self.model, copy),
                "optimizer": (gathered["optimizer"] if "optimizer" in gathered
                              else on_cpu(self.optimizer.state_dict(), copy)),
                **self.plain_contents(fields, rng, metric_value, gathered, copy)}

    def plain_contents(self, fields: dict[str, Any], rng: list[dict[str, Any]], metric_value: float | None,
                       gathered: dict[str, Any] | None = None, copy: bool = False) -> dict[str, Any]:
        """Everything but the model and optimizer state (a sharded folder's train_state.pth)."""
        gathered = gathered or {}
        ema = {}
        if self.ema is not None:
            ema = {"ema": gathered["ema"] if "ema" in gathered else cpu_state_dict(self.ema, copy)}
        own = deepcopy if copy else (lambda obj: obj)  # the scheduler's and the loop's lists and dicts change too
        return {
            **ema,  # the EMA weights, only when the run keeps an EMA
            "scheduler": own(self.scheduler.state_dict()),
            "scaler": on_cpu(self.scaler.state_dict(), copy) if self.scaler else {},
            **own(fields),  # epoch, global_step, best_value (of best_metric), best_epoch, epoch_step, epoch_sums, ...
            "metric_value": metric_value,  # best_metric's value at this checkpoint's evaluation (None: none yet)
            "best_metric": self.best_metric,  # ema_val_top1: best.pth was chosen on its EMA weights (evaluate --ema)
            "world_size": self.info.world_size,
            "rng": rng,  # one entry per rank
            "class_names": list(self.class_names),
            "config": self.config,
            "wandb_id": self.wandb_id,
            "run_id": self.run_id,
            "data_sizes": self.data_sizes,
            "started_from": self.started_from,
        }

    def save(self, state: Stateful, metric_value: float | None = None, best: bool = False,
             epoch_file: bool = False) -> None:
        """Write last.pth (and best.pth, and an epoch file for a finished epoch); a collective."""
        fields = state.state_dict()  # syncs the epoch's running sums: a collective too
        rng = all_gather_object(rng_state())
        # dist.strategy=fsdp: the sharded model, EMA and optimizer gathered whole onto rank 0 (a collective); for a
        # sharded folder (DCP writes the model and optimizer) the EMA only, unless best.pth is written too.
        gathered = gather_sharded(self.model, self.optimizer, self.ema, whole=not self.sharded or best)
        if self.sharded:
            self.save_sharded(fields, rng, metric_value, gathered)
            if not best:
                return
        rank0_decides(lambda: self.write(fields, rng, metric_value, best, epoch_file, gathered))

    def save_sharded(self, fields: dict[str, Any], rng: list[dict[str, Any]], metric_value: float | None,
                     gathered: dict[str, Any] | None = None) -> None:
        """last.dcp/: every rank writes its shards (engine/checkpoint/sharded.py); inf/NaN on any rank refuses it on all."""
        broken = nonfinite_tensors(sharded.trained_module(self.model).state_dict())
        if max_over_ranks(int(bool(broken)), self.info.device):
            raise self.diverged(broken, fields)
        plain = self.plain_contents(fields, rng, metric_value, gathered) if self.info.is_main else {}  # rank 0's
        rank0_decides(self.check_folder)
        sharded.save(self.last, self.model, self.optimizer, plain)
        self.saved_step = fields["global_step"]

    def diverged(self, broken: list[str], fields: dict[str, Any]) -> UserError:
        """The error for a model holding inf/NaN: what is on disk, and what to change."""
        then = "then resume from it" if self.last.exists() else "then start again"
        return UserError(f"the model holds inf/NaN values ({', '.join(broken[:3]) or 'on another rank'}) at global "
                         f"step {fields['global_step']}; {self.kept_state()}. Lower optim.lr or set optim.clip_grad, "
                         f"{then}", all_ranks=True)

    def write(self, fields: dict[str, Any], rng: list[dict[str, Any]], metric_value: float | None, best: bool,
              epoch_file: bool, gathered: dict[str, Any] | None = None) -> None:
        """Rank 0's part of save(): finish the previous write, refuse inf/NaN weights, then write the files
        (in the background with async_save)."""
        self.finish_write()
        self.check_folder()
        remove_dead_temps(self.out_dir, is_checkpoint_name)  # a killed earlier run's (the folder is ours alone)
        ckpt = self.contents(fields, rng, metric_value, gathered, copy=self.async_save)
        broken = nonfinite_tensors(ckpt["model"])
        if broken:
            raise self.diverged(broken, fields)
        names = ([] if self.sharded else ["last.pth"]) + (["best.pth"] if best else [])
        finished_epoch = fields["epoch"] - 1  # the epoch just finished, as in metrics.jsonl
        prune_to = finished_epoch if epoch_file and self.keep_last_k > 0 else None
        if prune_to is not None and not self.sharded:
            names.append(f"epoch_{finished_epoch:04d}.pth")
        if not self.async_save:
            self.write_files(ckpt, names, fields["global_step"], prune_to)
            return
        self.write_done = threading.Event()
        self.writer = threading.Thread(target=self.write_in_background, name="checkpoint-writer",
                                       args=(ckpt, names, fields["global_step"], prune_to))
        finish_before_fork(self)
        self.writer.start()

    def write_in_background(self, *args) -> None:
        """The writer thread's body: write_files, keeping any error for finish_write to raise in the main thread."""
        try:
            self.write_files(*args)
        except BaseException as err:  # noqa: B036 - a thread's error is otherwise only printed
            self.write_error = err
        finally:
            self.write_done.set()

    def write_files(self, ckpt: dict[str, Any], names: list[str], step: int, prune_to: int | None) -> None:
        """Write `names` (the first whole, the others linked to it), then prune epoch files up to `prune_to`."""
        path = self.last
        try:
            for name in names:  # the first written whole, the others linked to it (a copy where links fail)
                path = self.out_dir / name
                with sigterm_deferred():
                    if name == names[0] or not link_atomic(self.out_dir / names[0], path):
                        save_atomic(ckpt, path)
                if name == "last.pth":
                    self.saved_step = step
        except OSError as err:
            self.check_folder()  # the folder was removed while the file was written: say that
            raise UserError(f"cannot write checkpoint {path} ({err.strerror or err}); free disk space (or raise "
                            f"the quota or file-size limit) or choose another output_dir; {self.kept_state()}") from None
        if prune_to is not None:
            self.prune_epoch_files(prune_to)

    def check_folder(self) -> None:
        """Rank 0, before writing: stop (UserError) if out_dir was removed or replaced since the run locked it."""
        if self.lock is not None:
            self.lock.check()

    def finish_write(self) -> None:
        """Rank 0: wait for the background write in flight; raises its UserError if it failed."""
        if self.writer is not None:
            self.write_done.wait()
            self.writer = None
        error, self.write_error = self.write_error, None
        if error is not None:
            raise error

    def wait(self) -> None:
        """Every checkpoint so far on disk; a collective: a failed background write stops every rank."""
        if self.async_save:
            rank0_decides(self.finish_write)

    def written(self) -> bool:
        """Rank 0, alone: wait for the write in flight; whether it worked (a failure is reported by the next
        save or wait)."""
        if self.writer is not None:
            self.write_done.wait()
        return self.write_error is None

    def close(self) -> None:
        """Rank 0: let the write in flight end, however the run ends (a failed write is only logged here: the
        run is already ending with an error of its own, or `wait()` reported it)."""
        try:
            self.finish_write()
        except Exception as err:  # noqa: BLE001 - logged, not raised: another error may be on its way
            log.error("%s", err)

    def kept_state(self) -> str:
        """What a stopped run leaves to resume from, as found on disk."""
        last = self.last
        if self.saved_step is not None:
            return f"{last} keeps the last good state (global step {self.saved_step})"
        if last.exists():
            return f"{last} is as it was before this run"
        return "no checkpoint was written"

    def prune_epoch_files(self, current: int) -> None:
        """Keep the newest keep_last_k epoch files up to `current` (later ones are overwritten as the run goes)."""
        numbered = sorted((int(m.group(1)), path) for path in self.out_dir.glob("epoch_*.pth")
                          if (m := EPOCH_FILE.fullmatch(path.name)) and int(m.group(1)) <= current)
        for _, path in numbered[:-self.keep_last_k]:
            path.unlink(missing_ok=True)


_writing: weakref.WeakSet[Checkpointer] = weakref.WeakSet()  # checkpointers that have started a background write
_fork_hook = False


def finish_before_fork(checkpointer: Checkpointer) -> None:
    """A fork (a DataLoader starting its workers) first lets `checkpointer`'s background write end: a child forked
    while another thread holds a lock (the allocator's, a file's) can deadlock on it."""
    global _fork_hook
    _writing.add(checkpointer)
    if not _fork_hook:
        os.register_at_fork(before=lambda: [c.write_done.wait() for c in list(_writing) if c.writer is not None])
        _fork_hook = True
