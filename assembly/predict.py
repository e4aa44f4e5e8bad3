"""predict.py's work: a trained model's top-k classes (or, multi-label, the classes above their thresholds) for
images given as files, folders or a list, every rank predicting its share."""

from __future__ import annotations
import argparse
import json
import logging
from pathlib import Path
from typing import Any
import torch

from assembly.inference import inference_model, open_trained, pipeline_line, shared_output_dir, start_processes
from core.config import Config
from core.config_load import parse_override
from core.dist import DistInfo, barrier, rank0_decides, read_launch_env
from core.errors import UserError
from core.files import CSV_OUTPUT, merge_parts, part_file, starts_with, write_csv, write_output
from core.logs import setup_logging
from data.datasets import ImageListDataset, find_images
from data.loader import build_eval_loader, collate_channels_last
from data.transforms import DeviceNormalize, eval_size, eval_transform
from engine.checkpoint.inference import Trained, ema_hint, precision_line
from engine.checkpoint.run_store import beside, fetched, output_at
from engine.evaluation import exact_kernels
from engine.precision import Precision, resolve_precision
from models.tta import CROPS, TTAModel, describe

log = logging.getLogger(__name__)
JSON_OUTPUT = starts_with(b'{\n "checkpoint": ')  # predictions.json as written below (indent=1)
OUTPUTS = {"predictions.csv": CSV_OUTPUT, "predictions.json": JSON_OUTPUT}


def collate_predictions(samples: list[tuple[torch.Tensor | None, int, str]]
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None, list[tuple[int, str]]]:
    """(readable images as a channels_last uint8 batch or None, their indices, (index, error) of the others)."""
    kept = [(image, index) for image, index, _ in samples if image is not None]
    failed = [(index, error) for image, index, error in samples if image is None]
    if not kept:
        return None, None, failed
    images, indices = collate_channels_last(kept)
    return images, indices, failed


def columns(k: int) -> list[str]:
    """predictions.csv's columns for the top k classes (the part files add the error column)."""
    return ["index", "path"] + [f"{name}_{i}" for i in range(1, k + 1) for name in ("class", "prob")]


ML_COLUMNS = ["index", "path", "labels", "probs"]  # multi-label predictions.csv


def class_thresholds(args: argparse.Namespace, trained: Trained) -> torch.Tensor:
    """Multi-label: each class's threshold (--thresholds eval.json, else --threshold or the model's own)."""
    if not trained.multi_label:
        if args.threshold is not None or args.thresholds:
            raise UserError(f"--threshold and --thresholds apply to multi-label models; {trained.source} is not one")
        return torch.zeros(0)
    if args.threshold is not None:
        check_threshold(args.threshold, "--threshold")
    chosen = [args.threshold or trained.threshold] * len(trained.class_names)
    if args.thresholds:
        try:
            per_class = {entry["class"]: float(entry["threshold"])
                         for entry in json.loads(Path(args.thresholds).read_text())["per_class"]}
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UserError(f"--thresholds {args.thresholds}: not an eval.json of evaluate.py --tune-thresholds "
                            f"({type(err).__name__}: {err})") from None
        missing = [name for name in trained.class_names if name not in per_class]
        if missing:
            raise UserError(f"--thresholds {args.thresholds} has no threshold for class {missing[0]!r} of "
                            f"{trained.source}")
        chosen = [per_class[name] for name in trained.class_names]
        for name, value in zip(trained.class_names, chosen):
            check_threshold(value, f"--thresholds {args.thresholds}: class {name!r}'s threshold")
    return torch.tensor(chosen, dtype=torch.float32)


def check_threshold(value: float, what: str) -> None:
    """A threshold some probability can reach: in (0, 1] (a tuned one may be a probability of 1.0, saturated in
    float32); NaN or 5 would predict no label at all, and 0 every label."""
    if not 0 < value <= 1:
        raise UserError(f"{what} must be in (0, 1], got {value}")


