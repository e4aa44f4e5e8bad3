"""Map-style datasets: an ImageFolder tree on disk, and synthetic images with no files.

Both return (CHW float tensor, int label). The augmentation RNG of a sample is seeded from
(seed, epoch, index): results do not depend on the number of workers or ranks, every epoch
sees new augmentations, and a resumed run sees exactly the ones it would have seen.
"""

from __future__ import annotations

import abc
import logging
import os
import random
from pathlib import Path
import albumentations as A
import cv2
import numpy as np
import torch
from torch.utils.data import Dataset

from engine.errors import UserError

log = logging.getLogger(__name__)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


class PackedStrings:
    """Many strings in two numpy arrays (utf-8 bytes + offsets).

    A Python list of str would be copied page by page into every DataLoader worker as reference
    counts are touched (pytorch/pytorch#13246); two flat arrays are never written to.
    """

    def __init__(self, strings: list[str]) -> None:
        encoded = [s.encode("utf-8") for s in strings]
        self.offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=self.offsets[1:])
        self.data = np.frombuffer(b"".join(encoded), dtype=np.uint8) if encoded else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        return self.data[self.offsets[i]:self.offsets[i + 1]].tobytes().decode("utf-8")


class AugmentedDataset(Dataset, abc.ABC):
    """Applies an albumentations pipeline to `load_image(index)` with a per-sample seeded RNG."""

    classes: list[str]
    labels: np.ndarray
    skip_corrupt = False  # True: an unreadable image gives None (collate_readable drops it), not an error

    def __init__(self, transform: A.Compose, seed: int) -> None:
        self.transform = transform
        self.seed = seed

    def __len__(self) -> int:
        return len(self.labels)

    @abc.abstractmethod
    def load_image(self, index: int) -> np.ndarray:
        """HWC uint8 RGB image."""

    @abc.abstractmethod
    def path(self, index: int) -> str:
        """Where sample `index` comes from (a file path, or a synthetic name), for predictions.csv."""

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int]:
        # Train samplers yield (epoch, index); evaluation yields plain indices.
        epoch, index = key if isinstance(key, tuple) else (0, key)
        rng = np.random.default_rng([self.seed, epoch, index])
        self.transform.set_random_state(rng, random.Random(int(rng.integers(2**63))))
        try:
            image = self.load_image(index)
        except UserError as err:
            if not self.skip_corrupt:
                raise
            log.warning("data.skip_corrupt: %s", err)
            return None
        return self.transform(image=image)["image"], int(self.labels[index])


def find_classes(split_dir: Path) -> list[str]:
    """Sorted class folder names, so class indices are the same on every rank and machine."""
    if not split_dir.is_dir():
        raise UserError(f"data folder {split_dir} does not exist; expected <data.root>/train/<class>/* "
                        "and <data.root>/val/<class>/* (set data.root)")
    classes = sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise UserError(f"{split_dir} has no class folders; put each class's images in {split_dir}/<class>/")
    return classes


def scan_images(split_dir: Path, classes: list[str]) -> tuple[list[str], np.ndarray]:
    """Relative paths and labels of every image under split_dir/<class>/, sorted."""
    paths: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        files = sorted(
            os.path.join(name, e.name) for e in os.scandir(split_dir / name)
            if e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS)
        )
        if not files:
            raise UserError(f"class folder {split_dir / name} has no images ({', '.join(IMAGE_EXTENSIONS)})")
        paths += files
        labels += [label] * len(files)
    return paths, np.asarray(labels, dtype=np.int64)


def read_image(path: str) -> np.ndarray:
    """Decode any JPEG/PNG (grayscale, RGB or RGBA) into HWC uint8 RGB (decoded as RGB: no BGR copy)."""
    image = cv2.imread(path, cv2.IMREAD_COLOR_RGB)
    if image is None:
        raise UserError(f"cannot read image {path} (corrupt, truncated or not an image); remove or replace it")
    return image


class ImageFolderDataset(AugmentedDataset):
    """`<root>/<split>/<class>/*` images; the index is kept in numpy arrays (see PackedStrings)."""

    def __init__(self, split_dir: str | Path, transform: A.Compose, seed: int,
                 classes: list[str] | None = None) -> None:
        super().__init__(transform, seed)
        self.root = Path(split_dir)
        self.classes = classes if classes is not None else find_classes(self.root)
        paths, self.labels = scan_images(self.root, self.classes)
        self.paths = PackedStrings(paths)

    def path(self, index: int) -> str:
        return str(self.root / self.paths[index])

    def load_image(self, index: int) -> np.ndarray:
        return read_image(self.path(index))


class DummyDataset(AugmentedDataset):
    """Synthetic, learnable images: a per-class colour layout plus per-sample noise.

    Sample `index` is a pure function of (seed, index + offset), so train and val (offset by the
    train size) never share a sample and no files are needed.
    """

    def __init__(self, size: int, num_classes: int, image_size: int, transform: A.Compose,
                 seed: int, offset: int = 0) -> None:
        super().__init__(transform, seed)
        self.classes = [f"class_{i}" for i in range(num_classes)]
        self.labels = (np.arange(size, dtype=np.int64) + offset) % num_classes
        self.offset = offset
        self.image_size = image_size
        layout_rng = np.random.default_rng([seed, 0x5EED])
        self.layouts = layout_rng.integers(0, 256, size=(num_classes, 4, 4, 3)).astype(np.float32)

    def path(self, index: int) -> str:
        return f"dummy:{index}"

    def load_image(self, index: int) -> np.ndarray:
        size = self.image_size
        base = cv2.resize(self.layouts[self.labels[index]], (size, size), interpolation=cv2.INTER_LINEAR)
        noise = np.random.default_rng([self.seed, index + self.offset]).normal(0, 48, (size, size, 3))
        return np.clip(base + noise, 0, 255).astype(np.uint8)

