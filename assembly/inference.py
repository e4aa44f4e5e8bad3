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

from core.config import Config, with_derived
from core.dist import DistInfo, init_distributed, rank0_decides, read_launch_env
from core.errors import UserError
from core.files import Recognise
from core.logs import setup_logging
from core.startup import tune_cpu_process
from data.pipeline import copy_name, file_sha256
from engine.checkpoint.inference import Trained, inference_config, load_trained, make_output_dir
from engine.checkpoint.run_dir import check_shared
from engine.checkpoint.weights import load_weights
from models.factory import check_input_sizes, create_model, prepare_model, sizes_fed


def open_trained(path: str | os.PathLike, ema: bool, overrides: Sequence[tuple[str, Any]] = (),
                 use: str = "used", may_override: bool = True) -> tuple[Trained, Config]:
    """The trained weights (the EMA's with `ema`) and their stored config with `overrides` applied; model.name may
    not be overridden into another architecture (`use`: what the tool does with it, for the message); the eval
    pipeline file is the run's own copy (`may_override`: the tool takes data.eval_transform=FILE instead)."""
    trained = load_trained(path, ema)
    cfg = inference_config(trained, overrides)
    stored = trained.config.get("model", {}).get("name")
    if cfg.model.name != stored:
        raise UserError(f"{trained.source} is a {stored}; it cannot be {use} as model.name={cfg.model.name} "
                        "(drop that override)")
    given = any(key == "data.eval_transform" for key, _ in overrides)
    return trained, with_eval_pipeline(cfg, trained, given, may_override)


def with_eval_pipeline(cfg: Config, trained: Trained, given: bool, may_override: bool) -> Config:
    """data.eval_transform read from the run's own copy (the checkpoint's run folder, or the model folder), its
    recorded sha256 checked: the file at the recorded path may have been edited or removed since. A file `given` on
    the command line is used instead, with its own sha256 (pipeline_line says so)."""
    if given:
        chosen = cfg.data.eval_transform
        return with_derived(cfg, data={"eval_transform_sha256": file_sha256(chosen, "data.eval_transform")
                                       if chosen else ""})
    data, own = trained.config.get("data", {}), run_pipeline(trained)
    if own is None:
        return cfg
    recorded = data.get("eval_transform_sha256") or "(none)"
    other = ", or give data.eval_transform=FILE to use another pipeline file" if may_override else ""
    if not own.is_file():
        writer = ("export.py writes it into the model folder" if trained.source.startswith("model folder")
                  else "train.py writes it beside the checkpoint")
        raise UserError(f"{trained.source} was trained with data.eval_transform={data['eval_transform']} (sha256 "
                        f"{recorded}); the run's copy of it, {own}, is missing: put it back ({writer}){other}")
    found = file_sha256(str(own), "data.eval_transform")
    if found != recorded:
        raise UserError(f"{own}, the run's copy of its data.eval_transform, has sha256 {found}, not the {recorded} "
                        f"{trained.source} recorded: it was changed after training; restore it{other}")
    return with_derived(cfg, data={"eval_transform": str(own)})


def run_pipeline(trained: Trained) -> Path | None:
    """Where the run keeps its copy of its data.eval_transform file (None: it used the preset): `eval_transform`
    with the file's suffix, in the checkpoint's run folder (train.py writes it there) or in the model folder."""
    name = trained.config.get("data", {}).get("eval_transform")
    if not name or trained.folder is None:
        return None
    return trained.folder / copy_name("eval", name)


def pipeline_line(trained: Trained, cfg: Config) -> str | None:
    """What the eval pipeline is, for the log: the run's own file (its copy, checked), a file or the preset given on
    the command line in its place (None: the preset, as the run used)."""
    own, used = run_pipeline(trained), cfg.data.eval_transform
    if own is not None and used == str(own):
        return (f"eval pipeline: the run's data.eval_transform, its copy {own} (sha256 "
                f"{cfg.data.eval_transform_sha256}, as recorded)")
    run_side = f"the run's own pipeline file ({own.name})" if own is not None else "the run's eval preset"
    if used:
        return (f"eval pipeline: data.eval_transform={used} given on the command line (sha256 "
                f"{cfg.data.eval_transform_sha256}), in place of {run_side}")
    if own is not None:
        return f"eval pipeline: the app's eval preset (data.eval_transform= given), in place of {run_side}"
    return None


def inference_model(trained: Trained, cfg: Config, device: torch.device) -> nn.Module:
    """The architecture with the trained weights on `device`, in eval mode: no gradient checkpointing, and no
    synchronized BatchNorm whatever the training used (evaluation uses the running statistics)."""
    model = create_model(dataclasses.replace(cfg.model, grad_checkpointing=False), len(trained.class_names))
    check_input_sizes(model, cfg.model, sizes_fed(cfg.data, training=False))
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
