"""evaluate.py's work: a trained model (checkpoint, last.dcp or exported folder) on a labelled split, exact over
any number of processes: metrics, per-image predictions merged from every rank, a confusion matrix, W&B."""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from assembly.inference import inference_model, open_trained, pipeline_line, shared_output_dir, start_processes
from core.config import Config, DataConfig, to_dict
from core.config_load import parse_override
from core.dist import DistInfo, barrier, read_launch_env
from core.errors import UserError
from core.files import (CSV_OUTPUT, merge_parts, part_file, starts_with, write_csv,
                        write_output)
from core.logs import setup_logging
from core.store import is_url
from data.datasets import AugmentedDataset, ImageFolderDataset
from data.loader import build_eval_loader, build_val_dataset, prepare_data
from data.mirror import errors_by_url, local_root, named_by_url, shown
from data.split import FILES, saved_split
from data.transforms import DeviceNormalize, eval_size, eval_transform
from engine.checkpoint.inference import Trained, ema_hint, precision_line
from engine.checkpoint.run_store import beside, fetched, output_at
from engine.checkpoint.weights import MODEL_CONFIG
from engine.evaluation import (best_thresholds, confidence_and_loss, evaluate, evaluate_multilabel,
                               multilabel_metrics)
from engine.label_issues import most_confused
from engine.metrics import (ECE_BINS, calibration_bins, class_metrics, class_report, confusion_matrix,
                            expected_calibration_error)
from engine.plots import PNG, confusion_figure, image_grid, plot_reliability, readable, save_png
from engine.precision import resolve_precision
from engine.tracking import WandbTracker
from models.tta import CROPS, TTAModel, describe

log = logging.getLogger(__name__)
COLUMNS = ("index", "path", "label", "pred", "confidence", "top5", "label_name", "pred_name", "loss")
TOP_LOSSES = 16  # images in top_losses.png and eval.json's top_losses (fastai's plot_top_losses)
MOST_CONFUSED = 20  # class pairs in eval.json's most_confused (fastai's most_confused), most images first
CONFUSION_MAX = 1000  # classes up to which confusion_matrix.png is drawn (C x C counts on the host: 8 MB at 1000)
ML_COLUMNS = ("index", "path", "labels", "pred", "label_names", "pred_names", "probs", "loss")  # multi-label
NUMBERS = {"index": int, "label": int, "pred": int, "confidence": float, "loss": float}  # as numbers in W&B's table
ML_NUMBERS = {"index": int, "loss": float}  # multi-label: labels, pred and probs are lists of numbers (text)
OUTPUTS = {"eval.json": starts_with(b'{\n  "checkpoint": '), "predictions.csv": CSV_OUTPUT,  # as written here
           "confusion_matrix.png": PNG, "reliability.png": PNG, "top_losses.png": PNG,
           "per_class.csv": starts_with(b"class,positives,ap,")}  # multi-label


def settings(args: argparse.Namespace, folder: bool) -> list[tuple[str, Any]]:
    """--data-dir, --batch-size and the dotted overrides as (key, value) for the stored config. A model folder
    records no data: it needs --data-dir."""
    check_tta(args)
    found: list[tuple[str, Any]] = []
    if args.data_dir:  # always an ImageFolder root (never a digits cache to (re)write, never dummy data), and its
        # own images, never the run's val.txt looked up in it (scored_images)
        found += [("data.name", "imagefolder"), ("data.root", args.data_dir), ("data.val_fraction", 0.0)]
    elif folder:
        raise UserError(f"model folder {args.checkpoint} records no data set; give --data-dir (an ImageFolder root "
                        "holding <data.val_split>/<class>/*)")
    if args.batch_size is not None:
        if args.batch_size <= 0:
            raise UserError(f"--batch-size must be > 0, got {args.batch_size}")
        found.append(("train.batch_size", args.batch_size))
    return found + [parse_override(item) for item in args.overrides]


