"""Evaluation, all of it: single-label (loss, top-1/5, the confusion matrix's metrics), multi-label (mAP, F1),
and the epoch's validation of the model and its EMA. train.py and evaluate.py both call here.

Exact over any number of processes: every rank evaluates its contiguous block of the unpadded validation set
(data.loader.ShardSampler); single-label sums are all-reduced once at the end, with no host sync per batch.

Multi-label average precision is ranking-based: it needs every image's score of a class, in one place. Each rank
keeps its images' sigmoid probabilities; they are gathered in the global sample order and every rank computes
the same numbers from the same arrays, so 1 and N processes report identical metrics. AP is scikit-learn's
(uninterpolated, ties grouped): sum over thresholds of (R_k - R_{k-1}) P_k. Metrics are in percent, as val_top1 is.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from core.config import DataConfig
from core.dist import (DistInfo, broadcast_tensors, gather_rows, gather_rows_to_host, get_world_size, is_fsdp,
                       max_over_ranks, min_over_ranks, rank_local_tensors, reshard)
from core.signals import workers_shielded
from core.startup import use_tf32
from engine.metrics import SumMeter, add_class_counts, class_metrics, hits, ranked_classes
from engine.precision import Precision
from engine.prefetch import Normalize, device_batches

StopCheck = Callable[[], None]  # at a batch boundary: raises to stop the evaluation there (a run's validation)


def model_logits(model: nn.Module, loader: DataLoader, precision: Precision, info: DistInfo, normalize: Normalize,
                 stop_check: StopCheck | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The model in eval mode over the loader: each batch's float32 logits and its targets (for the evaluations).

    A sharded model's forward is a collective (each unit all-gathers its weights), and the ranks' blocks of the
    validation set may differ by a batch: a rank with fewer batches runs forwards on one image until every rank
    has run as many (their outputs are dropped). `stop_check` (a run's validation) is called after each batch's
    forward that every rank has (a collective, engine/validation.StopAtBatch: it raises Preempted on all together).
    """
    model.eval()
    missing = max_over_ranks(len(loader), info.device) - len(loader) if is_fsdp(model) else 0
    checked = min_over_ranks(len(loader), info.device) if stop_check is not None else 0
    with workers_shielded():
        batches = device_batches(iter(loader), info.device, normalize)
    for i, (images, targets) in enumerate(batches):
        with precision.autocast(), exact_kernels(info.device, precision.tf32):
            logits = model(images)
        if i < checked:
            stop_check()
        yield logits.float(), targets
    for _ in range(missing):  # every rank has at least one batch (data.loader.build_data checks it)
        with precision.autocast(), exact_kernels(info.device, precision.tf32):
            model(images[:1])


def validation_precision(measured: Precision, training: Precision, model: nn.Module) -> str:
    """What a run's validation computes in, for its log: eval_amp's precision, except under dist.strategy=fsdp with
    amp=bf16, whose units all-gather their weights in bf16 whatever the autocast (docs/correctness.md)."""
    if is_fsdp(model) and training.dtype is not None and measured.dtype != training.dtype:
        return (f"{training.name} (eval_amp={measured.name}, but dist.strategy=fsdp gathers the weights in "
                f"{training.name}; evaluate.py on a checkpoint computes in eval_amp)")
    return measured.described


