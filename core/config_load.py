"""A Config from a YAML file and `key=value` overrides: YAML 1.2 booleans, duplicate keys refused, every leaf
coerced to its annotation, an unknown key answered with the closest valid one, then core.config_checks."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from core.config import Config
from core.config_checks import validate
from core.errors import UserError


CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class YamlLoader(yaml.SafeLoader):
    """SafeLoader reading plain scalars as YAML 1.2's core schema does (only true/false are booleans, so `amp: off`
    stays the string "off"; `010` is ten; `1:30` is text), and which refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # keys beside a `<<` merge override the merged ones: YAML's meaning, not a mistake
            key = self.construct_object(key_node)
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}, first on line {first_line[key] + 1}", key_node.start_mark)
            first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        """A YAML 1.2 core integer: `010` is ten, not octal 8 (YAML 1.1); octal is written `0o10`."""
        text = self.construct_scalar(node)
        sign, digits = (-1 if text[0] == "-" else 1), text.lstrip("+-")
        base = 16 if digits.startswith("0x") else 8 if digits.startswith("0o") else 10
        return sign * int(digits[2:] if base != 10 else digits, base)


# YAML 1.2 core schema for plain scalars: no yes/no/on/off booleans, no base-60 (`1:30` is text, not 90), no
# leading-zero octal, no `1_000`, no timestamps (`2026-11-27` stays text).
YAML11_ONLY = {"tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float",
               "tag:yaml.org,2002:timestamp"}
YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in YAML11_ONLY]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
YamlLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                 list("tTfF"))
YamlLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                                 list("-+0123456789"))
YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+.0123456789"))
YamlLoader.add_constructor("tag:yaml.org,2002:int", YamlLoader.construct_yaml_int)


def read_yaml(text: str) -> Any:
    """Parse YAML text with YamlLoader (plain data only, like yaml.safe_load)."""
    return yaml.load(text, Loader=YamlLoader)


def resolve_config_path(name: str) -> Path:
    """Accept a path, or a bare name (`resnet50`, `resnet50.yaml`) looked up in configs/."""
    if not name.strip():  # `--config ""`, `--config $UNSET`: would run on bare defaults
        raise UserError(f"--config is empty; give a YAML file, or one of configs/: {', '.join(known_configs())}")
    path = Path(name)
    if path.is_file():
        return path
    for candidate in (CONFIG_DIR / name, CONFIG_DIR / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    raise UserError(f"config file {name!r} not found (give a path, or one of configs/: {', '.join(known_configs())})")


def known_configs() -> list[str]:
    """The bare names --config finds in configs/."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def load_config(path: str | dict[str, Any] | None, overrides: list[str] = ()) -> Config:
    """Build the Config from defaults, then the YAML file (or a mapping of its sections in its place: a notebook's,
    assembly/api.py), then dotted `key=value` overrides."""
    raw: dict[str, Any] = {}
    if isinstance(path, dict):
        raw = copy.deepcopy(path)
    elif path is not None:
        file = resolve_config_path(path)
        try:
            raw = read_yaml(read_text(file)) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise UserError(f"{file}:{where} is not valid YAML ({getattr(err, 'problem', err)})") from None
        if not isinstance(raw, dict):
            raise UserError(f"{file}: expected a mapping of config sections, got {type(raw).__name__}")
    on_command_line = []
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
        on_command_line += dotted_keys({key: value}) if isinstance(value, dict) else [key]
    notes = implied_by_command_line(raw, on_command_line)
    cfg = config_from_dict(raw)
    cfg.from_command_line = frozenset(on_command_line)  # core/config.Config.from_command_line says why
    cfg.notes = notes
    return cfg


def implied_by_command_line(raw: dict[str, Any], on_command_line: list[str]) -> tuple[str, ...]:
    """A model.init_from given on the command line over a config file's model.pretrained: true (finetune.yaml's)
    starts from that file: model.pretrained becomes false, and a note says so. The command line is the user's latest
    word; a model.pretrained=true given there too is still refused with both named (core/config_checks.py)."""
    model = raw.get("model")
    if ("model.init_from" not in on_command_line or "model.pretrained" in on_command_line
            or not isinstance(model, dict) or not model.get("init_from") or model.get("pretrained") is not True):
        return ()
    model["pretrained"] = False
    return (f"model.pretrained=false: model.init_from={model['init_from']} on the command line names the starting "
            "weights, over the config file's model.pretrained: true",)


def read_text(file: Path) -> str:
    """The config file's text; a file that is not UTF-8 or cannot be read is named in one line."""
    try:
        data = file.read_bytes()
    except OSError as err:
        raise UserError(f"cannot read config file {file} ({err.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise UserError(f"config file {file} is not UTF-8 text (line {line}, byte 0x{data[err.start]:02x}); "
                        "save it as UTF-8") from None


def parse_override(item: str) -> tuple[str, Any]:
    """`optim.lr=0.2` -> ("optim.lr", 0.2); the value is read as YAML (numbers, lists, booleans).

    A value YAML would cut at a comment (`output_dir=runs/exp #1` -> `runs/exp`) or read through an anchor, alias
    or tag (`output_dir=&x y` -> `y`) stays the raw text: intact for a string key, refused by the type check for
    any other.
    """
    if "=" not in item:
        raise UserError(f"override {item!r} must look like key=value, e.g. optim.lr=0.2")
    key, text = item.split("=", 1)
    try:
        value = read_yaml(text) if text.strip() and not has_yaml_comment(text) and not has_yaml_node_marks(text) \
            else text
    except yaml.YAMLError:
        value = text
    return key.strip(), value


