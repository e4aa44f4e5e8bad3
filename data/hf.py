"""Hugging Face datasets on disk, read map-style from memory-mapped Arrow files, offline.

data.root is a folder written by `save_to_disk` (a DatasetDict whose keys are the splits, or one
Dataset folder per split), or a folder of Parquet files (`<split>.parquet`, `<split>-*.parquet` or
`<split>/*.parquet`, which datasets converts once into its Arrow cache, HF_DATASETS_CACHE).
data.image_column holds the encoded image (an Image feature stored with its bytes, or a binary
column), decoded by decode_image in the DataLoader workers, or a file path (a string column, relative
to data.root); data.label_column is a ClassLabel (its names are the classes), integers, or strings (the
classes are their sorted names). A row without a label (null, or -1 in a ClassLabel) is an error naming
it; with data.skip_corrupt the training split leaves such rows out, counted in a warning. A split's ClassLabel is the
one its own Parquet files record (datasets reads every split of a repo with the card's or the first file's features,
so a split listing its class names in another order would be read by index), and its labels are mapped to the
training classes by name.
data.path_column names each image in predictions.csv (default: the file path stored, else `<split>[row]`).
Multi-label (data.multi_label=true): the label column is a list per row (Sequence(ClassLabel), lists of
integers or of class names); an empty list is an image with no labels.
Rows are read one at a time from the memory-mapped table: forked workers share its pages and turn
only the row they read into Python objects.

data.root=hf-hub:<org>/<name> (timm's hfds/<org>/<name>, fsspec's hf://datasets/<org>/<name> too) names a dataset
repo on the Hub: its snapshot at data.hf_revision (a commit; "" = main's), the card and the files it names for
data.hf_config, is put in the Hugging Face hub cache (HF_HOME, HF_HUB_CACHE) by rank 0 first and read from there by
`datasets.load_dataset`, which keeps its Arrow tables in HF_DATASETS_CACHE; HF_HUB_OFFLINE=1 or HF_DATASETS_OFFLINE=1
reads the cache only.
`load_dataset` by the repo's name cannot read the hub cache offline (datasets 5.2.0 then looks only for Arrow
tables it prepared itself: "Couldn't reach '<org>/<name>' on the Hub (OfflineModeIsEnabled)"), hence the folder.
Any other URL (s3://, gs://, ...) is a folder of Parquet or save_to_disk files, read from its local mirror
(data/mirror.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import albumentations as A
import numpy as np

from core.config import DataConfig
from core.dist import is_main, rank0_decides
from core.errors import UserError
from data.datasets import AugmentedDataset, decode_image, multi_hot, read_image, shared_labels

log = logging.getLogger(__name__)


def open_split(root: Path, split: str) -> tuple[Any, list[str]]:
    """The split's datasets.Dataset, never from the network, and the Parquet files it was read from (none for a
    save_to_disk folder, whose splits keep their own features)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets reads its config
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    for folder in (root, root / split):
        if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
            loaded = datasets.load_from_disk(str(folder))
            if not isinstance(loaded, datasets.DatasetDict):
                return loaded, []
            if split not in loaded:
                raise UserError(f"Hugging Face dataset {folder} has no split {split!r} (it has "
                                f"{', '.join(loaded)}); set data.train_split / data.val_split")
            return loaded[split], []
    files = sorted({*root.glob(f"{split}.parquet"), *root.glob(f"{split}-*.parquet"), *root.glob(f"{split}/*.parquet")})
    if not files:
        raise UserError(f"no Hugging Face dataset for split {split!r} in {root}: expected a save_to_disk folder "
                        f"(dataset_dict.json) or {split}.parquet files; set data.root and the split names")
    try:
        names = [str(f) for f in files]
        return datasets.load_dataset("parquet", data_files={split: names}, split=split), names
    except Exception as err:  # pyarrow and datasets raise many types for a file that is not Parquet
        raise UserError(f"cannot read the Parquet files of split {split!r} in {root} ({err}); check them") from None


HUB_PREFIXES = ("hf-hub:", "hfds/", "hf://datasets/")  # hfds/: timm's --dataset spelling; hf://: fsspec's
COMMIT = re.compile(r"[0-9a-f]{40}")
TRUE = ("1", "ON", "YES", "TRUE")


