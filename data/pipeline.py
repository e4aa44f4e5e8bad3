"""data.train_transform / data.eval_transform: a user's albumentations pipeline, from the file `A.save` wrote.

The file is read with albumentations' own `A.load` (never eval or pickle) and used in place of the preset for its
split. The app keeps what it owns around it: decoding before it, and after it a check that each image is uint8
data.img_size x data.img_size x 3 (a one-line refusal naming the size or type produced), the uint8 CHW tensor,
and normalization with data.mean/std on the device. `ToTensorV2` and `Normalize` in the file are refused: the
app does both itself, and a float image would be normalized twice. The run folder keeps a copy of the file and
config.yaml its sha256 (data.train_transform_sha256 / data.eval_transform_sha256), so a resume with another
pipeline is refused like any changed key.
"""

from __future__ import annotations

import hashlib
import random
import warnings
from pathlib import Path
from types import TracebackType
from typing import Any

import albumentations as A
import numpy as np
from albumentations.pytorch import ToTensorV2

from core.config import DataConfig
from core.errors import UserError

REPLACED_KEYS = ("scale", "ratio", "hflip", "color_jitter")  # the preset's keys (data/transforms.py) a file replaces
APP_OWNS = {"ToTensorV2": "the app makes the uint8 tensor itself",
            "Normalize": "the app normalizes with data.mean/data.std on the device"}


def read_bytes(path: str, key: str) -> bytes:
    """The file's bytes; a missing or unreadable one named."""
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise UserError(f"{key}={path}: cannot read it ({err.strerror}); give the YAML or JSON file that "
                        "albumentations' A.save wrote") from None


def file_sha256(path: str, key: str) -> str:
    """The sha256 of the pipeline file (config.yaml records it; a resume with another file is refused)."""
    return hashlib.sha256(read_bytes(path, key)).hexdigest()


def load_pipeline(path: str, key: str) -> A.BaseCompose:
    """The pipeline A.load reads from `path` (YAML for .yaml/.yml, else JSON), its steps checked."""
    read_bytes(path, key)
    data_format = "yaml" if Path(path).suffix.lower() in (".yaml", ".yml") else "json"
    try:
        with warnings.catch_warnings():  # an argument albumentations does not know: refused below, by its transform
            warnings.filterwarnings("ignore", message="Argument\\(s\\) '.*' are not valid for transform")
            pipeline = A.load(path, data_format=data_format)
    except Exception as err:  # noqa: BLE001 - yaml/json syntax, an unknown name, bad arguments: A.load's own words
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"{key}={path}: albumentations cannot load it ({type(err).__name__}: {first}); write it with "
                        f"A.save(pipeline, path, data_format=\"{data_format}\") and only albumentations' transforms") \
            from None
    for step in steps_of(pipeline):
        if (name := type(step).__name__) in APP_OWNS:
            raise UserError(f"{key}={path}: remove {name} from the pipeline ({APP_OWNS[name]})")
        unknown_arguments(step, key, path)
    return pipeline


def unknown_arguments(step: Any, key: str, path: str) -> None:
    """A transform given an argument it does not take (a misspelling: `scael:`) is refused: albumentations only
    warns, and the transform then runs with that argument's default."""
    if unknown := getattr(step, "invalid_args", None):
        schema = getattr(type(step), "InitSchema", None)
        takes = sorted({"p", *(schema.model_fields if schema else ())} - {"strict"})
        raise UserError(f"{key}={path}: {type(step).__name__} has no argument {', '.join(map(repr, unknown))} "
                        f"(albumentations would ignore it and use the default); it takes {', '.join(takes)}")


def steps_of(transform: Any) -> list[Any]:
    """Every transform of a (nested) composition."""
    inner = getattr(transform, "transforms", None)
    return [transform] if inner is None else [step for t in inner for step in steps_of(t)]


def check_size(image: np.ndarray, size: int, key: str, path: str) -> np.ndarray:
    """The image, unless the user's pipeline left it in another size or type than the model's input."""
    if image.dtype != np.uint8 or image.shape != (size, size, 3):
        raise UserError(f"{key}={path}: the pipeline made a {image.dtype} image of {'x'.join(map(str, image.shape))}; "
                        f"it must end with uint8 {size}x{size}x3 (the model's input size): end it with a crop or "
                        "resize to that size, and no ToFloat")
    return image


class FileTransform:
    """The user's pipeline as it is (no outer Compose: that would draw from the sample's RNG first and shift every
    draw of the file's own), then the size check and the uint8 CHW tensor."""

    def __init__(self, path: str, key: str, size: int) -> None:
        self.pipeline, self.path, self.key, self.size = load_pipeline(path, key), path, key, size
        self.to_tensor = ToTensorV2()

    def set_random_state(self, random_generator: np.random.Generator, py_random: random.Random) -> None:
        self.pipeline.set_random_state(random_generator, py_random)

    def __call__(self, **data: Any) -> dict[str, Any]:
        image = check_size(self.pipeline(**data)["image"], self.size, self.key, self.path)
        return self.to_tensor(image=image)

    def failed(self, err: Exception, image: str, shape: tuple[int, ...]) -> UserError:
        """The one line for the pipeline failing on an image: the file, the transform that raised and the image."""
        steps = {id(step): step for step in steps_of(self.pipeline)}
        failing = [steps[id(owner)] for owner in frame_owners(err.__traceback__) if id(owner) in steps]
        name = type(failing[-1]).__name__ if failing else "a transform"
        first = (str(err).strip().splitlines() or [""])[0]
        return UserError(f"{self.key}={self.path}: {name} failed on image {image} ({'x'.join(map(str, shape))}): "
                         f"{type(err).__name__}: {first}; make the pipeline fit every image (a resize, or PadIfNeeded "
                         "before a crop), or remove the image")


def frame_owners(tb: TracebackType | None) -> list[Any]:
    """The `self` of each frame of a traceback, outermost first (the innermost transform is the one that raised)."""
    owners = []
    while tb is not None:
        owners.append(tb.tb_frame.f_locals.get("self"))
        tb = tb.tb_next
    return owners


def pipeline_hashes(cfg: DataConfig) -> dict[str, str]:
    """data.train_transform_sha256 / eval_transform_sha256 of the files given ("" without one); a hash given that
    the file does not have is refused."""
    hashes = {}
    for side in ("train", "eval"):
        path, given = getattr(cfg, f"{side}_transform"), getattr(cfg, f"{side}_transform_sha256")
        actual = file_sha256(path, f"data.{side}_transform") if path else ""
        if given and given != actual:
            raise UserError(f"data.{side}_transform_sha256={given}, but data.{side}_transform "
                            f"{path or '(none)'} has sha256 {actual or '(none)'}; give the pipeline file this run "
                            f"used, or drop data.{side}_transform_sha256 to start another run")
        hashes[f"{side}_transform_sha256"] = actual
    return hashes


def copy_name(side: str, path: str) -> str:
    """The name of the run folder's copy of a `side` ("train", "eval") pipeline file: `<side>_transform<suffix>`."""
    return f"{side}_transform{Path(path).suffix}"


def pipeline_copies(cfg: DataConfig) -> dict[str, bytes]:
    """The run folder's copy of each pipeline file (copy_name; written at the run's first write)."""
    return {copy_name(side, path): read_bytes(path, f"data.{side}_transform")
            for side in ("train", "eval") if (path := getattr(cfg, f"{side}_transform"))}
