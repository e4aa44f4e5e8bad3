"""Exact metrics across ranks: keep sums (loss x n, correct, n) and all-reduce those, never means.

The metrics of imbalanced data (balanced accuracy, macro-F1, per-class recall) come from three counts per class
(hits, true images, predicted images: a confusion matrix's diagonal, row and column sums), kept on the device and
all-reduced once with the sums (`class_metrics`): 3 x C numbers, where a C x C matrix at ImageNet-21k's 21,841
classes was 477M int64 on the device (3.8 GB, ~11 GB transient with its float64 copies) and a 3.8 GB all-reduce.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np
import torch

from core.dist import all_reduce_sum, get_rank, get_world_size


def ranked_classes(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The k best classes of each row, best first (k capped at the class count).

    Call it once per batch and derive every metric and written prediction from the result: two topk
    calls may break a tie between equal logits differently.
    """
    return logits.topk(min(k, logits.shape[1]), dim=1).indices


def hits(ranked: torch.Tensor, target: torch.Tensor, k: int) -> torch.Tensor:
    """How many rows have the target among their first k ranked classes."""
    return (ranked[:, :k] == target[:, None]).any(dim=1).sum()


class SumMeter:
    """Named running sums kept on the device, so updating them never syncs with the host."""

    def __init__(self, names: tuple[str, ...], device: torch.device) -> None:
        self.names = names
        self.sums = torch.zeros(len(names), dtype=torch.float64, device=device)

    def add(self, *values: torch.Tensor | float) -> None:
        """Tensors are added where they are; Python numbers become device fills, not blocking host copies."""
        self.sums += torch.stack([v.to(torch.float64) if isinstance(v, torch.Tensor)
                                  else torch.full((), v, dtype=torch.float64, device=self.sums.device)
                                  for v in values])

    def global_sums_with(self, counts: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
        """Sums over all ranks, and `counts` (e.g. a confusion matrix) summed over all ranks, in one all-reduce.

        float64 holds integer counts exactly up to 2^53."""
        total = all_reduce_sum(torch.cat([self.sums, counts.flatten().to(torch.float64)])).cpu()
        return dict(zip(self.names, total[:len(self.names)].tolist())), total[len(self.names):].view(counts.shape)

    def global_sums(self) -> dict[str, float]:
        """Sums over all ranks (a collective: every rank must call it)."""
        return self.global_sums_and_max(())[0]

    def global_sums_and_max(self, per_rank: tuple[float, ...]) -> tuple[dict[str, float], list[float]]:
        """Sums over all ranks, and the largest over ranks of each host value in `per_rank`, in one all-reduce.

        Each rank writes its values into its own slots of a zero tensor (device fills, not host copies); the
        sum then holds every rank's values, exactly, and the host takes their max: no second collective.
        """
        rank, world, count = get_rank(), get_world_size(), len(per_rank)
        slots = torch.zeros(world * count, dtype=torch.float64, device=self.sums.device)
        for i, value in enumerate(per_rank):
            slots[rank * count + i].fill_(value)
        total = all_reduce_sum(torch.cat([self.sums, slots])).tolist()
        ranks = [total[len(self.names) + r * count:len(self.names) + (r + 1) * count] for r in range(world)]
        return dict(zip(self.names, total)), [max(values) for values in zip(*ranks)]


PER_CLASS_RECALL_MAX = 20  # classes up to which each class's val recall gets its own metrics column
UNSAFE = re.compile(r"[^\w-]")  # kept: letters and digits (any script), "_" and "-"; "/" would open a W&B section,
# "." is define_metric's nesting separator, spaces and symbols break W&B's queries


def metric_names(class_names: Sequence[str]) -> list[str]:
    """Each class's name as a metric key part (val_recall/<name>): characters other than letters, digits, "_" and "-"
    become "_"; in class order, a name already taken gets "_<class index>" appended until it is unique."""
    taken: set[str] = set()
    names = []
    for index, name in enumerate(class_names):
        safe = UNSAFE.sub("_", str(name)) or "_"
        while safe in taken:
            safe = f"{safe}_{index}"
        taken.add(safe)
        names.append(safe)
    return names


def add_class_counts(counts: torch.Tensor, targets: torch.Tensor, predicted: torch.Tensor) -> None:
    """Add a batch to the 3 x C per-class counts (hits, true images, predicted images) on the device: scatter_add,
    not bincount, which on CUDA reads the input's max on the host."""
    ones = torch.ones_like(targets, dtype=counts.dtype)
    counts[0].scatter_add_(0, targets, (targets == predicted).to(counts.dtype))
    counts[1].scatter_add_(0, targets, ones)
    counts[2].scatter_add_(0, predicted, ones)


def confusion_matrix(labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """C x C counts of (true class, predicted class) pairs: rows true, columns predicted."""
    return np.bincount(labels * num_classes + predicted, minlength=num_classes ** 2).reshape(num_classes, num_classes)


def confusion_counts(confusion: torch.Tensor) -> torch.Tensor:
    """The 3 x C per-class counts of a C x C confusion matrix (rows: true class, columns: predicted class)."""
    return torch.stack([confusion.diagonal(), confusion.sum(1), confusion.sum(0)])


def class_metrics(counts: torch.Tensor, class_names: Sequence[str]) -> dict[str, float]:
    """val_balanced_acc (mean recall over the classes present), val_macro_f1 (mean F1 over the classes present or
    predicted), in percent as scikit-learn's balanced_accuracy_score and f1_score(average='macro') define them,
    and val_recall/<class name> (metric_names) of each class present when there are at most PER_CLASS_RECALL_MAX
    classes; from the 3 x C per-class counts (add_class_counts, confusion_counts) of the C `class_names`.

    The counts come to the host once (one copy, as the sums' tolist()); the arithmetic is numpy's.
    """
    hit, true, predicted = counts.cpu().numpy().astype(np.float64)
    present, seen = true > 0, (true + predicted) > 0
    recall = hit[present] / true[present]
    f1 = 2 * hit[seen] / (true[seen] + predicted[seen])
    metrics = {"val_balanced_acc": 100.0 * float(recall.mean()) if len(recall) else 0.0,
               "val_macro_f1": 100.0 * float(f1.mean()) if len(f1) else 0.0}
    if len(hit) <= PER_CLASS_RECALL_MAX:
        if len(class_names) != len(hit):
            raise ValueError(f"{len(class_names)} class names for {len(hit)} classes counted")
        names = metric_names(class_names)
        for c in np.flatnonzero(present).tolist():
            metrics[f"val_recall/{names[c]}"] = 100.0 * float(hit[c] / true[c])
    return metrics


def class_report(counts: np.ndarray, class_names: Sequence[str]) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Per-class precision, recall, F1 (percent) and support, and their macro and weighted means, from the 3 x C
    per-class counts (hits, true, predicted): scikit-learn's classification_report without a second pass.

    A class's undefined value (precision of a class never predicted, recall of one never true) is None; the means
    count it as 0 over the classes true or predicted, as scikit-learn's default (zero_division=0 after a warning).
    """
    hit, true, predicted = np.asarray(counts, dtype=np.float64)
    precision = np.divide(hit, predicted, out=np.full_like(hit, np.nan), where=predicted > 0)
    recall = np.divide(hit, true, out=np.full_like(hit, np.nan), where=true > 0)
    f1 = np.divide(2 * hit, true + predicted, out=np.full_like(hit, np.nan), where=(true + predicted) > 0)
    per_class = [{"class": name, "precision": percent(precision[c]), "recall": percent(recall[c]),
                  "f1": percent(f1[c]), "support": int(true[c])} for c, name in enumerate(class_names)]
    seen, support = (true + predicted) > 0, true.sum()
    means = {}
    for key, values in (("precision", precision), ("recall", recall), ("f1", f1)):
        zeroed = np.nan_to_num(values, nan=0.0)
        means[f"macro_{key}"] = 100.0 * float(zeroed[seen].mean()) if seen.any() else 0.0
        means[f"weighted_{key}"] = 100.0 * float((zeroed * true).sum() / support) if support else 0.0
    return per_class, means


def percent(value: float) -> float | None:
    """A fraction in percent; NaN (undefined) as None, null in JSON."""
    return None if np.isnan(value) else 100.0 * float(value)


ECE_BINS = 15  # equal-width confidence bins of the expected calibration error (Guo et al. 2017)


def calibration_bins(confidence: np.ndarray, correct: np.ndarray, bins: int = ECE_BINS) -> np.ndarray:
    """Per bin ((m-1)/M, m/M] of top-1 confidence: image count, summed confidence, summed correctness (3 x M)."""
    confidence = np.asarray(confidence, dtype=np.float64)
    which = np.clip(np.searchsorted(np.linspace(0.0, 1.0, bins + 1), confidence, side="left") - 1, 0, bins - 1)
    return np.stack([np.bincount(which, minlength=bins).astype(np.float64),
                     np.bincount(which, weights=confidence, minlength=bins),
                     np.bincount(which, weights=np.asarray(correct, dtype=np.float64), minlength=bins)])


def expected_calibration_error(confidence: np.ndarray, correct: np.ndarray, bins: int = ECE_BINS) -> float:
    """ECE in percent: the image-weighted mean over bins of |accuracy - mean confidence| (Guo et al. 2017, eq. 3)."""
    count, confidences, hits = calibration_bins(confidence, correct, bins)
    return 100.0 * float(np.abs(hits - confidences).sum() / count.sum()) if count.sum() else 0.0
