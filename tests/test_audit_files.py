"""The audit's file checks and duplicate search (issue 60), on real files: each finding kind from a file written to
show it, planted copies of the digits found across splits at the chosen threshold, and the blocked search equal to
a brute-force one on the same hashes."""

from __future__ import annotations

import io
import re
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import scipy.fftpack
import torch
from PIL import Image

from core.config import DataConfig, TrainConfig
from core.errors import UserError
from data.digits import export_digits
from data.duplicates import THRESHOLD, find_duplicates, grey_thumbnail, pairs_within, phash
from data.file_checks import IMBALANCE_REMEDY, REMEDIES, check_files


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    """The digits export (real 32x32 greyscale PNGs), written once for this file."""
    return export_digits(tmp_path_factory.mktemp("audit") / "digits")


def photo(size: tuple[int, int] = (48, 40), seed: int = 0) -> Image.Image:
    """An RGB image with smooth structure and noise, so that every format encodes something real."""
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h)], axis=-1)
    noise = np.random.default_rng(seed).normal(0, 12, (h, w, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def kinds(tmp_path: Path, files: dict[str, Image.Image | bytes], **save) -> dict[str, list[str]]:
    """Write each file (an image saved by its suffix, or raw bytes) and return its findings' kinds by name."""
    paths = []
    for name, content in files.items():
        paths.append(tmp_path / name)
        if isinstance(content, bytes):
            paths[-1].write_bytes(content)
        else:
            content.save(paths[-1], **save.get(name, {}))
    report = check_files(paths, [0] * len(paths), ["only"])
    found: dict[str, list[str]] = {name: [] for name in files}
    for finding in report.findings:
        found[Path(finding.path).name].append(finding.kind)
    return found


def encoded(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def test_truncated_and_unreadable_files_are_found(tmp_path):
    png, jpeg = encoded(photo(), "PNG"), encoded(photo(), "JPEG", quality=90)
    found = kinds(tmp_path, {"fine.png": png, "cut.png": png[:len(png) // 2], "cut.jpg": jpeg[:len(jpeg) * 2 // 3],
                             "text.jpg": b"not an image at all", "empty.png": b""})
    assert found == {"fine.png": [], "cut.png": ["truncated"], "cut.jpg": ["truncated"], "text.jpg": ["unreadable"],
                     "empty.png": ["unreadable"]}
    assert "data.skip_corrupt=true" in REMEDIES["truncated"]


def test_colour_modes_are_found_with_their_kind(tmp_path):
    rgba = np.asarray(photo().convert("RGBA")).copy()
    rgba[:4, :4, 3] = 0
    deep = (np.arange(40 * 48).reshape(40, 48) * 30).astype(np.uint16)  # 16-bit greyscale, up to 57570
    palette = photo().convert("P")
    found = kinds(tmp_path, {"rgb.png": photo(), "grey.png": photo().convert("L"), "rgba.png": Image.fromarray(rgba),
                             "opaque.png": photo().convert("RGBA"), "cmyk.jpg": photo().convert("CMYK"),
                             "deep.png": Image.fromarray(deep), "palette.png": palette,
                             "clear.png": palette.copy()},
                  **{"clear.png": {"transparency": int(np.asarray(palette)[0, 0])}})
    assert Image.open(tmp_path / "deep.png").mode == "I;16"
    assert found == {"rgb.png": [], "grey.png": ["greyscale"], "rgba.png": ["alpha"], "opaque.png": [],
                     "cmyk.jpg": ["cmyk"], "deep.png": ["16-bit"], "palette.png": [], "clear.png": ["alpha"]}


def test_an_exif_rotated_jpeg_is_found(tmp_path):
    turned, upright = Image.Exif(), Image.Exif()
    turned[0x0112], upright[0x0112] = 6, 1
    found = kinds(tmp_path, {"turned.jpg": photo(), "upright.jpg": photo(), "plain.jpg": photo()},
                  **{"turned.jpg": {"exif": turned}, "upright.jpg": {"exif": upright}})
    assert found == {"turned.jpg": ["exif-rotated"], "upright.jpg": [], "plain.jpg": []}


def test_extreme_sizes_and_shapes_are_found(tmp_path):
    paths = [tmp_path / "icon.png", tmp_path / "strip.png", tmp_path / "big.png"]
    photo((12, 12)).save(paths[0])
    photo((200, 40)).save(paths[1])
    photo((120, 100)).save(paths[2])
    report = check_files(paths, [0, 0, 0], ["only"], max_pixels=100 * 100)
    assert [(Path(f.path).name, f.kind) for f in report.findings] == [
        ("icon.png", "tiny"), ("strip.png", "aspect"), ("big.png", "huge")]
    assert "data.max_image_pixels=10000" in report.findings[2].detail


def test_class_counts_and_imbalance(tmp_path):
    paths = [tmp_path / f"{i}.png" for i in range(10)]
    for path in paths:
        photo().save(path)
    report = check_files(paths, [0] * 8 + [1] * 2, ["cat", "dog"])
    assert (report.class_counts, report.imbalance, report.imbalance_remedy) == ({"cat": 8, "dog": 2}, 4.0,
                                                                                IMBALANCE_REMEDY)
    empty = check_files(paths, [0] * 9 + [2], ["cat", "dog", "emu"])
    assert empty.imbalance == float("inf") and "dog" in empty.imbalance_remedy
    assert check_files(paths, [0] * 5 + [1] * 5, ["cat", "dog"]).imbalance_remedy == ""


def test_every_config_key_a_remedy_names_exists():
    """The remedies name real keys: a renamed key would send the user to an option that is not there."""
    known = {f"data.{f.name}" for f in fields(DataConfig)} | {f"train.{f.name}" for f in fields(TrainConfig)}
    named = set(re.findall(r"(?<![/\w])(?:data|train)\.[a-z_]+(?![\w.])", " ".join([*REMEDIES.values(),
                                                                                  IMBALANCE_REMEDY])))
    assert named and named <= known


def test_phash_is_imagehash_phash(digits):
    """The matrix DCT against scipy.fftpack.dct on the same thumbnails, as imagehash computes phash."""
    thumbnails = np.stack([grey_thumbnail(path.read_bytes()) for path in sorted(digits.glob("val/*/*.png"))[:60]])
    for thumbnail, bits in zip(thumbnails, phash(thumbnails)):
        low = scipy.fftpack.dct(scipy.fftpack.dct(thumbnail.astype(np.float64), axis=0), axis=1)[:8, :8]
        assert np.array_equal(bits, (low > np.median(low)).ravel())


def test_planted_copies_across_splits_are_found(digits, tmp_path):
    """Copies of train digits planted in val and test are found at the chosen threshold, leaks first; the
    originals (distinct digits) pair with nothing. A 2 px crop is planted on a digit upscaled to 96 px: on the
    32-px digits it rescales the image by 12.5% and is found 55% of the time (benchmarks/duplicate_hashes.py)."""
    every_train = sorted(digits.glob("train/*/*.png"))
    train, val = every_train[::60][:20], sorted(digits.glob("val/*/*.png"))[::30][:10]
    big = tmp_path / "big.png"
    Image.open(every_train[1]).resize((96, 96), Image.Resampling.BICUBIC).save(big)
    source = [Image.open(path) for path in train[1:5]]
    planted = {"resized_down.png": (source[0].resize((24, 24), Image.Resampling.BICUBIC), {}),
               "resized_up.png": (source[1].resize((48, 48), Image.Resampling.BICUBIC), {}),
               "q75.jpg": (source[2], {"quality": 75}),
               "cropped_1px.png": (source[3].crop((1, 1, 31, 31)), {}),
               "big_cropped_2px.png": (Image.open(big).crop((2, 2, 94, 94)), {})}
    for name, (image, options) in planted.items():
        image.save(tmp_path / name, **options)
    (tmp_path / "byte_copy.png").write_bytes(train[6].read_bytes())
    items = [(p, "train") for p in [*train, big]] + [(p, "val") for p in val] + \
            [(tmp_path / name, "val") for name in planted] + [(tmp_path / "byte_copy.png", "test")]
    pairs = find_duplicates(items, THRESHOLD, block=8).pairs
    expected = {(str(train[k]), str(tmp_path / name)) for k, name in enumerate(planted, start=1) if k < 5}
    expected |= {(str(big), str(tmp_path / "big_cropped_2px.png")), (str(train[6]), str(tmp_path / "byte_copy.png"))}
    assert {(p.path_a, p.path_b) for p in pairs} == expected
    assert all(p.cross_split and p.distance <= THRESHOLD for p in pairs)
    assert [p.distance for p in pairs] == sorted(p.distance for p in pairs)
    assert next(p for p in pairs if p.split_b == "test").distance == 0


def test_exact_copies_within_a_split_follow_the_leaks(digits, tmp_path):
    """Byte copies pair at distance 0, an undecodable file and its copy too (by their bytes), and the files after an
    undecodable one keep their own paths."""
    first, second = sorted(digits.glob("val/*/*.png"))[:2]
    (tmp_path / "again.png").write_bytes(first.read_bytes())
    (tmp_path / "leak.png").write_bytes(second.read_bytes())
    (tmp_path / "broken.png").write_bytes(b"not an image")
    (tmp_path / "broken_too.png").write_bytes(b"not an image")
    items = [(tmp_path / "broken.png", "train"), (first, "train"), (second, "train"), (tmp_path / "again.png", "train"),
             (tmp_path / "leak.png", "val"), (tmp_path / "broken_too.png", "val")]
    pairs = [(p.path_a, p.path_b, p.split_a, p.split_b, p.distance) for p in find_duplicates(items).pairs]
    leaks = sorted([(str(second), str(tmp_path / "leak.png"), "train", "val", 0),
                    (str(tmp_path / "broken.png"), str(tmp_path / "broken_too.png"), "train", "val", 0)])
    assert pairs == [*leaks, (str(first), str(tmp_path / "again.png"), "train", "train", 0)]


def brute_force(a: torch.Tensor, b: torch.Tensor | None, threshold: int) -> set[tuple[int, int, int]]:
    """Every pair's Hamming distance at once, in numpy."""
    x, y = a.numpy(), (a if b is None else b).numpy()
    distances = (x[:, None, :] != y[None, :, :]).sum(-1)
    rows, cols = np.nonzero(distances <= threshold)
    return {(r, c, distances[r, c]) for r, c in zip(rows.tolist(), cols.tolist()) if b is not None or r < c}


@pytest.mark.parametrize("threshold", [0, 3, 8])
def test_the_blocked_search_equals_brute_force(threshold):
    """Blocks of 64 over 700 and 300 hashes (uneven last blocks), with planted copies 0-10 bits away, some of
    them inside one block and some across blocks, symmetric duplicates and a triple."""
    generator = torch.Generator().manual_seed(threshold)
    a = torch.randint(0, 2, (700, 64), generator=generator).bool()
    b = torch.randint(0, 2, (300, 64), generator=generator).bool()
    for k, (i, j) in enumerate([(3, 5), (3, 650), (5, 650), (64, 127), (128, 699), (200, 201), (10, 400)]):
        a[j] = a[i]
        a[j, :k + k % 3] ^= True
    for k, (i, j) in enumerate([(0, 0), (699, 299), (64, 64), (300, 10)]):
        b[j] = a[i]
        b[j, k * 3:k * 3 + k] ^= True
    for other in (None, b):
        rows, cols, distances = pairs_within(a, other, threshold, block=64)
        assert set(zip(rows.tolist(), cols.tolist(), distances.tolist())) == brute_force(a, other, threshold)
        assert len(rows) == len(set(zip(rows.tolist(), cols.tolist())))
    assert brute_force(a, None, threshold) and brute_force(a, b, threshold)


def test_a_threshold_the_hash_cannot_mean_is_refused(digits):
    with pytest.raises(UserError, match="threshold 64 is not within 0-63 bits"):
        find_duplicates([(next(digits.glob("val/*/*.png")), "val")], threshold=64)
