"""Sharded training checkpoints: a folder (`last.dcp/`) every rank writes its own shards into, in parallel.

torch.distributed.checkpoint (DCP) writes the model's and the optimizer's tensors, taken with
`get_model_state_dict`/`get_optimizer_state_dict` (plain, DDP and FSDP2-sharded modules alike): each rank
writes the shards it holds, and loading reshards, so a folder written by 2 processes loads on 1 or 3. Everything else a training checkpoint
holds (epoch, step, sums, per-rank RNG, config, class names, W&B id, scheduler, GradScaler, EMA weights, the
optimizer's param_groups) is plain data in `train_state.pth`, written by rank 0 and read weights_only.

Atomic as a whole: the folder is written under a temp name beside it (`.last.dcp.<pid>.<hex>.tmp`), every
file fsynced, then rank 0 swaps it in (old aside, new in, old removed: engine/outputs.replace_with). A run
killed before the swap leaves the previous folder as it was; one killed between the two renames leaves it
aside as `.last.dcp.<pid>.<hex>.old`, which resume=auto reads (nothing is renamed when a run only reads)
and the next save moves back before replacing it. Temp folders are ours by that name only.

Reads are data-only. DCP's `.metadata` is a pickle and its FileSystemReader unpickles it with plain
`pickle.load`, and loads any non-tensor entry with `torch.load(weights_only=False)`: both could run code.
Here `.metadata` goes through `MetadataUnpickler` (DCP's own metadata classes, torch.Size, dtypes, a path;
anything else refused), a folder whose index lists a non-tensor entry is refused, and the shards themselves
are read by DCP with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from engine.dist import broadcast_object, is_main, rank0_decides
from engine.errors import UnreadableCheckpoint, UserError
from engine.outputs import check_replaceable, remove, replace_with, temp_name, write_new
from engine.signals import sigterm_deferred

SUFFIX = ".dcp"
PLAIN = "train_state.pth"  # rank 0's plain data (torch.save, weights_only-loadable)
METADATA = ".metadata"  # DCP's index of the shards (a pickle: read through MetadataUnpickler)
OURS = "a sharded checkpoint train.py wrote"  # what a save may replace, in messages
SHARD = re.compile(r"__\d+_\d+\.distcp")  # DCP's shard files: __<rank>_<n>.distcp
TEMP = re.compile(r"\.(?P<name>.+\.dcp)\.\d+\.[0-9a-f]+\.(?P<tag>tmp|old)")  # outputs.temp_name of a folder here
# What a DCP .metadata pickle may name: its dataclasses, torch.Size, a tensor layout, the checkpoint's path.
METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in
    ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
     "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("collections", "OrderedDict")}


def is_sharded(path: str | os.PathLike) -> bool:
    """A sharded checkpoint's path: a folder named *.dcp, or any folder holding DCP's index."""
    path = Path(path)
    return path.suffix == SUFFIX or (path.is_dir() and (path / METADATA).is_file())


def is_ours(path: Path) -> bool:
    """A folder this app wrote as a sharded checkpoint (the only kind a save may replace)."""
    return path.is_dir() and not path.is_symlink() and (path / PLAIN).is_file() and (path / METADATA).is_file() \
        and all(p.name in (PLAIN, METADATA) or SHARD.fullmatch(p.name) for p in path.iterdir())


class MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata, unpickled with only DCP's metadata classes (plain pickle.load could run any code)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP index")


def read_metadata(folder: Path) -> Metadata:
    """The folder's DCP index, as data; every entry must be a tensor (DCP unpickles other entries as code)."""
    file = folder / METADATA
    try:
        with file.open("rb") as f:
            metadata = MetadataUnpickler(f).load()
    except pickle.UnpicklingError as err:
        raise UserError(f"checkpoint {folder} was refused: its {METADATA} holds objects that are not plain data and "
                        f"could run code when loaded ({err}); only load files you trust") from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as err:
        raise UnreadableCheckpoint(f"checkpoint {folder} cannot be read ({METADATA}: {type(err).__name__}: "
                                   f"{str(err)[:80] or 'truncated?'}); it is damaged or not a checkpoint") from None
    if not isinstance(metadata, Metadata):
        raise UnreadableCheckpoint(f"checkpoint {folder} cannot be read ({METADATA} is not a DCP index); it is "
                                   "damaged or not a checkpoint")
    other = [key for key, entry in metadata.state_dict_metadata.items() if not isinstance(entry, TensorStorageMetadata)]
    if other:
        raise UserError(f"checkpoint {folder} was refused: its {METADATA} lists entries that are not tensors "
                        f"({', '.join(other[:3])}), which DCP would unpickle as code; only load files you trust")
    files = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}
    outside = sorted(str(name) for name in files if not (isinstance(name, str) and SHARD.fullmatch(name)))
    if outside:
        raise UserError(f"checkpoint {folder} was refused: its {METADATA} points at files that are not its own shards "
                        f"({', '.join(outside[:3])}); only load files you trust")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with the index read as data (read_metadata above)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank indexes are written only without collectives: not ours
            raise UnreadableCheckpoint(f"checkpoint {self.path} has per-rank indexes; it was not written by train.py")
        metadata = read_metadata(Path(self.path))
        metadata.storage_meta = StorageMeta(load_id=self.load_id)  # as FileSystemReader.read_metadata sets it
        return metadata


