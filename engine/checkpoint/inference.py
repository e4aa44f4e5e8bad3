"""What evaluate.py, predict.py and export.py share: a trained model read back, and per-rank CSV parts merged.

A trained model comes from a checkpoint written by train.py, or from a model folder written by
`export.py --format safetensors` (config.json + model.safetensors, the layout timm and the Hugging Face
hub use). Either way the config it was trained with (architecture, eval preprocessing) comes with it,
so inference uses exactly the training's eval pipeline. Inference computes in the precision the run's own
validation computed in (its `eval_amp`: fp32 unless the run chose another; `amp=...` given to the tool chooses
another), never in the run's training `amp`: every route to the same weights then gives the same predictions, and
evaluate.py repeats the run's numbers (docs/correctness.md, "One precision for every reported number").
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from core.config import Config
from core.config_load import config_from_dict, set_dotted
from core.errors import UserError
from core.files import Recognise, check_replaceable
from engine.checkpoint.formats import is_sharded, read_checkpoint
from engine.checkpoint.weights import MODEL_CONFIG, MODEL_WEIGHTS, model_folder_files



@dataclass
class Trained:
    """A trained model as stored: its config as a plain dict, its weights (EMA ones with `ema`), its classes."""

    config: dict[str, Any]
    weights: dict[str, torch.Tensor]
    class_names: list[str]
    source: str  # "checkpoint PATH" or "model folder PATH", for messages
    best_metric: str = "val_top1"  # what the checkpoint was chosen on: ema_val_top1 with train.best_on_ema
    multi_label: bool = False  # one sigmoid per class (data.multi_label), not a softmax over the classes
    threshold: float = 0.5  # multi-label: a class is predicted at sigmoid >= this (data.multi_label_threshold)
    metrics: dict[str, Any] = field(default_factory=dict)  # what a checkpoint records of these weights' evaluation
    data_sizes: dict[str, int] | None = None  # images per split the run recorded (model card); None: not recorded
    started_from: dict[str, Any] | None = None  # the run's starting weights (Resume.started_from); None: not recorded
    selected: bool = False  # best.pth: kept because of its validation metric (the model card says so)
    wandb_id: str | None = None  # the tracked training run (an evaluation's W&B run links its model artifact)
    folder: Path | None = None  # holds its pipeline files' copies: the checkpoint's run folder or the model folder


PIPELINE_NAMES = ("eval_transform.yaml", "eval_transform.yml", "eval_transform.json")  # a model folder's pipeline
SHA256 = re.compile("[0-9a-f]{64}")
INFERENCE_AMP = "off"  # eval_amp of a run that predates the key: its validation computed in fp32 on CPUs without bf16


def for_inference(config: dict[str, Any]) -> dict[str, Any]:
    """A private copy of a stored training config, set to compute as the run's validation did (eval_amp): its
    training `amp` (often `auto`, which is bf16 on some CPUs and not on others) would make evaluate.py's numbers
    differ from the run's, and a checkpoint and its exported folder predict differently."""
    raw = json.loads(json.dumps(config))
    raw["amp"] = raw.setdefault("eval_amp", INFERENCE_AMP)
    raw.setdefault("tf32", False)  # a run saved before the key validated in full fp32
    return raw


def precision_line(amp: str, computed_in: str, run_eval_amp: str) -> str:
    """The log line that says which precision (`computed_in`: fp32, bf16, fp16) inference computes in, whether
    that is how the run computed its own numbers, and how to choose another."""
    if amp == run_eval_amp:
        return (f"computing in {computed_in}, as the run's validation did (its eval_amp={run_eval_amp}); "
                "amp=off|bf16|auto chooses another")
    return (f"computing in {computed_in} (amp={amp}); the run's validation computed with eval_amp={run_eval_amp}, "
            "so its numbers may differ slightly from these")


def ema_hint(source: str, best_metric: str | None, using_ema: bool) -> str | None:
    """What to say when the weights in use are not the ones best.pth was chosen on (evaluate, predict, export)."""
    if using_ema or not (best_metric or "").startswith("ema_"):
        return None
    return (f"{source} was chosen on its EMA weights' {best_metric.removeprefix('ema_')} (train.best_on_ema); add --ema "
            "to use those weights")