def check_split(cfg: Config, trained: Trained, args: argparse.Namespace) -> None:
    """data.val_fraction / data.split_seed overrides: evaluate.py never splits data anew (a new split of the run's
    images would score images it trained on), so one it would not follow is refused. data.val_fraction=0 is followed:
    data.root's data.val_split is scored instead of the run's val.txt."""
    stored, data_dir = trained.config.get("data", {}), args.data_dir
    fraction = cfg.data.val_fraction
    ignored = [f"data.val_fraction={fraction}"] if fraction and (data_dir or fraction != stored.get(
        "val_fraction", DataConfig.val_fraction)) else []
    if cfg.data.split_seed != stored.get("split_seed", DataConfig.split_seed):
        ignored.append(f"data.split_seed={cfg.data.split_seed}")
    if not ignored:
        return
    if data_dir:
        scored = f"--data-dir {data_dir}'s {cfg.data.val_split}/ split, or every image of its class folders"
    elif stored.get("val_fraction"):
        scored = f"the run's validation list, {FILES['val']} beside {args.checkpoint}"
    else:
        scored = f"data.root's data.val_split={cfg.data.val_split}"
    raise UserError(f"{' '.join(ignored)}: evaluate.py never splits data anew (a new split of the run's images would "
                    f"score images it trained on); it scores {scored}: drop {'them' if len(ignored) > 1 else 'it'}, "
                    "or give --data-dir FOLDER to score another folder's images")


def scored_images(cfg: Config, args: argparse.Namespace, info: DistInfo, class_names: list[str]
                  ) -> tuple[AugmentedDataset, str]:
    """The images to score and where they are, for the output. --data-dir: its data.val_split folder, or (it has none
    and no data.train_split folder either) every image of its class folders, whatever split the run used; else the
    run's own validation data (data.val_fraction: exactly its val.txt)."""
    data = cfg.data
    if args.data_dir and data.name == "imagefolder":
        prepare_data(data, info.local_rank)  # a URL: copied to its local mirror (data/mirror.py)
        root = Path(local_root(data))
        named = shown(str(root), data)  # as the user wrote it: a URL, not its mirror
        split_given = any(parse_override(item)[0] == "data.val_split" for item in args.overrides)
        if not (split_given or (root / data.val_split).is_dir() or (root / data.train_split).is_dir()):
            with errors_by_url(data):
                dataset = named_by_url(ImageFolderDataset(root, eval_transform(data, args.tta_crops), cfg.seed,
                                                          class_names, max_pixels=data.max_image_pixels), data)
            return dataset, f"every image under {named}'s class folders (it has no {data.val_split}/ split folder)"
        dataset = build_val_dataset(data, cfg.seed, info.local_rank, class_names, args.tta_crops)
        return dataset, f"{named}/{data.val_split} (the {data.val_split} split of --data-dir)"
    split = saved_split(data, args.checkpoint)
    dataset = build_val_dataset(data, cfg.seed, info.local_rank, class_names, args.tta_crops, split)
    if split is not None:
        return dataset, (f"the run's validation list {Path(args.checkpoint).parent / FILES['val']} (data.val_fraction="
                         f"{data.val_fraction} of {data.root})")
    where = f" in {data.root}" if data.name not in ("dummy", "digits") else ""
    return dataset, f"the {data.val_split} split of data.name={data.name}{where}"


def check_options(cfg: Config, args: argparse.Namespace) -> None:
    """The options that do not apply to the model's kind (single- or multi-label)."""
    if cfg.data.multi_label and (args.tta_flip or args.tta_crops > 1):
        raise UserError(f"checkpoint {args.checkpoint} is multi-label: --tta-flip and --tta-crops (averaged softmax "
                        "probabilities) do not apply to it; evaluate without them")
    if args.tune_thresholds and not cfg.data.multi_label:
        raise UserError(f"--tune-thresholds applies to multi-label checkpoints; {args.checkpoint} is single-label")


