"""Suspected label errors from predicted probabilities: cleanlab's confident learning (its find_label_issues, ranked by
its self-confidence label quality: its own ranking, not a re-implementation), and fastai's top losses and
most-confused class pairs from the same numbers."""

from __future__ import annotations

import numpy as np


# cleanlab's filter: per class, the images it most likely mislabels, as many as the estimated noise of that class
# (docs/benchmarks.md, "audit.py against planted problems": on the digits with 5% flips its default,
# prune_by_noise_rate, found fewer of them at the same precision).
FILTER = "prune_by_class"


def label_issues(labels: np.ndarray, probs: np.ndarray) -> list[tuple[int, int, float]]:
    """(image index, suggested class, label quality score in [0, 1]) of each image cleanlab flags, most suspect
    first; `probs` must be out-of-sample (out-of-fold) for its verdicts to hold."""
    from cleanlab.filter import find_label_issues
    from cleanlab.rank import get_label_quality_scores

    ranked = find_label_issues(labels, probs, filter_by=FILTER, return_indices_ranked_by="self_confidence",
                               n_jobs=1)  # no process pool: inside torchrun's workers (and the same result)
    scores = get_label_quality_scores(labels, probs, method="self_confidence")
    return [(int(i), int(probs[i].argmax()), float(scores[i])) for i in ranked]


def top_losses(labels: np.ndarray, probs: np.ndarray, count: int) -> list[tuple[int, float]]:
    """(image index, cross-entropy of its given label), the `count` largest first (fastai's plot_top_losses)."""
    losses = -np.log(np.clip(probs[np.arange(len(labels)), labels], 1e-300, None))
    order = np.argsort(-losses, kind="stable")[:count]
    return [(int(i), float(losses[i])) for i in order]


def most_confused(labels: np.ndarray, predicted: np.ndarray, classes: int) -> list[tuple[int, int, int]]:
    """(given class, predicted class, images) for each pair that differs, most images first, ties in class order
    (fastai's most_confused: its confusion matrix's off-diagonal cells, stably sorted by count)."""
    counts = np.bincount(labels * classes + predicted, minlength=classes * classes).reshape(classes, -1)
    np.fill_diagonal(counts, 0)
    given, guessed = np.nonzero(counts)
    order = np.lexsort((guessed, given, -counts[given, guessed]))
    return [(int(given[i]), int(guessed[i]), int(counts[given[i], guessed[i]])) for i in order]
