"""What is wrong with the image files themselves, before any training (the audit, issue 60): files the loader refuses,
sizes and shapes its crops handle badly, colour modes it converts, EXIF rotations it ignores, and class counts.

Each finding says what the app's loader (data.datasets.decode_image) does with the file, so that the remedy is the
truth: the decode is the loader's own, and size, mode and EXIF come from PIL's lazy open (the header only). A file
is decoded once, by the loader, to find what it refuses (truncated or corrupt data); only an image with an alpha
channel or a 16-bit greyscale one is decoded a second time, by PIL, to see whether its alpha or its values matter.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from core.config import DataConfig
from core.errors import UserError
from data.datasets import decode_image, image_header

MIN_SIDE = 16  # pixels: a smaller side is a thumbnail or an icon more often than a photo
MAX_ASPECT = 4.0  # long side / short side: beyond it the square crops see a small part of the image
IMBALANCED = 2.0  # largest class / smallest class from which the report names the remedies (docs/data.md)
EXIF_ORIENTATION = 0x0112
ORIENTATIONS = {2: "mirrored", 3: "turned 180°", 4: "upside down and mirrored", 5: "mirrored and turned 90°",
                6: "turned 90° clockwise", 7: "mirrored and turned 90°", 8: "turned 90° anticlockwise"}
DEEP_MODES = ("I", "F")  # I, I;16, I;16B, ..., F: greyscale deeper than 8 bits, which PIL's convert("RGB") clips

UNREADABLE = "remove or replace the file; data.skip_corrupt=true skips it in training (never in validation)"
REMEDIES = {
    "unreadable": UNREADABLE,
    "truncated": UNREADABLE,
    "huge": "the loader refuses it: shrink it, or raise data.max_image_pixels",
    "tiny": "the loader scales it up to data.img_size: check it is a real photo, not a thumbnail or an icon",
    "aspect": "the train crop (data.scale, data.ratio) and the eval centre crop (short side to data.img_size / "
              "data.crop_pct) see only part of it: crop it around the subject, or remove it",
    "greyscale": "none needed: the loader repeats the grey channel as R, G and B; but if one class is mostly "
                 "greyscale the model can learn the colour as the class",
    "alpha": "the loader drops the alpha channel, so transparent pixels show whatever colour is stored under them "
             "(often black): flatten it onto the background you want and save it as RGB",
    "cmyk": "the loader converts it as PIL's convert('RGB') does (as timm's and torchvision's loaders), without "
            "its colour profile, so colours may be off: convert it to an sRGB JPEG",
    "16-bit": "the loader reads it as PIL's convert('RGB') does (as timm's and torchvision's loaders), clipping "
              "every value above 255 to white: convert it to 8 bits (value / 257) first",
    "exif-rotated": "the loader ignores EXIF orientation (as timm's and torchvision's loaders), so the model sees "
                    "the stored pixels; if images are shown upright where the model is used, rotate the pixels "
                    "(PIL's ImageOps.exif_transpose) and drop the tag",
}
IMBALANCE_REMEDY = ("data.sampler=class_balanced (the safe first choice), train.class_weights=effective or "
                    "train.logit_adjustment (docs/data.md); and train.best_metric=val_balanced_acc")


@dataclass(frozen=True)
class Finding:
    """One thing wrong with one file: what (kind), the evidence (detail) and what to do (remedy)."""

    path: str
    kind: str
    detail: str
    remedy: str


@dataclass
class FileReport:
    """The audit's file checks: per-file findings, in the order of the files, and the class counts."""

    findings: list[Finding] = field(default_factory=list)
    class_counts: dict[str, int] = field(default_factory=dict)
    imbalance: float = 1.0  # largest class / smallest class; inf when a class has no image
    imbalance_remedy: str = ""  # "" below IMBALANCED


@dataclass(frozen=True)
class Header:
    """What PIL's lazy open tells about a file without decoding it."""

    width: int
    height: int
    mode: str
    orientation: int
    transparency: bool  # an alpha channel, or a palette's transparent colour


def check_files(paths: Sequence[Path], labels: Sequence[int], class_names: list[str], *,
                max_pixels: int = DataConfig.max_image_pixels) -> FileReport:
    """Every file's findings and the class counts, so the user fixes the data before a run trips over it."""
    if len(paths) != len(labels):
        raise ValueError(f"{len(paths)} paths but {len(labels)} labels")
    findings = [finding for path in paths for finding in check_file(Path(path), max_pixels)]
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=len(class_names))
    class_counts = {name: int(n) for name, n in zip(class_names, counts)}
    ratio = imbalance_ratio(counts)
    return FileReport(findings, class_counts, ratio, imbalance_remedy(class_counts, ratio))