class PredictionWriter:
    """Collects this rank's per-image predictions from evaluate()'s on_batch hook, in order.

    Batches stay on the device until `write`: reading them on the host per batch would wait for the device.
    """

    def __init__(self, dataset: AugmentedDataset, start: int, class_names: list[str]) -> None:
        self.dataset, self.start, self.class_names = dataset, start, class_names
        self.batches: list[tuple[torch.Tensor, ...]] = []

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, ranked: torch.Tensor) -> None:
        confidence, losses = confidence_and_loss(logits, targets, ranked)
        self.batches.append((targets, ranked, confidence, losses))

    def rows(self) -> list[dict[str, Any]]:
        """One dict per image, with the classes ranked as the top-1/top-5 metrics ranked them."""
        if not self.batches:
            return []
        targets, ranked, confidence, losses = (torch.cat(parts).tolist() for parts in zip(*self.batches))
        rows = []
        for offset, (label, indices, value, loss) in enumerate(zip(targets, ranked, confidence, losses)):
            index = self.start + offset
            rows.append({"index": index, "path": self.dataset.path(index), "label": label, "pred": indices[0],
                         "confidence": f"{value:.6f}", "top5": " ".join(map(str, indices)),
                         "label_name": self.class_names[label], "pred_name": self.class_names[indices[0]],
                         "loss": repr(loss)})
        return rows

    def write(self, path: Path) -> None:
        write_csv(self.rows(), path, COLUMNS)


class MultiLabelWriter:
    """PredictionWriter for multi-label data: each image's sigmoid probabilities and the classes above threshold."""

    def __init__(self, dataset: AugmentedDataset, start: int, class_names: list[str], threshold: float) -> None:
        self.dataset, self.start, self.class_names, self.threshold = dataset, start, class_names, threshold
        self.batches: list[tuple[torch.Tensor, ...]] = []

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        losses = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets, reduction="none").mean(1)
        self.batches.append((targets, logits.sigmoid(), losses))

    def rows(self) -> list[dict[str, Any]]:
        if not self.batches:
            return []
        targets, probs, losses = (torch.cat(parts).tolist() for parts in zip(*self.batches))
        rows = []
        for offset, (target, prob, loss) in enumerate(zip(targets, probs, losses)):
            index = self.start + offset
            true = [c for c, t in enumerate(target) if t]
            pred = [c for c, p in enumerate(prob) if p >= np.float32(self.threshold)]
            rows.append({"index": index, "path": self.dataset.path(index), "labels": " ".join(map(str, true)),
                         "pred": " ".join(map(str, pred)), "label_names": "|".join(self.class_names[c] for c in true),
                         "pred_names": "|".join(self.class_names[c] for c in pred),
                         "probs": " ".join(map(repr, prob)), "loss": repr(loss)})
        return rows

    def write(self, path: Path) -> None:
        write_csv(self.rows(), path, ML_COLUMNS)


