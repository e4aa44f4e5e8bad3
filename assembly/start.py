"""Run start-up: everything a run (assembly/run.build_run: fit, --dry-run, --find-lr) checks and builds before its
model is placed.

The checkpoint to resume and the config resolved against it (the batch, the lr, the preprocessing), the data, the
precision, the model with its starting weights, the teacher. Nothing in output_dir is written here.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import random
from pathlib import Path

import numpy as np
import torch
from torch import nn

from core.config import Config, ModelConfig, mixing, to_dict, with_derived
from core.dist import DistInfo, all_gather_object, main_first, min_over_ranks, rank0_decides
from core.errors import UserError
from data.hf import hub_revision
from data.loader import DataBundle, build_data, dropped_images_note, prepare_data, probe_data, with_batch_size
from data.pipeline import pipeline_hashes
from data.split import run_split
from engine.batch_size import (CPU_BATCH, MAX_BATCH, UNIT, largest_batch, on_device_fits, resolved_batch,
                               whole_groups, with_headroom)
from engine.checkpoint.resume import Resume, config_changes, decide_resume
from engine.checkpoint.run_dir import resolve_output_dir
from engine.checkpoint.weights import Pretrained, check_pretrained, read_pretrained, resolve_preprocessing
from engine.distill import check_teacher_needed, freeze_teacher, teacher_name, teacher_sha256
from engine.optim import batch_and_lr, build_optimizer, check_optimizer, check_scheduler, lr_for_batch
from engine.precision import Precision
from engine.profiling import check_trace_folder, window_warnings
from models.factory import (check_input_sizes, check_model_name, create_model, prepare_model,
                            pretrained_cfg_of, sizes_fed)

log = logging.getLogger(__name__)


def resolve_start(cfg: Config, info: DistInfo, fresh: bool = False) -> tuple[Config, Resume, StartingWeights]:
    """The checkpoint to resume (resume=auto: only the folder's own run, Resume.check_continuation), model.init_from's
    weights, the teacher's (distill.teacher_weights, its sha256 checked: refused before any data is read), and the
    config with the preprocessing (unset keys: resumed, the weights', or defaults), the batch per process from
    train.global_batch_size, optim.lr from optim.lr_base (train.batch_size=auto: later, once the model is built) and
    distill.teacher_sha256 resolved."""
    check_optimizer(cfg.optim)  # the config's own rules first, before any file or download is read
    batch = batch_and_lr(cfg, info.world_size, info.is_main)
    path, hub_cfg = rank0_decides(lambda: decide_start(cfg, fresh))
    start = Resume.open(path, auto=not fresh and cfg.resume == "auto")
    pretrained = start.pretrained(cfg.model)
    taught = cfg.distill.teacher_weights  # the teacher's file, read as model.init_from's is
    teacher_file = read_pretrained(taught, key="distill.teacher_weights") if taught else None
    saved = start.ckpt["config"] if start.ckpt else None
    data = {**resolve_preprocessing(cfg.data, cfg.model.name, cfg.given, pretrained, saved, hub_cfg),
            **pipeline_hashes(cfg.data),  # a resume with another pipeline file: refused
            "hf_revision": hub_revision(cfg.data, saved)}
    distill, name = {}, None
    if teacher_file is not None:
        name = teacher_name(cfg.distill, teacher_file)
        given = "distill.teacher_sha256" in cfg.given
        distill["teacher_sha256"] = teacher_sha256(cfg.distill, teacher_file, given, saved)
        check_model_name(name, key="distill.teacher_name")
    cfg = with_derived(cfg, data=data, distill=distill, **batch)
    start.check_continuation(cfg)
    return cfg, start, StartingWeights(pretrained, hub_cfg, teacher_file, name if teacher_file is not None else None)


def decide_start(cfg: Config, fresh: bool) -> tuple[str | None, dict | None]:
    """Rank 0's start-up checks, one decision every rank learns: the trace folder (logging.profile_steps), the
    checkpoint to continue (none when `fresh`), and for a fresh run the config of model.pretrained's timm weights."""
    out = Path(cfg.output_dir)
    if cfg.logging.profile_steps:
        check_trace_folder(out)
    path = None if fresh else decide_resume(cfg.resume, out)
    return path, None if path else pretrained_cfg_of(cfg.model)


@dataclasses.dataclass
class StartingWeights:
    """Where a fresh run's weights come from: model.init_from's file, or (model.pretrained) timm's weights' config;
    and the teacher's file (distill.teacher_weights) with its timm model name."""

    pretrained: Pretrained | None = None
    hub_cfg: dict | None = None
    teacher: Pretrained | None = None
    teacher_name: str | None = None


@dataclasses.dataclass
class Teacher:
    """distill.*: the frozen teacher model with its file's weights, the file, its timm model name
    (engine/distill.py says what the teacher does)."""

    model: nn.Module
    weights: Pretrained
    name: str


def build_start(cfg: Config, start: Resume, weights: StartingWeights, precision: Precision,
                info: DistInfo) -> tuple[Config, DataBundle, nn.Module]:
    """The data and the model with its starting weights, checked against the resumed checkpoint; the config with
    train.batch_size=auto's batch found (in training's `precision`)."""
    pretrained, hub_cfg = weights.pretrained, weights.hub_cfg
    auto_batch = cfg.train.batch_size == "auto"  # found once the model is built: with_auto_batch
    seed_everything(cfg.seed)
    prepare_data(cfg.data, info.local_rank)  # data.root at a URL: copied before the auto split scans it
    split = run_split(cfg.data, start.path, start.ckpt["config"].get("data") if start.ckpt else None, info.is_main)
    if auto_batch:  # loaders of UNIT images only count this rank's share: draws per group wait for the batch
        data = probe_data(cfg.data, UNIT, cfg.seed, info, split)
    else:
        data = build_data(cfg.data, cfg.train.batch_size, cfg.seed, info, cfg.train.accum_steps,
                          cfg.train.drop_last_accum, split)
    if hub_cfg is not None:  # rank 0 fills the Hugging Face cache, the others read it
        model = main_first(lambda: create_model(cfg.model, data.num_classes, from_hub=True))
        log.info("model.pretrained: the weights of %s (%s) from the Hugging Face cache%s", cfg.model.name,
                 hub_cfg.get("hf_hub_id") or hub_cfg.get("url"), "" if hub_cfg.get("num_classes") == data.num_classes
                 else f"; classifier freshly initialised for {data.num_classes} classes")
    elif pretrained is None:
        model = create_model(cfg.model, data.num_classes)
    else:
        model = create_model(cfg.model, data.num_classes, pretrained.state_dict, pretrained.source)
        check_pretrained(model, pretrained)
    check_input_sizes(model, cfg.model, sizes_fed(cfg.data))
    if auto_batch:
        cfg, data = with_auto_batch(cfg, data, model, precision, info)
    if info.is_main and (note := dropped_images_note(data.train, info.world_size, cfg.train.accum_steps,
                                                     cfg.train.drop_last_accum)):  # the loaders as trained
        log.log(*note)
    per_epoch = data.steps_per_epoch
    steps = start.step_range(cfg.train.epochs, per_epoch, cfg.train.max_steps)
    start.load_model(model, cfg, data.class_names, info.world_size)  # the checkpoint checked against this run
    for warning in (check_scheduler(cfg.sched, cfg.train.epochs, per_epoch)
                    + window_warnings(cfg.logging.profile_steps, *steps)):
        if info.is_main:
            log.warning(warning)
    return cfg, data, model


def with_auto_batch(cfg: Config, data: DataBundle, model: nn.Module, precision: Precision,
                    info: DistInfo) -> tuple[Config, DataBundle]:
    """train.batch_size=auto: the largest batch every rank fits (engine/batch_size.py), train.accum_steps for
    train.global_batch_size, optim.lr from optim.lr_base, and the loaders rebuilt for that batch."""
    cap = len(data.train.sampler)  # this rank's training images: no batch may be larger
    if info.device.type == "cuda":
        probe = prepare_model(copy.deepcopy(model), cfg.model, info.device, world_size=1)
        optimizer = build_optimizer(probe, cfg.optim, grad_scaler=precision.scaler is not None)
        fits = on_device_fits(probe, optimizer, precision, cfg.data.img_size, data.num_classes,
                              cfg.model.channels_last)
        largest = largest_batch(fits, min(cap, MAX_BATCH))
        largest = with_headroom(fits, largest, cfg.data.img_size, info.is_main)
        del probe, optimizer, fits
        torch.cuda.empty_cache()
        how = f"the largest {precision.name} training step that fits on every GPU"
    else:
        largest = largest_batch(lambda batch: batch <= CPU_BATCH, cap)
        how = (f"{CPU_BATCH} on the CPU, where host memory is not the limit and the speed per image hardly changes "
               "with the batch; set train.batch_size to choose")
    largest = min_over_ranks(largest, info.device)
    if mixing(cfg.data) and cfg.data.mix_mode == "batch" and cfg.data.mix_group:  # each batch whole draws
        largest = whole_groups(largest, cfg.data.mix_group)
    if not largest:
        raise UserError(f"train.batch_size=auto: not even a batch of {UNIT} fits ({cfg.model.name} at "
                        f"data.img_size {cfg.data.img_size}, amp={cfg.amp}); lower data.img_size, set "
                        "model.grad_checkpointing=true, or use a smaller model", all_ranks=True)
    train = resolved_batch(cfg.train, largest, info.world_size, mixing(cfg.data),
                           "train.accum_steps" in cfg.from_command_line)
    cfg = with_derived(cfg, train=train, optim=lr_for_batch(cfg, train, info.world_size, info.is_main))
    if info.is_main:
        log.info("train.batch_size=auto: %d per process (%s)%s", cfg.train.batch_size, how,
                 f", x train.accum_steps={cfg.train.accum_steps} for train.global_batch_size="
                 f"{cfg.train.global_batch_size}" if cfg.train.global_batch_size else "")
    return cfg, with_batch_size(data, cfg.data, cfg.train.batch_size, cfg.seed, info, cfg.train.accum_steps,
                                cfg.train.drop_last_accum)


def load_teacher(cfg: Config, weights: StartingWeights, model: nn.Module, num_classes: int) -> Teacher | None:
    """distill.*: the teacher built from the file resolve_start read (`weights.teacher`); None without a teacher."""
    check_teacher_needed(cfg.distill, model, cfg.model.name)
    if weights.teacher is None or weights.teacher_name is None:
        return None
    name = weights.teacher_name
    frozen = freeze_teacher(create_model(ModelConfig(name=name, kwargs=cfg.distill.teacher_kwargs), num_classes),
                            weights.teacher, name)
    return Teacher(frozen, weights.teacher, name)


def seed_everything(seed: int) -> None:
    """Same seed on every rank, so models start identical (DDP also broadcasts rank 0's weights)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def with_run_folder(cfg: Config) -> Config:
    """cfg with output_dir's placeholders resolved once for every rank (run_dir.resolve_output_dir), said on rank 0;
    config.yaml and the checkpoints keep the folder, so the run resumes there."""
    folder = resolve_output_dir(cfg.output_dir, cfg.model.name, cfg.resume)
    if folder != cfg.output_dir:
        log.info("output_dir %s: %s", cfg.output_dir, folder)
    return with_derived(cfg, output_dir=folder)


def check_same_config(cfg: Config) -> None:
    """Every process trains the same resolved config: processes launched with other arguments or environment (a
    sweep agent per node, a script that varies by rank) would otherwise train a mix of runs as one."""
    configs = all_gather_object(to_dict(cfg))
    for rank, other in enumerate(configs):
        if other != configs[0]:
            differ = ", ".join(config_changes(configs[0], other))
            raise UserError(f"process {rank} has another config than process 0 ({differ}); launch every process with "
                            "the same arguments and environment (one W&B sweep agent per job, which starts torchrun)",
                            all_ranks=True)