def hub_repo(root: str) -> str:
    """The Hub dataset repo data.root names (hf-hub:<org>/<name>, hfds/<org>/<name>), or "" for a local folder."""
    for prefix in HUB_PREFIXES:
        if str(root).startswith(prefix):
            return checked_repo(str(root)[len(prefix):], str(root), prefix)
    return ""


def checked_repo(repo: str, root: str, prefix: str) -> str:
    """`repo` if the Hub could hold it; a malformed one (huggingface_hub's HFValidationError) refused in one line."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    name, at, revision = repo.partition("@")
    if at:
        raise UserError(f"data.root={root}: a dataset's revision is not part of its name; write "
                        f"data.root={prefix}{name} data.hf_revision=<commit> (40 hex digits), or leave "
                        "data.hf_revision unset for main's")
    try:
        validate_repo_id(repo)
    except HFValidationError:
        raise UserError(f"data.root={root} does not name a Hugging Face dataset repo; write {prefix}<org>/<name> "
                        "(letters, digits, '-', '_' and '.', one '/'), or give a local folder") from None
    return repo


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (read by huggingface_hub at import) or HF_DATASETS_OFFLINE: the cache only, no network."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_DATASETS_OFFLINE", "").upper() in TRUE


def hub_snapshot(repo: str, revision: str, config: str = "") -> Path:
    """The repo's snapshot folder in the hub cache, named by its commit, holding the files data.hf_config needs:
    downloaded, or the cache's when offline."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    if revision and not COMMIT.fullmatch(revision):
        raise UserError(f"data.hf_revision={revision} is not a commit; give the dataset repo's commit (40 hex digits, "
                        f"the Hub's 'History' tab) or leave it unset for main's")
    at, offline = f" at commit {revision}" if revision else "", hub_offline()
    try:
        revision, patterns = card_files(repo, revision, config, offline)
        return Path(snapshot_download(repo, repo_type="dataset", revision=revision or None, allow_patterns=patterns,
                                      local_files_only=offline))
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set" if offline else "the Hub cannot be reached"
        raise UserError(f"Hugging Face dataset {repo}{at} is not in the cache {constants.HF_HUB_CACHE} and {why}; "
                        "download it once online, or point HF_HOME/HF_HUB_CACHE at a cache that holds it") from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:
        raise UserError(f"Hugging Face dataset {repo}{at}: {type(err).__name__} (a private or gated repo needs "
                        "`hf auth login`); check data.root and data.hf_revision") from None


def card_files(repo: str, revision: str, config: str, offline: bool) -> tuple[str, list[str] | None]:
    """(the commit the dataset card was read at, the file patterns its config `config` names, "" = the default
    one): a repo of many configs is not downloaded whole. No card, or no files named: the revision asked, None
    (every file: datasets then finds the splits by the files' names)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError  # LocalEntryNotFoundError too: snapshot_download says

    try:
        card = Path(hf_hub_download(repo, "README.md", repo_type="dataset", revision=revision or None,
                                    local_files_only=offline))
    except EntryNotFoundError:
        return revision, None
    patterns = split_patterns(card, repo, config)
    if not patterns:
        return card.parent.name, None
    return card.parent.name, ["README.md", ".huggingface.yaml", *(p for each in patterns.values() for p in each)]


def split_patterns(card: Path, repo: str, config: str) -> dict[str, list[str]]:
    """The file patterns of each split the card's config `config` ("" = the default one) names ({}: none named);
    a card whose YAML header does not read is refused in one line (was the YAML parser's traceback)."""
    import yaml
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    try:
        configs = MetadataConfigs.from_dataset_card_data(DatasetCard.load(card).data)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)  # a line of the header, which starts on the card's line 2
        problem = f"line {mark.line + 2}: {err.problem}" if mark else " ".join(str(err).split())
        raise UserError(f"Hugging Face dataset {repo}: its dataset card {card} has a YAML header (between the --- "
                        f"lines) that does not read ({problem}); fix the card in the repo, or choose a commit whose "
                        "card reads with data.hf_revision") from None
    default = next((name for name, c in configs.items() if c.get("default")), "default")
    chosen = configs.get(config or default) or {}
    files = chosen.get("data_files") or ([f"{chosen['data_dir']}/*"] if chosen.get("data_dir") else [])
    patterns: dict[str, list[str]] = {}
    for entry in files if isinstance(files, list) else [files]:
        split, paths = (entry["split"], entry["path"]) if isinstance(entry, dict) else ("train", entry)
        patterns.setdefault(split, []).extend([paths] if isinstance(paths, str) else paths)
    return patterns


