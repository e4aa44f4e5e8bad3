"""Figures written to disk (matplotlib's Agg backend: no display needed), each replaced atomically."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from core.files import Recognise, replace_with, starts_with, temp_beside

PNG = starts_with(b"\x89PNG\r\n\x1a\n")


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, its font-cache notice kept out of the app's log."""
    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: Path, ours: Recognise, expected: str, option: str) -> None:
    """fig as a PNG at path through a temp file: a reader never sees half a figure; the figure is closed."""
    try:
        with temp_beside(path) as tmp:
            fig.savefig(tmp, format="png")
            replace_with(tmp, path, ours, expected, option)
    finally:
        pyplot().close(fig)


def readable(name: str) -> str:
    """A class or file name for a person: bytes that are not UTF-8 (kept as surrogates) shown as U+FFFD."""
    return os.fsencode(name).decode("utf-8", errors="replace")


def confusion_figure(confusion: np.ndarray, class_names: list[str], title: str) -> Any:
    """A confusion matrix a person can read: class names on both axes, counts in the cells when they fit
    (evaluate.py's PNG, and each validation's TensorBoard figure)."""
    plt = pyplot()
    class_names = [readable(name) for name in class_names]
    n = len(class_names)
    side = min(4 + 0.45 * n, 30)
    fig, ax = plt.subplots(figsize=(side, side), dpi=100)
    row_sums = confusion.sum(axis=1, keepdims=True)
    fraction = np.divide(confusion, row_sums, out=np.zeros(confusion.shape), where=row_sums > 0)
    image = ax.imshow(fraction, cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="fraction of the true class")
    if n <= 60:
        ax.set_xticks(range(n), labels=class_names, rotation=90 if n > 10 else 0)
        ax.set_yticks(range(n), labels=class_names)
    if n <= 30:
        for i in range(n):
            for j in range(n):
                if confusion[i, j]:
                    ax.text(j, i, str(confusion[i, j]), ha="center", va="center", fontsize=8,
                            color="white" if fraction[i, j] > 0.5 else "black")
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def plot_reliability(bins: np.ndarray, path: Path, title: str, ours: Recognise = PNG,
                     expected: str = "an earlier reliability.png of evaluate.py", option: str = "--output-dir") -> None:
    """A reliability diagram: each confidence bin's accuracy against its mean confidence (calibration_bins)."""
    save_png(reliability_figure(bins, title), path, ours, expected, option)


def reliability_figure(bins: np.ndarray, title: str) -> Any:
    """The reliability diagram's figure; its legend sits below both panels, where no bar can be (inside, a
    well-calibrated model's tall bars filled every corner)."""
    plt = pyplot()
    count, confidences, hits = bins
    edges = np.linspace(0.0, 1.0, len(count) + 1)
    filled = count > 0
    fig, (ax, hist) = plt.subplots(2, 1, figsize=(5, 6), dpi=100, sharex=True, height_ratios=[3, 1])
    ax.bar(edges[:-1][filled], hits[filled] / count[filled], width=1 / len(count), align="edge",
           edgecolor="black", label="accuracy")
    ax.plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
    ax.plot(confidences[filled] / count[filled], hits[filled] / count[filled], "o", color="red",
            label="mean confidence")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    hist.bar(edges[:-1], count, width=1 / len(count), align="edge", edgecolor="black")
    hist.set_xlabel("top-1 confidence")
    hist.set_ylabel("images")
    hist.set_xlim(0, 1)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize="small", frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))  # the bottom 5% for the legend
    return fig


def image_grid(images: list[np.ndarray], captions: list[str], title: str) -> Any:
    """Images (HWC uint8) in rows of up to 4, each with its caption (fastai's show_batch and plot_top_losses)."""
    plt = pyplot()
    columns = max(1, min(4, len(images)))
    rows = max(1, -(-len(images) // columns))
    fig, axes = plt.subplots(rows, columns, figsize=(2.6 * columns, 3.0 * rows + 0.4), dpi=100, squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, caption in zip(axes.flat, images, captions):
        ax.imshow(image, interpolation="nearest")
        ax.set_title(caption, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
