"""Export a trained model for use outside this app: ONNX, TorchScript, or a timm / Hugging Face model folder.

    python export.py runs/digits/best.pth --format onnx            # runs/digits/best.onnx
    python export.py runs/digits/best.pth --format torchscript     # runs/digits/best.torchscript.pt
    python export.py runs/digits/best.pth --format safetensors     # runs/digits/best-hf/ (config.json, weights, card)
    python export.py runs/digits/best.pth --format onnx --ema --output model.onnx

ONNX and TorchScript take a float32 NCHW batch of any size, already resized, centre-cropped and normalized as
the stored config says (its mean, std, image size and crop_pct are in the ONNX metadata and in the TorchScript
file's config.json); they return logits. Before it reports success the command runs the exported model and
the PyTorch model on real images (--images, else the checkpoint's validation set; random pixels if neither
can be read) in batches of 1 and --check-batch, prints the largest absolute difference of the logits, and
fails above --atol. The model folder (config.json: architecture, num_classes, label_names, pretrained_cfg with
the preprocessing; model.safetensors; README.md, the model card the Hugging Face Hub shows) loads with
`timm.create_model("local-dir:FOLDER")`, with `timm.create_model(arch, pretrained=True, num_classes=N,
pretrained_cfg_overlay=dict(file="FOLDER/model.safetensors", num_classes=N))`, with predict.py and as
model.init_from; its weights are checked to load back into timm bitwise.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: a SIGTERM or SIGUSR1 during the imports below (seconds) gets handled
    from core.signals import handle_early

    handle_early()

import argparse
import errno
import io
import json
import logging
import math
import os
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from core.startup import import_timm_without_wandb

import_timm_without_wandb()  # first: the imports below reach timm, which would import wandb (core/startup.py)

from core.cli import run_main
from core.config import Config
from core.errors import UserError
from core.files import check_folder, check_replaceable, replace_with, temp_beside, write_new
from core.logs import setup_logging
from data.datasets import ImageListDataset, find_images
from data.loader import build_val_dataset
from data.transforms import DeviceNormalize, eval_size, eval_transform
from engine.checkpoint.inference import Trained, ema_hint, inference_config, load_trained
from engine.checkpoint.weights import MODEL_CONFIG, MODEL_WEIGHTS, load_weights
from models.factory import create_model

log = logging.getLogger("export")
NOT_OURS = ("tag", "license", "hf_hub_id", "url", "origin_url", "paper_ids", "paper_name", "notes", "source", "file")
SUFFIXES = {"onnx": ".onnx", "torchscript": ".torchscript.pt", "safetensors": "-hf"}
MODEL_CARD = "README.md"  # a model folder's card: what the Hugging Face Hub shows for it
CARD_MARK = "<!-- model card written by export.py"  # how a later export knows the card is its own
CLASSES_SHOWN = 20  # class names listed in the card (all of them are in config.json)
EXPECTED = {"onnx": "an ONNX file export.py wrote", "torchscript": "a TorchScript file export.py wrote",
            "safetensors": f"a model folder export.py wrote (only {MODEL_CONFIG}, {MODEL_WEIGHTS} and its "
                           f"{MODEL_CARD})"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint written by train.py")
    parser.add_argument("--format", required=True, choices=sorted(SUFFIXES), help="what to write")
    parser.add_argument("--output", help="the file (folder for safetensors) to write (default: beside the "
                                         "checkpoint, named after it)")
    parser.add_argument("--ema", action="store_true", help="export the checkpoint's EMA weights")
    parser.add_argument("--images", help="an image, folder or list file to check the export on (default: the "
                                         "checkpoint's validation images)")
    parser.add_argument("--check-batch", type=int, default=8, help="images in the larger check batch (default 8)")
    parser.add_argument("--atol", type=float, default=1e-4, help="largest allowed |logit difference| (default 1e-4)")
    parser.add_argument("--opset", type=int, default=18, help="ONNX opset version (default 18)")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for user errors")
    return parser.parse_args(argv)


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
    import onnx
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


def model_card(cfg: Config, trained: Trained, model: nn.Module, name: str) -> str:
    """The folder's README.md by timm's own card writer (generate_readme, as its push_to_hf_hub uses): the Hub's
    header, what the model was trained on and from, the metrics its checkpoint records of these weights and how far
    to trust them, preprocessing, usage and limitations; then the training config without local paths."""
    import yaml
    from timm.models._hub import generate_readme

    size, crop_pct = eval_size(cfg.data)
    arch = model.pretrained_cfg.get("architecture") or cfg.model.name
    classes, data = trained.class_names, trained.config.get("data", {})
    hidden = len(classes) - CLASSES_SHOWN
    more = f", and {hidden} more (config.json lists them all)" if hidden > 0 else ""
    kind = (f"multi-label image classification (one sigmoid per class, present at >= {trained.threshold})"
            if trained.multi_label else "image classification")
    trained_how = "fine-tuned" if from_weights(trained) else "trained from scratch"
    details = {
        "Model Type": kind,
        "Architecture": f"timm {arch}",
        "Params (M)": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        "Started from": start_of(trained),
        "Data": f"{data_set_name(data)}: {split_sizes(trained.data_sizes, data)}",
        "Classes": f"{len(classes)}: {', '.join(classes[:CLASSES_SHOWN])}{more}",
        "Metrics (validation split, as the checkpoint records them)": trained.metrics or "none recorded",
        "Preprocessing": {"resize": f"short side to {math.floor(size / crop_pct)} px ({cfg.data.interpolation}), "
                                    f"centre crop {size} x {size} (crop_pct {crop_pct})",
                          "normalize": f"mean {list(cfg.data.mean)}, std {list(cfg.data.std)} (RGB, 0-1)"},
    }
    scores = "sigmoid()" if trained.multi_label else "softmax(-1)"
    usage = ("```python\nimport timm\nfrom PIL import Image\n\n"
             f'model = timm.create_model("hf-hub:<user>/{name}", pretrained=True).eval()  # or "local-dir:{name}"\n'
             "transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))\n"
             f'scores = model(transform(Image.open("photo.jpg").convert("RGB")).unsqueeze(0)).{scores}\n'
             'labels = model.pretrained_cfg["label_names"]\n```\n')
    card = {"tags": ["image-classification", "timm"], "license": "other", "details": details, "usage": usage,
            "description": f"A timm {arch} {trained_how} with the image classification reference trainer "
                           f"(export.py wrote this folder). {selection_note(trained)} `license: other` above is a "
                           "placeholder: set the license of these weights (and of any weights they started from) "
                           "before publishing."}
    title = f"{arch} {trained_how} on {data_set_name(data)} ({len(classes)} classes)"
    config = yaml.safe_dump(without_local_paths(trained.config), sort_keys=False) if trained.config else "{}\n"
    return (f"{generate_readme(card, title)}\n{limitations(trained, len(classes))}\n## Training config\n\n"
            "The run's resolved config (its config.yaml), with each local path cut to its last component (`<local "
            f"path>` where it has none):\n\n```yaml\n{config}```\n\n"
            f"{CARD_MARK} from {Path(trained.source.split(' ', 1)[-1]).name}; export again to rewrite it -->\n")


DATA_SETS = {"digits": "scikit-learn's handwritten digits", "dummy": "synthetic dummy data"}  # data.name's own data


def data_set_name(data: dict[str, Any]) -> str:
    """The data a run trained on, by name: the data set a built-in data.name makes, else data.root's last part."""
    if data.get("name") in DATA_SETS:
        return DATA_SETS[data["name"]]
    return str(data.get("root") or "unrecorded data").rstrip("/").rsplit("/", 1)[-1]