def check_file(path: Path, max_pixels: int) -> list[Finding]:
    """One file's findings: refused by the loader (then nothing else is said), or its size, mode and EXIF."""
    try:
        data = path.read_bytes()
    except OSError as err:
        return [finding(path, "unreadable", f"cannot read the file ({err.strerror})")]
    try:
        header = read_header(data)
    except Image.DecompressionBombError as err:
        return [finding(path, "huge", f"{err}; data.max_image_pixels={max_pixels}")]
    if header is not None and header.width * header.height > max_pixels:
        return [finding(path, "huge", f"{header.width}x{header.height} pixels, more than "
                                      f"data.max_image_pixels={max_pixels}")]
    try:
        pixels = decode_image(data, str(path), max_pixels)
    except UserError as err:
        return [refused(path, data, str(err))]
    height, width = pixels.shape[:2]
    found = shape_findings(path, width, height)
    if header is not None:
        found += mode_findings(path, data, header) + exif_findings(path, header)
    return found


def refused(path: Path, data: bytes, message: str) -> Finding:
    """The loader's refusal as a finding: truncated when the end marker is missing, else unreadable."""
    try:
        complete = image_header(data)[2]
    except Image.DecompressionBombError:
        complete = True
    kind = "unreadable" if complete else "truncated"
    return finding(path, kind, message if complete else f"the file ends before its image data does ({message})")


def read_header(data: bytes) -> Header | None:
    """Size, mode, EXIF orientation and transparency from the header; None when PIL does not know the format."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                return Header(image.width, image.height, image.mode, orientation(image), image.has_transparency_data)
    except Image.DecompressionBombError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, TypeError):
        return None


def orientation(image: Image.Image) -> int:
    """The EXIF orientation tag (1: as stored); a PNG's only from an eXIf chunk before its pixels (for one after
    them PIL would decode the whole image)."""
    if image.format == "PNG" and "exif" not in image.info:
        return 1
    return int(image.getexif().get(EXIF_ORIENTATION, 1))


def shape_findings(path: Path, width: int, height: int) -> list[Finding]:
    """Too small a side, or too elongated a shape for square crops."""
    found = []
    if min(width, height) < MIN_SIDE:
        found.append(finding(path, "tiny", f"{width}x{height} pixels, a side under {MIN_SIDE}"))
    if max(width, height) > MAX_ASPECT * max(1, min(width, height)):
        ratio = max(width, height) / max(1, min(width, height))
        found.append(finding(path, "aspect", f"{width}x{height} pixels, {ratio:.1f}:1 (over {MAX_ASPECT:g}:1)"))
    return found


def mode_findings(path: Path, data: bytes, header: Header) -> list[Finding]:
    """Colour modes the loader converts: greyscale, CMYK, 16-bit greyscale, and alpha that hides pixels."""
    mode, found = header.mode, []
    if mode in ("L", "LA", "1"):
        found.append(finding(path, "greyscale", f"mode {mode} (greyscale)"))
    elif mode == "CMYK":
        found.append(finding(path, "cmyk", "mode CMYK (a print workflow's JPEG)"))
    elif mode.startswith(DEEP_MODES):
        largest = pil_image(data, lambda image: image.getextrema()[1])
        found.append(finding(path, "16-bit", f"mode {mode} (greyscale deeper than 8 bits), largest value {largest}"))
    if header.transparency:
        opaque_min = pil_image(data, lambda image: image.convert("RGBA").getchannel("A").getextrema()[0])
        if opaque_min < 255:
            found.append(finding(path, "alpha", f"mode {mode} with transparent pixels (alpha down to {opaque_min})"))
    return found


def pil_image(data: bytes, measure):
    """`measure` of the image decoded by PIL: the second decode, for the rare modes whose values matter."""
    with Image.open(io.BytesIO(data)) as image:
        return measure(image)


def exif_findings(path: Path, header: Header) -> list[Finding]:
    """An EXIF orientation other than 1: viewers turn the photo, the loader does not."""
    if header.orientation == 1:
        return []
    how = ORIENTATIONS.get(header.orientation, "differently")
    return [finding(path, "exif-rotated", f"EXIF orientation {header.orientation}: viewers show it {how}")]


def finding(path: Path, kind: str, detail: str) -> Finding:
    """A finding with its kind's remedy."""
    return Finding(str(path), kind, detail, REMEDIES[kind])


def imbalance_ratio(counts: np.ndarray) -> float:
    """Largest class count over the smallest; inf when a class has no image, 1.0 without classes."""
    if counts.size == 0:
        return 1.0
    return float("inf") if counts.min() == 0 else float(counts.max() / counts.min())


def imbalance_remedy(class_counts: dict[str, int], ratio: float) -> str:
    """What to do about the class counts: empty classes first, then the imbalance options."""
    empty = [name for name, n in class_counts.items() if n == 0]
    if empty:
        return f"class(es) {', '.join(empty[:10])} have no image: add images, or remove the class folder"
    return IMBALANCE_REMEDY if ratio >= IMBALANCED else ""
