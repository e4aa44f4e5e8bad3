"""Weights & Biases tracking: one run per job, from global rank 0, that can never end a training.

`wandb` is imported only when `logging.wandb` is on, and only on rank 0. Every call into wandb goes
through `WandbTracker._guard`: the first exception becomes one warning, and tracking switches itself
off for the rest of the job while training goes on.

Steps: W&B's step is the global optimizer step, which a resumed training continues, so curves of a
resumed run join up. Each epoch's row (the same dict that goes into metrics.jsonl) is logged at the
step that ends the epoch; every `logging.interval` steps the all-reduced loss, lr and global img/s
over the last interval are logged under `interval/`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from engine.config import LoggingConfig

log = logging.getLogger(__name__)

INIT_TIMEOUT_S = 90.0  # wandb.init gives up after this (network down) instead of hanging the job
FINISH_TIMEOUT_S = 600.0  # the end-of-run upload gives up after this; `wandb sync` uploads the rest later
OFFLINE_MODES = ("offline", "dryrun", "disabled")


class WandbTracker:
    """A W&B run on rank 0; every method is a no-op when tracking is off, on other ranks, or after a failure."""

    def __init__(self, cfg: LoggingConfig, is_main: bool) -> None:
        self.cfg = cfg
        self.active = cfg.wandb and is_main
        self.run: Any = None
        self.run_id: str | None = None  # stored in checkpoints, so a resumed training continues this run

    def start(self, config: dict[str, Any], output_dir: str | os.PathLike, resume_id: str | None = None,
              job_type: str = "train") -> None:
        """wandb.init with the resolved config; `resume_id` continues that run instead of starting one."""
        if not self.active:
            return
        with self._guard("wandb.init"):
            import wandb

            mode = None if has_credentials_or_mode(wandb) else "offline"
            self.run = wandb.init(
                project=self.cfg.wandb_project, entity=self.cfg.wandb_entity or None,
                name=self.cfg.wandb_name or Path(output_dir).resolve().name, group=self.cfg.wandb_group or None,
                tags=list(self.cfg.wandb_tags) or None, notes=self.cfg.wandb_notes or None, job_type=job_type,
                config=config, id=resume_id, resume="allow" if resume_id else None, mode=mode,
                dir=None if "WANDB_DIR" in os.environ else str(output_dir), settings=wandb.Settings(**timeouts()))
            self.run_id = None if self.run.disabled else self.run.id
            run_dir = Path(self.run.dir).parent
            if mode == "offline":
                log.warning("W&B: no API key and no WANDB_MODE, so the run is offline in %s "
                            "(upload it later with `wandb sync %s`)", run_dir, run_dir)
            else:
                log.info("W&B run %s (%s) in %s", self.run_id, "resumed" if resume_id else "new", run_dir)

    def log_interval(self, step: int, stats: dict[str, float]) -> None:
        """Train loss, lr and img/s over the last `logging.interval` steps (all-reduced by the caller)."""
        self.log(step, {f"interval/{k}": v for k, v in stats.items()})

    def log_epoch(self, step: int, row: dict[str, Any], best_top1: float) -> None:
        """The epoch's metrics.jsonl row, and the best val_top1 so far in the run summary."""
        self.log(step, row)
        self.summary({"best_val_top1": best_top1})

    def log(self, step: int, values: dict[str, Any]) -> None:
        """One history row at the global optimizer `step` (rows logged at the same step merge)."""
        if self.active:
            with self._guard("logging"):
                self.run.log(values, step=step)

    def summary(self, values: dict[str, Any]) -> None:
        """Values that describe the whole run (shown in W&B's run table), not one step."""
        if self.active:
            with self._guard("updating the summary"):
                self.run.summary.update(values)

    def log_checkpoint(self, path: str | os.PathLike, metadata: dict[str, Any]) -> None:
        """Upload a checkpoint as a `model` artifact (when logging.wandb_log_checkpoints is on)."""
        path = Path(path)
        if not (self.active and self.cfg.wandb_log_checkpoints and path.is_file()):
            return
        with self._guard("uploading the checkpoint"):
            import wandb

            artifact = wandb.Artifact(f"model-{self.run.id}", type="model", metadata=metadata)
            artifact.add_file(str(path), name=path.name)
            self.run.log_artifact(artifact, aliases=["best", "latest"])

    def log_evaluation(self, metrics: dict[str, Any], confusion_png: str | os.PathLike,
                       rows: list[dict[str, Any]]) -> None:
        """evaluate.py's results: metrics in the summary under eval/, the confusion matrix, a predictions table."""
        if not self.active:
            return
        with self._guard("logging the evaluation"):
            import wandb

            columns = list(rows[0]) if rows else []
            table = wandb.Table(columns=columns, data=[[table_cell(row[c]) for c in columns] for row in rows])
            self.run.log({"eval/confusion_matrix": wandb.Image(str(confusion_png)), "eval/predictions": table})
            self.run.summary.update({f"eval/{k}": v for k, v in metrics.items()})

    def finish(self) -> None:
        """Close the run (bounded by FINISH_TIMEOUT_S when uploading)."""
        if self.active:
            with self._guard("finishing the run"):
                self.run.finish()
            self.active = False

    @contextlib.contextmanager
    def _guard(self, action: str) -> Iterator[None]:
        """Turn any wandb exception into one warning and switch tracking off; training goes on."""
        try:
            yield
        except Exception as err:  # noqa: BLE001 - tracking must never end a run, whatever wandb raises
            self.active = False
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            log.warning("W&B %s failed (%s: %s); training goes on without W&B tracking",
                        action, type(err).__name__, first)


def has_credentials_or_mode(wandb: Any) -> bool:
    """True when wandb may choose its own mode: WANDB_MODE (or `wandb offline`) is set, or an API key exists.

    Otherwise wandb.init would ask for a key on a terminal or fail; we run offline instead.
    """
    if os.environ.get("WANDB_MODE") or wandb.setup().settings.mode in OFFLINE_MODES:
        return True
    return wandb.login(prompt=False, verify=False)


def timeouts() -> dict[str, float]:
    """Bounded waits for wandb.init and the final upload, unless WANDB_INIT_TIMEOUT / WANDB_FINISH_TIMEOUT are set."""
    defaults = {"init_timeout": INIT_TIMEOUT_S, "finish_timeout": FINISH_TIMEOUT_S}
    return {key: value for key, value in defaults.items() if f"WANDB_{key.upper()}" not in os.environ}


def table_cell(value: Any) -> Any:
    """Scalars stay as they are; anything else (a top-5 list) becomes its text, which a W&B table can hold."""
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)

