"""audit.py's work: what is wrong with the data a config names. Suspected label errors from k-fold out-of-fold
predictions (each fold a run of the config's own recipe, engine/label_issues.py ranks them with cleanlab),
near-duplicates and train/val leaks, file problems; or the same from a finished run's own predictions (weaker
evidence). Everything lands in one audit folder, with a self-contained report.html (assembly/audit_report.py)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import albumentations as A
import numpy as np

from assembly.audit_checks import data_findings
from assembly.audit_report import AuditFindings, check_report_path, write_report
from assembly.inference import inference_model, open_trained, start_processes
from assembly.fit import fit
from assembly.launch import config_file, run_folder, training_processes
from assembly.start import check_same_config, with_run_folder
from core.config import Config
from core.config_load import load_config
from core.dist import DistInfo, all_gather_object, rank0_decides
from core.errors import UserError
from core.files import starts_with, write_output
from core.store import refuse_url
from data.datasets import AugmentedDataset
from data.folds import Folds, FoldSubset, make_folds, read_folds
from data.loader import build_eval_loader, build_val_dataset, dataset_of, prepare_data, shard_bounds
from data.split import Split, run_split, saved_split
from data.transforms import DeviceNormalize, eval_transform
from engine.checkpoint.inference import Trained
from engine.evaluation import ImageProbabilities, evaluate
from engine.label_issues import label_issues, most_confused, top_losses
from engine.precision import resolve_precision

log = logging.getLogger(__name__)

FOLDS_FILE = "fold_assignment.json"  # each training image's fold: kept, so that a rerun continues the same folds
COLUMNS = ("path", "given", "suggested", "score")
FOLD_COLUMNS = ("val_top1", "val_top5", "val_loss", "val_balanced_acc", "val_macro_f1")
TOP_LOSSES = 36
OURS_JSON = starts_with(b'{\n  "audit": ')
OURS_CSV = starts_with(b"path,given,suggested,score", b"path_a,path_b,split_a,split_b,distance")


def audit_command(args: argparse.Namespace) -> int:
    """audit.py: k folds of the config's recipe, or (a checkpoint given) a finished run's own predictions."""
    refuse_url(args.out or "", "--out", "give a local folder (and copy the report to the URL afterwards)")
    if args.checkpoint is None:
        audit_folds(args.config, args.overrides, args.folds, args.out)
    elif args.config or args.overrides:
        raise UserError(f"audit.py {args.checkpoint} audits that run's data with its own model and config: drop "
                        "--config and the overrides, or drop the checkpoint to audit a config with k folds")
    else:
        audit_run(args.checkpoint, args.out)
    return 0


def audit_folds(config: str | None, overrides: list[str], folds: int, out: str | None) -> dict[str, Any] | None:
    """`--folds` runs of the config's recipe, each on all the training images but one fold and validated on that
    fold, then cleanlab on the out-of-fold probabilities, the data's own checks and the report; rank 0 returns
    audit.json's contents. A rerun reuses the fold file and continues each fold's run (resume=auto)."""
    cfg = load_config(config_file(config, overrides), overrides)
    check_auditable(cfg)
    refuse_url(cfg.output_dir, "output_dir", "audit.py trains its folds in a local folder: give one")
    info = training_processes(cfg)
    cfg = with_run_folder(cfg)
    folder = Path(out or Path(cfg.output_dir) / "audit")
    rank0_decides(lambda: check_outputs(folder))
    train, val = audit_datasets(cfg, info, A.Compose([]))  # files, labels and paths: no transform needed
    unreadable = unreadable_images(train, info)  # in no fold: a fold's validation would stop at them
    assignment = rank0_decides(lambda: kept_folds(folder / FOLDS_FILE, train, folds, cfg.seed, unreadable))
    probs = np.full((len(train), len(train.classes)), np.nan, np.float32) if info.is_main else None
    rows = []
    for k in range(assignment.count):
        run = folder / f"fold_{k}"
        fold_cfg = load_config(config_file(config, overrides), [*overrides, f"data.folds_file={folder / FOLDS_FILE}",
                                                                f"data.fold={k}", f"output_dir={run}"])
        check_same_config(fold_cfg)
        if info.is_main:
            log.info("audit: fold %d of %d, %d images held out, in %s", k + 1, assignment.count,
                     assignment.fold.count(k), run)
        with run_folder(fold_cfg) as lock:
            fit(fold_cfg, info, lock)
        held = held_out_probabilities(last_checkpoint(run), info)
        if info.is_main:
            probs[np.asarray(assignment.fold) == k] = held
            rows.append({"fold": k, "images": assignment.fold.count(k), **last_row(run)})
    if not info.is_main:
        return None
    evidence = (f"out-of-fold predictions of {assignment.count} folds (each image predicted by a model that never "
                "saw it)")
    return write_audit(folder, train, val, probs, evidence, fold_summary(rows), cfg)


def audit_run(checkpoint: str, out: str | None) -> dict[str, Any] | None:
    """A finished run's own model on its training and validation images: the same report from in-sample
    predictions on the training images (the model saw their labels: weaker evidence)."""
    trained, cfg = open_trained(checkpoint, ema=False, use="audited")
    check_auditable(cfg)
    info = start_processes(cfg)  # as evaluate.py: one thread per process on the CPU
    folder = Path(out or Path(checkpoint).parent / "audit")
    rank0_decides(lambda: check_outputs(folder))
    train, val = audit_datasets(cfg, info, eval_transform(cfg.data), saved_split(cfg.data, checkpoint),
                                trained.class_names)
    readable = np.flatnonzero(~unreadable_images(train, info))  # the file findings name the others
    held = predicted(trained, cfg, FoldSubset(train, readable), info)
    if not info.is_main:
        return None
    probs = np.full((len(train), len(trained.class_names)), np.nan, np.float32)
    probs[readable] = held
    evidence = (f"in-sample predictions of {checkpoint} on its own training images: weaker evidence (the model saw "
                "these labels; k folds, audit.py --config, do not)")
    return write_audit(folder, train, val, probs, evidence, None, cfg)


def check_auditable(cfg: Config) -> None:
    """What the audit cannot do, refused before anything is read or trained."""
    if cfg.data.multi_label:
        raise UserError("audit.py finds label errors among single-label classes; data.multi_label=true is not "
                        "supported: audit the data without it, one tag at a time")
    if cfg.data.folds_file:
        raise UserError("data.folds_file is audit.py's own key (it sets it for each fold); drop it")


def check_outputs(folder: Path) -> None:
    """The audit folder made, and its report absent or an earlier one of audit.py's: refused in seconds, not after
    the folds' training."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--out {folder}: cannot make the folder ({err.strerror}); choose another --out") from None
    check_report_path(folder / "report.html", "--out")