def multi_label_rows(logits: torch.Tensor, indices: list[int], dataset: ImageListDataset, class_names: list[str],
                     thresholds: torch.Tensor) -> list[dict[str, Any]]:
    """Rows of a multi-label model: the classes at or above their thresholds, and every class's probability."""
    probs = logits.float().sigmoid().cpu()
    present = probs >= thresholds
    return [{"index": index, "path": dataset.path(index), "error": "",
             "labels": "|".join(name for name, on in zip(class_names, row_present.tolist()) if on),
             "probs": " ".join(f"{value:.6f}" for value in row.tolist())}
            for index, row, row_present in zip(indices, probs, present)]


@torch.no_grad()
def predict(model: torch.nn.Module, loader, dataset: ImageListDataset, class_names: list[str], k: int,
            cfg: Config, info: DistInfo, precision: Precision, thresholds: torch.Tensor | None = None
            ) -> list[dict[str, Any]]:
    """This rank's rows, in input order: top-k names and probabilities (multi-label, with `thresholds`: the
    classes above them and every probability), or the error of an unreadable file."""
    normalize = DeviceNormalize(cfg.data.mean, cfg.data.std, info.device, cfg.model.channels_last)
    rows: list[dict[str, Any]] = []
    for images, indices, failed in loader:
        rows += [{"index": index, "path": dataset.path(index), "error": error} for index, error in failed]
        if images is None:
            continue
        with precision.autocast(), exact_kernels(info.device, precision.tf32):  # the kernels evaluate.py and validation use
            logits = model(normalize(images.to(info.device)))
        if thresholds is not None:
            rows += multi_label_rows(logits, indices.tolist(), dataset, class_names, thresholds)
            continue
        probs, ranked = logits.float().softmax(dim=1).topk(k, dim=1)
        for index, top, p in zip(indices.tolist(), ranked.tolist(), probs.tolist()):
            row = {"index": index, "path": dataset.path(index), "error": ""}
            for i, (c, value) in enumerate(zip(top, p), start=1):
                row[f"class_{i}"], row[f"prob_{i}"] = class_names[c], f"{value:.6f}"
            rows.append(row)
    return sorted(rows, key=lambda row: row["index"])


