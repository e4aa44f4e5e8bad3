"""Build the network: any timm model, optionally with synchronized BN.

Weights come from a state dict the caller read (model.init_from, a checkpoint) or, for a fresh run with
model.pretrained=true only, from timm's own pretrained loading through the Hugging Face cache (HF_HOME,
HF_HUB_OFFLINE honoured); every other build (evaluate, predict, export, resume) asks for no weights at all.
"""

from __future__ import annotations

import difflib
import json
import logging
import re
from pathlib import Path
from typing import Any

import timm
import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
from safetensors import SafetensorError
from torch import nn

from core.config import DataConfig, ModelConfig
from core.errors import UserError
from models.freeze import freeze_backbone

log = logging.getLogger(__name__)


HUB_PREFIX = "hf-hub:"  # timm's prefix for a Hugging Face Hub repository id


def check_model_name(name: str, key: str = "model.name") -> None:
    """Fail fast, with close timm names, instead of timm's long traceback."""
    if name.startswith(HUB_PREFIX):
        check_hub_config(name, key)  # timm reads the architecture from the repository's config.json
        return
    if local := local_path_of(name):
        weights = ("distill.teacher_weights" if key.startswith("distill.") else "model.init_from") + f"={local}"
        raise UserError(f"{key}={name} names local weights, not a timm model; set {weights}"
                        f"{'' if key.startswith('distill.') else ' (with model.pretrained=false)'} and {key} to the "
                        "timm architecture they are for")
    if "/" in name:  # timm's own rule: a repository id needs its prefix
        raise UserError(f"{key} {name!r} looks like a Hugging Face Hub id; write {key}={HUB_PREFIX}{name}")
    arch = name.split(".")[0]  # "resnet50.a1_in1k" names a pretrained tag of "resnet50"
    known = timm.list_models()
    if arch in known:
        return
    close = difflib.get_close_matches(arch, known, n=5, cutoff=0.6) or timm.list_models(f"*{arch[:5]}*")[:5]
    hint = f"; did you mean: {', '.join(close)}?" if close else "; see timm.list_models()"
    raise UserError(f"unknown {key} {name!r}{hint}")


def hub_config_file(name: str) -> str:
    """The cached config.json of the hf-hub: repository `name` (fetched into the cache as timm does)."""
    try:
        return timm.models._hub.download_from_hf(name[len(HUB_PREFIX):], "config.json")
    except (OSError, EntryNotFoundError, ValueError) as err:
        raise hub_error(name, err) from None


def check_hub_config(name: str, key: str = "model.name") -> None:
    """The repository's config.json names one architecture timm knows (timm raised KeyError, AttributeError or
    'Unknown model' otherwise): one line naming the file."""
    file = hub_config_file(name)
    try:
        arch = json.loads(Path(file).read_text(encoding="utf-8")).get("architecture")
    except (OSError, ValueError, AttributeError) as err:
        raise UserError(f"{key}={name}: {file} is not a timm config.json ({err}); check {key}") from None
    if arch is None:
        why = "has no 'architecture' (the timm model its weights are for)"
    elif not isinstance(arch, str):
        why = f"gives 'architecture' as {type(arch).__name__} {arch!r}, not one timm model name"
    elif not timm.is_model(arch):
        why = f"names architecture {arch!r}, which timm {timm.__version__} does not know"
    else:
        return
    raise UserError(f"{key}={name}: the repository's {file} {why}; check {key}, or fix that file (timm's "
                    "push_to_hf_hub writes it)")


def local_path_of(name: str) -> str | None:
    """The file or folder a model.name names when it is a local path (timm's local-dir: prefix, an absolute or
    relative path, a weights file), else None: those are model.init_from's, not a Hub id."""
    if name.startswith("local-dir:"):
        return name[len("local-dir:"):]
    if name.startswith(("/", "./", "../", "~")) or name.endswith((".safetensors", ".pth", ".pt", ".bin")):
        return name
    return name if "/" in name and Path(name).exists() else None