def open_hub_split(folder: Path, repo: str, config: str, split: str) -> tuple[Any, list[str]]:
    """One split of the snapshot, as datasets.load_dataset reads it (its Arrow tables kept in HF_DATASETS_CACHE), and
    the data files it was read from."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        builder = datasets.load_dataset_builder(str(folder), name=config or None)
        builder.download_and_prepare()
        ds = builder.as_dataset(split=split)
    except (ValueError, FileNotFoundError) as err:  # an unknown config or split; data files the snapshot lacks
        missing = missing_splits(folder, repo, config)
        if missing or isinstance(err, FileNotFoundError):
            named = f"split(s) {', '.join(missing)} ({', '.join(missing.values())})" if missing else "its splits"
            raise UserError(f"Hugging Face dataset {repo} at commit {folder.name}: the hub cache holds no files of "
                            f"{named} in {folder}; download the dataset again with the network reachable "
                            "(HF_HUB_OFFLINE unset), or point HF_HOME/HF_HUB_CACHE at a cache that holds them") from None
        raise UserError(f"Hugging Face dataset {repo}: {err}; set data.hf_config, data.train_split and "
                        "data.val_split") from None
    return ds, [str(f) for f in (builder.config.data_files or {}).get(split, [])]


def recorded_labels(files: list[str], label_column: str, where: str):
    """The label column's ClassLabel as the split's own Parquet files record it (datasets' `huggingface` schema
    metadata), None if they record none: datasets reads every split with the card's or the first file's features, so
    a split whose ClassLabel names its classes in another order would be read by index. Files of one split that
    disagree are refused."""
    import datasets
    import pyarrow.parquet as pq

    found: dict[str, Any] = {}
    for file in (f for f in files if f.endswith(".parquet")):
        try:
            features = json.loads((pq.read_schema(file).metadata or {})[b"huggingface"])["info"]["features"]
            feature = datasets.Features.from_dict({label_column: features[label_column]})[label_column]
        except (KeyError, TypeError, ValueError):
            continue  # no features recorded (a Parquet file not written by datasets)
        if class_names(feature):
            found[file] = feature
    orders = {tuple(class_names(feature)): file for file, feature in found.items()}
    if len(orders) > 1:
        shown = "; ".join(f"{Path(file).name}: {', '.join(names)}" for names, file in list(orders.items())[:2])
        raise UserError(f"{where}: its Parquet files name the classes of column {label_column!r} in different orders "
                        f"({shown}); write the split with one ClassLabel")
    return next(iter(found.values()), None)


def class_names(feature) -> list[str] | None:
    """A ClassLabel's names, or those of a list of ClassLabels (multi-label); None for any other feature."""
    return getattr(feature, "names", None) or getattr(getattr(feature, "feature", None), "names", None)


def missing_splits(folder: Path, repo: str, config: str) -> dict[str, str]:
    """{split: its patterns} of the splits the snapshot's card names and whose files the snapshot lacks."""
    card = folder / "README.md"
    patterns = split_patterns(card, repo, config) if card.is_file() else {}
    return {split: ", ".join(each) for split, each in patterns.items()
            if not any(next(folder.glob(pattern), None) for pattern in each)}


def hub_revision(cfg: DataConfig, resumed: dict | None = None) -> str:
    """data.hf_revision for config.yaml: with data.root=hf-hub:..., the commit every rank reads (unset: the resumed
    run's, else main's now), its snapshot put in the caches by rank 0 first."""
    repo = hub_repo(cfg.root)
    if cfg.name == "hf" and not repo and (cfg.hf_config or cfg.hf_revision):
        raise UserError(f"data.hf_config / data.hf_revision choose a dataset on the Hub, and data.root={cfg.root} is "
                        "a local folder; unset them, or set data.root=hf-hub:<org>/<name>")
    if cfg.name != "hf" or not repo:
        return cfg.hf_revision
    revision = cfg.hf_revision or ((resumed or {}).get("data") or {}).get("hf_revision", "")

    def fetch() -> str:
        folder = hub_snapshot(repo, revision, cfg.hf_config)
        for split in (cfg.train_split, cfg.val_split):
            open_hub_split(folder, repo, cfg.hf_config, split)
        return folder.name

    commit = rank0_decides(fetch)  # the others then read the cache (or fetch this commit on another node)
    if is_main():
        log.info("data.root=%s: Hugging Face dataset %s%s at commit %s (data.hf_revision)", cfg.root, repo,
                 f" config {cfg.hf_config}" if cfg.hf_config else "", commit)
    return commit


