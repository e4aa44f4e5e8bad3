"""Sharded training checkpoints: a folder (`last.dcp/`) every rank writes its own shards into, in parallel.

torch.distributed.checkpoint (DCP) writes the model's and the optimizer's tensors, taken with
`get_model_state_dict`/`get_optimizer_state_dict` (plain, DDP and FSDP2-sharded modules alike): each rank
writes the shards it holds, and loading reshards, so a folder written by 2 processes loads on 1 or 3. Everything else a training checkpoint
holds (epoch, step, sums, per-rank RNG, config, class names, W&B id, scheduler, GradScaler, EMA weights, the
optimizer's param_groups) is plain data in `train_state.pth`, written by rank 0 and read weights_only.

Atomic as a whole: the folder is written under a temp name beside it (`.last.dcp.<pid>.<hex>.tmp`), every
file fsynced, then rank 0 swaps it in (old aside, new in, old removed: core/files.replace_with). A run
killed before the swap leaves the previous folder as it was; one killed between the two renames leaves it
aside as `.last.dcp.<pid>.<hex>.old`, which resume=auto reads (nothing is renamed when a run only reads)
and the next save moves back before replacing it. Temp folders are ours by that name only.

Reads are data-only, through engine/checkpoint/formats.py (its docstring says how).
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from core.dist import broadcast_object, is_main, rank0_decides
from core.errors import UserError
from core.files import check_replaceable, remove, remove_dead_temps, replace_with, temp_name, write_new
from core.signals import sigterm_deferred
from engine.checkpoint.formats import (PLAIN, SafeReader, first_line, is_ours, quiet_single_process,
                                       read_metadata, set_aside)

OURS = "a sharded checkpoint train.py wrote"  # what a save may replace, in messages
SHARD_RANK = re.compile(r"__(\d+)_")  # the rank in DCP's shard file name __<rank>_<n>.distcp


def split_optimizer(optim_sd: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, the rest) of a get_state_dict optimizer state: DCP gets only tensors, the rest is plain data."""
    tensors = {fqn: {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
               for fqn, state in optim_sd["state"].items()}
    rest = {fqn: {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
            for fqn, state in optim_sd["state"].items()}
    return tensors, {"param_groups": optim_sd["param_groups"], "state": rest}


def trained_module(model: nn.Module) -> nn.Module:
    """The module get_state_dict needs: below torch.compile's wrapper (DDP and FSDP2 it handles itself)."""
    return getattr(model, "_orig_mod", model)


def save(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, plain: dict[str, Any]) -> None:
    """Write `folder` as a whole (a collective: every rank writes its shards, rank 0 the plain data and the swap).

    `plain`: everything but the model and optimizer tensors (rank 0's is written). OSError and DCP failures become
    one UserError on every rank naming the folder; the previous folder stays as it was.
    """
    module = trained_module(model)
    model_sd = get_model_state_dict(module)
    if optimizer.state:
        optim_tensors, optim_rest = split_optimizer(get_optimizer_state_dict(module, optimizer))
    else:  # never stepped: get_optimizer_state_dict would make its state with a zero step (Adam's count too)
        optim_tensors, optim_rest = {}, {"param_groups": None, "state": {}}
    tmp = Path(broadcast_object(str(temp_name(folder)) if is_main() else None))
    rank0_decides(lambda: prepare(folder, tmp))
    try:
        try:
            with sigterm_deferred(), quiet_single_process():
                dcp.save({"model": model_sd, "optimizer": optim_tensors},
                         storage_writer=FileSystemWriter(tmp, sync_files=True, overwrite=False))
        except CheckpointException as err:
            rank0_decides(lambda: remove(tmp))
            raise UserError(f"cannot write checkpoint {folder} ({write_failure(err)}); free disk space (or raise the "
                            "quota) or choose another output_dir", all_ranks=True) from None
        rank0_decides(lambda: finish(folder, tmp, {**plain, "format": "sharded", "optimizer_rest": optim_rest}))
    finally:  # rank 0 has swapped or removed its temp folder; one left in another rank's view is node-local
        if not is_main() and tmp.is_dir():
            remove(tmp)


def write_failure(err: BaseException) -> str:
    """The first rank's reason in a DCP CheckpointException (it carries one per failed rank)."""
    failures = getattr(err, "failures", {}) or {}
    for rank, failure in sorted(failures.items()):
        cause = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {getattr(cause, 'strerror', None) or first_line(cause)}"
    return first_line(err)


def prepare(folder: Path, tmp: Path) -> None:
    """Rank 0, before a save: our temp folders left by a killed save removed, the new temp folder made."""
    try:
        recover(folder)
        check_replaceable(folder, is_ours, OURS, "output_dir")  # before any rank writes (checked again at the swap)
        remove_dead_temps(folder.parent, lambda name: name == folder.name)
        tmp.mkdir()
    except OSError as err:
        raise UserError(f"cannot write checkpoint {folder} ({err.strerror or err}); make output_dir writable or "
                        "choose another output_dir") from None


def finish(folder: Path, tmp: Path, plain: dict[str, Any]) -> None:
    """Rank 0, after every rank wrote its shards: the plain data, fsync, then the swap into place."""
    try:
        check_shards(folder, tmp)
        buffer = io.BytesIO()
        torch.save(plain, buffer)  # in memory: a failed write is then a plain OSError (torch.save's is a RuntimeError)
        write_new(tmp / PLAIN, buffer.getvalue())
        fsync_folder(tmp)
        replace_with(tmp, folder, is_ours, OURS, "output_dir")
        fsync_folder(folder.parent)
    except OSError as err:
        remove(tmp)
        raise UserError(f"cannot write checkpoint {folder} ({err.strerror or err}); free disk space (or raise the "
                        "quota) or choose another output_dir") from None
    except BaseException:
        remove(tmp)
        raise


def check_shards(folder: Path, tmp: Path) -> None:
    """Every shard file the new index names is in rank 0's view of the temp folder before the swap: shards another
    process wrote where rank 0 cannot see them (a node-local output_dir) would make a folder no resume can read."""
    metadata = read_metadata(tmp)
    named = {info.relative_path for info in (metadata.storage_data or {}).values()}
    missing = sorted(name for name in named if not (tmp / name).is_file())
    if missing:
        ranks = sorted({int(SHARD_RANK.match(name)[1]) for name in missing})
        raise UserError(f"cannot write checkpoint {folder}: the shards of rank(s) {', '.join(map(str, ranks))} "
                        f"({', '.join(missing[:3])}) are not in rank 0's view of it, so output_dir is not one folder "
                        "for every process; put it on storage every node shares (docs/clusters.md). The "
                        "previous checkpoint is kept")


def fsync_folder(folder: Path) -> None:
    """A folder's entries on disk (the files in it were fsynced by their writers)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recover(folder: Path) -> None:
    """Before a save: a folder set aside by a killed save goes back to its name (the save then replaces it)."""
    aside = set_aside(folder)
    if aside is not None:
        os.rename(aside, folder)


def load(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, optim_rest: dict[str, Any]) -> None:
    """The folder's model and optimizer state into this run's (wrapped) model and optimizer; a collective.

    Resharded by DCP to this run's layout: any number of processes, DDP or FSDP2.
    """
    module = trained_module(model)
    stepped = optim_rest["param_groups"] is not None  # else saved before the optimizer's first step: nothing to load
    state = {"model": get_model_state_dict(module)}
    if stepped:
        state["optimizer"] = split_optimizer(get_optimizer_state_dict(module, optimizer))[0]
    try:
        with quiet_single_process():
            dcp.load(state, storage_reader=SafeReader(folder))
    except CheckpointException as err:
        raise UserError(f"checkpoint {folder} cannot be read ({write_failure(err)}); it is damaged, or its "
                        "optimizer does not fit this run's", all_ranks=True) from None
    set_model_state_dict(module, state["model"], options=StateDictOptions(strict=True))
    if stepped:
        merged = {fqn: {**optim_rest["state"].get(fqn, {}), **tensors} for fqn, tensors in state["optimizer"].items()}
        set_optimizer_state_dict(module, optimizer, {"state": merged, "param_groups": optim_rest["param_groups"]})
