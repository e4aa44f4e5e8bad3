"""What a checkpoint save costs: one file from rank 0 (train.ckpt_format=file) vs a sharded folder (sharded).

Two gloo ranks on the CPU, one thread each, a timm model with AdamW state (3 tensors per parameter). Each round
times, alternating which goes first: the file save as the Checkpointer makes it (rank 0 copies the model and
optimizer state to the CPU and writes one fsynced file with `save_atomic`; rank 1 waits), and the sharded save
of the same DDP model (`engine.checkpoint.sharded.save`: both ranks write their share with DCP, rank 0 adds the plain data
and swaps the folder in); then the sharded save of the model sharded with FSDP2 (fully_shard per block, then the
root). Prints rank 0's medians and the bytes each rank wrote.

    python benchmarks/sharded_save.py [--model vit_small_patch16_224] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import harness  # noqa: F401  (puts the repo on sys.path)
from harness import machine_line


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default="vit_small_patch16_224")
    parser.add_argument("--dir", default="", help="where to write (default: a temp folder)")
    return parser.parse_args()


def built(name: str, fsdp: bool):
    """The model (DDP, or FSDP2 per block + root) and an AdamW that has taken one step (so it has state)."""
    import timm
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, img_size=32) if "vit" in name else timm.create_model(name)
    if fsdp:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        wrapped = model
    else:
        wrapped = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    size = 32 if "vit" in name else 64
    wrapped(torch.randn(2, 3, size, size)).sum().backward()
    optimizer.step()
    return model, wrapped, optimizer


def rank_main(rank: int, args: argparse.Namespace, port: int, folder: str, results) -> None:
    import torch
    import torch.distributed as dist

    from core.dist import rank0_decides
    from core.files import save_atomic
    from engine.checkpoint import sharded
    from engine.checkpoint.saver import cpu_state_dict, on_cpu

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = Path(folder)
    model, wrapped, optimizer = built(args.model, fsdp=False)

    def file_save() -> None:
        rank0_decides(lambda: save_atomic({"model": cpu_state_dict(model), "optimizer": on_cpu(optimizer.state_dict())},
                                          out / "last.pth"))

    def sharded_save() -> None:
        sharded.save(out / "last.dcp", model, optimizer, {"global_step": 1})

    def timed(save) -> float:
        dist.barrier()
        start = time.perf_counter()
        save()
        dist.barrier()
        return time.perf_counter() - start

    file_save(), sharded_save()  # warmup
    times: dict[str, list[float]] = {"file": [], "sharded (DDP)": []}
    for round_ in range(args.rounds):
        order = [("file", file_save), ("sharded (DDP)", sharded_save)]
        for name, save in order if round_ % 2 == 0 else order[::-1]:
            times[name].append(timed(save))
    sizes = {"file": [(out / "last.pth").stat().st_size, 0],
             "sharded (DDP)": [sum(p.stat().st_size for p in (out / "last.dcp").glob(f"__{r}_*.distcp"))
                               for r in range(2)]}
    model, wrapped, optimizer = built(args.model, fsdp=True)
    sharded_save()  # warmup
    times["sharded (FSDP2)"] = [timed(sharded_save) for _ in range(args.rounds)]
    sizes["sharded (FSDP2)"] = [sum(p.stat().st_size for p in (out / "last.dcp").glob(f"__{r}_*.distcp"))
                                for r in range(2)]
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        results.put((times, sizes, params))
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    from tests.helpers import free_port

    args = parse_args()
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with tempfile.TemporaryDirectory(dir=args.dir or None) as folder:
        mp.start_processes(rank_main, args=(args, free_port(), folder, results), nprocs=2, start_method="spawn")
        times, sizes, params = results.get()
    print(machine_line())
    print(f"2 gloo ranks x 1 thread, {args.model} ({params / 1e6:.1f}M parameters, AdamW state), {args.rounds} "
          "rounds, fsynced writes\n")
    print("| save | min (s) | median (s) | max (s) | MB written by rank 0 / rank 1 |\n| --- | --- | --- | --- | --- |")
    for name, values in times.items():
        written = " / ".join(f"{b / 1e6:.0f}" for b in sizes[name])
        print(f"| {name} | {min(values):.2f} | {statistics.median(values):.2f} | {max(values):.2f} | {written} |")


if __name__ == "__main__":
    main()
