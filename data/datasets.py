"""Map-style datasets: an ImageFolder tree on disk, and synthetic images with no files.

Both return (CHW uint8 tensor, int label). The augmentation RNG of a sample is seeded from
(seed, epoch, index), and the repeat number with data.aug_repeats: results do not depend on the number of
workers or ranks, every epoch (and every repeat) sees new augmentations, and a resumed run sees exactly
the ones it would have seen.
"""

from __future__ import annotations

import abc
import io
import logging
import os
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import albumentations as A
import cv2
import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from core.config import DataConfig
from core.errors import UserError
from data.pipeline import FileTransform

TensorTransform = Callable[[torch.Tensor], torch.Tensor]
log = logging.getLogger(__name__)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


class PackedStrings:
    """Many strings in two numpy arrays (file-system bytes + offsets).

    A Python list of str would be copied page by page into every DataLoader worker as reference
    counts are touched (pytorch/pytorch#13246); two flat arrays are never written to. Strings are
    stored as os.fsencode bytes, so a file name that is not UTF-8 (valid on Linux) round-trips.
    """

    def __init__(self, strings: list[str]) -> None:
        encoded = [os.fsencode(s) for s in strings]
        self.offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=self.offsets[1:])
        self.data = np.frombuffer(b"".join(encoded), dtype=np.uint8) if encoded else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        return os.fsdecode(self.data[self.offsets[i]:self.offsets[i + 1]].tobytes())


class AugmentedDataset(Dataset, abc.ABC):
    """Applies an albumentations pipeline, then torchvision's tensor policies, to `load_image(index)` with
    per-sample seeded RNGs."""

    classes: list[str]
    labels: np.ndarray
    skip_corrupt = False  # True: an unreadable image gives None (collate_readable drops it), not an error
    corrupt_advice = ""  # the training set's: data.skip_corrupt, said with an unreadable image that stops the run
    erasing = None  # data.random_erase_fill=normalized: a TimmErasing whose boxes (not pixels) each sample carries
    # data.size_schedule: epoch -> (pipeline, tensor policies) at that epoch's size (data.transforms.SizedTransforms)
    sized: Callable[[int], tuple[A.Compose, TensorTransform | None]] | None = None
    mirror = ("", "")  # data.root at a URL, read from its local copy (data/mirror.py): (the copy's folder, the URL)

    def __init__(self, transform: A.Compose, seed: int, tensor_transform: TensorTransform | None = None) -> None:
        self.transform = transform
        self.tensor_transform = tensor_transform
        self.seed = seed

    def __len__(self) -> int:
        return len(self.labels)

    @abc.abstractmethod
    def load_image(self, index: int) -> np.ndarray:
        """HWC uint8 RGB image."""

    @abc.abstractmethod
    def path(self, index: int) -> str:
        """Where sample `index` comes from (a file path, or a synthetic name), for predictions.csv."""

    def __getitem__(self, key: int | tuple[int, ...]) -> tuple:
        """(image, label); (image, label, (epoch, pair)) for a sample of a mixed pair (data.loader.EpochSampler);
        with `erasing`, its boxes come third: (image, label, boxes[, (epoch, pair)]) (data.erasing).

        Train samplers yield (epoch, index) or (epoch, index, repeat, pair); evaluation yields plain indices.
        """
        epoch, index, repeat, pair = (*key, 0, -1)[:4] if isinstance(key, tuple) else (0, key, 0, -1)
        entropy = [self.seed, epoch, index] if repeat == 0 else [self.seed, epoch, index, repeat]
        rng = np.random.default_rng(entropy)
        transform, tensor_transform = self.transforms_at(epoch)
        transform.set_random_state(rng, random.Random(int(rng.integers(2**63))))
        try:
            image = self.load_image(index)
        except UserError as err:
            err = self.named(err)
            if not self.skip_corrupt:
                raise (UserError(f"{err}{self.corrupt_advice}") if self.corrupt_advice else err) from None
            log.warning("data.skip_corrupt: %s", err)
            return None
        try:
            image = self.transformed(image, index, transform)
        except UserError as err:
            raise self.named(err) from None
        boxes = ()
        if tensor_transform is not None or self.erasing is not None:
            image, *boxes = seeded(lambda x: self.augment_tensor(x, tensor_transform), image, tensor_seed(entropy))
        return image, self.target(index), *boxes, *[(epoch, pair)] * (pair >= 0)

    def named(self, err: UserError) -> UserError:
        """A sample's error naming its image by data.root's URL where the image was read from the URL's mirror."""
        return UserError(str(err).replace(*self.mirror)) if self.mirror[0] else err

    def transforms_at(self, epoch: int) -> tuple[A.Compose, TensorTransform | None]:
        """(albumentations pipeline, tensor policies) of a sample of `epoch`: data.size_schedule's at that epoch's
        size, decided by the epoch the sampler's key carries (in a loader worker too), else the dataset's own."""
        return (self.transform, self.tensor_transform) if self.sized is None else self.sized(epoch)

    def transformed(self, image: np.ndarray, index: int, transform: A.Compose | FileTransform) -> torch.Tensor:
        """The albumentations pipeline's image; a user's pipeline file that fails on it is one line naming the file,
        the transform and the image (data/pipeline.py), in this process and in a loader worker alike."""
        try:
            return transform(image=image)["image"]
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - any transform of the user's file, on any image
            if not isinstance(transform, FileTransform):
                raise
            raise transform.failed(err, self.path(index), image.shape) from None

    def augment_tensor(self, image: torch.Tensor, tensor_transform: TensorTransform | None) -> tuple:
        """(image after the tensor policies), and with `erasing` its boxes, drawn next from the same RNG."""
        if tensor_transform is not None:
            image = tensor_transform(image)
        return (image,) if self.erasing is None else (image, self.erasing.draw(image))

    def target(self, index: int) -> int | torch.Tensor:
        """A sample's label: its class index, or (multi-label: labels is a [N, C] 0/1 array) a float multi-hot row."""
        label = self.labels[index]
        return torch.from_numpy(label.astype(np.float32)) if label.ndim else int(label)