def has_yaml_comment(text: str) -> bool:
    """Whether YAML would drop part of text as a comment: a `#` outside every token."""
    if "#" not in text:
        return False
    spans = [(token.start_mark.index, token.end_mark.index) for token in yaml.scan(text, Loader=YamlLoader)]
    return any(char == "#" and not any(start <= i < end for start, end in spans) for i, char in enumerate(text))


def has_yaml_node_marks(text: str) -> bool:
    """Whether YAML would read text through an anchor (`&x`), an alias (`*x`) or a tag (`!x`): never what a
    command-line value means."""
    marks = (yaml.AnchorToken, yaml.AliasToken, yaml.TagToken)
    return any(isinstance(token, marks) for token in yaml.scan(text, Loader=YamlLoader))


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set raw["a"]["b"] = value for key "a.b", creating sections as needed; a mapping given for a section merges
    into it (merge_section)."""
    *sections, leaf = key.split(".")
    node = raw
    for section in sections:
        node = node.setdefault(section, {})
        if not isinstance(node, dict):
            raise UserError(f"override {key!r}: {section!r} is not a section")
    merge_section(node, leaf, value)


def merge_section(node: dict[str, Any], key: str, value: Any) -> None:
    """node[key] = value, except that a mapping given for a section sets only the keys it names (`data={img_size:
    48}` keeps the config file's hflip and mean, as OmegaConf's merge does); a mapping of free options
    (`model.kwargs`) is one value and replaces the one before it."""
    old = node.get(key)
    if not (isinstance(value, dict) and isinstance(old, dict)) or str(key).endswith("kwargs"):
        node[key] = value
        return
    for name, item in value.items():
        merge_section(old, name, item)


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Validate a plain dict (from YAML or a checkpoint) into a Config."""
    cfg = _build(Config, raw, prefix="")
    validate(cfg)
    cfg.given = frozenset(dotted_keys(raw))  # not a field: what the user set, for defaults resolved at start-up
    return cfg


def dotted_keys(raw: dict[str, Any], prefix: str = "") -> list[str]:
    """Every leaf key of a raw config dict, dotted ("data.mean"); mappings of free options count as leaves."""
    keys = []
    for key, value in raw.items():
        if isinstance(value, dict) and not key.endswith("kwargs"):
            keys += dotted_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise UserError(f"config key {prefix.rstrip('.') or '<root>'!r} must be a section (a mapping), got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in raw.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"; did you mean {prefix + close[0]!r}?" if close else f"; valid keys: {', '.join(names)}"
            raise UserError(f"unknown config key {prefix + str(key)!r}{hint}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            values[key] = _build(hint, value, prefix=f"{prefix}{key}.")
        else:
            values[key] = _coerce(f"{prefix}{key}", hint, value)
    return cls(**values)


# A number as YAML 1.2 writes it, in ASCII digits (what int keys take too): float() would also read `1_0` as 10 and
# other scripts' digits; nan and inf in any case are read so that the finite-number check names them.
FLOAT_TEXT = re.compile(r"[-+]?(?:(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|inf|infinity|nan)", re.IGNORECASE)


def _coerce(key: str, hint: Any, value: Any) -> Any:
    """Check one leaf value against its annotation; ints are accepted where floats are expected."""
    if isinstance(hint, types.UnionType) and type(None) in hint.__args__:  # `bool | None`: null = a library default
        (inner,) = [arg for arg in hint.__args__ if arg is not type(None)]
        if value is None:
            return None
        try:
            return _coerce(key, inner, value)
        except UserError as err:
            message = str(err).replace(f"must be {inner.__name__},", f"must be {inner.__name__} or null,")
            raise UserError(message) from None
    if hint == int | str:  # train.batch_size: a number, or a word (auto) that core/config_checks.py validates
        return value if isinstance(value, str) else _coerce(key, int, value)
    if isinstance(hint, types.UnionType):  # `str | list[float]`: a name, or a list (train.class_weights)
        named, listed = hint.__args__
        if isinstance(value, list):
            return _coerce(key, listed, value)
        try:
            return _coerce(key, named, value)
        except UserError as err:
            raise UserError(str(err).replace(f"must be {named.__name__},", f"must be {named.__name__} or a list,")) from None

    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if hint is float and isinstance(value, str) and FLOAT_TEXT.fullmatch(value):
        value = float(value)  # (PyYAML reads 1e-3, without a dot, as a string); float() alone takes 1_0 and ١٠
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"config key {key!r} must be a finite number, got {value!r}")
    if hint is str and isinstance(value, dict) and len(value) == 1 and None in value.values():
        value = f"{next(iter(value))}:"  # `data.root=hf-hub:` is, to YAML, the mapping {hf-hub: null}: the text typed
    if hint in (int, float, str, bool):
        if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
            return value
        raise UserError(f"config key {key!r} must be {hint.__name__}, got {value!r}")
    if typing.get_origin(hint) is dict:  # free options passed on to a library (timm): plain YAML data
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise UserError(f"config key {key!r} must be a mapping of names to values, e.g. "
                            f"{key}.img_size=224, got {value!r}")
        return {k: _yaml12_number(v) for k, v in value.items()}
    if typing.get_origin(hint) is list:
        (item_type,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise UserError(f"config key {key!r} must be a list of {item_type.__name__}, got {value!r}")
        return [_coerce(f"{key}[{i}]", item_type, v) for i, v in enumerate(value)]
    raise TypeError(f"unsupported annotation {hint} for {key}")


def _yaml12_number(value: Any) -> Any:
    """`1e-6` as YAML 1.2 reads it (a float); PyYAML, on YAML 1.1, leaves a float without a dot a string."""
    if isinstance(value, str) and re.fullmatch(r"[-+]?[0-9]+(\.[0-9]*)?[eE][-+]?[0-9]+", value):
        return float(value)
    return value
