"""What each command does once its arguments are parsed: the one call train.py (and, in later modules,
evaluate.py, predict.py, export.py) makes. The process group, the CPU threads and the run folder are set up here.

The config is read and checked before anything heavy is imported: a refused key answers at once, and torch, timm,
albumentations and the rest load after it (seconds), once the run's first line has said what starts."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

from core.config import Config, config_yaml, with_derived
from core.config_load import load_config
from core.errors import UserError
from core.logs import setup_logging
from core.startup import compute_threads, default_workers, import_timm_without_wandb, tune_cpu_process

if TYPE_CHECKING:
    from core.dist import DistInfo
    from engine.checkpoint.run_dir import FolderLock
    from engine.checkpoint.run_store import RunStore
    from engine.hooks import Hook

log = logging.getLogger(__name__)

QUICKSTART = "configs/digits.yaml"  # --config's default: the quickstart's own data and 32 px settings


def train(config: str | None, overrides: list[str], print_config: bool = False, dry: bool = False,
          lr_test: bool = False, hooks: Sequence[Hook] = ()) -> int:
    """train.py: print the resolved config, make a dry run, run the LR range test, or train (`fit`, with `hooks`
    after the run's own: benchmarks time epochs so); every rank calls it. `main` of train.py holds nothing else."""
    cfg = load_config(config_file(config, overrides), overrides)
    if print_config:
        import_timm_without_wandb()  # first: the imports below reach timm, which would import wandb (core/startup.py)
        from core.dist import read_launch_env
        from engine.optim import batch_and_lr

        rank, world_size, *_ = read_launch_env()
        if rank == 0:  # the batch and lr for this launch's processes; preprocessing: --dry-run shows it
            resolved = with_derived(cfg, **batch_and_lr(cfg, world_size, False))
            print(f"# as {world_size} process(es) run it\n{config_yaml(resolved)}", end="")
        return 0
    info, cfg = start_training(cfg, config)
    from assembly.fit import find_lr, fit  # timm, albumentations and the rest (seconds), loaded by start_training
    from assembly.run import dry_run

    if dry:
        with staged(cfg, dry=True) as (cfg, _):
            summary = dry_run(cfg, info)
        if info.is_main:
            print(summary)
        return 0
    with staged(cfg) as (cfg, store), run_folder(cfg) as lock:
        if lr_test:
            find_lr(cfg, info)
        else:
            fit(cfg, info, lock, hooks, store)  # report_errors leaves the process group after reporting an error
    return 0


@contextlib.contextmanager
def staged(cfg: Config, dry: bool = False) -> Iterator[tuple[Config, RunStore | None]]:
    """An output_dir at a URL: cfg with its local staging folder (engine/checkpoint/run_store.py), the run's lock
    object held on rank 0, the run copied there first and uploaded after each validation (fit's Upload hook) and at the
    end; a dry run reads a copy in a temporary folder. A local output_dir is yielded as it is."""
    from core.dist import rank0_decides
    from core.store import is_url

    if not is_url(cfg.output_dir):
        yield cfg, None
        return
    import tempfile

    from engine.checkpoint.run_store import LockObject, RunStore

    with contextlib.ExitStack() as stack:
        local = Path(stack.enter_context(tempfile.TemporaryDirectory())) if dry else None
        store = RunStore(cfg.output_dir, local)
        held: list[LockObject] = []
        rank0_decides(lambda: held.append(LockObject(store.url)) if not dry else None)
        store.lock = held[0] if held else None
        stack.callback(lambda: [lock.release() for lock in held])
        rank0_decides(store.pull)
        cfg = with_derived(cfg, output_dir=str(store.local), resume=store.resume_path(cfg.resume))
        try:
            yield cfg, store
        except BaseException as err:
            if held and not store.broken:  # the last good files reach the URL, whatever stopped the run
                with contextlib.suppress(UserError):
                    store.push()
            if isinstance(err, UserError):  # named as the user named it: the URL, not the staging folder
                raise type(err)(str(err).replace(str(store.local), store.url), all_ranks=err.all_ranks,
                                before_group=err.before_group) from None
            raise
        if not dry:
            rank0_decides(store.push)


def start_training(cfg: Config, config: str | dict | None) -> tuple[DistInfo, Config]:
    """The processes (training_processes) and the run's first lines, said before the slow imports, then cfg with its
    run folder resolved once for every rank, checked to be the same config on each: what train.py and
    assembly/api.train do before a run (`config`: as given, for the first line)."""
    cfg, notes = with_workers(cfg)
    info = training_processes(cfg)
    if info.is_main:
        for line in (first_line(cfg, config, info.world_size, info.device.type), *notes):
            log.info(line)
    import_timm_without_wandb()  # first: the imports below reach timm, which would import wandb (core/startup.py)
    from assembly.start import check_same_config, with_run_folder

    cfg = with_run_folder(cfg)
    check_same_config(cfg)
    return info, cfg


def with_workers(cfg: Config) -> tuple[Config, list[str]]:
    """cfg with data.num_workers as this machine runs it (core/startup.default_workers), and the notes to say:
    loading's (cfg.notes) and the workers'."""
    from core.dist import read_launch_env

    workers, capped = default_workers(cfg.data.num_workers, "data.num_workers" in cfg.given, read_launch_env()[3])
    return with_derived(cfg, data={"num_workers": workers}), [*cfg.notes, *([capped] if capped else [])]


def first_line(cfg: Config, config: str | dict | None, world_size: int, device: str) -> str:
    """The run's first line, said before the slow imports: what starts, where, on what (a config given as a dict, by
    assembly/api.train, is named so)."""
    data = cfg.data.name if cfg.data.name == "dummy" else f"{cfg.data.name} {cfg.data.root}"
    source = "a config dict" if isinstance(config, dict) else config_file(config, [])
    return (f"starting {source}: model {cfg.model.name}, data {data}, {world_size} process(es) on "
            f"{device}, output_dir {cfg.output_dir}")


def training_processes(cfg: Config) -> DistInfo:
    """Logging, the process group and, on the CPU, the compute threads: once per process, before any run."""
    from core.dist import init_distributed, read_launch_env

    setup_logging(read_launch_env()[0], cfg.logging.level)  # before the rendezvous, which may wait
    info = init_distributed(cfg.dist.backend, cfg.dist.timeout_s, cfg.dist.rendezvous_timeout_s)
    if info.device.type == "cpu":
        tune_cpu_process(compute_threads(info.local_world_size, cfg.data.num_workers))  # logged: assembly/run.py
    return info


@contextlib.contextmanager
def run_folder(cfg: Config) -> Iterator[FolderLock | None]:
    """output_dir locked for the run (one live run per folder; the lock on rank 0, None elsewhere), checked to be the
    same folder on every process."""
    from engine.checkpoint.run_dir import check_shared, locked

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