def audit_datasets(cfg: Config, info: DistInfo, transform: A.Compose, split: Split | None = None,
                   classes: list[str] | None = None) -> tuple[AugmentedDataset, AugmentedDataset | None]:
    """The training and validation images as the runs see them (any format), with `transform`: their files, labels
    and paths for the folds, the duplicates and the file checks; no validation split is said, and the leak check
    then looks within train. An unreadable image is an error here, never skipped: each image's row stays put."""
    prepare_data(cfg.data, info.local_rank)
    if split is None:
        split = run_split(cfg.data, None, None, info.is_main)
    train = dataset_of(cfg.data, True, transform, cfg.seed, classes, split)
    train.skip_corrupt = False
    try:
        return train, dataset_of(cfg.data, False, transform, cfg.seed, train.classes, split)
    except UserError as err:
        if info.is_main:
            log.warning("audit: no validation split (%s): duplicates are looked for within the training images only, "
                        "with no train/val leak check", err)
        return train, None


def unreadable_images(dataset: AugmentedDataset, info: DistInfo) -> np.ndarray:
    """Which images cannot be read (each rank tries its block of them: one decoding pass, spread), on every rank."""
    start, stop = shard_bounds(len(dataset), info.rank, info.world_size)
    bad = []
    for index in range(start, stop):
        try:
            dataset.load_image(index)
        except UserError:
            bad.append(index)
    mask = np.zeros(len(dataset), dtype=bool)
    mask[[i for part in all_gather_object(bad) for i in part]] = True
    return mask


def kept_folds(path: Path, train: AugmentedDataset, count: int, seed: int, unreadable: np.ndarray) -> Folds:
    """The fold file of an earlier run of this audit (checked to be for these images and settings), else new."""
    paths = [train.path(i) for i in range(len(train))]
    if path.exists():
        folds = read_folds(path)
        if (folds.count, folds.seed, folds.paths) != (count, seed, paths):
            raise UserError(f"{path} holds {folds.count} folds (seed {folds.seed}) of {len(folds.paths)} training "
                            f"images; this audit asks for {count} folds (seed {seed}) of {len(paths)}: use --folds "
                            f"{folds.count} to continue it, or another --out for a new audit")
        return folds
    folds = make_folds(np.asarray(train.labels), paths, count, seed, train.classes, unreadable)
    write_output(path, folds.to_json(), starts_with(b'{"folds": '), f"an earlier {path.name} of audit.py", "--out")
    return folds


def last_checkpoint(run: Path) -> Path:
    """A fold run's last checkpoint (train.ckpt_format=sharded: its last.dcp folder)."""
    return run / "last.pth" if (run / "last.pth").exists() else run / "last.dcp"


def held_out_probabilities(checkpoint: Path, info: DistInfo) -> np.ndarray | None:
    """A fold run's model on its held-out fold (its validation set, as evaluate.py reads it): the softmax
    probabilities in the fold's order, on rank 0."""
    trained, cfg = open_trained(checkpoint, ema=False, use="audited")
    dataset = build_val_dataset(cfg.data, cfg.seed, info.local_rank, trained.class_names,
                                split=saved_split(cfg.data, checkpoint))
    return predicted(trained, cfg, dataset, info)


