"""The minimal hand-written training loop the app is measured against (benchmarks 1 and 3).

What a practitioner writes in ten lines: a timm model in channels_last, torch's SGD, bf16 autocast,
batches already in memory; under torchrun the model is wrapped in DDP with default settings. It runs
one untimed epoch (warmup), then times one epoch and prints, as a JSON line on rank 0, the global img/s
and rank 0's images per CPU-second.

    taskset -c 0 python benchmarks/bare_train.py                       # 1 process x 1 thread
    torchrun --standalone --nproc_per_node=2 benchmarks/bare_train.py  # 2 ranks x 1 thread, gloo DDP
"""

from __future__ import annotations

import argparse
import json
import os
import time

import timm
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--img-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--train-size", type=int, default=768, help="images per epoch over all processes")
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--fused", action="store_true", help="torch's fused SGD instead of its default")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))  # the app's rule
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = timm.create_model(args.model, num_classes=args.num_classes).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True,
                                fused=True if args.fused else None)
    if world > 1:
        model = DistributedDataParallel(model, device_ids=None)
    loss_fn = nn.CrossEntropyLoss()
    steps = args.train_size // (args.batch_size * world)
    batches = [(torch.randn(args.batch_size, 3, args.img_size, args.img_size).to(memory_format=torch.channels_last),
                torch.randint(0, args.num_classes, (args.batch_size,))) for _ in range(steps)]

    def epoch() -> None:
        for images, targets in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model(images), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    model.train()
    epoch()  # warmup: oneDNN primitives, allocator, DDP buckets
    if world > 1:
        dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    epoch()
    if world > 1:
        dist.barrier()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    if world == 1 or dist.get_rank() == 0:
        print(json.dumps({"img_per_s": steps * args.batch_size * world / seconds,
                          "img_per_cpu_s": steps * args.batch_size / cpu_seconds, "steps": steps}))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
