"""Benchmark 1: train.py's steady-state img/s vs a minimal hand-written loop (target >= 0.95).

Both sides train the same timm model (resnet18, 64 px, batch 32, bf16 autocast, channels_last) in one
process pinned to one core (`taskset -c 0`, so one torch thread), alternating, one fresh process per run:
- `train.py` on synthetic data (data.name=dummy, num_workers=0: images are generated and augmented in the
  training process itself), 2 epochs, run through benchmarks/train_py_epoch.py; its second epoch is the
  steady-state figure (the first is warmup): train.py's own `train_img_per_s` (wall clock), and the
  epoch's images per CPU-second of the process.
- benchmarks/bare_train.py: ten lines of loop over batches already in memory, one warmup epoch, one timed
  epoch of the same number of steps; with torch's default SGD, and again with fused SGD (which the app
  uses), so the second ratio isolates the loop's own overhead.
Images per CPU-second is the headline (a single-threaded process's CPU time barely moves when other
jobs share the machine; wall-clock figures follow). It also profiles train_one_epoch to count host syncs
(`.item()`-like calls) per step.

    python benchmarks/loop_overhead.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import harness  # noqa: F401  (puts the repo on sys.path)
from harness import REPO, alternate, has_taskset, last_json_line, launch, machine_line, print_table, ratio_line
from harness import train_py_epoch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--img-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--train-size", type=int, default=1536, help="images per epoch")
    return parser.parse_args()


def dummy_data_ms_per_batch(img_size: int, batch_size: int) -> float:
    """CPU ms train.py's training process spends producing one batch of dummy data (num_workers=0)."""
    import cv2
    import torch
    from core.config import DataConfig
    from data.datasets import DummyDataset
    from data.loader import collate_channels_last
    from data.transforms import train_transform

    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    cfg = DataConfig(name="dummy", img_size=img_size, crop_pct=1.0)
    dataset = DummyDataset(1024, 10, img_size, train_transform(cfg), seed=0)
    collate_channels_last([dataset[(0, i)] for i in range(batch_size)])
    start = time.process_time()
    for b in range(8):
        collate_channels_last([dataset[(1, b * batch_size + i)] for i in range(batch_size)])
    return (time.process_time() - start) / 8 * 1e3


def host_syncs_per_step(steps: int = 10, log_interval: int = 5) -> tuple[int, int]:
    """(.item()-like calls seen by the profiler in `steps` steps of train_one_epoch, steps)."""
    import timm
    import torch
    from torch.profiler import profile

    from core.config import DataConfig, OptimConfig, SchedConfig
    from core.dist import DistInfo
    from data.transforms import DeviceNormalize
    from engine.optim import build_optimizer, build_scheduler
    from engine.precision import resolve_precision
    from engine.state import TrainState
    from engine.trainer import LoopConfig, TrainParts, train_one_epoch

    info = DistInfo(0, 1, 0, 1, torch.device("cpu"))
    model = timm.create_model("resnet10t", num_classes=10).to(memory_format=torch.channels_last)
    optimizer = build_optimizer(model, OptimConfig())
    scheduler = build_scheduler(optimizer, SchedConfig(), 2, steps)
    batches = [(torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8), torch.randint(0, 10, (8,)))
               for _ in range(steps)]
    data = DataConfig()
    loop = LoopConfig(log_interval=log_interval, normalize=DeviceNormalize(data.mean, data.std, info.device, True))
    parts = TrainParts(model, optimizer, scheduler, torch.nn.CrossEntropyLoss(), resolve_precision("auto", info.device))
    train_one_epoch(parts, batches, TrainState(), loop, info)
    with profile() as prof:
        train_one_epoch(parts, batches, TrainState(), loop, info)
    syncs = sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense")
    return syncs, steps


def main() -> None:
    args = parse_args()
    if not has_taskset():
        raise SystemExit("this benchmark pins processes to one core with `taskset` (util-linux); install it")
    overrides = [f"model.name={args.model}", f"data.img_size={args.img_size}",
                 f"data.dummy_image_size={args.img_size}", "data.crop_pct=1.0", "data.num_workers=0",
                 f"data.dummy_train_size={args.train_size}", f"data.dummy_val_size={2 * args.batch_size}",
                 f"train.batch_size={args.batch_size}"]
    bare = [f"--model={args.model}", f"--img-size={args.img_size}", f"--batch-size={args.batch_size}",
            f"--train-size={args.train_size}"]
    script = REPO / "benchmarks" / "bare_train.py"
    print(machine_line())
    runs = {"train.py": lambda: train_py_epoch(overrides, pin_core=0),
            "bare loop, torch SGD": lambda: last_json_line(launch(script, bare, pin_core=0)),
            "bare loop, fused SGD": lambda: last_json_line(launch(script, [*bare, "--fused"], pin_core=0))}
    wall: dict[str, list[float]] = {name: [] for name in runs}

    def side(name: str):
        def run() -> float:
            result = runs[name]()
            wall[name].append(result["img_per_s"])
            return result["img_per_cpu_s"]
        return run

    results = alternate({name: side(name) for name in runs}, args.repeats)
    title = (f"Loop overhead: {args.model} {args.img_size}px, batch {args.batch_size}, bf16, channels_last, "
             "1 process x 1 thread, steady state")
    print_table(title, results, "images per CPU-second, higher is better")
    ratio_line(results, "train.py", "bare loop, torch SGD", target=0.95)
    ratio_line(results, "train.py", "bare loop, fused SGD")
    print_table(title + ", wall clock", wall, "images per second of wall-clock time (shared machine: noisier)")
    ratio_line(wall, "train.py", "bare loop, torch SGD", target=0.95)
    data_ms = dummy_data_ms_per_batch(args.img_size, args.batch_size)
    step_ms = 1e3 * args.batch_size / statistics.median(results["train.py"])
    print(f"- train.py makes its dummy data in the training process: {data_ms:.1f} CPU ms per batch of "
          f"{args.batch_size}, {100 * data_ms / step_ms:.1f}% of its step (the bare loop's batches are premade)")
    syncs, steps = host_syncs_per_step()
    print(f"- host syncs (aten::_local_scalar_dense, i.e. .item()/float()/bool()) in {steps} steps of "
          f"train_one_epoch: {syncs} (metrics are read with one .tolist() every logging.interval steps)")
    print(machine_line())


if __name__ == "__main__":
    main()