def split_sizes(sizes: dict[str, int] | None, data: dict[str, Any]) -> str:
    """The images trained and validated on, as the run recorded them."""
    if not sizes:
        return "images per split not recorded (a checkpoint written before runs recorded them)"
    return (f"{sizes['train']} training images (split {data.get('train_split', 'train')}), {sizes['val']} "
            f"validation images (split {data.get('val_split', 'val')})")


def selection_note(trained: Trained) -> str:
    """How far the recorded validation metric can be trusted, given how the checkpoint was chosen."""
    if trained.selected:
        return (f"The validation split that measured its metrics also chose this checkpoint (best.pth: the "
                f"evaluation with the best {trained.best_metric}), so they are optimistic for new images.")
    return ("Its metrics come from the validation split, which did not choose this file (it may still have guided "
            "early stopping or the choice of settings).")


def limitations(trained: Trained, count: int) -> str:
    """The card's short, honest list of what the model was not shown to do."""
    val = (trained.data_sizes or {}).get("val")
    measured = f"{val} images" if val else "its size not recorded"
    amp = trained.config.get("amp", "not recorded")
    answer = "a subset of these classes" if trained.multi_label else "one of these classes"
    return ("## Limitations\n\n"
            f"- Validated only on the validation split named above ({measured}); "
            "how it does on other images (other cameras, places, times, people) is unknown.\n"
            f"- A closed class list: every image gets {answer} ({count}), even an image of none of them.\n"
            "- Expects the preprocessing above; another resize, crop or normalization changes its predictions.\n"
            f"- fp32 weights, trained with amp={amp}; export.py checked them in fp32 (bf16 or fp16 inference gives "
            "slightly different scores).\n")


