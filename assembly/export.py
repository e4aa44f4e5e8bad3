"""export.py's work: a trained model as ONNX, TorchScript or a timm / Hugging Face model folder, checked against
PyTorch on real images before anything is written."""

from __future__ import annotations

import argparse
import errno
import io
import json
import logging
import os
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from assembly.inference import inference_model, open_trained
from assembly.model_card import CARD_MARK, MODEL_CARD, model_card
from core.config import Config
from core.errors import UserError
from core.files import replace_with, temp_beside
from core.files import check_folder, check_replaceable, write_new
from core.logs import setup_logging
from data.datasets import ImageListDataset, find_images
from data.loader import build_val_dataset
from data.transforms import DeviceNormalize, eval_size, eval_transform
from engine.checkpoint.inference import ema_hint
from engine.checkpoint.inference import Trained
from engine.checkpoint.weights import MODEL_CONFIG, MODEL_WEIGHTS

log = logging.getLogger(__name__)
NOT_OURS = ("tag", "license", "hf_hub_id", "url", "origin_url", "paper_ids", "paper_name", "notes", "source", "file")
SUFFIXES = {"onnx": ".onnx", "torchscript": ".torchscript.pt", "safetensors": "-hf"}
EXPECTED = {"onnx": "an ONNX file export.py wrote", "torchscript": "a TorchScript file export.py wrote",
            "safetensors": f"a model folder export.py wrote (only {MODEL_CONFIG}, {MODEL_WEIGHTS} and its "
                           f"{MODEL_CARD})"}


def check_images(cfg: Config, images: str | None, count: int) -> tuple[torch.Tensor, str]:
    """Up to `count` eval-preprocessed images (float32 NCHW) and where they come from."""
    transform = eval_transform(cfg.data)
    if images:
        dataset = ImageListDataset(find_images(images), transform, cfg.data.max_image_pixels)
        samples = [dataset[i][0] for i in range(len(dataset))]
        batch = [s for s in samples if s is not None][:count]
        if not batch:
            raise UserError(f"--images {images}: none of its images can be read")
        where = f"--images {images}"
    else:
        try:
            dataset = build_val_dataset(cfg.data, cfg.seed)
            batch = [dataset[i][0] for i in range(min(count, len(dataset)))]
            where = f"validation images of data.name={cfg.data.name}"
            where += f" in {cfg.data.root}" if cfg.data.name != "dummy" else ""
        except UserError as err:
            log.warning("checking on random pixels: the stored validation data cannot be read (%s); "
                        "pass --images to check on real images", err)
            generator = torch.Generator().manual_seed(0)
            size = eval_size(cfg.data)[0]
            batch = list(torch.randint(0, 256, (count, 3, size, size), dtype=torch.uint8, generator=generator))
            where = "random pixels"
    normalize = DeviceNormalize(cfg.data.mean, cfg.data.std, torch.device("cpu"), channels_last=False)
    return normalize(torch.stack(batch)), where


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
    """What a user of an exported file needs to feed it: architecture, classes, preprocessing."""
    size, crop_pct = eval_size(cfg.data)
    return {"architecture": cfg.model.name, "num_classes": len(trained.class_names),
            "label_names": trained.class_names, "input_size": [3, size, size],
            "crop_pct": crop_pct, "mean": cfg.data.mean, "std": cfg.data.std,
            "interpolation": cfg.data.interpolation,
            "input": "float32 NCHW: short side resized to floor(input_size / crop_pct) (antialiased, as timm's "
                     "eval transform), centre-cropped, (x / 255 - mean) / std",
            **multi_label_meta(trained)}


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
    save_config_for_hf(model, str(config_file), model_config=model_config,
                       model_args=dict(cfg.model.kwargs), data_config=data_config)
    written = json.loads(config_file.read_text())
    for key in NOT_OURS:  # timm's default weights' provenance, which these weights do not have
        written["pretrained_cfg"].pop(key, None)
    config_file.write_text(json.dumps(written, indent=2) + "\n")
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    write_new(folder / MODEL_WEIGHTS, save(tensors))  # save_file: mode 0600 and a SafetensorError on EFBIG
    write_new(folder / MODEL_CARD, model_card(cfg, trained, model, name).encode())
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
    """A model folder this tool wrote: config.json (naming the architecture), model.safetensors and its own model card
    (a folder written before the card came holds the first two only), and nothing else."""
    if not path.is_dir() or path.is_symlink():
        return False
    names = sorted(p.name for p in path.iterdir())
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
    checkpoint = Path(args.checkpoint)
    out = Path(args.output) if args.output else checkpoint.parent / f"{checkpoint.stem}{SUFFIXES[args.format]}"
    check_output(out, checkpoint, args.format)  # before any work: nothing at --output is lost
    trained, cfg = open_trained(args.checkpoint, args.ema, [("data.num_workers", 0), ("model.channels_last", False)])
    if hint := ema_hint(trained.source, trained.best_metric, args.ema):
        log.warning(hint)
    model = inference_model(trained, cfg, torch.device("cpu")).float()  # exported from the CPU, in fp32
    batch, where = check_images(cfg, args.images, args.check_batch)
    example = batch[:2] if len(batch) > 1 else batch.repeat(2, 1, 1, 1)  # export with 2: batch 1 is checked too
    meta = metadata(cfg, trained)
    try:
        with temp_beside(out) as tmp:
            runner = write_export(args, model, cfg, trained, example, meta, tmp, out.name)
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
    print(f"wrote {out} ({cfg.model.name}, {len(trained.class_names)} classes, {trained.source})")
    return 0
