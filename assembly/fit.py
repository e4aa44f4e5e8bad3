"""The training run: fit() is the loop over epochs -- train, validate, the per-epoch hooks -- of the run build_run
makes once; its side effects are hooks (engine/hooks.py, listed in order in assembly/run.hooks_of). --find-lr's
range test builds the same run without writing."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Sequence

from assembly.run import Run, build_run
from core.config import Config
from core.dist import DistInfo, rank0_decides
from core.errors import UserError
from core.logs import run_summary
from core.signals import Preempted, training_steps
from engine.checkpoint.run_dir import FolderLock, continue_with
from engine.checkpoint.run_store import RunStore, url_of
from engine.hooks import Hook, StopRun
from engine.lr_find import LABEL as LR_RULE_LABEL, range_test, write_results
from engine.state import TrainState
from engine.trainer import train_one_epoch

log = logging.getLogger(__name__)


def find_lr(cfg: Config, info: DistInfo) -> dict:
    """--find-lr: the LR range test on the run's data, fresh model, optimizer, precision and loss (never a checkpoint
    of output_dir, which it leaves as it is); rank 0 writes lr_find.json and lr_find.png to output_dir."""
    run = build_run(cfg, info, write=False, fresh=True)
    assert run is not None  # a fresh run always has work left
    cfg = run.cfg
    result = {**range_test(run.parts, run.data.train, run.loop, info, cfg.tune), "world_size": info.world_size,
              "batch_size": cfg.train.batch_size, "accum_steps": cfg.train.accum_steps}
    rank0_decides(lambda: write_results(result, Path(cfg.output_dir)))  # every rank learns whether it could
    if result["suggested_lr"] is None:  # every rank's curve is the same all-reduced one: all refuse together
        raise UserError(f"--find-lr has no suggestion: {result['no_suggestion']} ({result['stopped']}); lower "
                        f"tune.lr_min, or check that the data can be learnt (the curve: lr_find.json and lr_find.png "
                        f"in {cfg.output_dir})", all_ranks=True)
    if info.is_main:
        log.info("LR range test: %d steps (%s); suggested optim.lr %.3g (%s; its steepest descent at lr %.3g); "
                 "lr_find.json and lr_find.png in %s", result["steps"], result["stopped"], result["suggested_lr"],
                 LR_RULE_LABEL, result["steepest_lr"], cfg.output_dir)
    return result


def fit(cfg: Config, info: DistInfo, lock: FolderLock | None = None,
        hooks: Sequence[Hook] = (), store: RunStore | None = None) -> TrainState | None:
    """The run: epochs of training steps, each validated (and every train.val_every_steps steps inside it: the
    ValidateEvery hook); what happens around them is the run's hooks, then `hooks`. `lock`: rank 0's lock on
    output_dir (launch.train holds it), checked before each write there. Over the epochs a stop signal only asks for
    a stop (training_steps): every rank stops after the same step, at the same validation batch, or once a
    validation's hooks (its checkpoint) are done, and last.pth is written there. `store`: output_dir's URL
    (launch.staged), uploaded to after each validation."""
    run = build_run(cfg, info, write=True, lock=lock, extra=hooks, store=store)
    if run is None:  # a finished run: nothing to train
        return None
    cfg, state, out = run.cfg, run.state, run.outputs
    try:  # close(): however the run ends, its last checkpoint write (train.async_save) finishes first
        with training_steps():  # a signal after the last check is raised as the block ends (Terminated)
            while state.epoch < cfg.train.epochs:
                try:
                    epoch(run, state, info)
                except Preempted as stopped:  # SIGTERM, SIGUSR1 or SIGINT: every rank stopped at the same place
                    stopped.checkpoint = out.save_now(state)  # resume=auto continues there (a cut validation first)
                    stopped.overrides = continue_with(cfg.output_dir, cfg.resume)
                    raise
                except StopRun:  # before the epoch, or at a validation inside it (said, checkpointed, recorded)
                    break
        for hook in run.hooks:
            hook.after_train(state)
    finally:
        out.checkpointer.close()
    if info.is_main:
        log.info(run_summary(out.record.rows(), run.chosen_on, state.best_value, state.best_epoch,
                             time.monotonic() - run.started, url_of(cfg.output_dir), cut_short=state.epoch_step > 0))
    return state


def epoch(run: Run, state: TrainState, info: DistInfo) -> None:
    """One pass of the loop: the epoch's (remaining) steps, their validation and the hooks after it. A validation a
    stop cut short (state.unvalidated, put back from last.pth) comes first: one inside the epoch
    (train.val_every_steps) before the epoch trains on; the one after the steps in place of them (they are done)."""
    owed = state.unvalidated
    if owed is not None and owed["mid_epoch"]:
        validated(run, state, owed["train"], mid_epoch=True)
    if owed is None or owed["mid_epoch"]:
        for hook in run.hooks:
            hook.before_epoch(state)  # the first, StopRules, raises StopRun when a stop rule holds
        train = train_one_epoch(run.parts, run.data.train, state, run.loop, info, run.hooks)
    else:
        train = owed["train"]
    validated(run, state, train)


def validated(run: Run, state: TrainState, train: dict[str, float], mid_epoch: bool = False) -> None:
    """A validation with the train columns `train`, then every hook's after_epoch (the last, StopRequests, raises
    Preempted when a stop signal came meanwhile)."""
    finished = not mid_epoch and state.epoch_finished(run.data.steps_per_epoch)
    end = run.validation(state, train, finished=finished, mid_epoch=mid_epoch)
    for hook in run.hooks:
        hook.after_epoch(state, end)
