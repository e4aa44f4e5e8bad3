"""What benchmark.py does once its arguments are parsed: the model's steps timed as train.py places and steps them,
the batch sweep, the input pipeline timed alone, their tables and the --json result (benchmark.py's docstring
says what each figure means)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from core.config import Config, OptimConfig
from core.config_load import load_config
from core.dist import DistInfo, init_distributed
from core.errors import UserError
from core.files import check_replaceable, starts_with, write_output
from core.startup import compute_threads, training_kernels, tune_cpu_process
from data.loader import build_data, build_train_loader
from engine.batch_size import MAX_BATCH
from engine.optim import build_optimizer
from engine.precision import Precision, resolve_precision
from models.factory import create_model, prepare_model
from models.parallel import wrap_for_training

PERCENTILES = (50, 90, 99)
CUDA_MAX_BATCH = MAX_BATCH  # --sweep-batch's default cap on CUDA: train.batch_size=auto's search's
OURS = starts_with(b'{\n  "benchmark": "benchmark.py"')  # --json replaces only an earlier result of ours


def benchmark_command(args: argparse.Namespace) -> int:
    """benchmark.py: on the device train.py would pick, set up as train.py sets it, time the model's steps, sweep the
    batch and time the loader as asked; print each table and (--json) write the result."""
    cfg = settings(args)
    if args.json:  # before minutes of benchmarking, not after
        check_replaceable(args.json, OURS, "an earlier benchmark.py JSON", "--json")
    info = init_distributed("auto")
    device = info.device  # the device train.py would pick
    if device.type == "cpu":
        tune_cpu_process(compute_threads(1, cfg.data.num_workers))  # the threads train.py computes with
    precision = resolve_precision(cfg.amp, device, tf32=cfg.tf32)
    training_kernels(device.type, precision.tf32)  # train.py's backend settings (cuDNN's autotuning, TF32 on CUDA)
    if args.sweep_batch and args.max_batch is None and device.type == "cpu":
        raise UserError("--sweep-batch on the CPU needs --max-batch (host RAM is not probed for running out)")
    result = {"benchmark": "benchmark.py", "device": device_name(device)}
    if (mode := model_mode(args)) is not None:
        result = benchmark(cfg, device, precision, mode, args.warmup, args.steps, args.num_classes)
        print(table(result))
    if args.sweep_batch:
        result["sweep_batch"] = sweep_batch(cfg, device, precision, args.max_batch or CUDA_MAX_BATCH,
                                            args.num_classes)
        sweep = result["sweep_batch"]
        print(f"\nlargest batch that fits: {sweep['max_batch']} ({cfg.model.name}, {cfg.data.img_size} px, "
              f"{precision.name} training step; stopped by {sweep['stopped_by']})")
    if args.data:
        result["data"] = data_result(args, cfg, info, result)
        print("\n" + data_table(result["data"]))
    if args.json:
        write_result(args.json, result)
    return 0


def data_result(args: argparse.Namespace, cfg: Config, info: DistInfo, result: dict) -> dict:
    """--data's figures against --target-img-s, else against the training img/s `result` measured in this call."""
    measured = args.target_img_s is None
    target = result["train"]["img_per_s"] if measured else args.target_img_s
    data = time_data(cfg, info, args.workers or default_workers(), args.data_batches, target)
    data["target_source"] = "training img/s measured above" if measured else "--target-img-s"
    return data


def write_result(path: Path, result: dict) -> None:
    """--json: the result, over nothing but an earlier result of ours."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_output(path, (json.dumps(result, indent=2) + "\n").encode(), OURS, "an earlier benchmark.py JSON", "--json")


def settings(args: argparse.Namespace) -> Config:
    """The config to benchmark: defaults (or --config), with the command line's options applied."""
    overrides = [f"{key}={value}" for key, value in (
        ("model.name", args.model), ("train.batch_size", args.batch_size), ("data.img_size", args.img_size),
        ("amp", args.amp), ("model.channels_last", args.channels_last)) if value is not None]
    if args.compile:
        overrides.append("model.compile=true")
    if args.steps < 1 or args.warmup < 0:
        raise UserError(f"--steps must be >= 1 and --warmup >= 0, got --steps {args.steps} --warmup {args.warmup}")
    check_data_args(args)
    return load_config(args.config, [*args.overrides, *overrides])


