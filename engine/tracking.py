"""Experiment tracking from global rank 0 that can never end a training: W&B, and TensorBoard beside it.

Both sinks have the same small interface (`start`, `log_interval`, `log_epoch`, `finish`). `wandb` and
tensorboard are imported only when their sink is on, and only on rank 0. Every call into them goes
through `Sink._guard`: the first exception becomes one warning, and that sink switches itself off for the
rest of the job while training goes on.

Steps: the step is the global optimizer step, which a resumed training continues, so curves of a
resumed run join up. Each epoch's row (the same dict that goes into metrics.jsonl) is logged at the
step that ends the epoch; every `logging.interval` steps the all-reduced loss, lr and global img/s
over the last interval are logged under `interval/`.

W&B: `define_metric` makes `epoch` the x axis of the epoch-level metrics and keeps the best value of
the validation metrics (max, or min for losses) in the run summary. With logging.wandb_log_checkpoints,
each best.pth is logged when it is written, as a version of the model artifact `model-<run id>`
(aliases best, latest), and evaluate.py's run declares the checkpoint it evaluates as a version of that
artifact, its input.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import yaml

from core.config import LoggingConfig
from core.startup import sweep_run_id

log = logging.getLogger(__name__)
CONFUSION_CLASSES = 100  # classes up to which each validation logs W&B's confusion matrix chart

INIT_TIMEOUT_S = 90.0  # wandb.init gives up after this (network down) instead of hanging the job
FINISH_TIMEOUT_S = 600.0  # the end-of-run upload gives up after this; `wandb sync` uploads the rest later
OFFLINE_MODES = ("offline", "dryrun", "disabled")
BEST = {"val_top1": "max", "val_top5": "max", "val_loss": "min",  # the same for the ema_ metrics
        "val_map": "max", "val_map_micro": "max", "val_f1": "max",  # multi-label
        "val_balanced_acc": "max", "val_macro_f1": "max"}  # single-label, imbalanced


class Sink:
    """Rank 0 only and never fatal: every method is a no-op when the sink is off, on other ranks, or after a failure."""

    name = "tracking"

    def __init__(self, enabled: bool, is_main: bool) -> None:
        self.active = enabled and is_main

    def log_interval(self, step: int, stats: dict[str, float]) -> None:
        """Train loss, lr and img/s over the last `logging.interval` steps (all-reduced by the caller)."""

    def log_epoch(self, step: int, row: dict[str, Any], best: dict[str, float]) -> None:
        """The epoch's metrics.jsonl row, at the global step that ends the epoch; `best`: {train.best_metric's
        column: its best value so far}."""

    def finish(self) -> None:
        """Write out what is pending and close."""

    @contextlib.contextmanager
    def _guard(self, action: str) -> Iterator[None]:
        """Turn any exception of the tracking library into one warning and switch the sink off; training goes on."""
        try:
            yield
        except Exception as err:  # noqa: BLE001 - tracking must never end a run, whatever the library raises
            self.active = False
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            log.warning("%s %s failed (%s: %s); training goes on without %s", self.name, action,
                        type(err).__name__, first, self.name)


class WandbTracker(Sink):
    """A W&B run on rank 0."""

    name = "W&B"

    def __init__(self, cfg: LoggingConfig, is_main: bool) -> None:
        super().__init__(cfg.wandb, is_main)
        self.cfg = cfg
        if is_main and not cfg.wandb and sweep_run_id():
            log.warning("a W&B sweep agent started this run (WANDB_SWEEP_ID) but logging.wandb is false, so the sweep "
                        "gets no metrics; add logging.wandb=true to the sweep's command")
        self.run: Any = None
        self.run_id: str | None = None  # stored in checkpoints, so a resumed training continues this run
        self.defined: set[str] = set()  # metrics given their axis and summary (define_metric) in this process

    def start(self, config: dict[str, Any], output_dir: str | os.PathLike, resume_id: str | None = None,
              job_type: str = "train") -> None:
        """wandb.init with the resolved config; `resume_id` continues that run instead of starting one. Under a sweep
        agent the run is the agent's (WANDB_RUN_ID), whatever run a checkpoint names: its trials are its runs."""
        if not self.active:
            return
        with self._guard("wandb.init"):
            import wandb

            agent_run = sweep_run_id()
            if agent_run and resume_id not in (None, agent_run):
                log.info("W&B: run %s of the sweep agent, not the checkpoint's run %s", agent_run, resume_id)
            resume_id = resume_id if agent_run in (None, resume_id) else None
            mode = None if has_credentials_or_mode(wandb) else "offline"
            self.run = wandb.init(
                project=self.cfg.wandb_project, entity=self.cfg.wandb_entity or None,
                name=self.cfg.wandb_name or Path(output_dir).resolve().name, group=self.cfg.wandb_group or None,
                tags=list(self.cfg.wandb_tags) or None, notes=self.cfg.wandb_notes or None, job_type=job_type,
                config=config, id=resume_id or agent_run, resume="allow" if resume_id else None, mode=mode,
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

    def log_epoch(self, step: int, row: dict[str, Any], best: dict[str, float]) -> None:
        """The epoch's metrics.jsonl row, and the best value so far of train.best_metric in the run summary as
        `best_<metric>` (best_val_top1, best_ema_val_top1, best_val_loss, ...).

        It comes from the training state, which checkpoints keep: it stays right across a resume, where W&B's own
        maximum (`val_top1.max`) sees only the epochs logged since the process started.
        """
        if self.active:
            with self._guard("defining the epoch metrics"):
                self.define_epoch_metrics(row)
        self.log(step, row)
        self.summary({f"best_{name}": value for name, value in best.items()})

    def define_epoch_metrics(self, keys: Iterable[str]) -> None:
        """`epoch` as the x axis of the epoch-level metrics; the summary keeps the best and the last val metrics."""
        if "epoch" not in self.defined:
            self.run.define_metric("epoch")
            self.defined.add("epoch")
        for key in keys:
            if key not in self.defined:
                best = BEST.get(key.removeprefix("ema_"))
                self.run.define_metric(key, step_metric="epoch", summary=f"{best},last" if best else None)
                self.defined.add(key)

    def log_samples(self, samples: Sequence[Any], step: int = 0) -> None:
        """A table of training images as the model gets them (data.datasets.Shown: index, path, HWC image, label,
        class name)."""
        if not (self.active and samples):
            return
        with self._guard("logging training samples"):
            import wandb

            rows = [[s.index, s.path, wandb.Image(s.image), s.label, s.name] for s in samples]
            table = wandb.Table(columns=["index", "path", "image", "label", "class"], data=rows)
            self.run.log({"train_samples": table}, step=step)

    def log_errors(self, step: int, outcomes: np.ndarray, dataset: Any, class_names: list[str], count: int) -> None:
        """A validation's error analysis (logging.wandb_errors): its `count` worst images by loss as a table of
        typed cells (the image as the model got it, before normalization; true and predicted class; confidence
        and loss as numbers) and, up to CONFUSION_CLASSES classes, W&B's confusion matrix of every image.
        `outcomes`: rows [index, true, predicted, confidence, loss] of the whole validation set (rank 0's)."""
        if not (self.active and count > 0 and len(outcomes)):
            return
        with self._guard("logging the validation errors"):
            import wandb

            rows = []
            for index, true, pred, confidence, loss in outcomes[np.argsort(-outcomes[:, 4], kind="stable")[:count]]:
                image = dataset[int(index)][0]  # evaluation's own deterministic pipeline
                rows.append([int(index), dataset.path(int(index)), wandb.Image(image.permute(1, 2, 0).numpy()),
                             class_names[int(true)], class_names[int(pred)], float(confidence), float(loss)])
            columns = ["index", "path", "image", "true", "predicted", "confidence", "loss"]
            logged = {"val/worst": wandb.Table(columns=columns, data=rows)}
            if len(class_names) <= CONFUSION_CLASSES:
                logged["val/confusion"] = wandb.plot.confusion_matrix(
                    y_true=outcomes[:, 1].astype(int).tolist(), preds=outcomes[:, 2].astype(int).tolist(),
                    class_names=list(class_names), title="validation confusion matrix")
            self.run.log(logged, step=step)

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

    @property
    def logs_checkpoints(self) -> bool:
        """Whether log_checkpoint uploads anything (it needs the file written first)."""
        return self.active and self.cfg.wandb_log_checkpoints

    def log_checkpoint(self, path: str | os.PathLike, metadata: dict[str, Any]) -> None:
        """A new version of the `model` artifact (with logging.wandb_log_checkpoints), aliases best and latest.

        Called when best.pth has just been written, so a preempted run keeps its best model in W&B. wandb
        hashes the file and copies it to its staging folder (WANDB_DATA_DIR) here, then uploads the copy in
        the background: a later best.pth cannot change a version in flight. Offline, each copy stays staged
        until `wandb sync`.
        """
        path = Path(path)
        if not (self.logs_checkpoints and path.is_file()):
            return
        with self._guard("uploading the checkpoint"):
            import wandb

            artifact = wandb.Artifact(model_artifact_name(self.run.id), type="model", metadata=metadata)
            artifact.add_file(str(path), name=path.name)
            self.run.log_artifact(artifact, aliases=["best", "latest"])

    def use_model(self, path: str | os.PathLike, trained_run_id: str | None) -> None:
        """Declare the checkpoint being evaluated as this run's input: a version of the training's model artifact.

        Only for a checkpoint of a tracked training that logged its checkpoints (logging.wandb_log_checkpoints).
        W&B matches the file to the version that holds the same bytes: evaluating best.pth names the training's
        last best version, and another file becomes a new version of the same artifact. `run.use_artifact`
        does this for a local artifact and then waits for the upload, but refuses to run offline; its first
        half, `_log_artifact(use_after_commit=True)`, records the same thing and `wandb sync` completes it.
        """
        path = Path(path)
        if not (self.active and trained_run_id and self.cfg.wandb_log_checkpoints and path.is_file()):
            return
        with self._guard("declaring the model artifact"):
            import wandb

            artifact = wandb.Artifact(model_artifact_name(trained_run_id), type="model")
            artifact.add_file(str(path), name=path.name)
            self.run._log_artifact(artifact, is_user_created=True, use_after_commit=True)

    def log_evaluation(self, metrics: dict[str, Any], confusion_png: str | os.PathLike | None,
                       rows: list[dict[str, Any]], numbers: dict[str, type] | None = None) -> None:
        """evaluate.py's results: metrics in the summary under eval/, the confusion matrix (none for multi-label),
        a predictions table. `numbers`: the columns whose text (predictions.csv's) is an int or float, stored as
        numbers so that W&B sorts and filters them as numbers."""
        if not self.active:
            return
        with self._guard("logging the evaluation"):
            import wandb

            columns = list(rows[0]) if rows else []
            kinds = numbers or {}
            table = wandb.Table(columns=columns,
                                data=[[table_cell(row[c], kinds.get(c)) for c in columns] for row in rows])
            image = {} if confusion_png is None else {"eval/confusion_matrix": wandb.Image(str(confusion_png))}
            self.run.log({**image, "eval/predictions": table})
            self.run.summary.update({f"eval/{k}": v for k, v in metrics.items()})

    def finish(self) -> None:
        """Close the run (bounded by FINISH_TIMEOUT_S when uploading)."""
        if self.active:
            with self._guard("finishing the run"):
                self.run.finish()
            self.active = False


class TensorBoardWriter(Sink):
    """TensorBoard event files in <output_dir>/tensorboard from rank 0: the scalars W&B gets, at the same steps, and
    each validation's confusion matrix as a figure (log_confusion).

    Scalars are written as doubles (the values of metrics.jsonl, not float32 roundings). When the folder
    already holds events of an earlier run, nothing is written until this run has started (its first
    checkpoint or metrics row, as for metrics.jsonl): then the events the earlier run logged after this
    run's first step are hidden (SummaryWriter's purge_step), as a resumed run rewrites metrics.jsonl's
    later rows. A run that fails before it starts leaves the earlier record as it was.
    """

    name = "TensorBoard"

    def __init__(self, cfg: LoggingConfig, is_main: bool) -> None:
        super().__init__(cfg.tensorboard, is_main)
        self.writer: Any = None
        self.pending: list[tuple[str, float, int]] = []  # (tag, value, step) held until the run has started
        self.started: Callable[[], bool] = lambda: True
        self.logdir, self.first_step, self.config_text = Path("tensorboard"), 0, ""

    def start(self, config: dict[str, Any], output_dir: str | os.PathLike, step: int = 0,
              started: Callable[[], bool] = lambda: True) -> None:
        """Prepare the writer for a training that starts at global `step`; `started()`: has the run written yet."""
        if not self.active:
            return
        self.logdir, self.first_step = Path(output_dir) / "tensorboard", step
        self.config_text = "```yaml\n" + yaml.safe_dump(config, sort_keys=False) + "```"
        if any(self.logdir.glob("events.out.tfevents.*")):  # an earlier run's record: keep it until we start
            self.started = started
        self.write({})

    def log_interval(self, step: int, stats: dict[str, float]) -> None:
        self.write({f"interval/{k}": v for k, v in stats.items()}, step)

    def log_epoch(self, step: int, row: dict[str, Any], best: dict[str, float]) -> None:
        self.write(row, step, flush=True)

    def log_confusion(self, step: int, outcomes: np.ndarray, class_names: list[str]) -> None:
        """A validation's confusion matrix as the figure `val/confusion` (evaluate.py's), up to CONFUSION_CLASSES
        classes; `outcomes`: rows [index, true, predicted, confidence, loss] of the whole validation set. Written
        after the validation's row, so the run has started (RecordRow)."""
        if not (self.active and self.writer is not None and len(class_names) <= CONFUSION_CLASSES):
            return
        with self._guard("writing the confusion figure"):
            from engine.metrics import confusion_matrix
            from engine.plots import confusion_figure  # matplotlib only where a run draws

            confusion = confusion_matrix(outcomes[:, 1].astype(int), outcomes[:, 2].astype(int), len(class_names))
            figure = confusion_figure(confusion, list(class_names), f"validation confusion matrix, step {step}")
            self.writer.add_figure("val/confusion", figure, step, close=True)
            self.writer.flush()

    def write(self, values: dict[str, Any], step: int = 0, flush: bool = False) -> None:
        """Queue the numeric values; once the run has started, write everything queued."""
        if not self.active:
            return
        self.pending += [(k, float(v), step) for k, v in values.items() if isinstance(v, (int, float))]
        if not self.started():
            return
        with self._guard(f"writing {self.logdir}"):
            if self.writer is None:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(self.logdir), purge_step=self.first_step + 1)
                self.writer.add_text("config", self.config_text, self.first_step)
            for tag, value, at in self.pending:
                self.writer.add_scalar(tag, value, at, new_style=True, double_precision=True)
            self.pending.clear()
            if flush:
                self.writer.flush()

    def finish(self) -> None:
        """Write what is queued (if the run has started) and close the event file."""
        if self.active:
            self.write({})
            with self._guard("closing the event file"):
                if self.writer is not None:
                    self.writer.close()
            self.active = False


def model_artifact_name(run_id: str) -> str:
    """The W&B model artifact of a training run (as Lightning's WandbLogger names it): evaluate.py derives it
    from the run id stored in a checkpoint."""
    return f"model-{run_id}"


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


def table_cell(value: Any, kind: type | None = None) -> Any:
    """A number's text as `kind` (int, float); other scalars as they are; anything else (a top-5 list) as its text,
    which a W&B table can hold."""
    if kind is not None and isinstance(value, str):
        return kind(value)
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)

