"""What each command does once its arguments are parsed: the one call train.py (and, in later modules,
evaluate.py, predict.py, export.py) makes. The process group, the CPU threads and the run folder are set up here."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Sequence

from assembly.fit import find_lr, fit
from assembly.run import dry_run
from assembly.start import check_same_config, with_run_folder
from core.config import Config, config_yaml, with_derived
from core.config_load import load_config
from core.dist import DistInfo, init_distributed, read_launch_env
from core.errors import UserError
from core.logs import setup_logging
from core.startup import compute_threads, tune_cpu_process
from engine.checkpoint.run_dir import FolderLock, check_shared, locked
from engine.hooks import Hook
from engine.optim import batch_and_lr

QUICKSTART = "configs/digits.yaml"  # --config's default: the quickstart's own data and 32 px settings


def train(config: str | None, overrides: list[str], print_config: bool = False, dry: bool = False,
          lr_test: bool = False, hooks: Sequence[Hook] = ()) -> int:
    """train.py: print the resolved config, make a dry run, run the LR range test, or train (`fit`, with `hooks`
    after the run's own: benchmarks time epochs so); every rank calls it. `main` of train.py holds nothing else."""
    cfg = load_config(config_file(config, overrides), overrides)
    if print_config:
        rank, world_size, *_ = read_launch_env()
        if rank == 0:  # the batch and lr for this launch's processes; preprocessing: --dry-run shows it
            resolved = with_derived(cfg, **batch_and_lr(cfg, world_size, False))
            print(f"# as {world_size} process(es) run it\n{config_yaml(resolved)}", end="")
        return 0
    info, cfg = start_training(cfg)
    if dry:
        summary = dry_run(cfg, info)
        if info.is_main:
            print(summary)
        return 0
    with run_folder(cfg) as lock:
        if lr_test:
            find_lr(cfg, info)
        else:
            fit(cfg, info, lock, hooks)  # report_errors leaves the process group, after reporting any error
    return 0


def start_training(cfg: Config) -> tuple[DistInfo, Config]:
    """The processes (training_processes) and cfg with its run folder resolved once for every rank, checked to be the
    same config on each: what train.py and assembly/api.train do before a run."""
    info = training_processes(cfg)
    cfg = with_run_folder(cfg)
    check_same_config(cfg)
    return info, cfg


def training_processes(cfg: Config) -> DistInfo:
    """Logging, the process group and, on the CPU, the compute threads: once per process, before any run."""
    setup_logging(read_launch_env()[0], cfg.logging.level)  # before the rendezvous, which may wait
    info = init_distributed(cfg.dist.backend, cfg.dist.timeout_s, cfg.dist.rendezvous_timeout_s)
    if info.device.type == "cpu":
        tune_cpu_process(compute_threads(info.local_world_size, cfg.data.num_workers))  # logged: assembly/run.py
    return info


@contextlib.contextmanager
def run_folder(cfg: Config) -> Iterator[FolderLock | None]:
    """output_dir locked for the run (one live run per folder; the lock on rank 0, None elsewhere), checked to be the
    same folder on every process."""
    with locked(Path(cfg.output_dir)) as lock:
        check_shared(Path(cfg.output_dir))  # every process writes into rank 0's folder: one folder for all
        yield lock


def config_file(given: str | dict | None, overrides: list[str]) -> str | dict:
    """--config, or the quickstart's; other data without --config is refused in one line: the digits config's
    32 px and mean/std 0.5 would silently apply to the user's photos."""
    if given is not None:
        return given
    data = [item.split("=", 1)[0] for item in overrides if item.split("=", 1)[0] in ("data.root", "data.name")]
    if data:
        raise UserError(f"{' and '.join(data)} given without --config, whose default is the digits quickstart (32 px, "
                        "its own mean/std); for your own images add --config finetune (a pretrained model at 224 px) "
                        "or another config from configs/")
    return QUICKSTART
