"""export.py's work: a trained model as ONNX, TorchScript or a timm / Hugging Face model folder, checked against
PyTorch on real images before anything is written."""

from __future__ import annotations

import argparse
import errno
import io
import itertools
import json
import logging
import math
import os
import random
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from assembly.inference import inference_model, open_trained, pipeline_line
from assembly.model_card import CARD_MARK, MODEL_CARD, model_card
from core.config import Config
from core.errors import UserError
from core.files import replace_with, temp_beside
from core.files import check_folder, check_replaceable, write_new
from core.logs import setup_logging
from data.datasets import find_images, read_image
from data.loader import build_val_dataset
from data.split import saved_split
from data.transforms import DeviceNormalize, eval_size, eval_transform
from engine.checkpoint.inference import ema_hint
from engine.checkpoint.inference import PIPELINE_NAMES, Trained
from engine.checkpoint.run_store import fetched, output_at
from engine.checkpoint.weights import MODEL_CONFIG, MODEL_WEIGHTS

log = logging.getLogger(__name__)
NOT_OURS = ("tag", "license", "hf_hub_id", "url", "origin_url", "paper_ids", "paper_name", "notes", "source", "file")
SUFFIXES = {"onnx": ".onnx", "torchscript": ".torchscript.pt", "safetensors": "-hf"}
EXPECTED = {"onnx": "an ONNX file export.py wrote", "torchscript": "a TorchScript file export.py wrote",
            "safetensors": f"a model folder export.py wrote (only {MODEL_CONFIG}, {MODEL_WEIGHTS}, its "
                           f"{MODEL_CARD} and an {PIPELINE_NAMES[0]} or {PIPELINE_NAMES[2]})"}


def check_sources(cfg: Config, images: str | None, count: int, checkpoint: str | None) -> tuple[list[np.ndarray], str]:
    """Up to `count` decoded images (HWC uint8 RGB) to check the export on, and where they come from: --images, else
    the checkpoint's validation images (data.val_fraction: the run's val.txt beside `checkpoint`), else (said)
    random pixels."""
    if images:
        decoded = (readable(path, cfg) for path in find_images(images))
        raw = list(itertools.islice((image for image in decoded if image is not None), count))
        if not raw:
            raise UserError(f"--images {images}: none of its images can be read")
        return raw, f"--images {images}"
    try:
        split = saved_split(cfg.data, checkpoint) if checkpoint else None
        dataset = build_val_dataset(cfg.data, cfg.seed, split=split)
        raw = [dataset.load_image(i) for i in range(min(count, len(dataset)))]
    except UserError as err:
        log.warning("checking on random pixels: the stored validation data cannot be read (%s); "
                    "pass --images to check on real images", err)
        size, crop_pct = eval_size(cfg.data)
        side = math.floor(size / crop_pct)
        return list(np.random.default_rng(0).integers(0, 256, (count, side, side, 3), dtype=np.uint8)), "random pixels"
    if split is not None:
        return raw, f"validation images of the run's val.txt beside {checkpoint}, in {cfg.data.root}"
    return raw, f"validation images of data.name={cfg.data.name}" + (
        f" in {cfg.data.root}" if cfg.data.name != "dummy" else "")


def readable(path: str, cfg: Config) -> np.ndarray | None:
    """The decoded image, or None for a file that cannot be read (--images may hold some)."""
    try:
        return read_image(path, cfg.data.max_image_pixels)
    except UserError:
        return None


def preprocessed(cfg: Config, raw: list[np.ndarray]) -> torch.Tensor:
    """`raw` through cfg's eval pipeline (each image's random state seeded alike, for any pipeline) and normalized:
    the float32 NCHW batch the model takes."""
    transform = eval_transform(cfg.data)
    batch = []
    for index, image in enumerate(raw):
        rng = np.random.default_rng([0, index])
        transform.set_random_state(rng, random.Random(int(rng.integers(2**63))))
        batch.append(transform(image=image)["image"])
    normalize = DeviceNormalize(cfg.data.mean, cfg.data.std, torch.device("cpu"), channels_last=False)
    return normalize(torch.stack(batch))


