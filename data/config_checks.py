"""What the data layer knows of its config keys, checked at load time with core's own checks (core/config_checks.py
runs what add_check registers: this module registers on import, which every module that builds data makes): the
auto-augment policy strings, the formats that hold a set of labels per image, and data.size_schedule's pairs."""

from __future__ import annotations

import re

from core.config import Config, DataConfig
from core.config_checks import add_check
from core.errors import UserError
from core.store import is_url


AUTO_AUGMENT_FORMS = ("rand-m<magnitude 0-10>[-n<ops>][-mstd<std>][-p<op probability>][-inc1] (e.g. "
                      "rand-m9-mstd0.5-inc1), "
                      "trivialaugment, "
                      "augmix[-m<severity 1-10>][-w<width>][-d<depth>], autoaugment, or \"\" for none")
AUTO_AUGMENT_OPTIONS = {"rand": {"m": 9.0, "n": 2.0, "mstd": 0.0, "p": 0.5, "inc": 0.0},
                        "augmix": {"m": 3.0, "w": 3.0, "d": -1.0},
                        "trivialaugment": {}, "autoaugment": {}}


def parse_auto_augment(text: str) -> tuple[str, dict[str, float]]:
    """timm-style policy string -> (policy, options with defaults); ("", {}) for none."""
    if not text:
        return "", {}
    name, *parts = text.split("-")
    if name not in AUTO_AUGMENT_OPTIONS:
        raise UserError(f"config key 'data.auto_augment' is {text!r}; use {AUTO_AUGMENT_FORMS}")
    options = dict(AUTO_AUGMENT_OPTIONS[name])
    for part in parts:
        match = re.fullmatch(r"(mstd|[a-z]+?)(\d+(?:\.\d*)?)", part)
        integer_only = match and match.group(1) not in ("mstd", "p")
        if not match or match.group(1) not in options or (integer_only and "." in match.group(2)):
            raise UserError(f"config key 'data.auto_augment' is {text!r}: cannot read {part!r}; use "
                            f"{AUTO_AUGMENT_FORMS}")
        options[match.group(1)] = float(match.group(2))
    if name == "rand" and not (options["m"] <= 10 and options["n"] >= 1 and options["p"] <= 1
                               and options["inc"] in (0, 1)):
        raise UserError(f"config key 'data.auto_augment' is {text!r}: rand needs m in 0-10, n >= 1, p in [0, 1] "
                        f"and inc 0 or 1")
    if name == "augmix" and not (1 <= options["m"] <= 10 and options["w"] >= 1):
        raise UserError(f"config key 'data.auto_augment' is {text!r}: augmix needs m in 1-10 and w >= 1")
    return name, options


MULTI_LABEL_FORMATS = ("listfile", "hf", "wds")  # the formats whose samples can carry a set of labels


def check_data_keys(cfg: Config) -> None:
    """data.auto_augment reads as a policy; data.multi_label names a format that can hold a set of labels; split names
    are not given beside data.val_fraction, which makes its own."""
    parse_auto_augment(cfg.data.auto_augment)
    if cfg.data.multi_label and cfg.data.name not in MULTI_LABEL_FORMATS:
        raise UserError(f"data.multi_label=true needs data.name {', '.join(MULTI_LABEL_FORMATS)}: data.name="
                        f"{cfg.data.name} gives each image one class (write a list file: path,labels with a|b)")
    check_split_names(cfg.data)
    check_size_schedule(cfg.data, cfg.train.epochs)
    check_root_url(cfg.data)


def check_split_names(data: DataConfig) -> None:
    """data.train_split and data.val_split are not read with data.val_fraction (its two sides are data.root's class
    folders, split in two): one given beside it is refused, not silently ignored."""
    named = [f"data.{key}={getattr(data, key)}" for key in ("train_split", "val_split")
             if getattr(data, key) != getattr(DataConfig, key)]
    if data.val_fraction and named:
        raise UserError(f"{' and '.join(named)} is not read with data.val_fraction={data.val_fraction}, which splits "
                        "data.root's class folders itself; remove the split name, or set data.val_fraction=0 to use "
                        "data.root's named splits")


def check_root_url(data: DataConfig) -> None:
    """data.root at a URL is read by the formats that can (wds: shards; imagefolder, listfile, hf: a local mirror,
    data/mirror.py) and refused by the others, never taken for a local folder named after the URL."""
    if not is_url(data.root) or data.name in ("wds", "dummy"):
        return
    if data.name == "digits":
        raise UserError(f"data.root={data.root}: data.name=digits writes its images into data.root, which must be a "
                        "local folder; give one (e.g. data.root=.cache/digits), or read images at a URL with "
                        "data.name=imagefolder")
    if data.root.startswith("pipe:"):
        raise UserError(f"data.root={data.root}: a pipe: command is read for WebDataset shards only (data.name=wds); "
                        "give an fsspec URL (s3://, gs://, ...) or a local folder")


SIZE_SCHEDULE_FORM = "[[epoch, size], ...] with epochs rising from 0, e.g. [[0, 64], [4, 80], [8, 96]]"


def check_size_schedule(data: DataConfig, epochs: int) -> None:
    """data.size_schedule: pairs whose epochs start at 0 and rise, each reached within train.epochs, sizes > 0 and
    no larger than data.img_size, where it ends (the size evaluation, the batch-size search and the model card
    read); never beside a pipeline file, whose size is its own."""
    schedule = data.size_schedule
    if not schedule:
        return
    where = f"config key 'data.size_schedule' is {schedule}"
    if not all(len(pair) == 2 for pair in schedule):
        raise UserError(f"{where}: use {SIZE_SCHEDULE_FORM}")
    starts, sizes = [start for start, _ in schedule], [size for _, size in schedule]
    if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
        raise UserError(f"{where}: its epochs must start at 0 and rise; use {SIZE_SCHEDULE_FORM}")
    if starts[-1] >= epochs:
        raise UserError(f"{where}: epoch {starts[-1]} is never trained (train.epochs={epochs}, the last epoch is "
                        f"{epochs - 1}); remove it or raise train.epochs")
    if sizes[-1] != data.img_size:
        raise UserError(f"{where}: it ends at {sizes[-1]} px and data.img_size is {data.img_size}; set "
                        f"data.img_size={sizes[-1]} (the last training size, which evaluation uses unless "
                        "data.val_img_size says otherwise)")
    if min(sizes) <= 0 or max(sizes) > data.img_size:
        raise UserError(f"{where}: every size must be > 0 and at most data.img_size={data.img_size}")
    if data.train_transform:
        raise UserError(f"{where} and data.train_transform={data.train_transform}, a pipeline file of its own "
                        "size: choose one")


add_check(check_data_keys)