def column_type(feature) -> str:
    """A column's type in a word: a Value's dtype (int64, string, binary), or the feature's kind (ClassLabel, Image)."""
    import datasets

    if isinstance(feature, datasets.Value):
        return feature.dtype
    return "struct" if isinstance(feature, dict) else type(feature).__name__  # a struct is a plain dict of features


LABEL_TYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "string", "large_string")
IMAGE_TYPES = ("Image", "binary", "large_binary", "string", "large_string")
LIST_TYPES = ("List", "LargeList", "Sequence")  # a list of labels per row (multi-label)


def check_column_types(features, image_column: str, label_column: str, where: str, multi_label: bool = False) -> None:
    """Labels are class names, integers or a ClassLabel (multi-label: a list of them per row); images are an
    Image feature, bytes or file paths."""
    columns = ", ".join(f"{name} {column_type(feature)}" for name, feature in features.items())
    kind = column_type(features[label_column])
    if (kind in LIST_TYPES) != multi_label:
        need = "a list of labels per row (Sequence(ClassLabel))" if multi_label else "one label per row"
        raise UserError(f"{where}: data.label_column={label_column} is a column of {kind}, and data.multi_label="
                        f"{str(multi_label).lower()} needs {need}; set data.multi_label={str(not multi_label).lower()}"
                        " or name another column")
    if multi_label:
        kind = column_type(features[label_column].feature)
    if kind != "ClassLabel" and kind not in LABEL_TYPES:
        raise UserError(f"{where}: data.label_column={label_column} names a column of {kind}, not labels; name a "
                        f"column of class names, integers or a ClassLabel (columns: {columns})")
    kind = column_type(features[image_column])
    if kind not in IMAGE_TYPES:
        raise UserError(f"{where}: data.image_column={image_column} names a column of {kind}, not images; name a "
                        f"column of images, encoded image bytes or file paths (columns: {columns})")


def labelled_rows(ds, label_column: str, where: str, skip: bool, multi_label: bool = False) -> tuple[np.ndarray | None,
                                                                                                   np.ndarray]:
    """(the rows kept, None for all; their label column): a row without a label (null, or -1, which a ClassLabel
    uses for "no label") is an error naming it, or with `skip` (data.skip_corrupt) left out with a warning."""
    import pyarrow.compute as pc

    column = ds.with_format("arrow")[label_column]
    missing = pc.is_null(column).to_numpy(zero_copy_only=False)
    if column_type(ds.features[label_column]) == "ClassLabel":
        missing |= pc.equal(column, -1).fill_null(False).to_numpy(zero_copy_only=False)
    if not missing.any():
        return None, column if multi_label else column.to_numpy()
    rows = np.flatnonzero(missing)
    if not skip:
        more = f" (and {len(rows) - 1} more row(s))" if len(rows) > 1 else ""
        raise UserError(f"{where} row {rows[0]}{more} has no label (null, or -1 in a ClassLabel) in column "
                        f"{label_column!r}; give it its label, or remove it (data.skip_corrupt=true skips rows "
                        "without a label in training)")
    more = f", and {len(rows) - 10} more" if len(rows) > 10 else ""
    log.warning("data.skip_corrupt: %s: %d row(s) without a label skipped (rows %s%s)", where, len(rows),
                ", ".join(map(str, rows[:10])), more)
    kept = np.flatnonzero(~missing)
    column = column.filter(~missing)
    return kept, column if multi_label else column.to_numpy()  # in Arrow: numpy makes an int column with nulls float