def create_model(cfg: ModelConfig, num_classes: int, weights: dict[str, torch.Tensor] | None = None,
                 source: str = "", from_hub: bool = False) -> nn.Module:
    """A timm model with `num_classes` outputs: fresh, started from `weights` (a state dict read from `source`), or
    (from_hub) from timm's pretrained weights of cfg.name, by timm's own pretrained loading. Only from_hub may
    download; train.py asks for it on a fresh run with model.pretrained=true, rank 0 first."""
    check_model_name(cfg.name)
    kwargs = dict(num_classes=num_classes, drop_rate=cfg.drop_rate)
    if cfg.drop_path_rate > 0:
        kwargs["drop_path_rate"] = cfg.drop_path_rate
    kwargs.update(cfg.kwargs)
    if weights:  # never empty: timm would fall back to its hub or URL
        kwargs["pretrained_cfg_overlay"] = local_pretrained_cfg(cfg.name, weights)
    model, missing = timm_create(cfg.name, bool(weights) or from_hub, from_hub, source, kwargs)
    if from_hub:
        check_hub_load(model, cfg.name, missing)
    if not (weights or from_hub):
        fresh_init(model, cfg)
    elif cfg.head_init_std > 0 and not classifier_was_loaded(model, num_classes, weights, cfg.name):
        init_head(model, cfg.head_init_std, cfg.name)  # the classifier timm re-made for num_classes
    for name in ("pretrained_cfg", "default_cfg"):  # timm keeps the overlay: drop its reference to the weights
        if isinstance(getattr(model, name, None), dict):
            getattr(model, name).pop("state_dict", None)
    if cfg.grad_checkpointing:
        try:
            model.set_grad_checkpointing(True)
        except (AttributeError, AssertionError, NotImplementedError) as err:
            raise UserError(f"model {cfg.name!r} does not support gradient checkpointing ({err or 'timm says no'}); "
                            "set model.grad_checkpointing=false") from None
    return model


