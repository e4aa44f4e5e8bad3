"""What the per-step stop check costs: one all-reduce of one number, against a DDP training step.

Two gloo ranks on the CPU, one thread each. Each round times `--calls` calls of `core.dist.max_over_ranks`
(the check `train_one_epoch` makes after every optimizer step, so that all ranks stop after the same step
when one got SIGTERM or SIGUSR1) and `--steps` DDP training steps of the model (forward, backward with the
gradient all-reduce, fused SGD step). Prints rank 0's medians over the rounds and the check's share of a step.

    python benchmarks/stop_check.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import harness  # noqa: F401  (puts the repo on sys.path)
from harness import machine_line


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--img-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    return parser.parse_args()


def rank_main(rank: int, args: argparse.Namespace, port: int, results) -> None:
    import timm
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from core.dist import max_over_ranks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = DistributedDataParallel(timm.create_model(args.model, num_classes=10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)
    images = torch.randn(args.batch_size, 3, args.img_size, args.img_size)
    targets = torch.randint(0, 10, (args.batch_size,))
    device = torch.device("cpu")

    def step() -> None:
        torch.nn.functional.cross_entropy(model(images), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warmup
    checks, steps = [], []
    for _ in range(args.rounds):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.calls):
            max_over_ranks(0, device)
        checks.append((time.perf_counter() - start) / args.calls)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        steps.append((time.perf_counter() - start) / args.steps)
    if rank == 0:
        results.put((checks, steps))
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    from tests.helpers import free_port

    args = parse_args()
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(rank_main, args=(args, free_port(), results), nprocs=2, start_method="spawn")
    checks, steps = results.get()
    check_us, step_ms = statistics.median(checks) * 1e6, statistics.median(steps) * 1e3
    print(machine_line())
    print(f"2 gloo ranks x 1 thread, {args.model} {args.img_size} px, batch {args.batch_size} per rank, "
          f"{args.rounds} rounds (min / median / max)\n")
    print("| | min | median | max |\n| --- | --- | --- | --- |")
    print(f"| stop check (us) | {min(checks) * 1e6:.0f} | {check_us:.0f} | {max(checks) * 1e6:.0f} |")
    print(f"| DDP training step (ms) | {min(steps) * 1e3:.0f} | {step_ms:.0f} | {max(steps) * 1e3:.0f} |")
    print(f"\nstop check / step: {check_us / 1e3 / step_ms:.3%}")


if __name__ == "__main__":
    main()