def from_weights(trained: Trained) -> bool:
    """Whether the run started from trained weights (its record, else its config for an older checkpoint)."""
    if trained.started_from is not None:
        return trained.started_from.get("kind") in ("file", "timm")
    model = trained.config.get("model", {})
    return bool(model.get("pretrained") or model.get("init_from"))


def start_of(trained: Trained) -> str:
    """The weights a training run started from, as its checkpoints recorded them."""
    record = trained.started_from
    if record is None:
        model = trained.config.get("model", {})
        said = ("model.pretrained=true" if model.get("pretrained") else
                "model.init_from" if model.get("init_from") else "neither model.pretrained nor model.init_from")
        return f"not recorded (a checkpoint written before runs recorded it); its config sets {said}"
    if record.get("kind") == "file":
        return f"the file {without_local_paths(record['path'])} (model.init_from, sha256 {record['sha256']})"
    if record.get("kind") != "timm":
        return "random initialisation"
    if not record.get("hf_hub_id"):
        return f"timm's pretrained weights {record['name']} ({record.get('url')})"
    revision = (f"revision {record['revision']}" if record.get("revision")
                else "revision unknown: not found in the Hugging Face cache at start-up")
    return f"timm's pretrained weights {record['name']} (Hugging Face {record['hf_hub_id']}, {revision})"


def without_local_paths(value: Any) -> Any:
    """`value` (a config, nested) with each absolute path or path under the user's home cut to its last component."""
    if isinstance(value, dict):
        return {key: without_local_paths(item) for key, item in value.items()}
    if isinstance(value, list):
        return [without_local_paths(item) for item in value]
    home = os.path.expanduser("~")
    if isinstance(value, str) and (os.path.isabs(value) or value.startswith("~")
                                   or (len(home) > 1 and value.startswith(home))):
        return Path(value).name or "<local path>"
    return value


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


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    setup_logging(0, "INFO")
    for noisy in ("onnxscript", "onnx_ir", "timm"):  # INFO lines of the exporter and of the check's reload
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.check_batch < 1:
        raise UserError(f"--check-batch must be >= 1, got {args.check_batch}")
    checkpoint = Path(args.checkpoint)
    out = Path(args.output) if args.output else checkpoint.parent / f"{checkpoint.stem}{SUFFIXES[args.format]}"
    check_output(out, checkpoint, args.format)  # before any work: nothing at --output is lost
    trained = load_trained(args.checkpoint, args.ema)
    if hint := ema_hint(trained.source, trained.best_metric, args.ema):
        log.warning(hint)
    cfg = inference_config(trained, [("data.num_workers", 0), ("model.grad_checkpointing", False)])
    model = create_model(cfg.model, len(trained.class_names))
    load_weights(model, trained.weights, trained.source)
    model = model.eval().float()
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


if __name__ == "__main__":
    run_main(main, after_sigterm="run the same command again to export")