def load_trained(path: str | os.PathLike, ema: bool = False) -> Trained:
    """A train.py checkpoint or an exported model folder (config.json + model.safetensors)."""
    path = Path(path)
    if path.is_dir() and not is_sharded(path) and not (path / MODEL_CONFIG).is_file() \
            and not any(path.glob("*.pth")):
        weights = " beside model.safetensors" if (path / MODEL_WEIGHTS).is_file() else " and model.safetensors"
        raise UserError(f"{path} is a folder that holds no checkpoint (.pth) and no {MODEL_CONFIG}; a model folder "
                        f"needs {MODEL_CONFIG}{weights} (export.py --format safetensors writes both), or give the "
                        ".pth file train.py wrote")
    if path.is_dir() and not is_sharded(path) and (path / MODEL_CONFIG).is_file():
        if ema:
            raise UserError(f"model folder {path} holds one set of weights; use it without --ema")
        return load_model_folder(path)
    ckpt = read_checkpoint(path)  # a .pth file, or a sharded last.dcp/ folder
    absent = [key for key in ("config", "model", "class_names") if key not in ckpt]
    if absent:
        raise UserError(f"checkpoint {path} was not written by train.py (no {', '.join(absent)}); "
                        "inference needs the config and class names stored in it")
    key = "ema" if ema else "model"
    if key not in ckpt:
        raise UserError(f"checkpoint {path} holds no EMA weights; use it without --ema")
    data = ckpt["config"].get("data", {})
    return Trained(json.loads(json.dumps(ckpt["config"])), ckpt[key], list(ckpt["class_names"]),
                   f"checkpoint {path}", ckpt.get("best_metric", "val_top1"), bool(data.get("multi_label", False)),
                   float(data.get("multi_label_threshold", 0.5)), recorded_metrics(ckpt, ema),
                   ckpt.get("data_sizes"), ckpt.get("started_from"), path.name == "best.pth", ckpt.get("wandb_id"),
                   path.parent)


# Where a checkpoint keeps the value of train.best_metric at its evaluation and the run's best value of it: their
# names, then the names checkpoints written before had (the first present is read).
VALUE_KEYS = ("metric_value", "val_top1")
BEST_KEYS = ("best_value", "best_top1")


def stored_number(ckpt: dict[str, Any], keys: Sequence[str]) -> float | None:
    """The first of `keys` the checkpoint holds as a finite number (None: none recorded)."""
    for key in keys:
        value = ckpt.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None


def recorded_metrics(ckpt: dict[str, Any], ema: bool = False) -> dict[str, Any]:
    """What a checkpoint says of the evaluation of the weights in use (`ema`: its EMA weights): the value of the
    metric best.pth follows at its last evaluation and the run's best value of it, when they measured these weights
    (else "not recorded", naming what was), and how far it trained."""
    name = ckpt.get("best_metric", "val_top1")
    value, best = stored_number(ckpt, VALUE_KEYS), stored_number(ckpt, BEST_KEYS)
    metrics: dict[str, Any] = {}
    if name.startswith("ema_") != ema:  # the recorded value measured the other set of weights
        own = f"ema_{name}" if ema else name.removeprefix("ema_")
        other = "non-EMA weights' {}, exported without --ema" if ema else "EMA weights' {}, exported with --ema"
        metrics[own] = f"not recorded (the checkpoint records only its {other.format(name)})"
        value = best = None
    if value is not None:
        metrics[name] = round(value, 4)
    if best is not None:
        metrics[f"best {name} of the run"] = round(best, 4)
    for key, label in (("epoch", "finished epochs"), ("epoch_step", "steps into the next epoch"),
                       ("global_step", "optimizer steps")):
        if isinstance(ckpt.get(key), int) and (ckpt[key] or key != "epoch_step"):
            metrics[label] = ckpt[key]
    return metrics