def check_complete(folder: Path) -> None:
    """A folder resume or inference can read: both index files are there, else a one-line UnreadableCheckpoint."""
    if not folder.is_dir():
        raise UserError(f"checkpoint {folder} does not exist; check the path")
    missing = [name for name in (METADATA, PLAIN) if not (folder / name).is_file()]
    if missing:
        raise UnreadableCheckpoint(f"checkpoint {folder} is not a whole sharded checkpoint (no {', '.join(missing)}): "
                                   "train.py swaps in only finished folders, so it was cut short or made by something "
                                   "else; give a whole one (a last.dcp or .pth file train.py wrote)")


def read_plain(folder: Path, load_file) -> dict[str, Any]:
    """The folder's plain data (train_state.pth) through `load_file` (engine.checkpoint.load_checkpoint)."""
    check_complete(folder)
    plain = load_file(folder / PLAIN)
    if not isinstance(plain, dict) or plain.get("format") != "sharded":
        raise UnreadableCheckpoint(f"checkpoint {folder}: {PLAIN} is not the plain data of a sharded checkpoint")
    return plain


def read_tensors(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` ("model.") as whole CPU tensors, read in this process alone (no collective)."""
    metadata = read_metadata(folder)
    wanted = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
              for key, entry in metadata.state_dict_metadata.items() if key.startswith(prefix)}
    if not wanted:
        raise UnreadableCheckpoint(f"checkpoint {folder} holds no {prefix.rstrip('.')} tensors")
    try:
        with quiet_single_process():
            dcp.load(wanted, storage_reader=SafeReader(folder), no_dist=True)
    except (CheckpointException, OSError, RuntimeError, ValueError) as err:
        raise UnreadableCheckpoint(f"checkpoint {folder} cannot be read ({first_line(err)}); it is damaged or "
                                   "truncated") from None
    return {key[len(prefix):]: tensor for key, tensor in wanted.items()}


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Without a process group DCP warns on every call that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:120]}" if text else type(err).__name__


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
        with sigterm_deferred(), quiet_single_process():
            dcp.save({"model": model_sd, "optimizer": optim_tensors},
                     storage_writer=FileSystemWriter(tmp, sync_files=True, overwrite=False))
    except CheckpointException as err:
        rank0_decides(lambda: remove(tmp))
        raise UserError(f"cannot write checkpoint {folder} ({write_failure(err)}); free disk space (or raise the "
                        "quota) or choose another output_dir", all_ranks=True) from None
    rank0_decides(lambda: finish(folder, tmp, {**plain, "format": "sharded", "optimizer_rest": optim_rest}))


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
        folder.parent.mkdir(parents=True, exist_ok=True)
        recover(folder)
        check_replaceable(folder, is_ours, OURS, "output_dir")  # before any rank writes (checked again at the swap)
        for path in folder.parent.iterdir():
            match = TEMP.fullmatch(path.name)
            if match and match["name"] == folder.name and match["tag"] == "tmp":
                remove(path)
        tmp.mkdir()
    except OSError as err:
        raise UserError(f"cannot write checkpoint {folder} ({err.strerror or err}); make output_dir writable or "
                        "choose another output_dir") from None


def finish(folder: Path, tmp: Path, plain: dict[str, Any]) -> None:
    """Rank 0, after every rank wrote its shards: the plain data, fsync, then the swap into place."""
    try:
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


def fsync_folder(folder: Path) -> None:
    """A folder's entries on disk (the files in it were fsynced by their writers)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def set_aside(folder: Path) -> Path | None:
    """The previous folder a save killed between its two renames left aside (`.<name>.<pid>.<hex>.old`), when
    `folder` itself is missing; None otherwise."""
    if folder.exists() or not folder.parent.is_dir():
        return None
    aside = sorted((p for p in folder.parent.glob(f".{folder.name}.*.old")
                    if (m := TEMP.fullmatch(p.name)) and m["name"] == folder.name and is_ours(p)),
                   key=lambda p: p.stat().st_mtime)
    return aside[-1] if aside else None


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
