"""Exact and near-duplicate images within and across splits (the audit, issue 60): a val or test image that is a
copy of a train image inflates every validation number, and copies within train weight an image twice.

Why these choices (measured: `python benchmarks/duplicate_hashes.py` and `benchmarks/audit_planted.py`,
docs/benchmarks.md 20 and 19):
- exact copies: the sha256 of the file bytes, with no decode; a copy saved again with the same pixels has the same
  perceptual hash, so the search reports it too, at distance 0;
- near copies: a 64-bit DCT pHash (imagehash's, in numpy). On 80-px photo tiles it found 96.9% of planted resized,
  JPEG q75 and 1-2 px cropped copies within 8 bits with no false pair among 3,741; dHash and aHash found fewer or
  paired more at every threshold, a 256-bit pHash found fewer. Each image is also hashed with 3% and 6% cut off
  every side (CROPS): a 1-2 px crop of a 32-px digit moved its hash 4-12 bits, as far as distinct digits are;
- the threshold is calibrated on the images (calibrated_threshold): the largest up to 8 bits at which near pairs
  stay under 1 per 100 images. Distinct photos rarely come within 8 bits, distinct digits do from 4 bits on: 3 bits
  there found every planted copy with 1.9 false cross-split pairs per 100 validation images;
- the search: Hamming distances as one matmul of +-1 matrices per block of rows x block of columns on a torch
  device, so memory stays bounded (block^2 distances) for any number of images; the work grows as A x B.
"""

from __future__ import annotations

import hashlib
import io
import logging
import warnings
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from core.errors import UserError

log = logging.getLogger(__name__)

THRESHOLD = 8  # bits of 64: the measured default (module docstring)
BITS = 64
THUMBNAIL = 32  # pixels: the pHash's DCT is taken on a 32x32 grey thumbnail, its 8x8 lowest frequencies kept
CROPS = (0.03, 0.06)  # shares of each side also cut off before hashing: a copy cropped by 1-2 px of 32 matches
CALIBRATION = 0.01  # near pairs per image the calibrated threshold allows (docs/benchmarks.md 19)
BLOCK = 1024  # rows and columns of the distance buffer: 4 MB of float32 (2048: as fast, 16 MB; docs 20b)
CHUNK = 4096  # images decoded and hashed together: 16 MB of thumbnails


@dataclass(frozen=True)
class Pair:
    """Two files that hold the same image (distance 0: same bytes, or same pHash) or nearly (distance in bits);
    path_a is the one listed first."""

    path_a: str
    path_b: str
    split_a: str
    split_b: str
    distance: int

    @property
    def cross_split(self) -> bool:
        return self.split_a != self.split_b


@dataclass(frozen=True)
class Duplicates:
    """The pairs found (leaks across splits first, then by distance) and the near-copy threshold they were found at."""

    pairs: list[Pair]
    threshold: int


def find_duplicates(items: Sequence[tuple[Path, str]], threshold: int | None = None,
                    device: str | torch.device = "cpu", block: int = BLOCK) -> Duplicates:
    """Every pair of copies among (path, split) items, for review; `threshold` None: calibrated on these images."""
    if threshold is not None:
        check_threshold(threshold)
    paths = [Path(path) for path, _ in items]
    digests, hashes, cropped, readable = hash_files(paths)
    near = near_pairs(hashes, cropped, THRESHOLD if threshold is None else threshold, block, device)
    chosen = calibrated_threshold(list(near.values()), len(readable)) if threshold is None else threshold
    found = {pair: 0 for pair in exact_pairs(digests)}
    for (i, j), distance in sorted(near.items()):
        if distance <= chosen:
            found.setdefault((int(readable[i]), int(readable[j])), distance)
    pairs = [Pair(str(paths[i]), str(paths[j]), items[i][1], items[j][1], d) for (i, j), d in found.items()]
    return Duplicates(sorted(pairs, key=lambda p: (not p.cross_split, p.distance, p.path_a, p.path_b)), chosen)


