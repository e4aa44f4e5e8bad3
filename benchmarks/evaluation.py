"""Benchmark 6: the app's evaluation img/s vs a bare inference loop (target >= 0.95).

Both sides run the same model (eval mode, channels_last, amp=auto i.e. bf16 autocast) over the same
batches already in memory, in one process with one torch thread by default (CPU-time figures are then
robust to other jobs on the machine; --threads 2 uses both cores), alternating:
- ours: engine.evaluation.evaluate (exact loss / top-1 / top-5 sums, all-reduced; what train.py and
  evaluate.py call per validation pass) on uint8 batches, as the app's loaders deliver them, so it also
  pays for the normalization (data.transforms.DeviceNormalize);
- bare: `with torch.inference_mode(), autocast: correct += (model(x).argmax(1) == y).sum()` on batches
  already normalized to float32 (as torchvision's pipeline delivers them): the strict reference, since
  its normalization was paid elsewhere;
- bare + normalize: the same loop on the uint8 batches, normalizing each the textbook way,
  `(x.float() / 255 - mean) / std`: the same input and work as ours.
Like evaluate.py (core.startup.tune_cpu_process), the process first raises glibc's malloc thresholds
(core.startup), which both sides share; set `GLIBC_TUNABLES=` (empty) to measure glibc's defaults.

    python benchmarks/evaluation.py [--repeats 5]
"""

from __future__ import annotations

import argparse

import harness  # noqa: F401  (puts the repo on sys.path)
from harness import alternate, cpu_and_wall, machine_line, print_table, ratio_line


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=4, help="batches per timed run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import torch

    from core.config import DataConfig, ModelConfig
    from core.dist import DistInfo
    from core.startup import keep_freed_memory
    from data.transforms import DeviceNormalize
    from engine.evaluation import evaluate
    from engine.precision import resolve_precision
    from models.factory import create_model, prepare_model
    from tests.helpers import Batches

    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as evaluate.py's tune_cpu_process does on CPU (`GLIBC_TUNABLES= ...` measures without)
    print(machine_line(), f"torch threads {torch.get_num_threads()}")
    info = DistInfo(0, 1, 0, 1, torch.device("cpu"))
    torch.manual_seed(0)
    cfg = ModelConfig(name=args.model)
    model = prepare_model(create_model(cfg, num_classes=1000), cfg, info.device, world_size=1).eval()
    precision = resolve_precision("auto", info.device)
    shape = (args.batch_size, 3, args.img_size, args.img_size)
    raw = Batches([(torch.randint(0, 256, shape, dtype=torch.uint8).contiguous(memory_format=torch.channels_last),
                    torch.randint(0, 1000, (args.batch_size,))) for _ in range(args.batches)], 1000)
    data = DataConfig()
    normalize = DeviceNormalize(data.mean, data.std, info.device, cfg.channels_last)
    batches = [(normalize(x), y) for x, y in raw]
    images = args.batch_size * args.batches

    def ours() -> int:
        evaluate(model, raw, precision, info, normalize)
        return images

    def bare() -> int:
        correct = torch.zeros((), dtype=torch.long)
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            for x, y in batches:
                correct += (model(x).argmax(1) == y).sum()
        correct.item()
        return images

    mean = torch.tensor(data.mean).view(1, 3, 1, 1)
    std = torch.tensor(data.std).view(1, 3, 1, 1)

    def bare_normalize() -> int:
        correct = torch.zeros((), dtype=torch.long)
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            for x, y in raw:
                correct += (model((x.float() / 255 - mean) / std).argmax(1) == y).sum()
        correct.item()
        return images

    sides = {"ours (engine.evaluation.evaluate)": ours, "bare inference loop": bare,
             "bare inference loop + normalize": bare_normalize}
    names = tuple(sides)
    wall: dict[str, list[float]] = {name: [] for name in names}
    results = alternate({name: cpu_and_wall(fn, wall[name]) for name, fn in sides.items()}, args.repeats, warmup=1)
    title = (f"Evaluation: {args.model} {args.img_size}px, batch {args.batch_size}, {precision.name}, channels_last, "
             f"{torch.get_num_threads()} thread(s)")
    print_table(title, results, "images per CPU-second, higher is better")
    ratio_line(results, names[0], names[1], target=0.95)
    ratio_line(results, names[0], names[2], target=0.95)
    wall = {name: values[1:] for name, values in wall.items()}  # drop the warmup round
    print_table(title + ", wall clock", wall, "images per second of wall-clock time (shared machine: noisier)")
    ratio_line(wall, names[0], names[1], target=0.95)
    print(machine_line())


if __name__ == "__main__":
    main()