class Shown(NamedTuple):
    """A training sample as shown to a person: samples.png, W&B's train_samples table."""
    index: int
    path: str
    image: np.ndarray  # HWC uint8, augmented, before normalization
    label: int | list[int]  # multi-label: the classes present
    name: str  # their class names, "|"-joined


def augmented_samples(dataset: AugmentedDataset, count: int, epoch: int = 0) -> list[Shown]:
    """`count` training samples as the model gets them in `epoch` (seeded by seed, epoch and index, so drawing
    them changes nothing in training), spread over the whole set, which an ImageFolder sorts by class. An
    unreadable one (data.skip_corrupt) is left out."""
    indices = np.unique(np.linspace(0, len(dataset) - 1, min(count, len(dataset))).round().astype(int))
    shown = []
    for index in indices.tolist():
        sample = dataset[(epoch, index)]
        if sample is not None:  # (data.random_erase_fill=normalized: unerased, the device fills)
            image, label = sample[:2]
            label = label.nonzero().flatten().tolist() if torch.is_tensor(label) else label
            name = "|".join(dataset.classes[c] for c in (label if isinstance(label, list) else [label]))
            shown.append(Shown(index, dataset.path(index), image.permute(1, 2, 0).numpy(), label, name))
    return shown


def tensor_seed(entropy: list[int]) -> int:
    """The torch seed of a sample's torchvision policies: a child of its albumentations seed sequence."""
    return int(np.random.SeedSequence(entropy, spawn_key=(1,)).generate_state(1, np.uint64)[0])


