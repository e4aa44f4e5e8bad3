"""Figures written to disk (matplotlib's Agg backend: no display needed), each replaced atomically."""

from __future__ import annotations

import logging
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


def plot_reliability(bins: np.ndarray, path: Path, title: str, ours: Recognise = PNG,
                     expected: str = "an earlier reliability.png of evaluate.py", option: str = "--output-dir") -> None:
    """A reliability diagram: each confidence bin's accuracy against its mean confidence (calibration_bins)."""
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
    ax.legend(loc="upper left")
    ax.set_title(title)
    hist.bar(edges[:-1], count, width=1 / len(count), align="edge", edgecolor="black")
    hist.set_xlabel("top-1 confidence")
    hist.set_ylabel("images")
    hist.set_xlim(0, 1)
    fig.tight_layout()
    save_png(fig, path, ours, expected, option)