def near_pairs(hashes: torch.Tensor, cropped: torch.Tensor, threshold: int, block: int,
               device: str | torch.device) -> dict[tuple[int, int], int]:
    """{(i, j): bits}, i < j, of the images within `threshold`: each image's hash against every other's, as it is
    and with CROPS cut off (`cropped`: len(CROPS) rows per image, in image order), the smallest distance kept."""
    found: dict[tuple[int, int], int] = {}
    for other, per in ((None, 1), (cropped, len(CROPS))):
        rows, cols, distances = pairs_within(hashes, other, threshold, block=block, device=device)
        for i, j, distance in zip(rows.tolist(), (cols // per).tolist(), distances.tolist()):
            if i != j:
                key = (min(i, j), max(i, j))
                found[key] = min(found.get(key, distance), distance)
    return found


def calibrated_threshold(distances: Sequence[int], images: int) -> int:
    """The largest threshold up to THRESHOLD at which the near pairs (1 bit or more apart) are at most CALIBRATION
    per image: beyond it unrelated images of this data pair (small, plain images such as the digits at a few bits;
    photos rarely within THRESHOLD)."""
    counts = np.cumsum(np.bincount([d for d in distances if d > 0], minlength=THRESHOLD + 1))
    return max(t for t in range(THRESHOLD + 1) if counts[t] <= CALIBRATION * images)


def check_threshold(threshold: int) -> None:
    """A threshold the 64-bit hash can mean: 0 (same hash) to 63 bits."""
    if not 0 <= threshold < BITS:
        raise UserError(f"near-duplicate threshold {threshold} is not within 0-{BITS - 1} bits of the {BITS}-bit "
                        f"perceptual hash; {THRESHOLD} is the measured default")


def hash_files(paths: Sequence[Path]) -> tuple[list[str | None], torch.Tensor, torch.Tensor, np.ndarray]:
    """(each file's sha256 or None, [N, 64] bool pHashes of the files that decode, [N x len(CROPS), 64] their
    cropped pHashes, their positions in `paths`): one read of each file, a chunk of files hashed together."""
    digests: list[str | None] = []
    hashes, cropped, readable = [], [], []
    for start in range(0, len(paths), CHUNK):
        thumbnails = []
        for i in range(start, min(start + CHUNK, len(paths))):
            digest, views = file_hashes(paths[i])
            digests.append(digest)
            if views is not None:
                thumbnails.append(views)
                readable.append(i)
        if thumbnails:
            views = np.stack(thumbnails)  # [n, 1 + len(CROPS), 32, 32]
            hashes.append(phash(views[:, 0]))
            cropped.append(phash(views[:, 1:].reshape(-1, THUMBNAIL, THUMBNAIL)))
    if len(readable) < len(paths):
        log.warning("%d of %d images could not be decoded and are compared by their bytes only (the file checks "
                    "name them)", len(paths) - len(readable), len(paths))
    as_bits = lambda parts: (torch.from_numpy(np.concatenate(parts)) if parts  # noqa: E731
                             else torch.zeros(0, BITS, dtype=torch.bool))
    return digests, as_bits(hashes), as_bits(cropped), np.asarray(readable, dtype=np.int64)


def file_hashes(path: Path) -> tuple[str | None, np.ndarray | None]:
    """(sha256 of the file's bytes, its grey thumbnails: whole, then each of CROPS) from one read; None for what
    cannot be read or decoded."""
    try:
        data = path.read_bytes()
    except OSError:
        return None, None
    return hashlib.sha256(data).hexdigest(), grey_thumbnails(data)


def exact_pairs(digests: Sequence[str | None]) -> list[tuple[int, int]]:
    """(i, j), i < j, of files with the same bytes; a file that could not be read (None) pairs with nothing."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, digest in enumerate(digests):
        if digest is not None:
            groups[digest].append(i)
    return [(a, b) for group in groups.values() for k, a in enumerate(group) for b in group[k + 1:]]


def grey_thumbnail(data: bytes) -> np.ndarray | None:
    """The image as a 32x32 float32 grey thumbnail (LANCZOS, as imagehash), or None when PIL cannot decode it."""
    views = grey_thumbnails(data, ())
    return None if views is None else views[0]


def grey_thumbnails(data: bytes, crops: Sequence[float] = CROPS) -> np.ndarray | None:
    """[1 + len(crops), 32, 32] float32 grey thumbnails (LANCZOS, as imagehash): the image, then with each share of
    `crops` cut off every side; None when PIL cannot decode it.

    A JPEG is decoded at the smallest DCT scale of at least 64 px (PIL's draft), a fraction of a full decode.
    EXIF orientation is not applied: the pixels as stored, as the loader reads them.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                image.draft("L", (2 * THUMBNAIL, 2 * THUMBNAIL))
                grey = image.convert("L")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        return None
    views = []
    for share in (0.0, *crops):
        x, y = round(share * grey.width), round(share * grey.height)
        view = grey.crop((x, y, grey.width - x, grey.height - y)) if x or y else grey
        views.append(np.asarray(view.resize((THUMBNAIL, THUMBNAIL), Image.Resampling.LANCZOS), dtype=np.float32))
    return np.stack(views)


def dct_basis(n: int) -> np.ndarray:
    """scipy.fftpack.dct's type-II basis (unnormalized, as imagehash): row k is 2 cos(pi k (2x + 1) / 2n)."""
    k, x = np.arange(n)[:, None], np.arange(n)[None, :]
    return 2 * np.cos(np.pi * k * (2 * x + 1) / (2 * n))


DCT = dct_basis(THUMBNAIL).astype(np.float32)


def phash(thumbnails: np.ndarray) -> np.ndarray:
    """[N, 64] bool: each 32x32 thumbnail's 8x8 lowest DCT frequencies above their median (imagehash's phash)."""
    low = (DCT[:8] @ thumbnails @ DCT[:8].T).reshape(len(thumbnails), BITS)
    return low > np.median(low, axis=1, keepdims=True)


def pairs_within(a: torch.Tensor, b: torch.Tensor | None, threshold: int, *, block: int = BLOCK,
                 device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows of a, rows of b, Hamming distances) of every pair within `threshold` bits, as int64 CPU tensors.

    a, b: [N, bits] bool. With b None, the pairs within a, each once (row < column), no self-pairs. One buffer of
    `block` x `block` distances is reused for every block, so memory is the inputs as +-1 (4 bytes a bit: 256 MB
    for 1M hashes) and that buffer; +-1 products summed are exact in float32 (in fp16 on CUDA, half the bytes).
    """
    device = torch.device(device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    bits = a.shape[1]
    limit = bits - 2 * threshold  # dot >= limit exactly when distance = (bits - dot) / 2 <= threshold
    columns = signs(a if b is None else b, device, dtype)
    buffer = torch.empty(block * block, device=device, dtype=dtype)
    found = []
    for i in range(0, len(a), block):
        x = columns[i:i + block] if b is None else signs(a[i:i + block], device, dtype)
        for j in range(i if b is None else 0, len(columns), block):
            y = columns[j:j + block]
            dots = torch.matmul(x, y.T, out=buffer[:len(x) * len(y)].view(len(x), len(y)))
            if b is None and i == j:
                dots.diagonal().fill_(-bits)  # self-pairs; the pairs below the diagonal are dropped below
            rows, cols, hits = block_hits(dots, limit)
            keep = cols > rows if b is None and i == j else slice(None)
            if len(rows):  # three tensors per block would be 360k objects (~0.3 GB) at 1M x 1M
                found.append((rows[keep] + i, cols[keep] + j, hits[keep]))
    rows, cols, dots = (torch.cat(parts).cpu() for parts in zip(*found)) if found else [torch.zeros(0)] * 3
    return rows.long(), cols.long(), ((bits - dots.float()) / 2).round().long()


def signs(bits: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """bool bits as a +-1 matrix on the device, in place (`* 2 - 1` would hold two copies: 512 MB at 1M hashes)."""
    return bits.to(device=device, dtype=dtype).mul_(2).sub_(1)


def block_hits(dots: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, column, dot) of one block's pairs with dot >= limit; only rows whose largest dot reaches it are
    searched (one pass over the block instead of a compare and a scan: most rows have no hit)."""
    rows = (dots.amax(dim=1) >= limit).nonzero().squeeze(1)
    sub = dots[rows]
    hit_rows, cols = (sub >= limit).nonzero(as_tuple=True)
    return rows[hit_rows], cols, sub[hit_rows, cols]