def seeded(transform: TensorTransform, image: torch.Tensor, seed: int) -> torch.Tensor:
    """transform(image) with torch's global CPU RNG set to `seed`, and put back afterwards (torchvision v2
    draws from it, and dropout in this process must not see the difference)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # torch.manual_seed would also queue a lazy CUDA seeding per call
        return transform(image)


def shared_labels(labels: np.ndarray, own: list[str], classes: list[str], where: str) -> np.ndarray:
    """Labels indexing `own` (this split's class list) re-expressed in `classes`, the training class map.

    Every format goes through here, so a class has one index everywhere. A class the map lacks is an
    error (the model has no output for it); a class of the map with no sample here (a small validation
    split) is named in a warning, and metrics count the samples present.
    """
    position = {name: i for i, name in enumerate(classes)}
    extra = [name for name in own if name not in position]
    if extra:
        raise UserError(f"{where} has classes that are not among the {len(classes)} training classes "
                        f"({', '.join(extra[:10])}); remove them, or train on them too")
    mapped = np.asarray([position[name] for name in own], dtype=np.int64)[labels] if own != classes else labels
    counts = np.bincount(mapped, minlength=len(classes))
    if not counts.all():
        empty = [name for name, n in zip(classes, counts) if n == 0]
        more = f" and {len(empty) - 10} more" if len(empty) > 10 else ""
        log.warning("%s has no images of %d class(es): %s%s", where, len(empty), ", ".join(empty[:10]), more)
    return mapped


def multi_hot(label_sets: list[list[int]], own: list[str], classes: list[str], where: str) -> np.ndarray:
    """Multi-label samples (each a list of indices into `own`) as a [N, len(classes)] uint8 0/1 array in the
    training class map `classes`; as shared_labels, a class the map lacks is an error, an absent one a warning.
    An empty set ("no tags") is a row of zeros."""
    position = {name: i for i, name in enumerate(classes)}
    for row, labels in enumerate(label_sets):
        extra = [own[i] for i in labels if own[i] not in position]
        if extra:
            raise UserError(f"{where} row {row}: label {extra[0]!r} is not one of the {len(classes)} training "
                            "classes; fix the row, or train on that class too")
    hot = np.zeros((len(label_sets), len(classes)), dtype=np.uint8)
    for row, labels in enumerate(label_sets):
        hot[row, [position[own[i]] for i in labels]] = 1
    if len(classes) and not hot.any(axis=0).all():
        empty = [name for name, n in zip(classes, hot.any(axis=0)) if not n]
        more = f" and {len(empty) - 10} more" if len(empty) > 10 else ""
        log.warning("%s has no images of %d class(es): %s%s", where, len(empty), ", ".join(empty[:10]), more)
    return hot


SPLIT_NAMES = {"train", "val", "valid", "validation", "test"}  # folders that make a root one of splits, not classes


def missing_split_advice(root: Path) -> str:
    """What to do about a missing split folder: a root of class folders and no split is split by data.val_fraction."""
    folders = sorted(entry.name for entry in list_folder(root) if is_dir(entry) and not entry.name.startswith(".")) \
        if root.is_dir() else []
    if not folders or set(folders) & SPLIT_NAMES:
        return ("expected <data.root>/<split>/<class>/* for data.train_split and data.val_split (set data.root, or "
                "the split names)")
    shown = ", ".join(folders[:3]) + (", ..." if len(folders) > 3 else "")
    return (f"{root} holds folders ({shown}) but no such split: if they are the classes, add data.val_fraction=0.2 "
            "(a stratified validation split made for you, docs/data.md); else name the splits with data.train_split "
            "and data.val_split")


def find_classes(split_dir: Path) -> list[str]:
    """Sorted class folder names, so class indices are the same on every rank and machine."""
    if not split_dir.is_dir():
        raise UserError(f"data folder {split_dir} does not exist; {missing_split_advice(split_dir.parent)}")
    classes = []
    for entry in list_folder(split_dir):
        if entry.name.startswith("."):
            continue
        if is_dir(entry):
            classes.append(entry.name)
        elif reason := broken_link(entry):  # a class whose images would be missing without a word
            raise UserError(f"{entry.path} is a broken symbolic link ({reason}); fix or remove it")
    if not classes:
        raise UserError(f"{split_dir} has no class folders; put each class's images in {split_dir}/<class>/")
    return sorted(classes)


def scan_images(split_dir: Path, classes: list[str], skip_broken: bool = False) -> tuple[list[str], np.ndarray]:
    """Relative paths and labels of every image under split_dir/<class>/, at any depth (hidden folders skipped),
    in torchvision's ImageFolder order: folders by path, files by name within each.

    A broken symbolic link (target gone, or a loop) is an image that cannot be read: an error naming it,
    or with skip_broken (data.skip_corrupt, training only) a warning naming it.
    """
    paths: list[str] = []
    labels: list[int] = []
    broken: list[str] = []
    for label, name in enumerate(classes):
        list_folder(split_dir / name)  # a class folder that cannot be listed: one line naming it
        files = []
        for parent, names in walk_tree(split_dir / name):  # every depth, as torchvision's and timm's ImageFolder
            for file in names:
                full = os.path.join(parent, file)
                if not file.lower().endswith(IMAGE_EXTENSIONS):
                    continue
                if os.path.isfile(full):
                    files.append(os.path.relpath(full, split_dir))
                elif os.path.islink(full) and (reason := link_failure(full)):
                    broken.append(f"{full} is a broken symbolic link ({reason})")
        paths += files
        labels += [label] * len(files)
    if broken:
        more = f", and {len(broken) - 1} more under {split_dir}" if len(broken) > 1 else ""
        if not skip_broken:
            raise UserError(f"{broken[0]}{more}; fix or remove it (data.skip_corrupt=true skips such files in "
                            "training, never in validation)")
        log.warning("data.skip_corrupt: %s%s; skipped", broken[0], more)
    return paths, np.asarray(labels, dtype=np.int64)


def list_folder(folder: Path) -> list[os.DirEntry]:
    """The entries of a folder; one that cannot be listed (permissions) is named in one line."""
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except OSError as err:
        raise UserError(f"cannot list folder {folder} ({err.strerror})") from None


def is_dir(entry: os.DirEntry) -> bool:
    """entry.is_dir(), False for a symbolic link loop (which raises)."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def broken_link(entry: os.DirEntry) -> str | None:
    """Why a symbolic link leads nowhere (its target is gone, or links loop); None for anything else."""
    return link_failure(entry.path) if entry.is_symlink() else None


def link_failure(path: str) -> str | None:
    """Why the path cannot be followed (its target is gone, or links loop); None when it can."""
    try:
        os.stat(path)
    except OSError as err:
        return err.strerror
    return None


JPEG_FRAME_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # SOF0-SOF15 (not DHT, JPG, DAC)


def jpeg_header(data: bytes) -> tuple[int, int, bool]:
    """(width, height, complete): the frame header's size, and whether an end marker follows the first scan."""
    width, height, _, complete = jpeg_frame(data)
    return width, height, complete


def jpeg_frame(data: bytes) -> tuple[int, int, int, bool]:
    """(width, height, components, complete): the frame header's size and colour components (4: CMYK or YCCK),
    and whether an end marker follows the first scan.

    Scan data never holds FF D9 (an FF in it is followed by 00 or a restart marker), so a file cut
    anywhere after its headers has no end marker after its first scan; padding or data appended after
    the end marker is fine, and an FF D9 inside an EXIF thumbnail comes before the scan.
    """
    width = height = components = 0
    i = 2
    while i + 4 <= len(data):
        marker = data[i + 1]
        if data[i] != 0xFF:  # stray bytes between segments: libjpeg skips to the next marker too
            i = data.find(b"\xff", i)
            if i < 0:
                break
        elif marker == 0xFF:  # fill byte
            i += 1
        elif marker == 0x01 or 0xD0 <= marker <= 0xD9:  # markers without a length
            i += 2
        else:
            length = int.from_bytes(data[i + 2:i + 4], "big")
            if marker in JPEG_FRAME_MARKERS and i + 9 <= len(data):
                height, width = int.from_bytes(data[i + 5:i + 7], "big"), int.from_bytes(data[i + 7:i + 9], "big")
                components = data[i + 9] if i + 10 <= len(data) else 0
            elif marker == 0xDA:  # start of scan
                return width, height, components, data.rfind(b"\xff\xd9", i + 2 + length) >= 0
            i += 2 + length
    return width, height, components, False


def image_header(data: bytes) -> tuple[int, int, bool]:
    """(width, height, complete) from the bytes of an image file, without decoding it.

    JPEG and PNG are parsed here (complete: the end marker or IEND chunk is present); other formats
    go through PIL, which reads the header only (and refuses over 2x its MAX_IMAGE_PIXELS itself).
    (0, 0, True) for what PIL does not know either: OpenCV then decodes it or refuses it.
    """
    if data.startswith(b"\xff\xd8"):
        return jpeg_header(data)
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        if data[12:16] != b"IHDR" or len(data) < 24:  # junk after the signature: no size to trust, nothing to decode
            return 0, 0, False
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        return width, height, data.rfind(b"IEND", 33) >= 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                return image.width, image.height, True
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return 0, 0, True


def read_image(path: str, max_pixels: int = DataConfig.max_image_pixels) -> np.ndarray:
    """Decode the image file at `path` (see decode_image); a file that cannot be read is named in one line."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as err:
        raise UserError(f"cannot read image {path} ({err.strerror}); remove or replace it") from None
    return decode_image(data, path, max_pixels)


def decode_image(data: bytes, name: str, max_pixels: int = DataConfig.max_image_pixels) -> np.ndarray:
    """Decode any JPEG/PNG (grayscale, RGB or RGBA) into HWC uint8 RGB (decoded as RGB: no BGR copy).

    The bytes are checked before decoding: OpenCV decodes a truncated JPEG with its missing part grey
    (printing a warning that names no file), and a small file can declare a size that needs gigabytes
    of memory. `name` (a file path, or a shard and key) is what error messages call the image.
    """
    try:
        width, height, complete = image_header(data)
    except Image.DecompressionBombError as err:
        raise UserError(f"image {name} is too large ({err}); shrink or remove it") from None
    if width * height > max_pixels:
        raise UserError(f"image {name} is {width}x{height} pixels, more than data.max_image_pixels={max_pixels}; "
                        "shrink or remove it, or raise data.max_image_pixels")
    if complete and decoded_by_pil(data):
        return decode_as_pils(data, name)
    try:
        # As PIL reads it (timm's and torchvision's loaders): EXIF orientation ignored, where OpenCV would apply it.
        flags = cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION
        image = cv2.imdecode(np.frombuffer(data, np.uint8), flags) if data and complete else None
    except cv2.error as err:  # OpenCV's own size limit, or out of memory
        raise UserError(f"cannot decode image {name} (OpenCV: {getattr(err, 'err', err)}); remove or replace it") \
            from None
    if image is None:
        raise UserError(f"cannot read image {name} (corrupt, truncated or not an image); remove or replace it")
    return image


TIFF_SIGNATURES = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")  # little/big-endian TIFF and BigTIFF


def decoded_by_pil(data: bytes) -> bool:
    """Whether OpenCV would give other pixels than PIL's convert("RGB") (what timm's and torchvision's loaders read):
    a CMYK or YCCK JPEG (OpenCV one level off on nearly every pixel), a 16-bit greyscale PNG or a 16/32-bit or float
    greyscale TIFF (PIL clips each value at 255, OpenCV divides by 256 or refuses 32 bits). Read from the header."""
    if data.startswith(b"\xff\xd8"):
        return jpeg_frame(data)[2] == 4
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return data[24:26] == b"\x10\x00"  # IHDR: bit depth 16, colour type 0 (greyscale)
    if data[:4] in TIFF_SIGNATURES:
        try:
            with Image.open(io.BytesIO(data)) as image:
                return image.mode == "F" or image.mode.startswith("I")  # I, I;16, I;16B, ...
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
            return False  # OpenCV then decodes it or refuses it in one line
    return False


def decode_as_pils(data: bytes, name: str) -> np.ndarray:
    """The image through PIL's convert("RGB"), as timm's and torchvision's loaders read it (see decoded_by_pil).
    Rare (print workflows, 16-bit scans), so the slower path costs little."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return np.asarray(image.convert("RGB"))
    except (OSError, ValueError, SyntaxError) as err:
        raise UserError(f"cannot read image {name} (corrupt, truncated or not an image: {err}); remove or replace "
                        "it") from None


class ImageFolderDataset(AugmentedDataset):
    """`<root>/<split>/<class>/*` images; the index is kept in numpy arrays (see PackedStrings)."""

    def __init__(self, split_dir: str | Path, transform: A.Compose, seed: int, classes: list[str] | None = None,
                 *, skip_corrupt: bool = False, max_pixels: int = DataConfig.max_image_pixels,
                 tensor_transform: TensorTransform | None = None) -> None:
        super().__init__(transform, seed, tensor_transform)
        self.root = Path(split_dir)
        self.skip_corrupt = skip_corrupt
        self.max_pixels = max_pixels
        own = find_classes(self.root)
        paths, labels = scan_images(self.root, own, skip_broken=skip_corrupt)
        self.classes = classes if classes is not None else own
        self.labels = shared_labels(labels, own, self.classes, str(self.root))
        self.paths = PackedStrings(paths)

    def path(self, index: int) -> str:
        return str(self.root / self.paths[index])

    def load_image(self, index: int) -> np.ndarray:
        return read_image(self.path(index), self.max_pixels)


class DummyDataset(AugmentedDataset):
    """Synthetic, learnable images: a per-class colour layout plus per-sample noise.

    Sample `index` is a pure function of (seed, index + offset), so train and val (offset by the
    train size) never share a sample and no files are needed.
    """

    def __init__(self, size: int, num_classes: int, image_size: int, transform: A.Compose,
                 seed: int, offset: int = 0, tensor_transform: TensorTransform | None = None) -> None:
        super().__init__(transform, seed, tensor_transform)
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



class ImageListDataset(Dataset):
    """Unlabelled image files (predict.py): sample i is (uint8 CHW image or None, i, why it could not be read).

    An unreadable file gives its one-line error instead of an image, so it is reported and the others go on.
    """

    def __init__(self, paths: list[str], transform: A.Compose, max_pixels: int = DataConfig.max_image_pixels) -> None:
        self.paths = PackedStrings(paths)
        self.transform, self.max_pixels = transform, max_pixels

    def __len__(self) -> int:
        return len(self.paths)

    def path(self, index: int) -> str:
        return self.paths[index]

    def __getitem__(self, index: int) -> tuple[torch.Tensor | None, int, str]:
        try:
            image = read_image(self.path(index), self.max_pixels)
        except UserError as err:
            return None, index, str(err)
        return self.transform(image=image)["image"], index, ""


def list_images(folder: Path) -> list[str]:
    """Every image file under folder, at any depth, sorted; hidden entries skipped.

    Symbolic links are followed, but each real folder (device, inode) is walked once: a link back up the
    tree would be followed forever (2**40 paths for two links to `..`). The folders' own paths are taken
    first, so a link to a folder of the tree (or a loop) is the one skipped, named in a warning.
    """
    found = []
    for parent, files in walk_tree(folder):
        found += [os.path.join(parent, f) for f in files
                  if f.lower().endswith(IMAGE_EXTENSIONS) and not f.startswith(".")]
    return sorted(found)


def walk_tree(folder: Path) -> list[tuple[str, list[str]]]:
    """(folder, its file names sorted) for folder and every sub-folder not hidden, sorted by path (torchvision's
    ImageFolder order); each real folder once, by its own path before any link to it (list_images says why)."""
    seen: dict[tuple[int, int] | None, str] = {folder_id(str(folder)): str(folder)}
    for parent, dirs, _ in os.walk(folder):  # without links: each folder's own path
        dirs[:] = walk_once(parent, [d for d in dirs if not os.path.islink(os.path.join(parent, d))], seen)
    walked = []
    for parent, dirs, files in os.walk(folder, followlinks=True, onerror=unlistable):
        dirs[:] = walk_once(parent, dirs, seen)
        walked.append((parent, sorted(files)))
    return sorted(walked)


def unlistable(err: OSError) -> None:
    """os.walk's onerror: a sub-folder that cannot be listed is named in one line, not skipped in silence."""
    raise UserError(f"cannot list folder {err.filename} ({err.strerror})")


def folder_id(path: str) -> tuple[int, int] | None:
    """(device, inode) of the folder a path leads to; None when it cannot be reached."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def walk_once(parent: str, dirs: list[str], seen: dict[tuple[int, int] | None, str]) -> list[str]:
    """The sub-folders of `parent` to walk into: not hidden, and not a folder already walked under another path."""
    keep = []
    for name in sorted(d for d in dirs if not d.startswith(".")):
        path = os.path.join(parent, name)
        if (key := folder_id(path)) is None:  # gone since it was listed
            continue
        first = seen.setdefault(key, path)
        if first == path:
            keep.append(name)
        else:
            log.warning("%s is folder %s again (a symbolic link loop, or a second link to that folder); its images "
                        "are listed once, under %s", path, first, first)
    return keep


def find_images(inputs: str) -> list[str]:
    """The image paths to predict: one image, every image under a folder, or the lines of a list file."""
    path = Path(inputs)
    if path.is_dir():
        found = list_images(path)
        if not found:
            raise UserError(f"folder {path} holds no images ({', '.join(IMAGE_EXTENSIONS)}), at any depth")
        return found
    if not path.is_file():
        raise UserError(f"{path} does not exist; give an image, a folder of images or a text file of paths")
    if path.name.lower().endswith(IMAGE_EXTENSIONS):
        return [str(path)]
    return read_list_file(path)


def read_list_file(path: Path) -> list[str]:
    """Paths, one per line (blank lines and # comments skipped), relative ones taken from the file's folder."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path} is neither an image ({', '.join(IMAGE_EXTENSIONS)}) nor a UTF-8 text file of "
                        "image paths") from None
    except OSError as err:
        raise UserError(f"cannot read {path} ({err.strerror})") from None
    lines = [line.strip() for line in text.splitlines()]
    found = [str(path.parent / line) for line in lines if line and not line.startswith("#")]
    if not found:
        raise UserError(f"list file {path} names no images; put one image path per line")
    return found
