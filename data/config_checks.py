"""What the data layer knows of its config keys, checked at load time with core's own checks (core/config_checks.py
runs what add_check registers: this module registers on import, which every module that builds data makes): the
auto-augment policy strings and the formats that hold a set of labels per image."""

from __future__ import annotations

import re

from core.config import Config, DataConfig
from core.config_checks import add_check
from core.errors import UserError


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


def check_split_names(data: DataConfig) -> None:
    """data.train_split and data.val_split are not read with data.val_fraction (its two sides are data.root's class
    folders, split in two): one given beside it is refused, not silently ignored."""
    named = [f"data.{key}={getattr(data, key)}" for key in ("train_split", "val_split")
             if getattr(data, key) != getattr(DataConfig, key)]
    if data.val_fraction and named:
        raise UserError(f"{' and '.join(named)} is not read with data.val_fraction={data.val_fraction}, which splits "
                        "data.root's class folders itself; remove the split name, or set data.val_fraction=0 to use "
                        "data.root's named splits")


add_check(check_data_keys)