def check_folder_preprocessing(cfg: Config, folder: Path, raw: list[np.ndarray], where: str, out: Path) -> None:
    """The model folder, read back as predict.py and evaluate.py read it, preprocesses the check images exactly as
    the checkpoint does (its eval pipeline file, size, mean and std): else the two would predict differently."""
    _, read_back = open_trained(folder, False, [("data.num_workers", 0)], may_override=False)
    if not torch.equal(preprocessed(read_back, raw), preprocessed(cfg, raw)):
        raise UserError(f"the model folder preprocesses the check images ({where}) differently from the checkpoint, "
                        f"as predict.py would read it back, so their predictions would disagree; {out} was not "
                        "written")


def max_difference(run: Callable[[torch.Tensor], np.ndarray], model: nn.Module, batch: torch.Tensor,
                   sizes: tuple[int, ...]) -> float:
    """Largest |exported - PyTorch| logit over batches of each size (the dynamic batch axis at work)."""
    worst = 0.0
    for size in sizes:
        x = batch[:size] if size <= len(batch) else batch[torch.arange(size) % len(batch)]
        with torch.no_grad():
            expected = model(x).numpy()
        got = run(x)
        if got.shape != expected.shape:
            raise RuntimeError(f"the exported model returned shape {got.shape} for a batch of {size}, "
                               f"PyTorch {expected.shape}")
        worst = max(worst, float(np.abs(got - expected).max()))
    return worst


def metadata(cfg: Config, trained: Trained) -> dict[str, Any]:
    """What a user of an exported file needs to feed it: architecture, classes, preprocessing (the run's eval
    pipeline file itself when it had one)."""
    size, crop_pct = eval_size(cfg.data)
    meta = {"architecture": cfg.model.name, "num_classes": len(trained.class_names),
            "label_names": trained.class_names, "input_size": [3, size, size],
            "crop_pct": crop_pct, "mean": cfg.data.mean, "std": cfg.data.std,
            "interpolation": cfg.data.interpolation,
            "input": "float32 NCHW: short side resized to floor(input_size / crop_pct) (antialiased, as timm's "
                     "eval transform), centre-cropped, (x / 255 - mean) / std",
            **multi_label_meta(trained)}
    if cfg.data.eval_transform:
        meta.update(eval_transform=Path(cfg.data.eval_transform).read_text(), eval_transform_sha256=cfg.data
                    .eval_transform_sha256, input=f"float32 NCHW: the RGB uint8 image through the albumentations "
                    f"pipeline in eval_transform (the run's data.eval_transform file: save the text as "
                    f"{pipeline_name(cfg)} and A.load it), as CHW, (x / 255 - mean) / std; crop_pct and "
                    "interpolation do not apply")
    return meta


def pipeline_name(cfg: Config) -> str:
    """The name of the eval pipeline file in a model folder: its format (YAML or JSON) kept, as A.load reads it."""
    yaml_file = Path(cfg.data.eval_transform).suffix.lower() in (".yaml", ".yml")
    return PIPELINE_NAMES[0] if yaml_file else PIPELINE_NAMES[2]


def multi_label_meta(trained: Trained) -> dict[str, Any]:
    """Multi-label models say how to read their logits: one sigmoid per class and a threshold (none: a softmax)."""
    if not trained.multi_label:
        return {}
    return {"multi_label": True, "multi_label_threshold": trained.threshold,
            "output": "logits: one sigmoid per class; a class is present at sigmoid >= multi_label_threshold"}


def export_onnx(model: nn.Module, example: torch.Tensor, out: Path, meta: dict[str, Any], opset: int
                ) -> Callable[[torch.Tensor], np.ndarray]:
    """torch.onnx (dynamo exporter) with a dynamic batch axis; returns an onnxruntime runner of the written file."""
    import onnxruntime

    batch = torch.export.Dim("batch", min=1)
    program = torch.onnx.export(model, (example,), input_names=["input"], output_names=["logits"],
                                dynamic_shapes=({0: batch},), opset_version=opset, dynamo=True, verbose=False)
    proto = program.model_proto
    for key, value in meta.items():
        proto.metadata_props.add(key=key, value=json.dumps(value))
    write_new(out, proto.SerializeToString())  # a Python file: a failed write is an OSError naming its cause
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {"input": x.numpy()})[0]