class MissingKeys(logging.Filter):
    """Collects the tensors timm's pretrained load left at their init (timm loads non-strictly when the class count
    changes and names the missing keys only in load_pretrained's INFO line "Missing keys (...)"), and keeps timm's
    per-key lines below ERROR quiet: check_pretrained / train.py report the load."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if match := re.match(r"Missing keys \((.*)\) discovered", record.getMessage()):
            self.keys += [key for key in match.group(1).split(", ") if key]
        return record.levelno >= logging.ERROR


def fixed_input_size(model: nn.Module) -> tuple[int, int] | None:
    """The one input size a model takes (timm's PatchEmbed with a strict size: ViT, DeiT, Mixer...), else None."""
    from timm.layers import PatchEmbed

    for module in model.modules():
        if isinstance(module, PatchEmbed) and module.strict_img_size and module.img_size is not None:
            return tuple(module.img_size)
    return None


def sizes_fed(data: DataConfig, training: bool = True) -> dict[str, set[int]]:
    """The input sizes a run feeds the model, by the key that sets them (evaluation: the eval size alone)."""
    fed = {"data.val_img_size": {data.val_img_size or data.img_size}}
    if training:
        fed = {"data.img_size": {data.img_size}, "data.size_schedule": {size for _, size in data.size_schedule},
               **fed}
    return {key: sizes for key, sizes in fed.items() if sizes}


def check_input_sizes(model: nn.Module, cfg: ModelConfig, fed: dict[str, set[int]], all_ranks: bool = True) -> None:
    """A model of one input size fed others (sizes_fed) is refused in one line before the first batch, not by
    timm's assertion inside it."""
    fixed = fixed_input_size(model)
    every = set().union(*fed.values())
    if fixed is None or {(size, size) for size in every} == {fixed}:
        return
    said = "; ".join(f"{key} gives {', '.join(map(str, sorted(sizes)))} px" for key, sizes in fed.items()
                     if {(size, size) for size in sizes} != {fixed})
    what = f"model.name={cfg.name} takes {fixed[0]}x{fixed[1]} images only (timm's patch embedding), but {said}"
    if "data.img_size" not in fed:
        do = f"evaluate at data.val_img_size={fixed[0]}"
    elif len(every) > 1:
        do = "set model.kwargs.dynamic_img_size=true (timm resamples its position embedding for each size)"
    else:
        do = (f"set model.kwargs.img_size={next(iter(every))} (timm builds the model for that size, resampling "
              f"pretrained position embeddings) or data.img_size={fixed[0]}")
    raise UserError(f"{what}; {do}", all_ranks=all_ranks)


def timm_create(name: str, pretrained: bool, from_hub: bool, source: str,
                kwargs: dict[str, Any]) -> tuple[nn.Module, list[str]]:
    """timm.create_model with its errors as one line each, and the keys its pretrained load left missing; its hub's
    lines about the file it chose stay quiet."""
    builder, hub = logging.getLogger("timm.models._builder"), logging.getLogger("timm.models._hub")
    saved = (builder.level, hub.level)
    missing = MissingKeys()
    builder.addFilter(missing)
    builder.setLevel(logging.INFO)  # its missing keys reach `missing`, which passes only errors on
    hub.setLevel(logging.ERROR)
    try:
        return timm.create_model(name, pretrained=pretrained, **kwargs), missing.keys
    except TypeError as err:  # e.g. drop_path_rate on a model without stochastic depth
        option = re.search(r"keyword argument '(\w+)'", str(err))
        if name.startswith(HUB_PREFIX) and option and option.group(1) not in kwargs:  # the repository's model_args
            raise UserError(f"model.name={name}: the repository's {hub_config_file(name)} gives model_args its "
                            f"architecture rejects ({err}); the option is in that file, not in your config: fix "
                            "the file or choose another repository") from None
        raise UserError(f"model {name!r} rejected its options ({err}); remove them from the model section") from None
    except AttributeError as err:  # an hf-hub config.json whose first_conv names no module of its architecture
        if not (from_hub and name.startswith(HUB_PREFIX)):
            raise
        raise UserError(f"model.name={name}: timm cannot load {cached_weights(name)} into the architecture the "
                        f"repository's {hub_config_file(name)} names ({err}); that file describes other weights "
                        "(architecture, pretrained_cfg.first_conv): check model.name, or fix the file") from None
    except (OSError, EntryNotFoundError) as err:  # the Hub or its cache: from_hub, or an hf-hub: name's config.json
        if not (from_hub or name.startswith(HUB_PREFIX)):
            raise
        if from_hub and (folder := weights_folder(name)):
            raise UserError(f"model.name={name}: the Hugging Face cache holds a folder, {folder}, where its weights "
                            f"file belongs; remove {hub_cache_folder(name)} and run again where the Hub can be "
                            "reached to download it afresh") from None
        raise hub_error(name, err) from None
    except SafetensorError as err:  # the cache's model.safetensors cut short, empty or not one (from_hub)
        if not from_hub:
            raise
        raise damaged_cache_error(name, err) from None
    except RuntimeError as err:  # load_state_dict: a tensor timm cannot adapt (another architecture's)
        raise UserError(f"{source or cached_weights(name)} does not fit model {name} "
                        f"({load_error_summary(str(err))}); is it a checkpoint of model.name?") from None
    finally:
        builder.removeFilter(missing)
        builder.setLevel(saved[0])
        hub.setLevel(saved[1])


def check_hub_load(model: nn.Module, name: str, missing: list[str]) -> None:
    """timm's weights of `name` left only the classifier at its init (re-made for another class count): any other
    missing tensor would train from random values, silently."""
    heads = (getattr(model, "pretrained_cfg", None) or {}).get("classifier") or ()
    heads = (heads,) if isinstance(heads, str) else tuple(heads)
    random = [key for key in missing if key.rpartition(".")[0] not in heads]
    if random:
        more = f", ... ({len(random)} in all)" if len(random) > 3 else ""
        raise UserError(f"model.name={name}: the pretrained weights {cached_weights(name)} lack "
                        f"{', '.join(random[:3])}{more}, which would train from random values (only the classifier "
                        f"may be missing); fetch the weights again (remove {hub_cache_folder(name)}) or choose "
                        "other weights")


def fresh_init(model: nn.Module, cfg: ModelConfig) -> None:
    """The init options a recipe's source drew with where timm 1.0 draws otherwise (a random start only)."""
    if cfg.conv_init:
        init_convs(model, cfg.conv_init)
    if cfg.cls_token_std > 0:
        init_cls_token(model, cfg.cls_token_std, cfg.name)
    if cfg.head_init_std > 0:
        init_head(model, cfg.head_init_std, cfg.name)


def init_convs(model: nn.Module, mode: str) -> None:
    """model.conv_init: NVIDIA's ResNet-50 draws each convolution kaiming_normal_(mode="fan_in", nonlinearity="relu")
    (models/common.py LayerBuilder.conv), where timm's ResNet uses fan_out: a stem std of 0.117 there, 0.025 here."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode=mode, nonlinearity="relu")


def init_cls_token(model: nn.Module, std: float, name: str) -> None:
    """model.cls_token_std: DeiT trained under timm 0.3.2, whose VisionTransformer drew its cls_token with
    trunc_normal_(std=.02); timm 1.0 draws normal(std=1e-6), a token that starts near zero."""
    token = getattr(model, "cls_token", None)
    if not isinstance(token, torch.Tensor):
        raise UserError(f"model.cls_token_std is set but model {name!r} has no cls_token; remove "
                        "model.cls_token_std (it is for ViT-family models)")
    with torch.no_grad():
        timm.layers.trunc_normal_(token, std=std)


def classifier_weight(model: nn.Module, name: str) -> tuple[str, torch.Tensor]:
    """(state-dict name, tensor) of the classifier's weight (timm's get_classifier()), else a UserError."""
    weight = getattr(model.get_classifier(), "weight", None)
    names = {id(param): key for key, param in model.named_parameters()}
    if not isinstance(weight, torch.Tensor) or id(weight) not in names:
        raise UserError(f"model.head_init_std is set but model {name!r} has no classifier weight to draw "
                        f"(get_classifier() is {type(model.get_classifier()).__name__}); remove model.head_init_std")
    return names[id(weight)], weight


def init_head(model: nn.Module, std: float, name: str) -> None:
    """model.head_init_std: MAE's main_finetune.py draws the fine-tuning head's weight with timm's
    trunc_normal_(std=2e-5) (cut at +-2, absolute), bias left at its init (0 in timm's ViT head), where timm's
    VisionTransformer draws trunc_normal(std=0.02). The last draw of a fresh build, so the rest stays timm's."""
    _, weight = classifier_weight(model, name)
    with torch.no_grad():
        timm.layers.trunc_normal_(weight, std=std)


def classifier_was_loaded(model: nn.Module, num_classes: int, weights: dict[str, torch.Tensor] | None,
                          name: str) -> bool:
    """Whether timm's pretrained load kept the weights' classifier (the same class count) rather than re-making
    it: for a local state dict, the classifier weight is the file's tensor; for timm's own weights (from_hub),
    timm's rule: the pretrained class count is num_classes (timm.models.load_pretrained drops it otherwise)."""
    key, weight = classifier_weight(model, name)
    if weights is not None:
        loaded = weights.get(key)
        return loaded is not None and loaded.shape == weight.shape and torch.equal(loaded.to(weight), weight.detach())
    pretrained = getattr(model, "pretrained_cfg", None) or {}
    return not pretrained.get("classifier") or pretrained.get("num_classes") == num_classes


def names_weights(name: str) -> bool:
    """Whether model.name names pretrained weights itself: a tag (resnet50.a1_in1k) or a Hub id (hf-hub:...)."""
    return name.startswith(HUB_PREFIX) or "." in name


def pretrained_cfg_of(cfg: ModelConfig) -> dict[str, Any] | None:
    """For a fresh run: timm's pretrained_cfg of the weights model.pretrained=true starts from (their preprocessing
    and where they live), None for a random start. A name that names weights without model.pretrained (or
    model.init_from) is refused: the run would start from random weights under a pretrained name."""
    if not cfg.pretrained:
        if names_weights(cfg.name) and not cfg.init_from:
            bare = "a bare timm name" if cfg.name.startswith(HUB_PREFIX) else f"model.name={cfg.name.split('.')[0]}"
            raise UserError(f"model.name={cfg.name} names pretrained weights but model.pretrained is false, so the run "
                            f"would start from random weights; set model.pretrained=true to start from them, or "
                            f"{bare} for a random start")
        return None
    check_model_name(cfg.name)
    if cfg.name.startswith(HUB_PREFIX):
        try:  # the repository's config.json, through the cache: what timm.create_model reads too
            pretrained_cfg, _, _ = timm.models.load_model_config_from_hf(cfg.name[len(HUB_PREFIX):])
        except (OSError, EntryNotFoundError, ValueError) as err:
            raise hub_error(cfg.name, err) from None
        return dict(pretrained_cfg)
    arch = cfg.name.split(".")[0]
    try:
        found = timm.models.get_pretrained_cfg(cfg.name)
    except RuntimeError as err:  # "Invalid pretrained tag (x) for resnet50."
        raise UserError(f"model.name={cfg.name}: {err} timm.list_pretrained('{arch}.*') lists its weights") from None
    if found is None or not (found.hf_hub_id or found.url):
        raise UserError(f"model.pretrained=true but timm has no pretrained weights for {cfg.name}; choose a model "
                        f"timm.list_pretrained() lists, or set model.pretrained=false")
    return found.to_dict()


HUB_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "open_clip_model.safetensors",
                    "open_clip_pytorch_model.bin")  # what timm's load_state_dict_from_hf reads, safetensors first


