"""Benchmark 2: our decode + train augmentation vs torchvision's standard PIL pipeline (target >= 1.5x).

The benchmark writes a few hundred ImageNet-sized JPEGs (500x375, 375x500 and 500x333, quality 90,
about 100 KB each, textured so they compress like photos) into a temp folder, then measures images/s of
one DataLoader worker's work (one thread for torch and OpenCV, samples fetched and collated in batches
of 32), alternating:
- ours: data.datasets.ImageFolderDataset + data.transforms.train_transform (cv2.imread, albumentations'
  RandomResizedCrop box resized by torchvision's antialiased uint8 kernel (issue 31; OpenCV before), flip,
  ToTensorV2, per-sample seeded RNG; uint8), collated by
  data.loader.collate_channels_last as the app's loaders do. The app normalizes on the training device
  (data.transforms.DeviceNormalize); the side "ours + normalize in this process" adds that pass here, which
  is what it costs when the device is this CPU;
- torchvision: datasets.ImageFolder + RandomResizedCrop(224), RandomHorizontalFlip, ToTensor, Normalize
  (the pytorch/examples ImageNet pipeline), and the same with transforms.v2 (PILToTensor + ToDtype).

RandAugment (issue 14): the same sides with RandAugment, 2 ops at magnitude 9 of timm's 0-10 scale, every op
applied, after the crop and flip: ours with data.auto_augment=rand-m9-n2-p1 (torchvision.transforms.v2's
policy on the uint8 tensor with data.transforms.FastKernels, seeded per sample inside torch.random.fork_rng),
torchvision with transforms.RandAugment(num_ops=2, magnitude=27) on the PIL image (27 of its 31 bins is the
same 0.9 of each op's range; the 14 ops are the same). And RandAugment inc1 (issue 31): ours with
data.auto_augment=rand-m9-n2-p1-inc1 (timm's own PIL ops on the crop, through PIL and back) against timm's
create_transform(224, is_training=True, auto_augment="rand-m9-n2-p1-inc1") on the PIL image.

Reduced-size decoding: libjpeg can decode at 1/2, 1/4, 1/8 scale (cv2.IMREAD_REDUCED_COLOR_*, PIL draft).
It keeps the result correct only when the crop, after reduction, is still at least the output size;
RandomResizedCrop samples the crop from the image size, so the crop must be sampled (from the JPEG
header's size) before decoding. The second table measures that "reduce when valid" pipeline against the
same pipeline always decoding at full size, at 224 px and at 128 px, and counts how often reduction is valid.

    python benchmarks/data_pipeline.py [--images 256] [--repeats 7] [--only randaugment]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import harness  # noqa: F401  (puts the repo on sys.path)
from harness import alternate, machine_line, print_table, ratio_line

SIZES = ((500, 375), (375, 500), (500, 333))  # (width, height), the common ImageNet shapes
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
REDUCED = (1, 2, 4, 8)  # the scales libjpeg decodes at


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--only", choices=["randaugment"], help="run only the RandAugment comparison")
    return parser.parse_args()


def write_jpegs(root: Path, count: int) -> float:
    """root/train/{a,b}/*.jpg photo-like JPEGs; returns their mean size in KB."""
    import cv2
    import numpy as np

    rng = np.random.default_rng(0)
    total = 0
    for i in range(count):
        w, h = SIZES[i % len(SIZES)]
        low = cv2.resize(rng.integers(0, 256, (6, 8, 3)).astype(np.float32), (w, h), interpolation=cv2.INTER_CUBIC)
        mid = cv2.resize(rng.normal(0, 40, (h // 4, w // 4, 3)).astype(np.float32), (w, h))
        image = np.clip(low + mid + rng.normal(0, 16, (h, w, 3)).astype(np.float32), 0, 255).astype(np.uint8)
        folder = root / "train" / "ab"[i % 2]
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{i:04d}.jpg"
        cv2.imwrite(str(path), image, [cv2.IMWRITE_JPEG_QUALITY, 90])
        total += path.stat().st_size
    return total / count / 1024


def epoch_img_per_s(get: Callable[[int], tuple], size: int, batch_size: int, wall: list[float],
                    collate: Callable | None = None) -> Callable[[], float]:
    """One pass over the dataset as one worker does it: fetch samples, collate batches of batch_size.

    Returns images per CPU-second of this (single-threaded) process, which is what one worker on its own
    core delivers and, unlike wall time, hardly moves when other jobs share the machine; wall-clock
    images/s are appended to `wall`.
    """
    from torch.utils.data import default_collate

    collate = collate or default_collate

    def run() -> float:
        start, cpu_start = time.perf_counter(), time.process_time()
        for first in range(0, size, batch_size):
            collate([get(i) for i in range(first, min(first + batch_size, size))])
        wall.append(size / (time.perf_counter() - start))
        return size / (time.process_time() - cpu_start)

    return run


def reduced_decode_pipeline(paths: list[str], out_size: int, allow_reduce: bool):
    """RandomResizedCrop sampled from the header's size, decoded at the largest valid 1/r, flip, normalize.

    Returns (get(i) -> (tensor, 0), counter of decodes per reduction factor).
    """
    import albumentations as A
    import cv2
    import numpy as np
    import torch
    from PIL import Image

    crop = A.RandomResizedCrop(size=(out_size, out_size), scale=(0.08, 1.0), ratio=(0.75, 1.3333))
    flags = {1: cv2.IMREAD_COLOR_RGB, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
             8: cv2.IMREAD_REDUCED_COLOR_8}
    flags = {r: (f & ~cv2.IMREAD_COLOR) | cv2.IMREAD_COLOR_RGB for r, f in flags.items()}  # RGB at every scale
    mean = np.array(MEAN, np.float32) * 255
    inv_std = 1 / (np.array(STD, np.float32) * 255)
    counts = {r: 0 for r in REDUCED}

    def get(i: int) -> tuple:
        rng = random.Random(i)
        crop.py_random = rng
        with Image.open(paths[i]) as header:  # reads the JPEG header only
            width, height = header.size
        x0, y0, x1, y1 = crop.get_params_dependent_on_data({"shape": (height, width)}, {})["crop_coords"]
        r = 1
        if allow_reduce:  # the largest scale at which the crop still has out_size pixels per side
            r = max((f for f in REDUCED if x1 - x0 >= f * out_size and y1 - y0 >= f * out_size), default=1)
        counts[r] += 1
        image = cv2.imread(paths[i], flags[r])[y0 // r:y1 // r, x0 // r:x1 // r]
        image = cv2.resize(image, (out_size, out_size), interpolation=cv2.INTER_LINEAR)
        if rng.random() < 0.5:
            image = cv2.flip(image, 1)
        return torch.from_numpy((image - mean) * inv_std).permute(2, 0, 1), 0

    return get, counts


def main() -> None:
    args = parse_args()
    import albumentations as A
    import cv2
    import torch
    from albumentations.pytorch import ToTensorV2
    from torchvision import datasets
    from torchvision.datasets.folder import default_loader
    from torchvision import transforms as T
    from torchvision.transforms import v2

    from core.config import DataConfig
    from data.datasets import ImageFolderDataset, read_image
    from data.loader import collate_channels_last
    from data.transforms import DeviceNormalize, train_transform

    torch.set_num_threads(1)  # what a DataLoader worker gets
    cv2.setNumThreads(1)  # what data.loader's worker_init_fn sets
    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="bench-jpeg-") as tmp:
        root = Path(tmp)
        kb = write_jpegs(root, args.images)
        if args.only == "randaugment":
            randaugment_tables(root, kb, args)
            print(machine_line())
            return
        ours = ImageFolderDataset(root / "train", train_transform(DataConfig(img_size=224, mean=list(MEAN),
                                                                             std=list(STD))), seed=0)
        classic = datasets.ImageFolder(str(root / "train"), transform=T.Compose([
            T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)]))
        modern = datasets.ImageFolder(str(root / "train"), transform=v2.Compose([
            v2.RandomResizedCrop(224), v2.RandomHorizontalFlip(), v2.PILToTensor(),
            v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]))
        unaliased = ImageFolderDataset(root / "train", A.Compose([  # the crop before issue 31: OpenCV's resize
            A.RandomResizedCrop(size=(224, 224), interpolation=cv2.INTER_LINEAR), A.HorizontalFlip(), ToTensorV2()]),
            seed=0)
        n, bs = len(ours), args.batch_size
        paths = [ours.path(i) for i in range(n)]
        normalize = DeviceNormalize(MEAN, STD, torch.device("cpu"), channels_last=True)
        getters = {"ours (cv2 + albumentations)": lambda i: ours[(0, i)],
                   "ours, OpenCV resize (not antialiased)": lambda i: unaliased[(0, i)],
                   "ours + normalize in this process": lambda i: ours[(0, i)],
                   "torchvision (PIL, transforms)": classic.__getitem__,
                   "torchvision (PIL, transforms.v2)": modern.__getitem__,
                   "decode only: cv2.imread": lambda i: (read_image(paths[i]), 0),
                   "decode only: PIL open + convert": lambda i: (default_loader(paths[i]), 0)}
        wall: dict[str, list[float]] = {name: [] for name in getters}
        collates = {"ours (cv2 + albumentations)": collate_channels_last,  # the app's loaders use it
                    "ours, OpenCV resize (not antialiased)": collate_channels_last,
                    "ours + normalize in this process": lambda batch: normalize(collate_channels_last(batch)[0]),
                    "decode only: cv2.imread": list, "decode only: PIL open + convert": list}
        results = alternate({name: epoch_img_per_s(get, n, bs, wall[name], collates.get(name))
                             for name, get in getters.items()}, args.repeats, warmup=1)
        title = (f"Data pipeline: decode + RandomResizedCrop 224 + flip + normalize + to tensor + collate, "
                 f"{n} JPEGs (500x375 / 375x500 / 500x333, mean {kb:.0f} KB), one worker")
        print_table(title, results, "images per CPU-second of the worker, higher is better")
        ratio_line(results, "ours (cv2 + albumentations)", "torchvision (PIL, transforms)", target=1.5)
        ratio_line(results, "ours (cv2 + albumentations)", "torchvision (PIL, transforms.v2)", target=1.5)
        ratio_line(results, "ours + normalize in this process", "torchvision (PIL, transforms)")
        ratio_line(results, "ours (cv2 + albumentations)", "ours, OpenCV resize (not antialiased)")
        med = {name: statistics.median(values) for name, values in results.items()}
        after_ours = 1e3 / med["ours (cv2 + albumentations)"] - 1e3 / med["decode only: cv2.imread"]
        after_tv = 1e3 / med["torchvision (PIL, transforms)"] - 1e3 / med["decode only: PIL open + convert"]
        print(f"- CPU ms per image: decode {1e3 / med['decode only: cv2.imread']:.2f} (cv2) vs "
              f"{1e3 / med['decode only: PIL open + convert']:.2f} (PIL); everything after decoding "
              f"{after_ours:.2f} (ours) vs {after_tv:.2f} (torchvision transforms): {after_tv / after_ours:.1f}x")
        print_table(title + ", wall clock", {name: values[1:] for name, values in wall.items()},
                    "images per second of wall-clock time (shared machine: noisier)")
        ratio_line({name: values[1:] for name, values in wall.items()}, "ours (cv2 + albumentations)",
                   "torchvision (PIL, transforms)", target=1.5)

        sides, counters = {}, {}
        for out_size in (224, 128):
            for reduce in (False, True):
                name = f"{out_size}px, {'reduce when valid' if reduce else 'full decode'}"
                get, counters[name] = reduced_decode_pipeline(paths, out_size, reduce)
                sides[name] = epoch_img_per_s(get, n, bs, [])
        reduced = alternate(sides, args.repeats, warmup=1)
        print_table(f"Reduced-size JPEG decoding inside RandomResizedCrop (same {n} JPEGs, one worker)", reduced,
                    "images per CPU-second of the worker, higher is better")
        for out_size in (224, 128):
            ratio_line(reduced, f"{out_size}px, reduce when valid", f"{out_size}px, full decode")
            counts = counters[f"{out_size}px, reduce when valid"]
            total = sum(counts.values())
            shares = ", ".join(f"1/{r}: {100 * c / total:.0f}%" for r, c in counts.items() if c)
            print(f"  - {out_size}px: decodes by scale over all runs: {shares}")
        randaugment_tables(root, kb, args)
    print(machine_line())


def randaugment_tables(root: Path, kb: float, args: argparse.Namespace) -> None:
    """Ours vs torchvision's PIL pipelines, both with RandAugment 2 ops at 0.9 of each op's range."""
    import timm.data
    import torch
    from torchvision import datasets
    from torchvision import transforms as T
    from torchvision.transforms import v2

    from core.config import DataConfig
    from data.datasets import ImageFolderDataset
    from data.loader import collate_channels_last
    from data.transforms import DeviceNormalize, tensor_augment, train_transform

    cfg = DataConfig(img_size=224, mean=list(MEAN), std=list(STD), auto_augment="rand-m9-n2-p1")
    ours = ImageFolderDataset(root / "train", train_transform(cfg), seed=0, tensor_transform=tensor_augment(cfg))
    classic = datasets.ImageFolder(str(root / "train"), transform=T.Compose([
        T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.RandAugment(num_ops=2, magnitude=27),
        T.ToTensor(), T.Normalize(MEAN, STD)]))
    modern = datasets.ImageFolder(str(root / "train"), transform=v2.Compose([
        v2.RandomResizedCrop(224), v2.RandomHorizontalFlip(), v2.RandAugment(num_ops=2, magnitude=27),
        v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]))
    inc1 = DataConfig(img_size=224, mean=list(MEAN), std=list(STD), auto_augment="rand-m9-n2-p1-inc1")
    ours_inc1 = ImageFolderDataset(root / "train", train_transform(inc1), seed=0, tensor_transform=tensor_augment(inc1))
    timm_inc1 = datasets.ImageFolder(str(root / "train"), transform=timm.data.create_transform(
        224, is_training=True, auto_augment="rand-m9-n2-p1-inc1", interpolation="bilinear", mean=MEAN, std=STD))
    normalize = DeviceNormalize(MEAN, STD, torch.device("cpu"), channels_last=True)
    n, bs = len(ours), args.batch_size
    getters = {"ours + RandAugment (v2 on uint8)": lambda i: ours[(0, i)],
               "ours + RandAugment + normalize here": lambda i: ours[(0, i)],
               "torchvision + RandAugment (PIL, transforms)": classic.__getitem__,
               "torchvision + RandAugment (PIL, transforms.v2)": modern.__getitem__,
               "ours + RandAugment inc1 (timm's PIL ops)": lambda i: ours_inc1[(0, i)],
               "timm + RandAugment inc1 (PIL)": timm_inc1.__getitem__}
    collates = {"ours + RandAugment (v2 on uint8)": collate_channels_last,
                "ours + RandAugment inc1 (timm's PIL ops)": collate_channels_last,
                "ours + RandAugment + normalize here": lambda batch: normalize(collate_channels_last(batch)[0])}
    wall: dict[str, list[float]] = {name: [] for name in getters}
    results = alternate({name: epoch_img_per_s(get, n, bs, wall[name], collates.get(name))
                         for name, get in getters.items()}, args.repeats, warmup=1)
    print_table(f"Data pipeline with RandAugment (2 ops, magnitude 0.9): decode + RandomResizedCrop 224 + flip + "
                f"RandAugment + normalize + collate, {n} JPEGs (mean {kb:.0f} KB), one worker", results,
                "images per CPU-second of the worker, higher is better")
    ratio_line(results, "ours + RandAugment (v2 on uint8)", "torchvision + RandAugment (PIL, transforms)")
    ratio_line(results, "ours + RandAugment (v2 on uint8)", "torchvision + RandAugment (PIL, transforms.v2)")
    ratio_line(results, "ours + RandAugment + normalize here", "torchvision + RandAugment (PIL, transforms)")
    ratio_line(results, "ours + RandAugment inc1 (timm's PIL ops)", "timm + RandAugment inc1 (PIL)")


if __name__ == "__main__":
    main()