def class_labels(column: np.ndarray, feature, where: str) -> tuple[list[str], np.ndarray]:
    """(class names, label indices) from a label column: ClassLabel names, integers, or strings."""
    names = getattr(feature, "names", None)
    if names:
        return list(names), column.astype(np.int64)
    if column.dtype.kind in "iu":
        if len(column) and column.min() < 0:
            raise UserError(f"{where}: labels must be >= 0, found {column.min()}")
        return [str(i) for i in range(int(column.max()) + 1 if len(column) else 0)], column.astype(np.int64)
    if column.dtype.kind in "OU":
        names = sorted({str(v) for v in column})
        position = {name: i for i, name in enumerate(names)}
        return names, np.asarray([position[str(v)] for v in column], dtype=np.int64)
    raise UserError(f"{where}: the label column holds {column.dtype}; use class names, integers or a ClassLabel")


def label_sets(column, feature, where: str) -> tuple[list[str], list[list[int]]]:
    """(class names, each row's label indices) from a column of label lists (data.multi_label)."""
    flat = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    offsets = flat.offsets.to_numpy()
    own, values = class_labels(flat.values.to_numpy(zero_copy_only=False), feature.feature, where)
    return own, [sorted(set(values[start:stop].tolist())) for start, stop in zip(offsets[:-1], offsets[1:])]


class HFDataset(AugmentedDataset):
    """One split of a Hugging Face dataset on disk, in its row order."""

    def __init__(self, root: str | Path, split: str, transform: A.Compose, seed: int,
                 classes: list[str] | None = None, *, image_column: str = "image", label_column: str = "label",
                 path_column: str = "", skip_corrupt: bool = False,
                 max_pixels: int = DataConfig.max_image_pixels, multi_label: bool = False, hf_config: str = "",
                 hf_revision: str = "") -> None:
        super().__init__(transform, seed)
        import datasets

        self.split, self.skip_corrupt, self.max_pixels = split, skip_corrupt, max_pixels
        self.where = f"Hugging Face dataset {root} split {split}"
        if repo := hub_repo(str(root)):
            self.root = hub_snapshot(repo, hf_revision, hf_config)  # a column's file paths: in the snapshot
            ds, files = open_hub_split(self.root, repo, hf_config, split)
        else:
            self.root = Path(root)
            ds, files = open_split(self.root, split)
        for key, column in (("image", image_column), ("label", label_column), ("path", path_column)):
            if column and column not in ds.column_names:
                raise UserError(f"{self.where} has no column {column!r} (data.{key}_column); it has "
                                f"{', '.join(ds.column_names)}")
        check_column_types(ds.features, image_column, label_column, self.where, multi_label)
        self.rows, column = labelled_rows(ds, label_column, self.where, skip_corrupt, multi_label)
        feature = recorded_labels(files, label_column, self.where) or ds.features[label_column]  # mapped by name
        if multi_label:
            own, sets = label_sets(column, feature, self.where)
            self.classes = classes if classes is not None else own
            self.labels = multi_hot(sets, own, self.classes, self.where)
        else:
            own, labels = class_labels(column, feature, self.where)
            self.classes = classes if classes is not None else own
            self.labels = shared_labels(labels, own, self.classes, self.where)
        keep = [image_column] + ([path_column] if path_column else [])
        ds = ds.select_columns(keep)
        if isinstance(ds.features[image_column], datasets.Image):
            ds = ds.cast_column(image_column, datasets.Image(decode=False))  # bytes, not PIL images
        self.ds, self.image_column, self.path_column = ds, image_column, path_column

    def row(self, index: int) -> int:
        """The table row of sample `index` (rows without a label may have been left out)."""
        return index if self.rows is None else int(self.rows[index])

    def stored(self, index: int) -> tuple[bytes | None, str | None]:
        """The image's bytes (None: only a file path was stored) and its stored file path."""
        value = self.ds[self.row(index)][self.image_column]
        if isinstance(value, dict):
            return value.get("bytes"), value.get("path")
        if isinstance(value, str):  # a column of file paths, relative to data.root
            return None, str(self.root / value)
        return value, None

    def load_image(self, index: int) -> np.ndarray:
        data, path = self.stored(index)
        if data is None and path:
            return read_image(path, self.max_pixels)
        return decode_image(data or b"", f"{self.path(index)} ({self.where} row {self.row(index)})", self.max_pixels)

    def path(self, index: int) -> str:
        if self.path_column:
            return str(self.ds[self.row(index)][self.path_column])
        return self.stored(index)[1] or f"{self.split}[{self.row(index)}]"
