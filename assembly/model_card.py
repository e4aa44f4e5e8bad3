"""The model card (README.md) of an exported model folder: what the weights are, what they were trained and
chosen on, how well they did, and what they are not for; no local path leaks into it."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import albumentations as A
import yaml
from torch import nn

from core.config import Config
from data.pipeline import REPLACED_KEYS, copy_name, file_sha256, load_pipeline
from data.transforms import eval_size
from engine.checkpoint.inference import Trained

log = logging.getLogger(__name__)
MODEL_CARD = "README.md"  # a model folder's card: what the Hugging Face Hub shows for it
CARD_MARK = "<!-- model card written by export.py"  # how a later export knows the card is its own
CLASSES_SHOWN = 20  # class names listed in the card (all of them are in config.json)


def model_card(cfg: Config, trained: Trained, model: nn.Module, name: str, file: str | None = None) -> str:
    """The folder's README.md by timm's own card writer (generate_readme, as its push_to_hf_hub uses): the Hub's
    header, what the model was trained on and from, the metrics its checkpoint records of these weights and how far
    to trust them, preprocessing (`file`: the folder's eval pipeline file, the run's), usage and limitations; then
    the training config without local paths."""
    from timm.models._hub import generate_readme

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
        "Preprocessing": preprocessing(cfg, file),
    }
    scores = "sigmoid()" if trained.multi_label else "softmax(-1)"
    usage = ("```python\nimport timm\nfrom PIL import Image\n\n"
             f'model = timm.create_model("hf-hub:<user>/{name}", pretrained=True).eval()  # or "local-dir:{name}"\n'
             "transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))\n"
             f'scores = model(transform(Image.open("photo.jpg").convert("RGB")).unsqueeze(0)).{scores}\n'
             'labels = model.pretrained_cfg["label_names"]\n```\n')
    if file:
        usage = pipeline_usage(name, file, scores)
    card = {"tags": ["image-classification", "timm"], "license": "other", "details": details, "usage": usage,
            "description": f"A timm {arch} {trained_how} with the image classification reference trainer "
                           f"(export.py wrote this folder). {selection_note(trained)} `license: other` above is a "
                           "placeholder: set the license of these weights (and of any weights they started from) "
                           "before publishing."}
    title = f"{arch} {trained_how} on {data_set_name(data)} ({len(classes)} classes)"
    config = yaml.safe_dump(without_local_paths(card_config(trained.config)), sort_keys=False) if trained.config \
        else "{}\n"
    augmentation = augmentation_section(data, Path(trained.source.split(" ", 1)[-1]).parent)
    return (f"{generate_readme(card, title)}\n{limitations(trained, len(classes))}\n{augmentation}"
            "## Training config\n\n"
            "The run's resolved config (its config.yaml), with each local path cut to its last component (`<local "
            f"path>` where it has none):\n\n```yaml\n{config}```\n\n"
            f"{CARD_MARK} from {Path(trained.source.split(' ', 1)[-1]).name}; export again to rewrite it -->\n")


def card_config(config: dict[str, Any]) -> dict[str, Any]:
    """The training config the card shows: without the preset's augmentation keys a pipeline file replaced (they
    did nothing; the card's augmentation section says what the file did)."""
    data = config.get("data", {})
    if not data.get("train_transform"):
        return config
    return {**config, "data": {key: value for key, value in data.items() if key not in REPLACED_KEYS}}


def augmentation_section(data: dict[str, Any], folder: Path) -> str:
    """What a data.train_transform file did, by albumentations' own serialization (A.to_dict) of the run folder's
    copy (or the file named, when its sha256 is the one the run recorded); "" without a file."""
    if not (path := data.get("train_transform")):
        return ""
    digest = data.get("train_transform_sha256", "")
    replaced = ", ".join(f"`data.{key}`" for key in REPLACED_KEYS)
    head = (f"## Training augmentation\n\nThe albumentations pipeline file `{Path(path).name}` (data.train_transform, "
            f"sha256 {digest or 'not recorded'}) replaced the preset's {replaced}, left out of the config below")
    candidates = [folder / copy_name("train", path), Path(path)]
    found = next((file for file in candidates if file.is_file() and file_sha256(str(file), "data.train_transform")
                  == digest), None)
    if found is None:
        return f"{head}; the file was not found beside the checkpoint, so its transforms are not listed here.\n\n"
    serialized = json.loads(json.dumps(A.to_dict(load_pipeline(str(found), "data.train_transform"))["transform"]))
    return (f"{head}. Its transforms, as albumentations serializes them (`A.to_dict`):\n\n```yaml\n"
            f"{yaml.safe_dump(serialized, sort_keys=False)}```\n\n")


def preprocessing(cfg: Config, file: str | None) -> dict[str, str]:
    """What the model expects of an image: the run's eval pipeline file (`file`, in the folder), or the preset's
    resize and centre crop; then the normalization."""
    size, crop_pct = eval_size(cfg.data)
    normalize = f"mean {list(cfg.data.mean)}, std {list(cfg.data.std)} (RGB, 0-1)"
    if file:
        steps = " -> ".join(" ".join(repr(step).split()) for step in load_pipeline(cfg.data.eval_transform,
                                                                                   "data.eval_transform").transforms)
        return {"pipeline": f"the albumentations pipeline {file} in this folder (the run's data.eval_transform, "
                            f"sha256 {cfg.data.eval_transform_sha256}; A.load reads it): {steps}; it ends at "
                            f"{size} x {size} uint8 RGB", "normalize": normalize}
    return {"resize": f"short side to {math.floor(size / crop_pct)} px ({cfg.data.interpolation}), "
                      f"centre crop {size} x {size} (crop_pct {crop_pct})", "normalize": normalize}


def pipeline_usage(name: str, file: str, scores: str) -> str:
    """Usage code for a model whose eval pipeline is an albumentations file: timm's own transform would differ."""
    data_format = "yaml" if file.endswith(".yaml") else "json"
    return ("```python\nimport albumentations as A\nimport numpy as np\nimport timm\nimport torch\n"
            "from PIL import Image\n\n"
            f'model = timm.create_model("hf-hub:<user>/{name}", pretrained=True).eval()  # or "local-dir:{name}"\n'
            f'pipeline = A.load("{file}", data_format="{data_format}")  # this folder\'s {file}: the eval pipeline '
            "it was trained with (timm's create_transform would differ)\n"
            'image = pipeline(image=np.asarray(Image.open("photo.jpg").convert("RGB")))["image"]\n'
            "mean, std = (torch.tensor(model.pretrained_cfg[k]).view(3, 1, 1) for k in (\"mean\", \"std\"))\n"
            "x = (torch.from_numpy(image).permute(2, 0, 1).float() / 255 - mean) / std\n"
            f"scores = model(x.unsqueeze(0)).{scores}\n"
            'labels = model.pretrained_cfg["label_names"]\n```\n')


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
    if data.get("val_fraction"):
        return (f"{sizes['train']} training and {sizes['val']} validation images: data.val_fraction="
                f"{data['val_fraction']} of each class (data.split_seed={data.get('split_seed', 0)}), listed in the "
                "run folder's train.txt and val.txt")
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