def model_mode(args: argparse.Namespace) -> str | None:
    """Which model steps to time: --mode, else both unless --data or --sweep-batch asked for something else."""
    if args.mode is not None:
        return args.mode
    return None if args.data or args.sweep_batch else "both"


def check_data_args(args: argparse.Namespace) -> None:
    """Refuse --data / --sweep-batch values that cannot work, before anything is timed."""
    if args.workers is not None and min(args.workers) < 0:
        raise UserError(f"--workers must be >= 0, got {' '.join(map(str, args.workers))}")
    if args.data_batches < 1:
        raise UserError(f"--data-batches must be >= 1, got {args.data_batches}")
    if args.target_img_s is not None and not 0 < args.target_img_s < math.inf:
        raise UserError(f"--target-img-s must be a number > 0, got {args.target_img_s}")
    if args.data and args.target_img_s is None and model_mode(args) not in ("train", "both"):
        raise UserError("--data needs --target-img-s (the img/s the loader must deliver) or --mode train to "
                        "measure the model's training img/s in the same call")
    if args.max_batch is not None and args.max_batch < 2:
        raise UserError(f"--max-batch must be >= 2 (the sweep starts at batch 2), got {args.max_batch}")


def timed_steps(step: Callable[[], None], device: torch.device, warmup: int, steps: int) -> list[float]:
    """Seconds of each of `steps` calls after `warmup` untimed ones, each ended by a device synchronize."""
    for _ in range(warmup):
        step()
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def summary(seconds: list[float], batch_size: int) -> dict[str, float]:
    """img/s from the median step (and from the slowest and fastest), step-time percentiles in ms."""
    result = {"img_per_s": batch_size / float(np.median(seconds)), "img_per_s_min": batch_size / max(seconds),
              "img_per_s_max": batch_size / min(seconds)}
    for p in PERCENTILES:
        result[f"step_ms_p{p}"] = 1000 * float(np.percentile(seconds, p))
    return result


def reset_peak_memory(device: torch.device) -> None:
    """Each mode's peak its own on CUDA (inference's was counted into training's); the CPU's peak RSS cannot reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """The peak each mode reports: CUDA's allocated bytes since the reset, else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def benchmark(cfg: Config, device: torch.device, precision: Precision, mode: str, warmup: int,
              steps: int, num_classes: int) -> dict:
    """Inference and/or training figures for cfg's model at cfg's batch and image size on `device`."""
    model, run, fmt = model_on(cfg, device, num_classes)
    batch = cfg.train.batch_size
    images, labels = random_batch(batch, cfg.data.img_size, num_classes, fmt, device)
    result = {"benchmark": "benchmark.py", "model": cfg.model.name, "device": device_name(device), "batch_size": batch,
              "img_size": cfg.data.img_size, "amp": precision.name, "channels_last": cfg.model.channels_last,
              "compile": cfg.model.compile, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
              "warmup_steps": warmup, "timed_steps": steps}
    if mode in ("both", "inference"):
        model.eval()

        @torch.no_grad()
        def infer() -> None:
            with precision.autocast():
                run(images)

        reset_peak_memory(device)
        result["inference"] = summary(timed_steps(infer, device, warmup, steps), batch)
        result["inference"]["peak_memory_mib"] = peak_memory_bytes(device) / 2**20
    if mode in ("both", "train"):
        model.train()
        optimizer = build_optimizer(model, OptimConfig(), grad_scaler=precision.scaler is not None)
        train_step = make_train_step(model, run, optimizer, precision, images, labels)
        reset_peak_memory(device)
        result["train"] = summary(timed_steps(train_step, device, warmup, steps), batch)
        result["train"]["peak_memory_mib"] = peak_memory_bytes(device) / 2**20
    result["peak_memory_mib"] = max(result[mode]["peak_memory_mib"] for mode in ("inference", "train") if mode in result)
    result["peak_memory_kind"] = "max_memory_allocated" if device.type == "cuda" else "process peak RSS"
    return result


