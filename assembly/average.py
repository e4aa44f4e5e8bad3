"""What average_checkpoints.py does once its arguments are parsed: a run's newest epoch checkpoints checked to be of
one run and model, averaged (average_checkpoints.py's docstring says how), and written atomically to --output."""

from __future__ import annotations

import argparse
import errno
import re
from pathlib import Path
from typing import Any

import torch

from core.errors import UserError
from core.files import check_folder, check_replaceable, replace_with, save_atomic, temp_beside
from core.store import is_url
from engine.checkpoint.formats import load_checkpoint
from engine.checkpoint.run_store import fetched_folder

EPOCH_FILE = re.compile(r"epoch_(\d+)\.pth")
EXPECTED = "an averaged checkpoint written by average_checkpoints.py"


def average_command(args: argparse.Namespace) -> int:
    """average_checkpoints.py: the run folder's newest --last epoch files averaged into --output, over nothing but an
    earlier averaged checkpoint."""
    if args.last < 0:
        raise UserError(f"--last must be >= 0 (0: every kept epoch file), got {args.last}")
    run_dir = Path(args.run_dir)
    if is_url(args.run_dir):  # its epoch files copied to their local mirror (engine/checkpoint/run_store.py)
        run_dir = fetched_folder(args.run_dir, lambda name, size: bool(EPOCH_FILE.fullmatch(name)))
    out = Path(args.output) if args.output else run_dir / "averaged.pth"
    paths = epoch_files(run_dir, args.last)
    check_folder(out, "--output")
    check_replaceable(out, is_averaged, EXPECTED, "--output")  # before any work: nothing at --output is lost
    averaged = average_checkpoints(paths)
    write_averaged(averaged, out)
    weights = "model and EMA weights" if "ema" in averaged else "model weights"
    print(f"wrote {out}: {weights} averaged over {', '.join(averaged['averaged_from'])}")
    return 0


def write_averaged(averaged: dict[str, Any], out: Path) -> None:
    """The averaged checkpoint at `out`, atomically; a failed write is one line naming the way out."""
    try:
        with temp_beside(out) as tmp:
            save_atomic(averaged, tmp)
            replace_with(tmp, out, is_averaged, EXPECTED, "--output")
    except OSError as err:
        full = err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
        way_out = "free disk space (or raise the quota or file-size limit), or" if full else "make it writable, or"
        raise UserError(f"cannot write {out} ({err.strerror}); {way_out} choose another --output") from None


def epoch_files(run_dir: Path, last: int) -> list[Path]:
    """The newest `last` epoch_NNNN.pth files of a run, oldest first (all of them for last=0)."""
    if not run_dir.is_dir():
        raise UserError(f"run folder {run_dir} does not exist or is not a folder; give a run's output_dir")
    numbered = sorted((int(m.group(1)), p) for p in run_dir.iterdir() if (m := EPOCH_FILE.fullmatch(p.name)))
    if not numbered:
        raise UserError(f"{run_dir} holds no epoch_NNNN.pth checkpoints; train with train.keep_last_k=K to keep the "
                        "last K epochs' checkpoints, then average them")
    if last > len(numbered):
        raise UserError(f"--last {last}: {run_dir} holds only {len(numbered)} epoch checkpoint(s); lower --last or "
                        f"train with train.keep_last_k={last}")
    return [path for _, path in numbered[-last if last else 0:]]


def average_state_dicts(state_dicts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The elementwise mean of each tensor, summed in float64 (timm's avg_checkpoints.py), in its own dtype."""
    averaged = {}
    for key, first in state_dicts[0].items():
        total = sum(sd[key].double() for sd in state_dicts) / len(state_dicts)
        averaged[key] = total.round().to(first.dtype) if not first.is_floating_point() else total.to(first.dtype)
    return averaged


def check_same_model(ckpts: list[dict[str, Any]], paths: list[Path], key: str) -> None:
    """All checkpoints hold `key` with the same tensor names and shapes (one model, one run)."""
    first = {k: v.shape for k, v in ckpts[0][key].items()}
    for ckpt, path in zip(ckpts, paths):
        if key not in ckpt:
            raise UserError(f"checkpoint {path} holds no {key} weights but {paths[0]} does; average checkpoints "
                            "of one run")
        if {k: v.shape for k, v in ckpt[key].items()} != first:
            raise UserError(f"checkpoint {path} holds another model than {paths[0]} (other tensor names or "
                            "shapes); average checkpoints of one run")


DATA_KEYS = ("name", "root", "train_split")  # the run's training data: compared for files from before run ids


def check_one_run(ckpts: list[dict[str, Any]], paths: list[Path]) -> None:
    """Every file is of the newest file's run, else one line naming the odd file: a folder can hold another run's
    later epoch files (a run started over in it), whose names and shapes may well agree."""
    for ckpt, path in zip(ckpts, paths):
        differs = run_difference(ckpt, ckpts[-1])
        if differs:
            raise UserError(f"checkpoint {path} is of another run than {paths[-1]}: {differs}; average the epoch "
                            f"files of one run (move the other run's out of {path.parent}, or lower --last)")


def run_difference(ckpt: dict[str, Any], newest: dict[str, Any]) -> str:
    """What shows `ckpt` is of another run than `newest`: class names, model, run id (or, for a file from before
    run ids, its training data); "" when nothing does."""
    if list(ckpt["class_names"]) != list(newest["class_names"]):
        return "other class names"
    models = [(c["config"].get("model") or {}).get("name") for c in (ckpt, newest)]
    if models[0] != models[1]:
        return f"another model ({models[0]} vs {models[1]})"
    ids = [c.get("run_id") for c in (ckpt, newest)]
    if all(ids):
        return f"another run id ({ids[0]} vs {ids[1]})" if ids[0] != ids[1] else ""
    data = [tuple((c["config"].get("data") or {}).get(key) for key in DATA_KEYS) for c in (ckpt, newest)]
    return f"other training data (data.name, root, train_split: {data[0]} vs {data[1]})" if data[0] != data[1] else ""


def average_checkpoints(paths: list[Path]) -> dict[str, Any]:
    """The averaged checkpoint: mean model weights (and EMA weights where every file has them), the newest
    checkpoint's config and class names."""
    ckpts = []
    for path in paths:
        ckpt = load_checkpoint(path)
        if not all(key in ckpt for key in ("model", "config", "class_names")):
            raise UserError(f"checkpoint {path} was not written by train.py (no model, config or class names)")
        ckpts.append(ckpt)
    check_one_run(ckpts, paths)
    newest = ckpts[-1]
    without_ema = [path.name for ckpt, path in zip(ckpts, paths) if "ema" not in ckpt]
    keys = ["model"] + (["ema"] if not without_ema else [])
    if without_ema and len(without_ema) < len(paths):
        print(f"the EMA weights are not averaged: none in {', '.join(without_ema)} (the EMA was switched on at a "
              "resume); the model weights are")
    for key in keys:
        check_same_model(ckpts, paths, key)
    return {
        **{key: average_state_dicts([ckpt[key] for ckpt in ckpts]) for key in keys},
        "averaged_from": [path.name for path in paths],
        "epoch": newest.get("epoch"),
        "best_metric": newest.get("best_metric", "val_top1"),
        "class_names": list(newest["class_names"]),
        "config": newest["config"],
        **{key: newest[key] for key in ("data_sizes", "started_from") if key in newest},  # the model card's
    }


def is_averaged(path: Path) -> bool:
    """An earlier output of this tool (a checkpoint with `averaged_from`), which --output may replace."""
    try:
        return "averaged_from" in load_checkpoint(path)
    except UserError:
        return False

