"""Every checkpoint on disk, read as data only: the one reader that resume, evaluate/predict/export,
model.init_from, the teacher and average_checkpoints.py ask.

Two kinds: a `.pth` file (last.pth, best.pth, epoch_NNNN.pth) read with `torch.load(weights_only=True)`, and a
sharded folder (`last.dcp/`, written by every rank with torch.distributed.checkpoint, engine/checkpoint/sharded.py)
whose plain data (`train_state.pth`) is read the same way.

A sharded folder is read safely too. DCP's `.metadata` is a pickle and its FileSystemReader unpickles it with plain
`pickle.load`, and loads any non-tensor entry with `torch.load(weights_only=False)`: both could run code.
Here `.metadata` goes through `MetadataUnpickler` (DCP's own metadata classes, torch.Size, dtypes, a path;
anything else refused), a folder whose index lists a non-tensor entry is refused, and the shards themselves
are read by DCP with `torch.load(weights_only=True)`. `is_sharded(path)` is the one test for "a sharded folder".
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                     TensorProperties, TensorStorageMetadata)

from core.errors import UnreadableCheckpoint, UserError
from core.files import TEMP


SUFFIX = ".dcp"
PLAIN = "train_state.pth"  # rank 0's plain data (torch.save, weights_only-loadable)
METADATA = ".metadata"  # DCP's index of the shards (a pickle: read through MetadataUnpickler)
SHARD = re.compile(r"__\d+_\d+\.distcp")  # DCP's shard files: __<rank>_<n>.distcp
# torch.save's zip archive, and the legacy format (a protocol-2 pickle of torch's magic number) of old .pth files.
TORCH_FILE_STARTS = (b"PK\x03\x04", b"\x80\x02\x8a\x0a")
# A global torch's weights_only unpickler refuses, in either wording: "Unsupported global: GLOBAL a.b was not an allowed
# global" (any callable or class outside its allowlist) or "unsupported GLOBAL posix.system whose module posix is
# blocked" (torch's blocklist: os, sys, posix, nt). Either way the pickle would call it: code, not data.
CODE_GLOBAL = re.compile(r"GLOBAL (?P<name>\S+) (?:was not an allowed global|whose module \S+ is blocked)")
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # torch's messages carry terminal bold (ESC[1m ... ESC[0m)
# What a DCP .metadata pickle may name: its dataclasses, torch.Size, a tensor layout, the checkpoint's path.
METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in
    ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
     "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("collections", "OrderedDict")}


def is_sharded(path: str | os.PathLike) -> bool:
    """A sharded checkpoint's path: a folder named *.dcp, or any folder holding DCP's index (a file is read as a
    .pth file whatever its name; a missing path, as a missing file)."""
    path = Path(path)
    return path.is_dir() and (path.suffix == SUFFIX or (path / METADATA).is_file())


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
    wrong = wrong_field(metadata)
    if wrong:
        raise UnreadableCheckpoint(f"checkpoint {folder} cannot be read ({METADATA}: {wrong}); it is damaged or not "
                                   "a checkpoint")
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


def wrong_field(metadata: Metadata) -> str | None:
    """The first field of a DCP index that does not have the type DCP gives it (a list where a mapping belongs),
    or None: DCP reads them without checking, and would fail with an AttributeError or TypeError."""
    entries, storage, planner = metadata.state_dict_metadata, metadata.storage_data, metadata.planner_data
    if not isinstance(entries, dict) or not all(isinstance(key, str) for key in entries):
        return f"state_dict_metadata is a {type(entries).__name__}, not a mapping of names"
    for key, entry in entries.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue  # refused below, as an entry DCP would unpickle as code
        props, chunks = entry.properties, entry.chunks
        if not (isinstance(entry.size, torch.Size) and isinstance(props, TensorProperties)
                and isinstance(props.dtype, torch.dtype) and isinstance(chunks, list)
                and all(isinstance(c, ChunkStorageMetadata) and isinstance(c.offsets, torch.Size)
                        and isinstance(c.sizes, torch.Size) for c in chunks)):
            return f"the entry {key} is not a tensor's size, dtype and chunks"
    if not isinstance(storage, dict):
        return f"storage_data is a {type(storage).__name__}, not a mapping"
    for index, info in storage.items():
        if not (isinstance(index, MetadataIndex) and isinstance(index.fqn, str) and isinstance(info, _StorageInfo)
                and type(info.offset) is int and type(info.length) is int):
            return f"storage_data holds {type(index).__name__}: {type(info).__name__}, not a shard's place"
    if planner is not None and not (isinstance(planner, dict) and all(
            isinstance(key, str) and isinstance(path, (tuple, list)) for key, path in planner.items())):
        return f"planner_data is a {type(planner).__name__}, not a mapping of names"
    return None


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


def read_plain(folder: Path) -> dict[str, Any]:
    """The folder's plain data (train_state.pth), read as a .pth file is."""
    check_complete(folder)
    plain = load_checkpoint(folder / PLAIN)
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