@contextlib.contextmanager
def exact_kernels(device: torch.device, tf32: bool) -> Iterator[None]:
    """The kernels every reported number is computed with, so that a run's validation, evaluate.py and predict.py
    give the same numbers for the same weights: on the CPU one thread per process (fp32 results change with the
    thread count, which follows the cores and processes); on CUDA deterministic cuDNN algorithms, none picked by
    timing (training sets cudnn.benchmark), and TF32 as the precision computing them decided (`tf32`: Precision.tf32,
    the same rule in all three, whatever training used). The settings come back after."""
    if device.type != "cuda":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
        return
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = cudnn.benchmark, cudnn.deterministic, matmul.allow_tf32, cudnn.allow_tf32
    cudnn.benchmark, cudnn.deterministic = False, True
    use_tf32(tf32)
    try:
        yield
    finally:
        cudnn.benchmark, cudnn.deterministic, matmul.allow_tf32, cudnn.allow_tf32 = saved


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, precision: Precision, info: DistInfo,
             normalize: Normalize,
             on_batch: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
             stop_check: StopCheck | None = None) -> dict[str, float]:
    """Exact val_loss / val_top1 / val_top5, and the per-class metrics (engine.metrics.class_metrics: 3 x C counts,
    never a C x C matrix), over the whole (sharded, unpadded) validation set: one all-reduce at the end, no host
    sync per batch.

    on_batch(logits, targets, ranked) sees each batch with the top-5 classes the metrics counted; stop_check: as
    model_logits.
    """
    meter = SumMeter(("top1", "top5", "count"), info.device)
    counts = None  # 3 x C per-class counts (hits, true, predicted), C = the model's outputs
    losses = []  # each image's loss: val_loss is their exact mean (exact_mean)
    for logits, targets in model_logits(model, loader, precision, info, normalize, stop_check):
        losses.append(nn.functional.cross_entropy(logits, targets, reduction="none"))
        ranked = ranked_classes(logits, 5)
        meter.add(hits(ranked, targets, 1), hits(ranked, targets, 5), len(targets))
        if counts is None:
            counts = torch.zeros((3, logits.shape[1]), dtype=torch.int64, device=info.device)
        add_class_counts(counts, targets, ranked[:, 0])
        if on_batch is not None:
            on_batch(logits, targets, ranked)
    if counts is None:  # a rank without a batch still joins the reduction, with the data's class count
        counts = torch.zeros((3, len(loader.dataset.classes)), dtype=torch.int64, device=info.device)
    sums, counts = meter.global_sums_with(counts)
    count = sums["count"]
    return {"val_loss": exact_mean(losses, info.device), "val_top1": 100.0 * sums["top1"] / count,
            "val_top5": 100.0 * sums["top5"] / count, "val_count": int(count),
            **class_metrics(counts, loader.dataset.classes)}


def exact_mean(values: list[torch.Tensor], device: torch.device) -> float:
    """The mean of every rank's per-image values, correctly rounded (math.fsum on rank 0, then broadcast): the same
    for any number of processes and any batch size, and evaluate.py's loss, the fsum of predictions.csv's."""
    local = torch.cat(values).float() if values else torch.zeros(0, device=device)
    whole = gather_rows(local)
    mean = torch.zeros(1, dtype=torch.float64, device=device)
    if whole is not None and len(whole):
        mean.fill_(math.fsum(whole.tolist()) / len(whole))
    broadcast_tensors([mean])
    return mean.cpu().tolist()[0]  # one copy to the host at the end, as global_sums_with reads the sums


def confidence_and_loss(logits: torch.Tensor, targets: torch.Tensor,
                        ranked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's top-1 softmax probability and its cross-entropy loss (predictions.csv's and W&B's columns)."""
    confidence = logits.softmax(dim=1).gather(1, ranked[:, :1]).squeeze(1)
    return confidence, nn.functional.cross_entropy(logits, targets, reduction="none")


class ImageOutcomes:
    """Each validation image's (index in the validation set, true class, predicted class, confidence, loss), from
    evaluate()'s on_batch hook, gathered to rank 0 in the global order (`gather`, a collective): what the per-
    validation error analysis (the worst images, the confusion matrix) is drawn from. Kept on the device until
    then: no host sync per batch."""

    def __init__(self, start: int) -> None:
        self.start, self.batches = start, []

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, ranked: torch.Tensor) -> None:
        confidence, losses = confidence_and_loss(logits, targets, ranked)
        self.batches.append(torch.stack([targets.double(), ranked[:, 0].double(), confidence.double(),
                                         losses.double()], dim=1))

    def gather(self, device: torch.device) -> np.ndarray | None:
        """Rows [index, true, predicted, confidence, loss] of every rank's images, on rank 0 (None elsewhere)."""
        local = torch.cat(self.batches) if self.batches else torch.zeros((0, 4), dtype=torch.float64, device=device)
        indices = torch.arange(self.start, self.start + len(local), dtype=torch.float64, device=local.device)
        whole = gather_rows(torch.cat([indices[:, None], local], dim=1))
        return None if whole is None else whole.cpu().numpy()


