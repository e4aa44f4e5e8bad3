"""Fast-path check: the optimizer step the app builds (fused SGD) vs torch's default SGD on CPU.

engine.optim.build_optimizer asks timm for torch's fused step when the optimizer has one (SGD, Adam,
AdamW). This times `optimizer.step()` alone for resnet18 and resnet50 parameter sets (gradients filled
with noise), alternating the app's optimizer with torch's default (per-tensor loop on CPU, foreach on CUDA)
built from the same param groups, in one process with every core (or --threads).

    python benchmarks/optimizer_step.py [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import harness  # noqa: F401  (puts the repo on sys.path)
from harness import alternate, machine_line, print_table, ratio_line


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per timed run")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    return parser.parse_args()


def step_ms(optimizer, steps: int) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            optimizer.step()
        return (time.perf_counter() - start) / steps * 1e3

    return run


def main() -> None:
    args = parse_args()
    import timm
    import torch

    from core.config import OptimConfig
    from engine.optim import build_optimizer

    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_line(), f"torch threads {torch.get_num_threads()}")
    cfg = OptimConfig(name="sgd")
    for name in ("resnet18", "resnet50"):
        model = timm.create_model(name, num_classes=1000)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        ours = build_optimizer(model, cfg)
        groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in ours.param_groups]
        default = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=True)
        results = alternate({"app (fused SGD)": step_ms(ours, args.steps),
                             "torch default SGD": step_ms(default, args.steps)}, args.repeats, warmup=1)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        print_table(f"SGD step (nesterov, weight decay), {name} parameters ({params:.1f}M), "
                    f"{torch.get_num_threads()} thread(s)", results, "milliseconds per step, lower is better")
        ratio_line(results, "torch default SGD", "app (fused SGD)")
    print(machine_line())


if __name__ == "__main__":
    main()