def predicted(trained: Trained, cfg: Config, dataset: AugmentedDataset, info: DistInfo) -> np.ndarray | None:
    """The trained model's softmax probabilities on `dataset` (with its eval transform), gathered to rank 0."""
    loader = build_eval_loader(dataset, cfg.data, cfg.train.batch_size, info)
    model = inference_model(trained, cfg, info.device)
    normalize = DeviceNormalize(cfg.data.mean, cfg.data.std, info.device, cfg.model.channels_last)
    probs = ImageProbabilities()
    evaluate(model, loader, resolve_precision(cfg.amp, info.device, tf32=cfg.tf32), info, normalize, on_batch=probs)
    return probs.gather(len(trained.class_names), info.device)


def last_row(run: Path) -> dict[str, float]:
    """A fold run's last validation (metrics.jsonl's last row): its columns of FOLD_COLUMNS."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    row = json.loads(lines[-1])
    return {name: row[name] for name in FOLD_COLUMNS if name in row}


def fold_summary(rows: list[dict[str, float]]) -> dict[str, Any]:
    """folds.json: each fold's metrics, their mean and spread (population standard deviation, as numpy's std)."""
    names = [name for name in FOLD_COLUMNS if all(name in row for row in rows)]
    values = {name: np.asarray([row[name] for row in rows], dtype=np.float64) for name in names}
    return {"folds": rows, "mean": {n: float(v.mean()) for n, v in values.items()},
            "std": {n: float(v.std()) for n, v in values.items()}}


def write_audit(folder: Path, train: AugmentedDataset, val: AugmentedDataset | None, probs: np.ndarray,
                evidence: str, folds: dict | None, cfg: Config) -> dict[str, Any]:
    """Rank 0: probabilities.npy, label_issues.csv, folds.json, duplicates.csv, the file findings, report.html and
    audit.json. `probs`: float32 in the training split's order, NaN rows for the images not scored (unreadable)."""
    write_probabilities(folder / "probabilities.npy", probs)
    scored = np.flatnonzero(~np.isnan(probs[:, 0]))
    names, labels = train.classes, np.asarray(train.labels)[scored]
    probs = probs[scored].astype(np.float64)  # as saved: cleanlab on probabilities.npy gives label_issues.csv
    path = lambda i: train.path(int(scored[i]))  # noqa: E731 (an index into `scored`)
    issues = [{"path": path(i), "given": names[labels[i]], "suggested": names[s], "score": f"{score:.6f}"}
              for i, s, score in label_issues(labels, probs)]
    write_text(folder / "label_issues.csv", csv_text(issues, COLUMNS))
    if folds is not None:
        write_text(folder / "folds.json", json_text({"audit": "folds", **folds}))
    found = data_findings(train, val, cfg.data, write_rows, folder)
    losses = [{"path": path(i), "given": names[labels[i]], "predicted": names[int(probs[i].argmax())],
               "loss": loss, "probability": float(probs[i].max())} for i, loss in top_losses(labels, probs, TOP_LOSSES)]
    confused = [{"actual": names[a], "predicted": names[p], "count": n} for a, p, n in
                most_confused(labels, probs.argmax(axis=1), probs.shape[1])]
    counts = {"images": len(train) + (len(val) if val is not None else 0), "label_issues": len(issues), **found.counts}
    write_report(folder / "report.html", AuditFindings(
        evidence=evidence, label_issues=issues, duplicates=found.duplicates, top_losses=losses, confused=confused,
        files=found.files, class_counts=found.class_counts, folds=folds, counts=counts), option="--out")
    result = {"audit": str(folder), "evidence": evidence, "counts": counts,
              **({"folds": {"mean": folds["mean"], "std": folds["std"]}} if folds else {})}
    write_text(folder / "audit.json", json_text(result))
    files = ", ".join(f"{n} {name[6:]}" for name, n in counts.items() if name.startswith("files_")) or "none"
    log.info("audit of %d images: %d suspected label errors, %d duplicate pairs (%d across splits), file findings: "
             "%s; %s", counts["images"], len(issues), counts["duplicate_pairs"], counts["leaks"], files,
             folder / "report.html")
    return result


def write_probabilities(path: Path, probs: np.ndarray) -> None:
    """probabilities.npy: each training image's predicted probabilities (float32), over an earlier one only."""
    buffer = io.BytesIO()
    np.save(buffer, probs)
    write_output(path, buffer.getvalue(), starts_with(b"\x93NUMPY"), f"an earlier {path.name} of audit.py", "--out")


def write_rows(path: Path, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    write_text(path, csv_text(rows, columns))


def csv_text(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> bytes:
    """A CSV file's bytes (paths that are not UTF-8 kept byte for byte)."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return text.getvalue().encode("utf-8", "surrogateescape")


def json_text(value: dict[str, Any]) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode()


def write_text(path: Path, data: bytes) -> None:
    """One output of the audit folder, replacing only an earlier one of audit.py's."""
    ours = OURS_JSON if path.suffix == ".json" else OURS_CSV
    write_output(path, data, ours, f"an earlier {path.name} of audit.py", "--out")
