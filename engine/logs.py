"""Rank 0 speaks: log setup, the per-epoch metrics.jsonl file and the progress bar.

Other ranks log warnings only (prefixed with their rank) and get a disabled progress bar.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Iterable

from tqdm import tqdm


def setup_logging(rank: int, level: str = "INFO") -> None:
    """Rank 0 logs at `level`; the other ranks only warn, tagged with their rank."""
    fmt = "%(asctime)s %(levelname)s %(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s %(message)s"
    logging.basicConfig(level=level if rank == 0 else "WARNING", format=fmt, datefmt="%H:%M:%S",
                        stream=sys.stderr, force=True)
    if rank != 0:
        warnings.filterwarnings("ignore")  # library warnings are the same on every rank; rank 0 shows them


def progress(iterable: Iterable, total: int, desc: str, enabled: bool) -> tqdm:
    """A tqdm bar on rank 0 (when enabled); elsewhere a silent pass-through."""
    return tqdm(iterable, total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=False,
                file=sys.stderr)


class MetricsFile:
    """metrics.jsonl: one JSON object per epoch, appended and flushed as soon as the epoch ends."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def append(self, row: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")

    def keep_epochs_before(self, epoch: int) -> None:
        """Drop the rows of `epoch` and later, atomically: a resumed run writes them again, once."""
        if not self.path.exists():
            return
        kept = [row for row in self.rows() if row["epoch"] < epoch]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
        os.replace(tmp, self.path)

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
