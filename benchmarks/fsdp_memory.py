"""Benchmark: per-rank memory of parameters + gradients + AdamW state, and step time, dist.strategy fsdp vs ddp.

Each configuration runs in its own real process group (gloo on CPU, one process per rank, spawned here):
vit_base_patch16_224 (86.6M parameters, random init: nothing is downloaded), fp32, the app's AdamW
(engine/optim.build_optimizer) and, for fsdp, the app's sharding (models/parallel.shard_model: each block,
then the root); ddp is torch's DistributedDataParallel as train.py builds it (gradient_as_bucket_view). After
the last step every rank counts the bytes it holds, before zero_grad: its parameters, its gradients and its
optimizer state (for fsdp, the local shards of the DTensors). Activations and FSDP's transient all-gathered
blocks are not counted. The step time is the median over the timed steps of rank 0's wall time per optimizer
step (forward, backward, step), after one untimed step; the ranks share the machine's cores, so on a 2-core
machine 4 ranks are slow for both strategies alike: read the fsdp/ddp ratio, not the absolute figures.

    python benchmarks/fsdp_memory.py [--ranks 2 4] [--batch-size 1] [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness  # noqa: F401  (puts the repo on sys.path)
from harness import machine_line

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor


def local_bytes(tensors) -> int:
    """Bytes this rank holds for these tensors (a DTensor: its local shard only)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def run_rank(rank: int, world: int, port: int, strategy: str, args: argparse.Namespace, out: str) -> None:
    from core.config import OptimConfig
    from core.startup import import_timm_without_wandb
    from engine.optim import build_optimizer

    import_timm_without_wandb()
    import timm

    from models.parallel import shard_model

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = timm.create_model(args.model, pretrained=False, num_classes=1000, img_size=args.img_size)
    if strategy == "fsdp":
        train_model = shard_model(model, None)
    else:
        train_model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    optimizer = build_optimizer(model, OptimConfig(name="adamw", lr=1e-4, weight_decay=0.05))
    images = torch.randn(args.batch_size, 3, args.img_size, args.img_size)
    labels = torch.randint(0, 1000, (args.batch_size,))
    times = []
    for step in range(args.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(train_model(images), labels)
        loss.backward()
        optimizer.step()
        if step:
            times.append(time.perf_counter() - start)
    params = list(model.parameters())
    figures = {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params),
               "optim": local_bytes(v for state in optimizer.state.values() for v in state.values()
                                    if isinstance(v, torch.Tensor)),
               "step_s": statistics.median(times), "numel": sum(p.numel() for p in params)}
    gathered = [None] * world
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        torch.save(gathered, Path(out) / "figures.pt")
    dist.destroy_process_group()


def measure(strategy: str, world: int, args: argparse.Namespace) -> list[dict]:
    from tests.helpers import free_port

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(run_rank, args=(world, free_port(), strategy, args, out), nprocs=world,
                           start_method="spawn", join=True)
        return torch.load(Path(out) / "figures.pt", weights_only=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_base_patch16_224")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch-size", type=int, default=1, help="per rank")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps (after one untimed)")
    args = parser.parse_args()
    print(machine_line())
    mib = 2 ** 20
    rows = ["| ranks | strategy | params MiB | grads MiB | AdamW state MiB | total MiB per rank (largest rank) | "
            "vs ddp | step s (rank 0, median) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for world in args.ranks:
        ddp_total = None
        for strategy in ("ddp", "fsdp"):
            print(f"{strategy} on {world} ranks ...", file=sys.stderr, flush=True)
            per_rank = measure(strategy, world, args)
            worst = max(per_rank, key=lambda f: f["params"] + f["grads"] + f["optim"])
            total = worst["params"] + worst["grads"] + worst["optim"]
            ddp_total = ddp_total or total
            rows.append(f"| {world} | {strategy} | {worst['params'] / mib:.0f} | {worst['grads'] / mib:.0f} | "
                        f"{worst['optim'] / mib:.0f} | {total / mib:.0f} | {total / ddp_total:.3f} | "
                        f"{per_rank[0]['step_s']:.2f} |")
    print(f"{args.model} ({per_rank[0]['numel'] / 1e6:.1f}M parameters), fp32, AdamW, batch {args.batch_size} per "
          f"rank at {args.img_size} px, gloo on CPU")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