def load_model_folder(folder: Path) -> Trained:
    """An exported model folder as a Trained: config.json's pretrained_cfg becomes the eval preprocessing."""
    meta, weights, _ = model_folder_files(folder, "model folder")
    check_model_config(meta, folder / MODEL_CONFIG)
    pretrained = meta.get("pretrained_cfg") or {}
    raw: dict[str, Any] = {"model": {"name": meta["architecture"], "kwargs": meta.get("model_args") or {}},
                           "eval_amp": meta.get("eval_amp", INFERENCE_AMP)}
    raw["model"]["kwargs"].pop("num_classes", None)
    for key, value in preprocessing_from_pretrained_cfg(pretrained).items():
        set_dotted(raw, f"data.{key}", value)
    if meta.get("eval_transform"):  # the run's eval pipeline file, kept in the folder (export.py)
        set_dotted(raw, "data.eval_transform", meta["eval_transform"])
        set_dotted(raw, "data.eval_transform_sha256", meta["eval_transform_sha256"])
    names = meta.get("label_names") or [str(i) for i in range(meta["num_classes"])]
    if isinstance(names, dict):  # timm allows {class index: name}
        names = [str(names.get(str(i), names.get(i, i))) for i in range(meta["num_classes"])]
    return Trained(raw, weights, list(names), f"model folder {folder}", multi_label=bool(meta.get("multi_label")),
                   threshold=float(meta.get("multi_label_threshold", 0.5)), folder=folder)


def check_model_config(meta: dict[str, Any], file: Path) -> None:
    """config.json of a model folder holds the keys inference needs."""
    if not isinstance(meta.get("architecture"), str) or not isinstance(meta.get("num_classes"), int):
        raise UserError(f"{file} names no architecture and num_classes; it should be the config.json export.py "
                        "(or timm's push_to_hf_hub) writes")
    name, sha256 = meta.get("eval_transform"), meta.get("eval_transform_sha256")
    if name is not None and not (name in PIPELINE_NAMES and isinstance(sha256, str) and SHA256.fullmatch(sha256)):
        raise UserError(f"{file}: eval_transform must be one of {', '.join(PIPELINE_NAMES)} (the pipeline file in "
                        f"the folder) with its eval_transform_sha256 (64 hex digits), got {name!r} and {sha256!r}; "
                        "export the model again")


def preprocessing_from_pretrained_cfg(pretrained: dict[str, Any]) -> dict[str, Any]:
    """data.* keys (img_size, crop_pct, mean, std, interpolation) from a timm pretrained_cfg; absent ones left out."""
    data: dict[str, Any] = {}
    if pretrained.get("input_size"):
        data["img_size"] = int(pretrained["input_size"][-1])
    for key in ("crop_pct", "mean", "std"):
        if pretrained.get(key) is not None:
            data[key] = list(pretrained[key]) if key in ("mean", "std") else float(pretrained[key])
    if pretrained.get("interpolation"):
        data["interpolation"] = pretrained["interpolation"]
    return data


def inference_config(trained: Trained, overrides: Sequence[tuple[str, Any]] = ()) -> Config:
    """The stored config, computing in the run's eval_amp, with dotted overrides applied, validated. A refusal names
    the command line's overrides when the stored config alone passes (`amp=BF16` is the user's, not the file's)."""
    raw = for_inference(trained.config)
    stored = copy.deepcopy(raw)
    for key, value in overrides:
        set_dotted(raw, key, value)
    try:
        return config_from_dict(raw)
    except UserError as err:
        if not overrides or not passes(stored):
            raise UserError(f"{trained.source}: {err}") from None
        named = [(key, value) for key, value in overrides if key in str(err)] or list(overrides)
        given = " ".join(f"{key}={value}" for key, value in named)
        raise UserError(f"command-line override {given}: {err}") from None


def passes(raw: dict[str, Any]) -> bool:
    """Whether a raw config is valid as it is."""
    try:
        config_from_dict(raw)
    except UserError:
        return False
    return True


def check_same_architecture(cfg: Config, trained: Trained) -> None:
    """An override of model.name cannot make these weights another architecture."""
    stored = trained.config.get("model", {}).get("name")
    if cfg.model.name != stored:
        raise UserError(f"{trained.source} is a {stored}; it cannot be used as model.name={cfg.model.name} "
                        "(drop that override)")


def make_output_dir(out: Path, outputs: dict[str, Recognise]) -> None:
    """--output-dir, created if need be; each of `outputs` in it is absent or an earlier output of the tool."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--output-dir {out} is not writable ({err.strerror}); choose another one") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise UserError(f"--output-dir {out} is not writable (permission denied); choose another one")
    for name, ours in outputs.items():
        check_replaceable(out / name, ours, f"an earlier {name} of evaluate.py or predict.py", "--output-dir")