def set_aside(folder: Path) -> Path | None:
    """The previous folder a save killed between its two renames left aside (`.<name>.<pid>.<hex>.old`), when
    `folder` itself is missing; None otherwise."""
    if folder.exists() or not folder.parent.is_dir():
        return None
    aside = sorted((p for p in folder.parent.glob(f".{folder.name}.*.old")
                    if (m := TEMP.fullmatch(p.name)) and m["name"] == folder.name and is_ours(p)),
                   key=lambda p: p.stat().st_mtime)
    return aside[-1] if aside else None


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint as data only; a missing, truncated or unsafe file is a UserError."""
    path = Path(path)
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.pth"))
        if not inside:
            raise UserError(f"checkpoint {path} is a folder that holds no checkpoint (.pth); give the path of a "
                            ".pth file train.py wrote")
        raise UserError(f"checkpoint {path} is a folder, not a file (it holds {', '.join(inside[:5])}); give the "
                        f".pth file itself, e.g. {path / ('best.pth' if 'best.pth' in inside else inside[0])}")
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist; check the path")
    with path.open("rb") as f:
        head = f.read(4)
    if head not in TORCH_FILE_STARTS:
        raise UserError(f"checkpoint {path} is not a checkpoint: torch.save files start with a zip header, "
                        f"this one with {head!r}; check the path") from None
    try:
        return current_names(torch.load(path, weights_only=True, map_location="cpu"))
    except pickle.UnpicklingError as err:
        text = ANSI_ESCAPE.sub("", str(err))
        if named := CODE_GLOBAL.search(text):
            raise UserError(f"checkpoint {path} was refused: it would run code when loaded (its pickle calls "
                            f"{named['name']}, which is not plain data); only load files you trust") from None
        first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
        raise UnreadableCheckpoint(f"checkpoint {path} cannot be read ({first[:80]}); it is damaged or not a "
                                   "checkpoint") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError, TypeError) as err:
        text = ANSI_ESCAPE.sub("", str(err)).strip()
        raise UnreadableCheckpoint(f"checkpoint {path} cannot be read ({type(err).__name__}: "
                                   f"{text.splitlines()[0] if text else 'truncated?'}); "
                                   "it is truncated or not a checkpoint") from None


def current_names(ckpt: Any) -> Any:
    """A checkpoint written before the keys were named for what they hold, read with today's names: its "best_top1"
    (the best value of train.best_metric, whatever the metric) as "best_value" and its "val_top1" (that metric's
    value at the checkpoint's evaluation) as "metric_value"; anything else as it is."""
    if isinstance(ckpt, dict) and "best_top1" in ckpt and "best_value" not in ckpt:
        ckpt["best_value"] = ckpt.pop("best_top1")
        if "val_top1" in ckpt:
            ckpt["metric_value"] = ckpt.pop("val_top1")
    return ckpt


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint as plain data, whichever kind: a .pth file as saved; a sharded folder's plain data with its
    model (and EMA) weights whole, its optimizer tensors left in the folder (`load_sharded_training` reads them)."""
    path = Path(path)
    if not is_sharded(path):
        return load_checkpoint(path)
    ckpt = read_plain(path)
    ckpt["model"] = read_tensors(path, "model.")
    return ckpt
