"""How fast is a model here: inference and training img/s, step-time percentiles, peak memory, parameters.

    python benchmark.py --model resnet50 --batch-size 128 --amp bf16          # the device train.py would use
    python benchmark.py --config resnet50 --json runs/bench.json             # model, batch, amp... from a config

The model is timm's (random weights, nothing downloaded), placed and stepped as train.py does it
(prepare_model, the app's Precision and optimizer; torch.compile with --compile). Inputs are random batches
already on the device: this times the model, not the data pipeline (a run's own input wait says whether the
loader keeps up: README, "Speed"). Each mode runs --warmup untimed steps, then --steps timed ones, each
ended by a device synchronize; img/s is batch / the median step time, with min and max from the slowest and
fastest step; step-time percentiles interpolate linearly between steps (numpy.percentile).
Peak memory: CUDA's max_memory_allocated, or on CPU the process's peak RSS (which includes the interpreter
and torch itself, and is the maximum since the process started).
"""

from __future__ import annotations

if __name__ == "__main__":  # first: a SIGTERM or SIGUSR1 during the imports below (seconds) gets handled
    from engine.signals import handle_early

    handle_early()

import argparse
import json
import resource
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from engine.startup import cpu_share, import_timm_without_wandb, tune_cpu_process

import_timm_without_wandb()  # first: the imports below reach timm, which would import wandb (engine/startup.py)

from engine.cli import run_main
from engine.config import Config, OptimConfig, load_config
from engine.dist import init_distributed
from engine.errors import UserError
from engine.optim import build_optimizer
from engine.outputs import check_replaceable, starts_with, write_output
from engine.precision import Precision, resolve_precision
from models.factory import create_model, prepare_model

PERCENTILES = (50, 90, 99)
OURS = starts_with(b'{\n  "benchmark": "benchmark.py"')  # --json replaces only an earlier result of ours


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="take model, batch size, image size, amp, channels_last, compile from this "
                                         "config (YAML file or a name in configs/); the options below override it")
    parser.add_argument("--model", help="timm model name (default: the config's, else resnet18)")
    parser.add_argument("--batch-size", type=int, help="images per step (default: the config's train.batch_size)")
    parser.add_argument("--img-size", type=int, help="input side in pixels (default: the config's data.img_size)")
    parser.add_argument("--amp", choices=("auto", "bf16", "fp16", "off"), help="precision (default: the config's)")
    parser.add_argument("--channels-last", choices=("true", "false"), help="NHWC memory format (default: config's)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--num-classes", type=int, default=1000, help="classifier outputs (default 1000)")
    parser.add_argument("--mode", choices=("both", "inference", "train"), default="both")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    return parser.parse_args(argv)


def settings(args: argparse.Namespace) -> Config:
    """The config to benchmark: defaults (or --config), with the command line's options applied."""
    overrides = [f"{key}={value}" for key, value in (
        ("model.name", args.model), ("train.batch_size", args.batch_size), ("data.img_size", args.img_size),
        ("amp", args.amp), ("model.channels_last", args.channels_last)) if value is not None]
    if args.compile:
        overrides.append("model.compile=true")
    if args.steps < 1 or args.warmup < 0:
        raise UserError(f"--steps must be >= 1 and --warmup >= 0, got --steps {args.steps} --warmup {args.warmup}")
    return load_config(args.config, overrides)


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


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def benchmark(cfg: Config, device: torch.device, precision: Precision, mode: str, warmup: int,
              steps: int, num_classes: int) -> dict:
    """Inference and/or training figures for cfg's model at cfg's batch and image size on `device`."""
    model = prepare_model(create_model(cfg.model, num_classes), cfg.model, device, world_size=1)
    run = torch.compile(model) if cfg.model.compile else model
    batch = cfg.train.batch_size
    fmt = torch.channels_last if cfg.model.channels_last else torch.contiguous_format
    images = torch.randn(batch, 3, cfg.data.img_size, cfg.data.img_size, device=device).to(memory_format=fmt)
    labels = torch.randint(0, num_classes, (batch,), device=device)
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

        result["inference"] = summary(timed_steps(infer, device, warmup, steps), batch)
    if mode in ("both", "train"):
        model.train()
        optimizer = build_optimizer(model, OptimConfig(), grad_scaler=precision.scaler is not None)
        loss_fn = torch.nn.CrossEntropyLoss()

        def train_step() -> None:
            with precision.autocast():
                loss = loss_fn(run(images), labels)
            precision.backward(loss)
            precision.step(optimizer, model, 0.0)  # as train.py: the inf/NaN check reads one value per step
            optimizer.zero_grad(set_to_none=True)

        result["train"] = summary(timed_steps(train_step, device, warmup, steps), batch)
    result["peak_memory_mib"] = peak_memory_bytes(device) / 2**20
    result["peak_memory_kind"] = "max_memory_allocated" if device.type == "cuda" else "process peak RSS"
    return result


def device_name(device: torch.device) -> str:
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


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cfg = settings(args)
    if args.json:  # before minutes of benchmarking, not after
        check_replaceable(args.json, OURS, "an earlier benchmark.py JSON", "--json")
    device = init_distributed("auto").device  # the device train.py would pick
    if device.type == "cpu":
        tune_cpu_process(cpu_share(1))
    precision = resolve_precision(cfg.amp, device)
    result = benchmark(cfg, device, precision, args.mode, args.warmup, args.steps, args.num_classes)
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_output(args.json, (json.dumps(result, indent=2) + "\n").encode(), OURS, "an earlier benchmark.py JSON",
                     "--json")
    return 0


if __name__ == "__main__":
    run_main(main, after_sigterm="run it again")
