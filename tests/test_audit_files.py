"""The audit's file checks (issue 60), on real files: each finding kind from a file written to show it."""

from __future__ import annotations

import io
import re
from dataclasses import fields
from pathlib import Path

import numpy as np
from PIL import Image

from core.config import DataConfig, TrainConfig
from data.file_checks import IMBALANCE_REMEDY, REMEDIES, check_files


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