def settings(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """--batch-size and the dotted overrides, as (key, value) pairs for the stored config."""
    pairs = []
    if args.batch_size is not None:
        if args.batch_size <= 0:
            raise UserError(f"--batch-size must be > 0, got {args.batch_size}")
        pairs.append(("train.batch_size", args.batch_size))
    if args.topk <= 0:
        raise UserError(f"--topk must be > 0, got {args.topk}")
    if args.tta_crops not in CROPS:
        raise UserError(f"--tta-crops must be 1 (centre crop) or 5 (centre and four corners), got {args.tta_crops}")
    pairs.append(("model.grad_checkpointing", False))  # a training option: plain forward passes here
    return pairs + [parse_override(item) for item in args.overrides]


def run(trained: Trained, cfg: Config, args: argparse.Namespace, info: DistInfo, out: Path) -> dict[str, Any] | None:
    """Predict on every rank, writing to the local folder `out`; rank 0 merges, writes and returns the summary."""
    paths = rank0_decides(lambda: find_images(args.inputs))
    if len(paths) < info.world_size:
        raise UserError(f"{len(paths)} image(s) for {info.world_size} processes; use fewer processes")
    thresholds = class_thresholds(args, trained)
    if trained.multi_label and (args.tta_flip or args.tta_crops > 1):
        raise UserError(f"{trained.source} is multi-label: --tta-flip and --tta-crops (averaged softmax "
                        "probabilities) do not apply to it; predict without them")
    shared_output_dir(out, OUTPUTS)  # every rank writes its part file there
    dataset = ImageListDataset(paths, eval_transform(cfg.data, args.tta_crops), cfg.data.max_image_pixels)
    loader = build_eval_loader(dataset, cfg.data, cfg.train.batch_size, info, collate_fn=collate_predictions)
    model = inference_model(trained, cfg, info.device)
    if args.tta_flip or args.tta_crops > 1:
        model = TTAModel(model, args.tta_flip, args.tta_crops)
    k = min(args.topk, len(trained.class_names))
    if info.is_main:
        log.info("predicting %d images with %s (%s, %d classes), %d process(es), batch %d per process",
                 len(paths), trained.source, cfg.model.name, len(trained.class_names), info.world_size,
                 cfg.train.batch_size)
    precision = resolve_precision(cfg.amp, info.device, tf32=cfg.tf32)
    if info.is_main:
        if line := pipeline_line(trained, cfg):
            log.info(line)
        log.info(precision_line(cfg.amp, precision.described, cfg.eval_amp))
    multi = trained.multi_label
    shown = ML_COLUMNS if multi else columns(k)
    rows = predict(model, loader, dataset, trained.class_names, k, cfg, info, precision,
                   thresholds if multi else None)
    write_csv(rows, part_file(out, "predictions", info.rank), [*shown, "error"])
    barrier()  # every part file is complete before rank 0 reads them
    if not info.is_main:
        return None
    rows = merge_parts(out, "predictions", info.world_size, len(paths))
    good = [{key: row[key] for key in shown} for row in rows if not row["error"]]
    unreadable = [{"path": row["path"], "error": row["error"]} for row in rows if row["error"]]
    for row in unreadable:
        log.warning("skipped: %s", row["error"])
    write_csv(good, out / "predictions.csv", shown)
    size, crop_pct = eval_size(cfg.data)
    result = {"checkpoint": str(args.checkpoint), "ema": args.ema, "img_size": size, "crop_pct": crop_pct,
              "precision": precision.name, "tta": describe(args.tta_flip, args.tta_crops), "n": len(good), "unreadable": unreadable}
    if multi:
        result.update(multi_label=True, thresholds=dict(zip(trained.class_names, thresholds.tolist())),
                      predictions=[{"index": int(row["index"]), "path": row["path"],
                                    "labels": [name for name in row["labels"].split("|") if name],
                                    "probs": dict(zip(trained.class_names, map(float, row["probs"].split())))}
                                   for row in good])
    else:
        result["predictions"] = [{"index": int(row["index"]), "path": row["path"],
                                  "top": [{"class": row[f"class_{i}"], "prob": float(row[f"prob_{i}"])}
                                          for i in range(1, k + 1)]} for row in good]
    text = json.dumps(result, indent=1, ensure_ascii=False) + "\n"
    write_output(out / "predictions.json", text.encode("utf-8", "surrogateescape"), JSON_OUTPUT,
                 "an earlier predictions.json of predict.py", "--output-dir")
    return {**result, "output_dir": str(out)}


def predict_command(args: argparse.Namespace) -> int:
    """predict.py on every rank, after its arguments are parsed; rank 0 says what it wrote."""
    setup_logging(read_launch_env()[0])  # before a checkpoint is fetched from a URL (its retries are logged)
    target = args.output_dir or beside(args.checkpoint, f"predict-{Path(args.inputs).stem or 'inputs'}")  # (a URL's)
    args.checkpoint = fetched(args.checkpoint)  # a URL: copied to its local mirror (engine/checkpoint/run_store.py)
    trained, cfg = open_trained(args.checkpoint, args.ema, settings(args))
    info = start_processes(cfg)
    if (hint := ema_hint(trained.source, trained.best_metric, args.ema)) and info.is_main:
        log.warning(hint)
    with output_at(target, info.is_main) as out:  # a URL: written to its local mirror, then uploaded
        result = run(trained, cfg, args, info, out)  # report_errors leaves the process group, after any error
    if result is not None:
        skipped = len(result["unreadable"])
        print(f"predicted {result['n']} image(s), {skipped} unreadable skipped; wrote predictions.csv and "
              f"predictions.json to {target}")
    return 0
