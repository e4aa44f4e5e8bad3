"""Benchmark 4: bf16 autocast + channels_last vs fp32 for resnet50 training steps (target >= 1.4x).

Each side is the app's own loop (engine.trainer.train_one_epoch) with the app's model preparation,
precision and fused SGD, fed batches already in memory, in one process with one torch thread by default
(CPU-time figures are then robust to other jobs on the machine; --threads 2 uses both cores). The four
combinations of {fp32, bf16} x {NCHW, channels_last} alternate; each run times `--steps` optimizer
steps after one untimed warmup round. It also checks that `amp=auto` resolves to the faster dtype.

    python benchmarks/mixed_precision.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

import harness  # noqa: F401  (puts the repo on sys.path)
from harness import alternate, cpu_and_wall, machine_line, print_table, ratio_line


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2, help="timed optimizer steps per run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    return parser.parse_args()


def make_side(model_name: str, amp: str, channels_last: bool, batches: list) -> Callable[[], int]:
    """A function that runs `len(batches)` training steps through the app's loop and returns the image count."""
    import torch

    from core.config import DataConfig, ModelConfig, OptimConfig, SchedConfig
    from core.dist import DistInfo
    from data.transforms import DeviceNormalize
    from engine.optim import build_optimizer, build_scheduler
    from engine.precision import resolve_precision
    from engine.state import TrainState
    from engine.trainer import LoopConfig, TrainParts, train_one_epoch
    from models.factory import create_model, prepare_model

    info = DistInfo(0, 1, 0, 1, torch.device("cpu"))
    torch.manual_seed(0)
    cfg = ModelConfig(name=model_name, channels_last=channels_last)
    model = prepare_model(create_model(cfg, num_classes=1000), cfg, info.device, world_size=1)
    optimizer = build_optimizer(model, OptimConfig())
    scheduler = build_scheduler(optimizer, SchedConfig(), 1000, len(batches))
    precision = resolve_precision(amp, info.device)
    data = DataConfig()
    loop = LoopConfig(log_interval=1000, normalize=DeviceNormalize(data.mean, data.std, info.device, channels_last))
    parts = TrainParts(model, optimizer, scheduler, torch.nn.CrossEntropyLoss(), precision)

    def run() -> int:
        stats = train_one_epoch(parts, batches, TrainState(), loop, info)
        return int(stats["train_img_per_s"] * stats["epoch_time_s"] + 0.5)

    return run


def main() -> None:
    args = parse_args()
    import torch

    from engine.precision import resolve_precision

    torch.set_num_threads(args.threads)
    print(machine_line(), f"torch threads {torch.get_num_threads()}")
    torch.manual_seed(0)
    shape = (args.batch_size, 3, args.img_size, args.img_size)  # uint8, as the app's loaders deliver them
    batches = [(torch.randint(0, 256, shape, dtype=torch.uint8), torch.randint(0, 1000, (args.batch_size,)))
               for _ in range(args.steps)]
    configs = {"fp32": ("off", False), "fp32 + channels_last": ("off", True),
               "bf16": ("bf16", False), "bf16 + channels_last": ("bf16", True)}
    wall: dict[str, list[float]] = {name: [] for name in configs}
    sides = {name: cpu_and_wall(make_side(args.model, amp, cl, batches), wall[name])
             for name, (amp, cl) in configs.items()}
    results = alternate(sides, args.repeats, warmup=1)
    title = (f"Mixed precision: {args.model} {args.img_size}px training steps, batch {args.batch_size}, "
             f"{torch.get_num_threads()} thread(s)")
    print_table(title, results, "images per CPU-second, higher is better")
    ratio_line(results, "bf16 + channels_last", "fp32", target=1.4)
    ratio_line(results, "bf16 + channels_last", "fp32 + channels_last", target=1.4)
    wall = {name: values[1:] for name, values in wall.items()}  # drop the warmup round
    print_table(title + ", wall clock", wall, "images per second of wall-clock time (shared machine: noisier)")
    ratio_line(wall, "bf16 + channels_last", "fp32", target=1.4)
    auto = resolve_precision("auto", torch.device("cpu")).name
    fastest = max(results, key=lambda name: statistics.median(results[name]))
    print(f"- amp=auto resolves to {auto} on this CPU; the fastest side is '{fastest}': "
          f"{'auto picks the faster dtype' if fastest.startswith(auto) else 'auto does NOT pick the faster dtype'}")
    print(machine_line())


if __name__ == "__main__":
    main()
