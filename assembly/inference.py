"""The one way a trained model is opened for use: evaluate.py, predict.py and export.py read a checkpoint, a sharded
last.dcp/ folder or an exported model folder (engine/checkpoint/inference.load_trained), apply the tool's overrides
to the config stored with it, and build its architecture with those weights, placed and in eval mode."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from core.config import Config
from core.dist import DistInfo, init_distributed, rank0_decides, read_launch_env
from core.errors import UserError
from core.files import Recognise
from core.logs import setup_logging
from core.startup import tune_cpu_process
from engine.checkpoint.inference import Trained, inference_config, load_trained, make_output_dir
from engine.checkpoint.run_dir import check_shared
from engine.checkpoint.weights import load_weights
from models.factory import create_model, prepare_model


def open_trained(path: str | os.PathLike, ema: bool, overrides: Sequence[tuple[str, Any]] = (),
                 use: str = "used") -> tuple[Trained, Config]:
    """The trained weights (the EMA's with `ema`) and their stored config with `overrides` applied; model.name may
    not be overridden into another architecture (`use`: what the tool does with it, for the message)."""
    trained = load_trained(path, ema)
    cfg = inference_config(trained, overrides)
    stored = trained.config.get("model", {}).get("name")
    if cfg.model.name != stored:
        raise UserError(f"{trained.source} is a {stored}; it cannot be {use} as model.name={cfg.model.name} "
                        "(drop that override)")
    return trained, cfg


def inference_model(trained: Trained, cfg: Config, device: torch.device) -> nn.Module:
    """The architecture with the trained weights on `device`, in eval mode: no gradient checkpointing, and no
    synchronized BatchNorm whatever the training used (evaluation uses the running statistics)."""
    model = create_model(dataclasses.replace(cfg.model, grad_checkpointing=False), len(trained.class_names))
    load_weights(model, trained.weights, trained.source)
    return prepare_model(model, dataclasses.replace(cfg.model, sync_bn=False), device, 1).eval()


def start_processes(cfg: Config) -> DistInfo:
    """Logging, the process group (one process, or one per device under torchrun) and, on the CPU, one thread per
    process: CPU convolutions round differently with other thread counts, so the outputs do not depend on the
    number of processes (start one per core for speed)."""
    setup_logging(read_launch_env()[0], cfg.logging.level)  # before the rendezvous, which may wait
    info = init_distributed(cfg.dist.backend, cfg.dist.timeout_s, cfg.dist.rendezvous_timeout_s)
    if info.device.type == "cpu":
        tune_cpu_process(threads=1)
    return info


def shared_output_dir(out: Path, outputs: dict[str, Recognise]) -> None:
    """--output-dir, made by rank 0 (each of `outputs` in it absent or an earlier output of the tool) and seen by
    every rank, which each write a part file there: ranks that see another folder (a relative path on nodes
    without shared storage) are refused in one line before any part is written, and a folder made here for
    nothing is removed again."""
    made = rank0_decides(lambda: not out.exists())
    rank0_decides(lambda: make_output_dir(out, outputs))
    try:
        check_shared(out, "--output-dir")
    except UserError:
        if made:
            rank0_decides(lambda: remove_empty(out))
        raise


def remove_empty(folder: Path) -> None:
    """`folder`, if it is still empty (nothing of anyone's is removed)."""
    with contextlib.suppress(OSError):
        folder.rmdir()
