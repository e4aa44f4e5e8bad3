"""Process-wide settings the entry points make, explicitly: nothing here runs as an import side effect.

train.py and evaluate.py call `import_timm_without_wandb()` before their other imports and
`tune_cpu_process()` once they know their device.
"""

from __future__ import annotations

import os
import sys

from engine.host_memory import keep_freed_memory


def import_timm_without_wandb() -> None:
    """Import timm with wandb hidden: `import timm` imports wandb eagerly (timm/utils/summary.py, for a helper
    this app does not use), which would load wandb into every run even with logging.wandb=false.

    A None entry in sys.modules makes `import wandb` raise ImportError, which timm catches; the entry
    is removed right after, so engine/tracking.py can import wandb when tracking is on.
    """
    if "timm" in sys.modules or "wandb" in sys.modules:
        return
    sys.modules["wandb"] = None
    try:
        import timm  # noqa: F401
    finally:
        del sys.modules["wandb"]


def tune_cpu_process(threads: int) -> None:
    """A CPU process computes with `threads` threads (torchrun would force one) and keeps freed memory."""
    import torch

    torch.set_num_threads(threads)
    keep_freed_memory()


def cpu_share(processes_per_node: int) -> int:
    """This process's share of the cores it may run on."""
    return max(1, len(os.sched_getaffinity(0)) // processes_per_node)
