"""benchmark.py's training img/s against a bare loop's on the same model, batch and device (issue 28).

The bare side is what a practitioner writes: timm model in channels_last, torch SGD, random batches in
memory, forward / backward / step / zero_grad, the same number of timed steps after the same warm-up.
benchmark.py's side is `assembly/benchmark.benchmark()` (the app's Precision step with its one inf/NaN read per step,
fused SGD). fp32 (this machine's CPU has no bf16 instructions), 1 thread, alternating sides every round.

    python benchmarks/benchmark_py.py [--repeats 5] [--model resnet18] [--img-size 64] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import time

import harness  # noqa: F401  (puts the repo on sys.path)
from harness import alternate, machine_line, print_table, ratio_line


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--img-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import numpy as np
    import timm
    import torch

    from assembly import benchmark
    from core.config_load import load_config
    from engine.precision import resolve_precision

    torch.set_num_threads(1)
    print(machine_line(), "torch threads 1")
    cfg = load_config(None, [f"model.name={args.model}", f"train.batch_size={args.batch_size}",
                             f"data.img_size={args.img_size}", "amp='off'", "model.channels_last=true"])
    cpu = torch.device("cpu")

    def app() -> float:
        result = benchmark.benchmark(cfg, cpu, resolve_precision("off", cpu), "train", args.warmup, args.steps, 10)
        return result["train"]["img_per_s"]

    def bare() -> float:
        model = timm.create_model(args.model, num_classes=10).to(memory_format=torch.channels_last).train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        images = torch.randn(args.batch_size, 3, args.img_size, args.img_size).to(memory_format=torch.channels_last)
        labels = torch.randint(0, 10, (args.batch_size,))
        loss_fn = torch.nn.CrossEntropyLoss()
        seconds = []
        for step in range(args.warmup + args.steps):
            start = time.perf_counter()
            loss_fn(model(images), labels).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= args.warmup:
                seconds.append(time.perf_counter() - start)
        return args.batch_size / float(np.median(seconds))

    results = alternate({"benchmark.py": app, "bare loop": bare}, args.repeats)
    print_table(f"benchmark.py vs a bare loop: {args.model} {args.img_size}px, batch {args.batch_size}, fp32, "
                "channels_last, 1 thread, training img/s (median step)", results, "img/s, higher is better")
    ratio_line(results, "benchmark.py", "bare loop", target=0.9)


if __name__ == "__main__":
    main()
