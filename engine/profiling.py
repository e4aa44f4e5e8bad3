"""logging.profile_steps=[start, end]: a torch.profiler trace of those optimizer steps, from rank 0.

The trace (CPU and, on a GPU, CUDA activities; tensor shapes; memory) is written to
<output_dir>/profile/rank0.steps<start>-<end>.pt.trace.json (<end>: the run's last step, when it ended first),
a Chrome trace that Perfetto (ui.perfetto.dev), chrome://tracing and TensorBoard's profiler plugin
(`tensorboard --logdir <output_dir>/profile`) open.
Off (the default) train.py adds no hook and torch.profiler is never started. Steps count as global_step
does: step 1 is the run's first optimizer step; the trace covers from the end of step start-1 to the end of
step `end` (its data loading, forward, backward, optimizer step and the hooks before this one).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from core.errors import UserError
from engine.checkpoint.run_dir import RunRecord
from engine.hooks import Hook
from engine.state import TrainState

log = logging.getLogger(__name__)
FOLDER = "profile"  # <output_dir>/profile/: the traces


def check_trace_folder(out_dir: Path) -> None:
    """Refuse, at start-up, a file of the user's where the trace folder goes: met only when the trace is written
    (after training up to the profiled steps), it stopped the run as a failed write."""
    folder = out_dir / FOLDER
    if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
        raise UserError(f"logging.profile_steps: {folder} is a file, not a folder; the profile trace is written into "
                        f"{folder}/: move the file away, choose another output_dir, or set logging.profile_steps=[]")


class ProfileSteps(Hook):
    """Profile optimizer steps start..end on rank 0; every rank calls it (writing the trace starts the run)."""

    def __init__(self, steps: list[int], folder: Path, device: torch.device, record: RunRecord, is_main: bool,
                 state: TrainState) -> None:
        self.start, self.end = steps
        self.folder, self.device, self.record, self.is_main = folder, device, record, is_main
        self.profiler: Any = None
        self.done = state.global_step >= self.end  # a resumed run past the range records nothing
        if state.global_step == self.start - 1:
            self.begin()

    def begin(self) -> None:
        if not self.is_main or self.done:
            return
        from torch.profiler import ProfilerActivity, profile  # only when asked for

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.profiler = profile(activities=activities, record_shapes=True, profile_memory=True)
        self.profiler.start()

    def after_step(self, state: TrainState) -> None:
        if state.global_step == self.start - 1:
            self.begin()
        elif state.global_step == self.end:
            self.finish(state.global_step)

    def after_train(self, state: TrainState) -> None:
        """The run ended inside the profiled steps: write what it recorded."""
        self.finish(state.global_step)

    def finish(self, step: int) -> None:
        """Stop after optimizer step `step` (`end`, or the run's last when it ended first: then the trace also holds
        its evaluation) and write the trace (a collective: every rank calls it); a no-op once done."""
        if self.done:
            return
        self.done = True
        self.record.start()
        self.record.write(lambda: self.save(step))

    def save(self, step: int) -> None:
        if self.profiler is None:
            return
        self.profiler.stop()
        if step < self.start:  # started after step start-1, the run's last: no profiled step to write
            self.profiler = None
            return
        self.folder.mkdir(exist_ok=True)
        path = self.folder / f"rank0.steps{self.start}-{step}.pt.trace.json"
        tmp = path.with_name(f".{path.name}.tmp")
        self.profiler.export_chrome_trace(str(tmp))
        os.replace(tmp, path)
        self.profiler = None
        log.info("profile of steps %d-%d written to %s (open it in ui.perfetto.dev or TensorBoard)", self.start,
                 step, path)


def window_warnings(steps: list[int], first: int, last: int) -> list[str]:
    """logging.profile_steps against the optimizer steps this run makes (first+1..last; a resumed run starts past
    0): a window the run never enters writes no trace, one it leaves early a shorter one. Said at start-up (and by
    --dry-run), not found out at the end."""
    if not steps or last <= first:
        return []
    start, end = steps
    made = f"this run's optimizer steps ({first + 1}-{last})"
    if not first < start <= last:
        return [f"logging.profile_steps={steps} lies outside {made}: no profile is written"]
    if end > last:
        return [f"logging.profile_steps={steps} ends after {made}: the trace covers steps {start}-{last}"]
    return []