class ImageProbabilities:
    """Each image's softmax probabilities (float64, from the float32 logits), from evaluate()'s on_batch hook,
    gathered to rank 0 in the set's order (`gather`, a collective): audit.py's out-of-fold predictions."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, ranked: torch.Tensor) -> None:
        self.batches.append(logits.double().softmax(dim=1))

    def gather(self, num_classes: int, device: torch.device) -> np.ndarray | None:
        """[images, classes] probabilities of every rank's images, on rank 0 (None elsewhere): each rank holds one
        block of the set (data.loader.ShardSampler), and gather_rows joins them in rank order, the set's order."""
        local = (torch.cat(self.batches) if self.batches
                 else torch.zeros((0, num_classes), dtype=torch.float64, device=device))
        whole = gather_rows(local)
        return None if whole is None else whole.cpu().numpy()


def validate_epoch(model: nn.Module, ema: nn.Module | None, loader: DataLoader, precision: Precision, info: DistInfo,
                   normalize: Normalize, cfg: DataConfig, outcomes: ImageOutcomes | None = None,
                   stop_check: StopCheck | None = None) -> dict[str, float]:
    """The epoch's validation columns: the model's metrics, and its EMA's prefixed `ema_`; `outcomes` (single-
    label) collects the model's per-image results; `stop_check`: as model_logits."""
    row = validate(model, loader, precision, info, normalize, cfg, outcomes, stop_check)
    if ema is not None:
        like_rank0(ema)
        ema_stats = validate(ema, loader, precision, info, normalize, cfg, stop_check=stop_check)
        reshard(ema)  # its root unit stays gathered after the forward, while the EMA updates its shards
        row.update({f"ema_{k}": v for k, v in ema_stats.items() if k != "val_count"})
    return row


def like_rank0(ema: nn.Module) -> None:
    """Every rank evaluates rank 0's EMA, the one the checkpoint saves. Only its buffers can differ (BatchNorm
    statistics differ per rank between DDP's broadcasts, and so do their averages); its parameters average
    all-reduced ones, or are sharded (fsdp): one broadcast per buffer dtype, not one per tensor."""
    broadcast_tensors(rank_local_tensors(ema))


def validate(model: nn.Module, loader: DataLoader, precision: Precision, info: DistInfo, normalize: Normalize,
             cfg: DataConfig, outcomes: ImageOutcomes | None = None,
             stop_check: StopCheck | None = None) -> dict[str, float]:
    """The epoch's validation metrics: top-1/top-5, or mAP and F1 for multi-label data (evaluate_multilabel)."""
    if cfg.multi_label:
        return evaluate_multilabel(model, loader, precision, info, normalize, cfg.multi_label_threshold,
                                   stop_check=stop_check)
    return evaluate(model, loader, precision, info, normalize, on_batch=outcomes, stop_check=stop_check)



