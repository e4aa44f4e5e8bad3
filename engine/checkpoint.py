"""Checkpoints are data, not code: tensors, numbers and plain dicts, written atomically.

Writes go to a temp file in the same folder and are moved into place with os.replace, so a
crash mid-write leaves the previous file intact. Reads use weights_only=True: a checkpoint
cannot run code when it is loaded.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.errors import UserError


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP and torch.compile wrappers (what a checkpoint should hold)."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def cpu_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's tensors, on the CPU."""
    return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}


def save_atomic(obj: dict[str, Any], path: str | os.PathLike) -> None:
    """torch.save to a temp file beside `path`, fsync, then os.replace it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint as data only; a missing, truncated or unsafe file is a UserError."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist; check the path")
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"checkpoint {path} was refused: it holds objects that are not plain data "
                        f"and could run code when loaded ({first}); only load files you trust") from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise UserError(f"checkpoint {path} cannot be read ({type(err).__name__}: "
                        f"{str(err).strip().splitlines()[0] if str(err).strip() else 'truncated?'}); "
                        "it is truncated or not a checkpoint") from None
