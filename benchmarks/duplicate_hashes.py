"""Which perceptual hash and threshold data/duplicates.py uses: recall of planted near-copies and false pairs.

Three sets of originals: the 1,797 digits (32x32 PNGs, data.digits.export_digits), 80x80 tiles of the three photos
that ship with scikit-learn and matplotlib (china.jpg, flower.jpg, grace_hopper.jpg; tiles whose grey standard
deviation is under 10, i.e. sky, are left out: a flat image has no stable hash) saved as JPEG q95, and the same
tiles upscaled to 240x240 (where 1-2 px is ~1% of the side, as on a photo). Each original gets seven planted
copies: resized down (3/4 for the digits, 1/2 for the tiles) and up (3/2), JPEG q75, 1 px and 2 px cropped off
every side, 1 px off the top and left, 2 px off the left. Recall: planted copies within the threshold of their
original; false pairs: pairs of different originals within it (of all pairs). Candidates: the 64-bit DCT pHash of
data/duplicates.py, imagehash's dHash (9x8 gradient) and aHash (8x8 mean), and a 256-bit pHash (16x16 of a 64x64
DCT, thresholds x4).

    python benchmarks/duplicate_hashes.py [--out /tmp/duplicate-hashes]
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import harness  # noqa: F401  (puts the repo on sys.path)
from harness import machine_line

THRESHOLDS = (0, 2, 4, 6, 8, 10, 12, 14)
TILE = 80


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="folder for the images (default: a temporary one)")
    return parser.parse_args()


def grey(path: Path, size: tuple[int, int]) -> np.ndarray:
    """The image as float32 grey at `size` (width, height), decoded as data/duplicates.grey_thumbnail does."""
    from PIL import Image

    with Image.open(path) as image:
        image.draft("L", (2 * size[0], 2 * size[1]))
        return np.asarray(image.convert("L").resize(size, Image.Resampling.LANCZOS), dtype=np.float32)


def candidates() -> dict:
    """name -> (hash of one file as a bool vector, threshold scale)."""
    from data.duplicates import dct_basis, grey_thumbnail, phash

    basis64 = dct_basis(64)

    def phash256(path: Path) -> np.ndarray:
        low = (basis64 @ grey(path, (64, 64)) @ basis64.T)[:16, :16]
        return (low > np.median(low)).ravel()

    def dhash(path: Path) -> np.ndarray:
        pixels = grey(path, (9, 8))
        return (pixels[:, 1:] > pixels[:, :-1]).ravel()

    def ahash(path: Path) -> np.ndarray:
        pixels = grey(path, (8, 8))
        return (pixels > pixels.mean()).ravel()

    return {"phash (chosen)": (lambda path: phash(grey_thumbnail(path.read_bytes())[None])[0], 1), "dhash": (dhash, 1),
            "ahash": (ahash, 1), "phash256": (phash256, 4)}


def copies(image, down: float) -> dict[str, tuple[bytes, str]]:
    """The planted copies of one original: name -> (file bytes, suffix)."""
    from PIL import Image

    def encode(copy, fmt: str, **kwargs) -> tuple[bytes, str]:
        buffer = io.BytesIO()
        copy.save(buffer, fmt, **kwargs)
        return buffer.getvalue(), ".jpg" if fmt == "JPEG" else ".png"

    w, h = image.size
    bicubic = Image.Resampling.BICUBIC
    return {"resize down": encode(image.resize((round(w * down), round(h * down)), bicubic), "PNG"),
            "resize up 3/2": encode(image.resize((w * 3 // 2, h * 3 // 2), bicubic), "PNG"),
            "jpeg q75": encode(image, "JPEG", quality=75),
            "crop 1 px": encode(image.crop((1, 1, w - 1, h - 1)), "PNG"),
            "crop 2 px": encode(image.crop((2, 2, w - 2, h - 2)), "PNG"),
            "crop 1 px top-left": encode(image.crop((1, 1, w, h)), "PNG"),
            "crop 2 px left": encode(image.crop((2, 0, w, h)), "PNG")}


def photo_tiles(out: Path) -> tuple[list[Path], list[Path]]:
    """80-px tiles of the bundled photos (flat ones left out), and the same tiles at 240 px, as JPEG q95."""
    import matplotlib
    import sklearn.datasets
    from PIL import Image

    photos = [Path(sklearn.datasets.__file__).parent / "images" / name for name in ("china.jpg", "flower.jpg")]
    photos.append(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg")
    (out / "tiles").mkdir(parents=True, exist_ok=True)
    small, large = [], []
    for photo in photos:
        image = Image.open(photo).convert("RGB")
        for y in range(0, image.height - TILE + 1, TILE):
            for x in range(0, image.width - TILE + 1, TILE):
                tile = image.crop((x, y, x + TILE, y + TILE))
                if np.asarray(tile.convert("L"), dtype=np.float32).std() < 10:
                    continue
                small.append(out / "tiles" / f"{photo.stem}_{y}_{x}.jpg")
                tile.save(small[-1], quality=95)
                large.append(out / "tiles" / f"{photo.stem}_{y}_{x}_x3.jpg")
                tile.resize((3 * TILE, 3 * TILE), Image.Resampling.LANCZOS).save(large[-1], quality=95)
    return small, large


def plant(originals: list[Path], folder: Path, down: float) -> list[tuple[int, str, Path]]:
    """Write every original's copies; (original index, copy name, path) each."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    planted = []
    for index, original in enumerate(originals):
        with Image.open(original) as image:
            image.load()
            for number, (name, (data, suffix)) in enumerate(copies(image, down).items()):
                path = folder / f"{index}_{number}{suffix}"
                path.write_bytes(data)
                planted.append((index, name, path))
    return planted