def average_precision(targets: np.ndarray, scores: np.ndarray) -> float | None:
    """AP of one class (0/1 targets, scores), as sklearn.metrics.average_precision_score; None without positives."""
    positives = int(targets.sum())
    if positives == 0:
        return None
    order = np.argsort(-scores, kind="mergesort")
    sorted_scores, hits = scores[order], targets[order].astype(np.float64)
    last = np.r_[np.flatnonzero(np.diff(sorted_scores)), len(hits) - 1]  # the last row of each tied score
    tps = np.cumsum(hits)[last]
    precision = tps / (last + 1)
    recall = tps / positives
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def f1_counts(targets: np.ndarray, predicted: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-class true positives, false positives and false negatives of 0/1 decisions."""
    truth = targets.astype(bool)
    return ((predicted & truth).sum(0), (predicted & ~truth).sum(0), (~predicted & truth).sum(0))


def f1_score(tp: np.ndarray | int, fp: np.ndarray | int, fn: np.ndarray | int) -> np.ndarray | float:
    """2 TP / (2 TP + FP + FN); 0 where nothing was predicted and nothing was true."""
    denominator = 2 * np.asarray(tp) + fp + fn
    return np.divide(2.0 * np.asarray(tp), denominator, out=np.zeros(np.shape(denominator)), where=denominator > 0)


def best_thresholds(targets: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """Per class, the probability threshold that maximizes that class's F1 on these images (0.5 without positives)."""
    chosen = np.full(targets.shape[1], 0.5)
    for c in range(targets.shape[1]):
        positives = int(targets[:, c].sum())
        if positives == 0:
            continue
        order = np.argsort(-probs[:, c], kind="mergesort")
        scores, hits = probs[order, c], targets[order, c].astype(np.float64)
        last = np.r_[np.flatnonzero(np.diff(scores)), len(hits) - 1]
        tps = np.cumsum(hits)[last]
        f1 = 2 * tps / (last + 1 + positives)  # predicted: last + 1 images; 2TP / (predicted + positives)
        chosen[c] = scores[last[int(np.argmax(f1))]]
    return chosen


def multilabel_metrics(targets: np.ndarray, probs: np.ndarray, thresholds: float | np.ndarray) -> dict[str, Any]:
    """mAP (macro over the classes with a positive image; micro over every image-class pair), F1 and per-class
    AP/F1 at `thresholds` (one for all classes, or one per class): a class is predicted when prob >= threshold."""
    per_class_ap = [average_precision(targets[:, c], probs[:, c]) for c in range(targets.shape[1])]
    present = [ap for ap in per_class_ap if ap is not None]
    predicted = probs >= np.asarray(thresholds, dtype=probs.dtype)
    tp, fp, fn = f1_counts(targets, predicted)
    micro = average_precision(targets.ravel(), probs.ravel())
    return {"map": 100.0 * float(np.mean(present)) if present else 0.0,
            "map_micro": 100.0 * (micro or 0.0),
            "f1": 100.0 * float(f1_score(tp.sum(), fp.sum(), fn.sum())),
            "f1_macro": 100.0 * float(np.mean(f1_score(tp, fp, fn))),
            "per_class_ap": [None if ap is None else 100.0 * ap for ap in per_class_ap],
            "per_class_f1": (100.0 * f1_score(tp, fp, fn)).tolist(),
            "positives": targets.sum(0).astype(int).tolist(), "tp": tp.tolist(), "fp": fp.tolist(),
            "fn": fn.tolist()}


@torch.no_grad()
def evaluate_multilabel(model: nn.Module, loader: DataLoader, precision: Precision, info: DistInfo,
                        normalize: Normalize, threshold: float,
                        on_batch: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                        stop_check: StopCheck | None = None) -> dict[str, float]:
    """val_loss (mean over images of the per-class-mean BCE), val_map, val_map_micro and val_f1 (micro, at
    `threshold`) over the whole validation set, identical on every rank and for any number of ranks.

    on_batch(logits, targets) sees each batch (evaluate.py writes its predictions from it); stop_check: as
    model_logits.
    """
    batches_out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for logits, targets in model_logits(model, loader, precision, info, normalize, stop_check):
        losses = nn.functional.binary_cross_entropy_with_logits(logits, targets, reduction="none").mean(1)
        batches_out.append((logits.sigmoid(), targets, losses))
        if on_batch is not None:
            on_batch(logits, targets)
    values = torch.zeros(len(MULTILABEL_COLUMNS), dtype=torch.float64, device=info.device)
    found = gathered(batches_out, loader.dataset.labels.shape[1], info.device)
    if found is not None:  # rank 0: every image's probabilities, in the global sample order
        probs, targets, losses = found
        metrics = multilabel_metrics(targets, probs, threshold)
        values.copy_(torch.tensor([math.fsum(losses.tolist()) / len(losses), metrics["map"], metrics["map_micro"],
                                   metrics["f1"], len(losses)], dtype=torch.float64))
    broadcast_tensors([values])  # the same numbers on every rank (best.pth and early stopping read them)
    row = dict(zip(MULTILABEL_COLUMNS, values.tolist()))
    return {**row, "val_count": int(row["val_count"])}


MULTILABEL_COLUMNS = ("val_loss", "val_map", "val_map_micro", "val_f1", "val_count")
GATHER_BLOCK_BYTES = 256 * 2**20  # multi-label validation: rank 0's device holds this much of the gather at a time


def gathered(batches: list[tuple[torch.Tensor, ...]], num_classes: int, device: torch.device,
             block_bytes: int = GATHER_BLOCK_BYTES) -> tuple[np.ndarray, ...] | None:
    """(probs, targets, losses) of every rank's images in the global sample order, on rank 0 (None elsewhere):
    padded tensors gathered into rank 0's host memory, at most `block_bytes` on its device at a time."""
    if batches:
        local = [torch.cat(parts) for parts in zip(*batches)]
    else:
        local = [torch.zeros((0, num_classes), device=device), torch.zeros((0, num_classes), device=device),
                 torch.zeros(0, device=device)]
    rows = max(1, block_bytes // (get_world_size() * max(num_classes, 1) * local[0].element_size()))
    whole = [gather_rows_to_host(part, rows) for part in local]
    return None if whole[0] is None else tuple(part.numpy() for part in whole)