def model_on(cfg: Config, device: torch.device, num_classes: int) -> tuple[torch.nn.Module, Callable,
                                                                           torch.memory_format]:
    """cfg's model as train.py prepares it on one device, the callable that runs it (compiled or not), its layout."""
    model = prepare_model(create_model(cfg.model, num_classes), cfg.model, device, world_size=1)
    run = wrap_for_training(model, device, world_size=1, compile=cfg.model.compile)  # one process: no DDP
    return model, run, torch.channels_last if cfg.model.channels_last else torch.contiguous_format


def random_batch(batch: int, img_size: int, num_classes: int, fmt: torch.memory_format,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images in the model's layout and random labels, made on `device`."""
    images = torch.randn(batch, 3, img_size, img_size, device=device).to(memory_format=fmt)
    return images, torch.randint(0, num_classes, (batch,), device=device)


def make_train_step(model: torch.nn.Module, run: Callable, optimizer: torch.optim.Optimizer, precision: Precision,
                    images: torch.Tensor, labels: torch.Tensor) -> Callable[[], None]:
    """One training step on a fixed batch, as train.py steps: autocast forward, scaled backward, checked step."""
    loss_fn = torch.nn.CrossEntropyLoss()

    def train_step() -> None:
        with precision.autocast():
            loss = loss_fn(run(images), labels)
        precision.backward(loss)
        precision.step(optimizer, model, 0.0)  # as train.py: the inf/NaN check reads one value per step
        optimizer.zero_grad(set_to_none=True)

    return train_step


def sweep_batch(cfg: Config, device: torch.device, precision: Precision, max_batch: int, num_classes: int) -> dict:
    """The largest power-of-two batch up to max_batch whose training step runs (CUDA: not out of memory)."""
    model, run, fmt = model_on(cfg, device, num_classes)
    model.train()
    optimizer = build_optimizer(model, OptimConfig(), grad_scaler=precision.scaler is not None)
    fitted, stopped, batch = 0, f"--max-batch {max_batch}", 2  # BatchNorm cannot train on one image at 1x1
    while batch <= max_batch:
        if not fits(model, run, optimizer, precision, batch, cfg.data.img_size, num_classes, fmt, device):
            stopped = f"out of memory at batch {batch}"
            break
        fitted, batch = batch, batch * 2
    return {"max_batch": fitted, "cap": max_batch, "stopped_by": stopped}


def fits(model: torch.nn.Module, run: Callable, optimizer: torch.optim.Optimizer, precision: Precision, batch: int,
         img_size: int, num_classes: int, fmt: torch.memory_format, device: torch.device) -> bool:
    """Whether one training step at `batch` runs; after an out-of-memory error the cache is given back."""
    try:
        images, labels = random_batch(batch, img_size, num_classes, fmt, device)
        make_train_step(model, run, optimizer, precision, images, labels)()
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        return True
    except torch.cuda.OutOfMemoryError:
        pass
    optimizer.zero_grad(set_to_none=True)  # outside the except block: its traceback no longer holds the tensors
    torch.cuda.empty_cache()
    return False


def default_workers() -> list[int]:
    """0, then powers of two up to this machine's CPU count."""
    cpus = os.cpu_count() or 1
    return [0] + [2**i for i in range(cpus.bit_length()) if 2**i <= cpus]


def time_data(cfg: Config, info: DistInfo, workers: list[int], batches: int, target: float) -> dict:
    """img/s of train.py's train loader for each worker count; workers needed for `target` img/s."""
    bundle = build_data(cfg.data, cfg.train.batch_size, cfg.seed, info, cfg.train.accum_steps)  # built once
    rows = []
    for count in workers:
        # one epoch's batches are timed, so persistent workers change nothing but would outlive their row
        data_cfg = dataclasses.replace(cfg.data, num_workers=count, persistent_workers=False)
        loader = build_train_loader(bundle.train.dataset, data_cfg, cfg.train.batch_size, cfg.seed, info,
                                    cfg.train.accum_steps)
        if len(loader) < batches + 1:
            raise UserError(f"--data-batches {batches} needs {batches + 1} batches (one to warm up) but an epoch has "
                            f"{len(loader)} of train.batch_size {cfg.train.batch_size}; lower --data-batches")
        rows.append(data_row(loader, count, batches, target))
    return {"batch_size": cfg.train.batch_size, "dataset": cfg.data.name, "timed_batches": batches,
            "target_img_per_s": target, "workers": rows}


def data_row(loader: torch.utils.data.DataLoader, workers: int, batches: int, target: float) -> dict:
    """One worker count's figures: the warm-up batch's seconds, then img/s over `batches` timed batches."""
    start = time.perf_counter()
    it = iter(loader)
    next(it)  # untimed: workers start, first batch
    warmup_s = time.perf_counter() - start
    images = 0
    start = time.perf_counter()
    for _ in range(batches):
        images += len(next(it)[0])  # data.skip_corrupt may drop images from a batch
    seconds = time.perf_counter() - start
    del it  # the workers stop
    img_per_s = images / seconds
    per_worker = img_per_s / max(workers, 1)
    return {"num_workers": workers, "img_per_s": img_per_s, "img_per_s_per_worker": per_worker,
            "workers_needed": math.ceil(target / per_worker), "warmup_batch_s": warmup_s, "images": images}


def device_name(device: torch.device) -> str:
    """The device as the table and the JSON name it: the GPU's model, or the CPU with its compute threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def table(result: dict) -> str:
    """The results as a Markdown table, one row per mode."""
    head = (f"{result['model']} on {result['device']}: batch {result['batch_size']}, {result['img_size']} px, "
            f"{result['amp']}, channels_last={result['channels_last']}, compile={result['compile']}, "
            f"{result['params_m']:.2f}M parameters, {result['timed_steps']} timed steps after "
            f"{result['warmup_steps']} warm-up; peak memory {result['peak_memory_mib']:.0f} MiB "
            f"({result['peak_memory_kind']})")
    rows = ["| mode | img/s (median) | min | max | " + " | ".join(f"step ms p{p}" for p in PERCENTILES) + " |",
            "| --- " * (4 + len(PERCENTILES)) + "|"]
    for mode in ("inference", "train"):
        if mode in result:
            r = result[mode]
            rows.append(f"| {mode} | {r['img_per_s']:.1f} | {r['img_per_s_min']:.1f} | {r['img_per_s_max']:.1f} | "
                        + " | ".join(f"{r[f'step_ms_p{p}']:.1f}" for p in PERCENTILES) + " |")
    return "\n".join([head, "", *rows])


def data_table(data: dict) -> str:
    """--data's results as a Markdown table, one row per worker count."""
    head = (f"input pipeline ({data['dataset']}, batch {data['batch_size']}, {data['timed_batches']} timed batches "
            f"after 1 warm-up): workers needed for {data['target_img_per_s']:.1f} img/s "
            f"({data['target_source']}), if loading scales linearly with workers")
    rows = ["| data.num_workers | img/s | img/s per worker | workers needed | warm-up batch s |",
            "| --- " * 5 + "|"]
    for r in data["workers"]:
        rows.append(f"| {r['num_workers']} | {r['img_per_s']:.1f} | {r['img_per_s_per_worker']:.1f} | "
                    f"{r['workers_needed']} | {r['warmup_batch_s']:.2f} |")
    return "\n".join([head, "", *rows])