def read_multilabel(rows: list[dict[str, str]], num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(0/1 targets, float32 probabilities) of predictions.csv's multi-label rows, as evaluated."""
    targets = np.zeros((len(rows), num_classes), np.float32)
    for i, row in enumerate(rows):
        targets[i, [int(c) for c in row["labels"].split()]] = 1
    probs = np.array([row["probs"].split() for row in rows], dtype=np.float64).astype(np.float32)
    return targets, probs.reshape(len(rows), num_classes)


def summarize_multilabel(rows: list[dict[str, str]], metrics: dict[str, float], class_names: list[str],
                         threshold: float, tune: bool, checkpoint: str, ema: bool) -> dict[str, Any]:
    """eval.json contents for multi-label data, computed from predictions.csv (checked against the gathered run)."""
    targets, probs = read_multilabel(rows, len(class_names))
    found = multilabel_metrics(targets, probs, threshold)
    if (found["map"], found["f1"]) != (metrics["val_map"], metrics["val_f1"]):
        raise RuntimeError("predictions.csv disagrees with the gathered mAP / F1")
    per_class = [{"class": name, "positives": found["positives"][c], "ap": found["per_class_ap"][c],
                  "f1": found["per_class_f1"][c], "tp": found["tp"][c], "fp": found["fp"][c], "fn": found["fn"][c]}
                 for c, name in enumerate(class_names)]
    result = {"checkpoint": checkpoint, "ema": ema, "n": len(rows), "multi_label": True, "threshold": threshold,
              "map": found["map"], "map_micro": found["map_micro"], "f1": found["f1"], "f1_macro": found["f1_macro"],
              # Sum of per-image losses (mean BCE over classes), correctly rounded: the same for any number of processes.
              "loss": math.fsum(float(row["loss"]) for row in rows) / len(rows)}
    if tune:  # chosen on this set: an optimistic F1 unless the set is a validation split kept apart from the test
        chosen = best_thresholds(targets, probs)
        tuned = multilabel_metrics(targets, probs, chosen.astype(np.float32))
        result.update(f1_tuned=tuned["f1"], f1_macro_tuned=tuned["f1_macro"])
        for c, entry in enumerate(per_class):
            entry.update(threshold=float(chosen[c]), f1_tuned=tuned["per_class_f1"][c])
    result["per_class"] = per_class
    return result


def per_class_table(result: dict[str, Any]) -> bytes:
    """per_class.csv: one row per class (AP and F1 in percent; an AP is empty for a class with no positive image)."""
    columns = ["class", "positives", "ap", "f1", "tp", "fp", "fn", "threshold", "f1_tuned"]
    lines = [",".join(columns)]
    for entry in result["per_class"]:
        cells = ["" if entry.get(key) is None else entry[key] for key in columns]
        cells[0] = '"' + str(cells[0]).replace('"', '""') + '"'
        lines.append(",".join(str(cell) for cell in cells))
    return ("\n".join(lines) + "\n").encode("utf-8", errors="surrogateescape")


def calibration(rows: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
    """(top-1 confidence, correct) per image, as predictions.csv holds them (confidence to 6 decimals)."""
    return (np.array([float(row["confidence"]) for row in rows]),
            np.array([row["label"] == row["pred"] for row in rows]))


def summarize(rows: list[dict[str, str]], metrics: dict[str, float], class_names: list[str],
              checkpoint: str, ema: bool) -> tuple[dict[str, Any], np.ndarray | None]:
    """eval.json contents and the confusion matrix (rows: true class, columns: predicted class), the latter only up
    to CONFUSION_MAX classes (per-class results come from 3 x C counts at any class count)."""
    labels = np.array([int(row["label"]) for row in rows])
    preds = np.array([int(row["pred"]) for row in rows])
    num_classes = len(class_names)
    counts = np.stack([np.bincount(labels[labels == preds], minlength=num_classes),
                       np.bincount(labels, minlength=num_classes), np.bincount(preds, minlength=num_classes)])
    if round(metrics["val_top1"] * len(rows) / 100.0) != int(counts[0].sum()):
        raise RuntimeError("predictions.csv disagrees with the all-reduced top-1 count")
    if any(metrics.get(key) != value for key, value in class_metrics(torch.from_numpy(counts), class_names).items()):
        raise RuntimeError("predictions.csv disagrees with the all-reduced per-class counts")
    per_class, means = class_report(counts, class_names)
    for c, entry in enumerate(per_class):
        n = int(counts[1, c])
        entry.update(n=n, top1=100.0 * int(counts[0, c]) / n if n else None)
    confusion = None
    if num_classes <= CONFUSION_MAX:
        confusion = confusion_matrix(labels, preds, num_classes)
    result = {
        "checkpoint": checkpoint,
        "ema": ema,
        "n": len(rows),
        "top1": metrics["val_top1"],
        "top5": metrics["val_top5"],
        "balanced_acc": metrics["val_balanced_acc"],  # mean of the per-class top1 (recall) of the classes present
        "macro_f1": metrics["val_macro_f1"],  # = means["macro_f1"]: the same counts, the same arithmetic
        **{key: value for key, value in means.items() if key != "macro_f1"},
        # Sum of per-image losses, correctly rounded (math.fsum): the same for any number of processes.
        "loss": math.fsum(float(row["loss"]) for row in rows) / len(rows),
        # Of predictions.csv's confidences: anyone recomputes it from the file (Guo et al. 2017, ECE_BINS bins)
        "ece": expected_calibration_error(*calibration(rows)),
        "ece_bins": ECE_BINS,
        "per_class": per_class,
        "most_confused": [{"actual": class_names[a], "predicted": class_names[p], "images": n}
                          for a, p, n in most_confused(labels, preds, num_classes)[:MOST_CONFUSED]],
        "top_losses": top_loss_rows(rows, class_names),
    }
    return result, confusion


def top_loss_rows(rows: list[dict[str, str]], class_names: list[str]) -> list[dict[str, Any]]:
    """The TOP_LOSSES images of predictions.csv with the largest loss, largest first (ties in index order)."""
    order = sorted(range(len(rows)), key=lambda i: -float(rows[i]["loss"]))[:TOP_LOSSES]
    return [{"index": int(rows[i]["index"]), "path": rows[i]["path"], "actual": class_names[int(rows[i]["label"])],
             "predicted": class_names[int(rows[i]["pred"])], "confidence": float(rows[i]["confidence"]),
             "loss": float(rows[i]["loss"])} for i in order]


def plot_top_losses(dataset: AugmentedDataset, top: list[dict[str, Any]], crops: int, path: Path, title: str) -> None:
    """top_losses.png: each image as the model got it (the eval pipeline, before normalization; the centre view of
    --tta-crops 5), captioned actual / predicted / loss / confidence, as fastai's plot_top_losses."""
    images = []
    for entry in top:
        image = dataset[entry["index"]][0].permute(1, 2, 0).numpy()
        images.append(image[: image.shape[0] // crops])  # ResizeFiveCrop stacks the centre crop on top
    captions = [f"{readable(e['actual'])} -> {readable(e['predicted'])}\nloss {e['loss']:.2f}  p {e['confidence']:.2f}"
                for e in top]
    save_png(image_grid(images, captions, title), path, OUTPUTS[path.name], f"an earlier {path.name} of evaluate.py",
             "--output-dir")


def plot_confusion(confusion: np.ndarray, class_names: list[str], path: Path, title: str) -> None:
    """confusion_matrix.png: engine.plots.confusion_figure, replaced atomically."""
    save_png(confusion_figure(confusion, class_names, title), path, OUTPUTS[path.name],
             f"an earlier {path.name} of evaluate.py", "--output-dir")


def check_tta(args: argparse.Namespace) -> None:
    """--tta-crops is 1 or 5."""
    if args.tta_crops not in CROPS:
        raise UserError(f"--tta-crops must be 1 (centre crop) or 5 (centre and four corners), got {args.tta_crops}")


def tta_views(args: argparse.Namespace) -> int:
    return describe(args.tta_flip, args.tta_crops)["views"]


def run(cfg: Config, trained: Trained, args: argparse.Namespace, info: DistInfo, out: Path) -> dict[str, Any] | None:
    """Evaluate on every rank, writing to the local folder `out`; rank 0 returns the eval.json contents."""
    class_names = trained.class_names
    shared_output_dir(out, OUTPUTS)  # every rank writes its part file there
    # Labelled with the checkpoint's class map: classes the data lacks are fine, unknown ones are refused.
    dataset, where = scored_images(cfg, args, info, class_names)
    loader = build_eval_loader(dataset, cfg.data, cfg.train.batch_size, info)
    model = inference_model(trained, cfg, info.device)
    if args.tta_flip or args.tta_crops > 1:
        model = TTAModel(model, args.tta_flip, args.tta_crops)
    precision = resolve_precision(cfg.amp, info.device, tf32=cfg.tf32)
    size, crop_pct = eval_size(cfg.data)
    log.info("evaluating %s (%s, %s) on %d images (%s) at %d px (crop_pct %s), %d view(s) each, %d process(es), "
             "batch %d per process", args.checkpoint, cfg.model.name, "EMA weights" if args.ema else "weights",
             len(dataset), where, size, crop_pct, tta_views(args), info.world_size, cfg.train.batch_size)
    if line := pipeline_line(trained, cfg):
        log.info(line)
    log.info(precision_line(cfg.amp, precision.described, cfg.eval_amp))
    normalize = DeviceNormalize(cfg.data.mean, cfg.data.std, info.device, cfg.model.channels_last)
    if cfg.data.multi_label:
        return run_multilabel(cfg, args, info, out, dataset, loader, model, precision, normalize, class_names,
                              trained.wandb_id, where)
    writer = PredictionWriter(dataset, loader.sampler.start, class_names)
    metrics = evaluate(model, loader, precision, info, normalize, on_batch=writer)
    rows = merged_predictions(writer, out, info, len(dataset), COLUMNS)
    if rows is None:
        return None
    result, confusion = summarize(rows, metrics, class_names, str(args.checkpoint), args.ema)
    result.update(img_size=size, crop_pct=crop_pct, precision=precision.name,
                  tta=describe(args.tta_flip, args.tta_crops), scored=where)
    write_output(out / "eval.json", (json.dumps(result, indent=2) + "\n").encode(), OUTPUTS["eval.json"],
                 "an earlier eval.json of evaluate.py", "--output-dir")
    title = f"{cfg.model.name} on {len(rows)} images: top-1 {result['top1']:.2f}%"
    if confusion is not None:
        plot_confusion(confusion, class_names, out / "confusion_matrix.png", title)
    else:
        log.info("%d classes: no confusion_matrix.png (written up to %d classes); eval.json has the per-class "
                 "results", len(class_names), CONFUSION_MAX)
    if result["top_losses"]:
        plot_top_losses(dataset, result["top_losses"], args.tta_crops, out / "top_losses.png",
                        f"{cfg.model.name}: the {len(result['top_losses'])} largest losses (actual -> predicted)")
    plot_reliability(calibration_bins(*calibration(rows)), out / "reliability.png",
                     f"{cfg.model.name}: ECE {result['ece']:.2f}% ({ECE_BINS} bins)", OUTPUTS["reliability.png"])
    log_to_wandb(cfg, args, result, out, rows, trained.wandb_id)
    result["output_dir"] = str(out)
    return result


def merged_predictions(writer: PredictionWriter | MultiLabelWriter, out: Path, info: DistInfo, total: int,
                       columns: tuple[str, ...]) -> list[dict] | None:
    """Each rank writes its part; rank 0 merges them in the global order into predictions.csv and gets the rows
    (None on the other ranks)."""
    writer.write(part_file(out, "predictions", info.rank))
    barrier()  # every part file is complete before rank 0 reads them
    if not info.is_main:
        return None
    rows = merge_parts(out, "predictions", info.world_size, total)
    write_csv(rows, out / "predictions.csv", columns)
    return rows


def run_multilabel(cfg: Config, args: argparse.Namespace, info: DistInfo, out: Path, dataset: AugmentedDataset,
                   loader: torch.utils.data.DataLoader, model: torch.nn.Module, precision, normalize: DeviceNormalize,
                   class_names: list[str], trained_run_id: str | None, where: str) -> dict[str, Any] | None:
    """run() for multi-label data: predictions.csv with probabilities, eval.json with mAP/F1, per_class.csv."""
    threshold = cfg.data.multi_label_threshold
    writer = MultiLabelWriter(dataset, loader.sampler.start, class_names, threshold)
    metrics = evaluate_multilabel(model, loader, precision, info, normalize, threshold, on_batch=writer)
    rows = merged_predictions(writer, out, info, len(dataset), ML_COLUMNS)
    if rows is None:
        return None
    result = summarize_multilabel(rows, metrics, class_names, threshold, args.tune_thresholds, str(args.checkpoint),
                                  args.ema)
    size, crop_pct = eval_size(cfg.data)
    result.update(img_size=size, crop_pct=crop_pct, precision=precision.name, scored=where)
    write_output(out / "eval.json", (json.dumps(result, indent=2) + "\n").encode(), OUTPUTS["eval.json"],
                 "an earlier eval.json of evaluate.py", "--output-dir")
    write_output(out / "per_class.csv", per_class_table(result), OUTPUTS["per_class.csv"],
                 "an earlier per_class.csv of evaluate.py", "--output-dir")
    log_to_wandb(cfg, args, result, out, rows, trained_run_id)
    result["output_dir"] = str(out)
    return result


def log_to_wandb(cfg: Config, args: argparse.Namespace, result: dict[str, Any], out: Path,
                 rows: list[dict[str, str]], trained_run_id: str | None) -> None:
    """With logging.wandb on (stored or overridden), an "eval" W&B run gets the metrics, matrix (single-label) and
    predictions; the checkpoint of a tracked training that logged its checkpoints is declared as the run's input.
    Per class: top-1, or (multi-label) AP."""
    tracker = WandbTracker(cfg.logging, is_main=True)  # rank 0 only; never raises
    multi = bool(result.get("multi_label"))
    tracker.start({**to_dict(cfg), "checkpoint": str(args.checkpoint), "ema": args.ema}, out, job_type="eval")
    per_class = {c["class"]: c["ap"] if multi else c["top1"] for c in result["per_class"]}
    matrix = out / "confusion_matrix.png" if not multi and len(per_class) <= CONFUSION_MAX else None
    tracker.log_evaluation({**result, "per_class": per_class}, matrix, rows, ML_NUMBERS if multi else NUMBERS)
    tracker.use_model(args.checkpoint, trained_run_id)
    tracker.finish()


def evaluated(args: argparse.Namespace) -> dict[str, Any] | None:
    """evaluate.py's work on every rank, after its arguments are parsed: eval.json's contents (and its output_dir) on
    rank 0, None elsewhere (evaluate_command prints them; assembly/api.evaluate returns them)."""
    folder = Path(args.checkpoint).is_dir() and (Path(args.checkpoint) / MODEL_CONFIG).is_file()
    trained, cfg = open_trained(args.checkpoint, args.ema, settings(args, folder), use="evaluated")
    check_options(cfg, args)
    check_split(cfg, trained, args)
    info = start_processes(cfg)
    if (hint := ema_hint(trained.source, trained.best_metric, args.ema)) and info.is_main:
        log.warning(hint)
    target = args.output_dir or beside(str(args.checkpoint), f"eval-{Path(args.checkpoint).stem}")
    with output_at(target, info.is_main) as out:  # a URL: written to its local mirror, then uploaded
        result = run(cfg, trained, args, info, out)  # report_errors leaves the process group, after any error
    return result if result is None or not is_url(target) else {**result, "output_dir": target}


def evaluate_command(args: argparse.Namespace) -> int:
    """evaluate.py on every rank, after its arguments are parsed; rank 0 prints the summary."""
    setup_logging(read_launch_env()[0])  # before a checkpoint is fetched from a URL (its retries are logged)
    args.output_dir = args.output_dir or beside(args.checkpoint, f"eval-{Path(args.checkpoint).stem}")  # (a URL's)
    args.checkpoint = fetched(args.checkpoint)  # a URL: copied to its local mirror (engine/checkpoint/run_store.py)
    result = evaluated(args)
    if result is not None:
        print("\n".join(summary_lines(result)))
    return 0


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The console's summary of eval.json: the headline metrics (single-label: top-1 beside the balanced accuracy
    and macro-F1 that imbalanced classes need), the weakest classes, which images were scored and the files
    written."""
    if result.get("multi_label"):
        worst = sorted((c for c in result["per_class"] if c["ap"] is not None), key=lambda c: c["ap"])[:3]
        return [f"mAP {result['map']:.2f}  mAP micro {result['map_micro']:.2f}  F1@{result['threshold']} "
                f"{result['f1']:.2f}  loss {result['loss']:.4f}  n {result['n']}",
                "lowest per-class AP: " + ", ".join(f"{readable(c['class'])} {c['ap']:.1f}" for c in worst),
                f"scored {result['n']} images: {result['scored']}",
                f"wrote eval.json, predictions.csv, per_class.csv to {result['output_dir']}"]
    worst = sorted((c for c in result["per_class"] if c["top1"] is not None), key=lambda c: c["top1"])[:3]
    matrix = ", confusion_matrix.png" if len(result["per_class"]) <= CONFUSION_MAX else ""
    confused = [f"{readable(c['actual'])} -> {readable(c['predicted'])} {c['images']}"
                for c in result["most_confused"][:3]]
    return [f"top1 {result['top1']:.2f}%  top5 {result['top5']:.2f}%  balanced acc {result['balanced_acc']:.2f}%  "
            f"macro F1 {result['macro_f1']:.2f}%  loss {result['loss']:.4f}  ECE {result['ece']:.2f}%  n {result['n']}",
            "lowest per-class top1: " + ", ".join(f"{readable(c['class'])} {c['top1']:.1f}%" for c in worst),
            *(["most confused (actual -> predicted): " + ", ".join(confused)] if confused else []),
            f"scored {result['n']} images: {result['scored']}",
            f"wrote eval.json, predictions.csv{matrix}, reliability.png, top_losses.png to {result['output_dir']}"]
