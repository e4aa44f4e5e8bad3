"""Shared machinery: config, distributed setup, the training loop, metrics, checkpoints, logging."""

import sys


def _import_timm_without_wandb() -> None:
    """Import timm with wandb hidden: timm imports wandb eagerly (timm/utils/summary.py, for a helper
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


_import_timm_without_wandb()