def hub_origin(name: str, pretrained_cfg: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a fresh model.pretrained=true run started from, for its checkpoints (the model card): timm's weights, their
    Hub repository and the commit the Hugging Face cache resolved for them (snapshots/<sha>/), read once the weights
    are in the cache; None without pretrained_cfg (another start)."""
    if pretrained_cfg is None:
        return None
    tag = pretrained_cfg.get("tag")
    named = name if "." in name or name.startswith(HUB_PREFIX) or not tag else f"{name}.{tag}"  # timm's default tag
    origin: dict[str, Any] = {"kind": "timm", "name": named}
    hub_id = pretrained_cfg.get("hf_hub_id") or (name[len(HUB_PREFIX):] if name.startswith(HUB_PREFIX) else None)
    if not hub_id:
        return {**origin, "url": pretrained_cfg.get("url")}  # torch.hub's cache keeps no revision
    repo, _, revision = hub_id.partition("@")
    origin.update(hf_hub_id=repo, revision=None, file=None)
    for file in HUB_WEIGHT_FILES:
        cached = try_to_load_from_cache(repo, file, revision=revision or None)
        if isinstance(cached, str):  # .../models--org--name/snapshots/<commit sha>/<file>
            origin.update(revision=Path(cached).parent.name, file=file)
            break
    return origin


def hub_error(name: str, err: Exception) -> UserError:
    """timm could not get the files of `name` (weights, an hf-hub: config.json) from the Hub or its cache: one line
    naming them, the cache folder and what to do."""
    default = None if name.startswith(HUB_PREFIX) else timm.models.get_pretrained_cfg(name)
    where = name[len(HUB_PREFIX):] if default is None else (default.hf_hub_id or default.url)
    cache = f"the Hugging Face cache {hub_constants.HF_HUB_CACHE}"
    if isinstance(err, LocalEntryNotFoundError):
        why = "HF_HUB_OFFLINE=1 forbids downloading them" if hub_constants.HF_HUB_OFFLINE else "the Hub is unreachable"
        return UserError(f"model.name={name}: its pretrained files ({where}) are not in {cache} and {why}; run once "
                         "where the Hub can be reached to fill the cache, or point HF_HOME at a cache that holds them "
                         "(model.init_from takes local weights, with model.pretrained=false)")
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return UserError(f"model.name={name}: cannot get its pretrained files ({where}) into {cache}: {first}; check "
                     "model.name (model.init_from takes local weights, with model.pretrained=false)")


def hub_repo(name: str, keep_revision: bool = False) -> str:
    """The Hub repository (no @revision unless kept) that holds timm's weights of `name`, "" for weights from a URL."""
    default = None if name.startswith(HUB_PREFIX) else timm.models.get_pretrained_cfg(name)
    repo = name[len(HUB_PREFIX):] if default is None else default.hf_hub_id or ""
    return repo if keep_revision else repo.partition("@")[0]


def cached_weights(name: str) -> str:
    """The cached file timm's weights of `name` were read from (what an error names), else a description of it."""
    repo = hub_repo(name)
    for file in HUB_WEIGHT_FILES:
        cached = try_to_load_from_cache(repo, file) if repo else None
        if isinstance(cached, str):
            return cached
    return f"model.safetensors of {repo or name}"


def hub_cache_folder(name: str) -> Path:
    """The Hugging Face cache's folder of the repository holding `name`'s weights (removing it fetches afresh)."""
    return Path(hub_constants.HF_HUB_CACHE) / f"models--{hub_repo(name).replace('/', '--')}"


def weights_folder(name: str) -> Path | None:
    """A folder where the cache's snapshot of `name` should hold its weights file (safetensors then fails with
    `No such device`), else None."""
    folder = hub_cache_folder(name)
    revision = hub_repo(name, keep_revision=True).partition("@")[2]
    ref = folder / "refs" / (revision or "main")
    snapshot = folder / "snapshots" / (ref.read_text().strip() if ref.is_file() else revision or "main")
    return next((snapshot / file for file in HUB_WEIGHT_FILES if (snapshot / file).is_dir()), None)

def damaged_cache_error(name: str, err: Exception) -> UserError:
    """The cached weights file of `name` cannot be read as safetensors (a cut download, a disk error): one line naming
    the file and how to fetch it again (removing the repository's cache folder; the blob would be re-linked else)."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return UserError(f"model.name={name}: the Hugging Face cache's copy of its weights, {cached_weights(name)}, is "
                     f"damaged ({first}); remove {hub_cache_folder(name)} and run again where the Hub can be reached "
                     "to download it afresh")


def load_error_summary(message: str) -> str:
    """torch's load_state_dict error (every key, on many lines) as "missing: a, b, c, ... (n in all); ..." """
    parts = []
    for label, pattern in (("missing", r"Missing key\(s\) in state_dict: (.*)"),
                           ("unexpected", r"Unexpected key\(s\) in state_dict: (.*)")):
        if match := re.search(pattern, message):
            names = re.findall(r'"([^"]+)"', match.group(1))
            more = f", ... ({len(names)} in all)" if len(names) > 3 else ""
            parts.append(f"{label}: {', '.join(names[:3])}{more}")
    resized = re.findall(r"size mismatch for ([^:]+): copying a param with shape (torch.Size\(\[[^]]*\]\)) from "
                         r"checkpoint, the shape in current model is (torch.Size\(\[[^]]*\]\))", message)
    if resized:
        more = f", ... ({len(resized)} in all)" if len(resized) > 3 else ""
        shown = ", ".join(f"{k}: file {a[11:-1]} vs model {b[11:-1]}" for k, a, b in resized[:3])
        parts.append(f"shape differs: {shown}{more}")
    return "; ".join(parts) or message.splitlines()[0]


def local_pretrained_cfg(name: str, weights: dict[str, torch.Tensor]) -> dict:
    """timm's pretrained_cfg overlay for a state dict from a local file.

    The class count and input channels are read from the file's own classifier and first convolution, so
    timm resets the classifier only for another class count and adapts the first convolution only for another
    in_chans; the weights are passed as the state dict itself (no hub, no URL, no second read of the file).
    """
    default = timm.models.get_pretrained_cfg(name)
    heads = default.classifier if default else None
    heads = (heads,) if isinstance(heads, str) else tuple(heads or ())
    head_weight = weights.get(f"{heads[0]}.weight") if heads else None
    conv = weights.get(f"{default.first_conv}.weight") if default and isinstance(default.first_conv, str) else None
    in_chans = int(conv.shape[1]) if conv is not None and conv.ndim == 4 else 3
    size = tuple(default.input_size[1:]) if default else (224, 224)
    return {"state_dict": weights, "num_classes": int(head_weight.shape[0]) if head_weight is not None else 0,
            "input_size": (in_chans, *size), "label_offset": 0, "hf_hub_id": None, "url": None, "file": None}


def compile_warning(cfg: ModelConfig, world_size: int) -> str | None:
    """Why torch.compile will disappoint with these settings, or None.

    A synchronized BatchNorm all-reduces inside its forward; torch.compile cannot trace that and breaks the
    graph at every BN layer (pytorch/pytorch#161302): with the DDP optimizer's own splits, little is left
    to fuse, and errors have been reported for the combination.
    """
    if cfg.compile and cfg.sync_bn and world_size > 1:
        return ("model.compile=true with model.sync_bn=true: torch.compile breaks the graph at every synchronized "
                "BatchNorm (pytorch/pytorch#161302), so expect little speed-up; with 32 or more images per "
                "process, model.sync_bn=false trains about as well and compiles whole")
    return None


def prepare_model(model: nn.Module, cfg: ModelConfig, device: torch.device, world_size: int) -> nn.Module:
    """SyncBN (several processes only), device placement and memory format, before DDP wraps it; model.freeze=backbone
    for the whole run here, so frozen parameters are in neither the optimizer (timm's parameter groups skip them) nor
    DDP's reducer (with model.freeze_epochs the backbone is frozen later: assembly/parts.py)."""
    if cfg.sync_bn and world_size > 1:
        from models.sync_bn import convert_sync_batchnorm

        model = convert_sync_batchnorm(model, device)
        log.info("BatchNorm layers synchronized across %d processes", world_size)
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.freeze == "backbone" and not cfg.freeze_epochs:
        freeze_backbone(model)
    return model