def export_torchscript(model: nn.Module, example: torch.Tensor, out: Path, meta: dict[str, Any]
                       ) -> Callable[[torch.Tensor], np.ndarray]:
    """torch.jit.trace, with the metadata as the file's config.json; returns a runner of the reloaded file."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated, still what C++/mobile users load
        traced = torch.jit.trace(model, example)
        buffer = io.BytesIO()  # saved to a path, a failed write (disk full, file-size limit) aborts in C++
        torch.jit.save(traced, buffer, _extra_files={"config.json": json.dumps(meta)})
        write_new(out, buffer.getvalue())
        loaded = torch.jit.load(str(out), map_location="cpu")

    def run(x: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            return loaded(x).numpy()
    return run


def export_model_folder(model: nn.Module, cfg: Config, trained: Trained, folder: Path, name: str
                        ) -> Callable[[torch.Tensor], np.ndarray]:
    """config.json (timm's own writer, save_config_for_hf) + model.safetensors + README.md (the model card, named
    `name`); returns a runner of the model timm builds back from the folder (local-dir:, never the hub)."""
    import timm
    from safetensors.torch import save
    from timm.models._hub import save_config_for_hf

    folder.mkdir()
    size, crop_pct = eval_size(cfg.data)  # the evaluation's (data.val_img_size/val_crop_pct when set)
    data_config = {"input_size": (3, size, size), "crop_pct": crop_pct,
                   "crop_mode": "center", "mean": tuple(cfg.data.mean), "std": tuple(cfg.data.std),
                   "interpolation": cfg.data.interpolation}
    config_file = folder / MODEL_CONFIG
    model_config = {"label_names": trained.class_names, **multi_label_meta(trained),
                    "eval_amp": cfg.eval_amp}  # predict.py computes in it, as from the checkpoint
    model_config.pop("output", None)
    if cfg.data.eval_transform:  # the run's eval pipeline goes with the weights (predict.py reads it, sha256 checked)
        model_config.update(eval_transform=pipeline_name(cfg), eval_transform_sha256=cfg.data.eval_transform_sha256)
        write_new(folder / pipeline_name(cfg), Path(cfg.data.eval_transform).read_bytes())
    save_config_for_hf(model, str(config_file), model_config=model_config,
                       model_args=dict(cfg.model.kwargs), data_config=data_config)
    written = json.loads(config_file.read_text())
    for key in NOT_OURS:  # timm's default weights' provenance, which these weights do not have
        written["pretrained_cfg"].pop(key, None)
    config_file.write_text(json.dumps(written, indent=2) + "\n")
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    write_new(folder / MODEL_WEIGHTS, save(tensors))  # save_file: mode 0600 and a SafetensorError on EFBIG
    file = pipeline_name(cfg) if cfg.data.eval_transform else None
    write_new(folder / MODEL_CARD, model_card(cfg, trained, model, name, file).encode())
    loaded = timm.create_model(f"local-dir:{folder.resolve()}", pretrained=True).eval()

    def run(x: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            return loaded(x).numpy()
    return run


def is_onnx_export(path: Path) -> bool:
    """An ONNX file this tool wrote: a ModelProto (its first field, ir_version, is tag 0x08) with our metadata."""
    import onnx
    from google.protobuf.message import DecodeError

    if not path.is_file():
        return False
    with path.open("rb") as f:
        if f.read(1) != b"\x08":
            return False
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, OSError, ValueError):
        return False
    return {"architecture", "label_names"} <= {prop.key for prop in proto.metadata_props}


def is_torchscript_export(path: Path) -> bool:
    """A TorchScript archive this tool wrote: code/ and an extra config.json naming the architecture."""
    if not path.is_file() or not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            config = [name for name in names if name.endswith("/extra/config.json")]
            return bool(config) and any("/code/" in name for name in names) \
                and "architecture" in json.loads(archive.read(config[0]))
    except (zipfile.BadZipFile, OSError, ValueError, TypeError):
        return False


def is_model_folder_export(path: Path) -> bool:
    """A model folder this tool wrote: config.json (naming the architecture), model.safetensors, its own model card
    (a folder written before the card came holds the first two only) and maybe the run's eval pipeline file, and
    nothing else."""
    if not path.is_dir() or path.is_symlink():
        return False
    names = sorted(p.name for p in path.iterdir() if p.name not in PIPELINE_NAMES or p.is_symlink())
    if names not in ([MODEL_CONFIG, MODEL_WEIGHTS], sorted([MODEL_CONFIG, MODEL_WEIGHTS, MODEL_CARD])):
        return False
    try:
        card = path / MODEL_CARD
        if MODEL_CARD in names and (card.is_symlink() or CARD_MARK not in card.read_text(errors="replace")):
            return False
        return "architecture" in json.loads((path / MODEL_CONFIG).read_text())
    except (OSError, ValueError, TypeError):
        return False


RECOGNISE = {"onnx": is_onnx_export, "torchscript": is_torchscript_export, "safetensors": is_model_folder_export}


def check_output(out: Path, checkpoint: Path, fmt: str) -> None:
    """Before any work: --output is in an existing folder and holds nothing but an earlier export of `fmt`."""
    if out.exists() and checkpoint.exists() and os.path.samefile(out, checkpoint):
        raise UserError(f"--output {out} is the model being exported; choose another --output")
    check_folder(out, "--output")
    check_replaceable(out, RECOGNISE[fmt], EXPECTED[fmt], "--output")


def write_export(args: argparse.Namespace, model: nn.Module, cfg: Config, trained: Trained, example: torch.Tensor,
                 meta: dict[str, Any], out: Path, name: str) -> Callable[[torch.Tensor], np.ndarray]:
    """The --format export written to `out` (a new path; `name`: the one it will have); the exporter's own failures
    become one line."""
    try:
        if args.format == "onnx":
            return export_onnx(model, example, out, meta, args.opset)
        if args.format == "torchscript":
            return export_torchscript(model, example, out, meta)
        return export_model_folder(model, cfg, trained, out, name)
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:  # the exporter's, not a bug here
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise UserError(f"{args.format} export of {cfg.model.name} failed ({type(err).__name__}: {first}); "
                        "another --format may work for this architecture") from None


def export_command(args: argparse.Namespace) -> int:
    """export.py (one process), after its arguments are parsed: check the output, export, compare, then write."""
    setup_logging(0, "INFO")
    for noisy in ("onnxscript", "onnx_ir", "timm"):  # INFO lines of the exporter and of the check's reload
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.check_batch < 1:
        raise UserError(f"--check-batch must be >= 1, got {args.check_batch}")
    target = args.output or f"{os.path.splitext(args.checkpoint)[0]}{SUFFIXES[args.format]}"  # beside it by default
    args.checkpoint = fetched(args.checkpoint)  # a URL: copied to its local mirror (engine/checkpoint/run_store.py)
    with output_at(target) as out:  # a URL: written to its local mirror, then uploaded
        wrote = export_to(args, Path(args.checkpoint), out)
    print(f"wrote {target} ({wrote})")
    return 0


def export_to(args: argparse.Namespace, checkpoint: Path, out: Path) -> str:
    """The checked export of `checkpoint` written to the local path `out`; what it is, in a few words."""
    check_output(out, checkpoint, args.format)  # before any work: nothing at --output is lost
    trained, cfg = open_trained(args.checkpoint, args.ema, [("data.num_workers", 0), ("model.channels_last", False)],
                                may_override=False)
    if hint := ema_hint(trained.source, trained.best_metric, args.ema):
        log.warning(hint)
    if line := pipeline_line(trained, cfg):
        log.info(line)
    model = inference_model(trained, cfg, torch.device("cpu")).float()  # exported from the CPU, in fp32
    raw, where = check_sources(cfg, args.images, args.check_batch, args.checkpoint)
    batch = preprocessed(cfg, raw)
    example = batch[:2] if len(batch) > 1 else batch.repeat(2, 1, 1, 1)  # export with 2: batch 1 is checked too
    meta = metadata(cfg, trained)
    try:
        with temp_beside(out) as tmp:
            runner = write_export(args, model, cfg, trained, example, meta, tmp, out.name)
            if args.format == "safetensors":
                check_folder_preprocessing(cfg, tmp, raw, where, out)
            difference = max_difference(runner, model, batch, (1, args.check_batch))
            print(f"max abs difference of the logits, {args.format} vs PyTorch, batches of 1 and "
                  f"{args.check_batch} ({where}): {difference:.3g}")
            if not difference <= args.atol:
                raise UserError(f"the {args.format} export gives logits up to {difference:.3g} away from PyTorch's "
                                f"(--atol {args.atol}); {out} was not written")
            replace_with(tmp, out, RECOGNISE[args.format], EXPECTED[args.format], "--output")
    except OSError as err:
        full = err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
        way_out = "free disk space (or raise the quota or file-size limit), or" if full else "make it writable, or"
        raise UserError(f"cannot write {out} ({err.strerror}); {way_out} choose another --output") from None
    return f"{cfg.model.name}, {len(trained.class_names)} classes, {trained.source}"