def table(title: str, originals: list[Path], planted: list[tuple[int, str, Path]]) -> None:
    """Recall per copy and false pairs per threshold, for each candidate hash."""
    print(f"\n#### {title}: {len(originals)} originals, {len(planted)} planted copies, "
          f"{len(originals) * (len(originals) - 1) // 2:,} pairs of originals\n")
    for hash_name, (hash_file, scale) in candidates().items():
        start = time.perf_counter()
        hashes = np.stack([hash_file(path) for path in originals])
        copied = np.stack([hash_file(path) for _, _, path in planted])
        seconds = time.perf_counter() - start
        of = np.array([index for index, _, _ in planted])
        names = np.array([name for _, name, _ in planted])
        to_original = (hashes[of] != copied).sum(1)
        between = np.concatenate([(hashes[i] != hashes[i + 1:]).sum(1) for i in range(len(hashes) - 1)])
        thresholds = [t * scale for t in THRESHOLDS]
        print(f"| {hash_name} ({hashes.shape[1]} bits, {seconds / (len(originals) + len(planted)) * 1e3:.2f} ms/image)"
              f" | " + " | ".join(f"<= {t}" for t in thresholds) + " |")
        print("| --- " * (len(thresholds) + 1) + "|")
        for name in dict.fromkeys(names):
            row = [f"{(to_original[names == name] <= t).mean() * 100:.1f}" for t in thresholds]
            print(f"| recall: {name} | " + " | ".join(row) + " |")
        print("| **recall: all** | " + " | ".join(f"**{(to_original <= t).mean() * 100:.1f}**" for t in thresholds)
              + " |")
        print("| false pairs | " + " | ".join(f"{int((between <= t).sum())}" for t in thresholds) + " |\n")


def main() -> None:
    args = parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="duplicate-hashes-"))
    from data.digits import export_digits

    print(machine_line(), file=sys.stderr)
    digits = sorted(export_digits(out / "digits").glob("*/*/*.png"))
    small, large = photo_tiles(out)
    table("digits, 32x32", digits, plant(digits, out / "digit_copies", 3 / 4))
    table(f"photo tiles, {TILE}x{TILE}", small, plant(small, out / "tile_copies", 1 / 2))
    table(f"photo tiles, {3 * TILE}x{3 * TILE}", large, plant(large, out / "large_copies", 1 / 2))


if __name__ == "__main__":
    main()
