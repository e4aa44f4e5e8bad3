"""data.root=hf-hub:<org>/<name>: a dataset repo in the Hugging Face hub cache's own layout, read offline through the
real huggingface_hub and datasets code (tests/conftest.py makes the session's HF_HUB_CACHE, offline).

The repo is written as the Hub's downloads leave it: datasets--<org>--<name>/refs/main holding the commit, and
snapshots/<commit>/ with the dataset card (README.md: features and split files) and Parquet files of PNG bytes.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from PIL import Image

from tests.helpers import TINY, run_on_ranks, train_here

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CARD = """---
dataset_info:
  features:
  - name: image
    dtype: image
  - name: label
    dtype:
      class_label:
        names:
          '0': cat
          '1': dog
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
  - split: validation
    path: data/validation-*
---
"""
# TINY's test_resnet on 16-pixel crops, two steps
HUB = [*TINY, 
    "data.name=hf", "data.val_split=validation", "train.batch_size=4", "train.max_steps=2"]


def png(value: int, rng: np.random.Generator) -> bytes:
    pixels = np.clip(value + rng.integers(-20, 20, (20, 20, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def write_hub_repo(cache: Path, repo: str, sizes: dict[str, int]) -> Path:
    """The hub cache's folder of dataset `repo` at COMMIT, main pointing at it; returns the snapshot folder."""
    folder = cache / f"datasets--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / COMMIT
    (snapshot / "data").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT)
    (snapshot / "README.md").write_text(CARD)
    rng = np.random.default_rng(0)
    for split, size in sizes.items():
        labels = [i % 2 for i in range(size)]
        images = [{"bytes": png(60 + 120 * label, rng), "path": f"{split}_{i}.png"} for i, label in enumerate(labels)]
        pq.write_table(pa.table({"image": images, "label": labels}),
                       snapshot / "data" / f"{split}-00000-of-00001.parquet")
    return snapshot


@pytest.fixture(scope="module")
def hub_repo() -> str:
    """org/tiny-hub in the session's hub cache (HF_HUB_CACHE, offline)."""
    from huggingface_hub import constants

    write_hub_repo(Path(constants.HF_HUB_CACHE), "org/tiny-hub", {"train": 16, "validation": 6})
    return "org/tiny-hub"


@pytest.fixture
def offline_datasets(tmp_path, monkeypatch) -> dict[str, str]:
    """HF_DATASETS_OFFLINE=1 and a fresh datasets Arrow cache, here and in the ranks' environment."""
    import datasets

    env = {"HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    return env


def recorded_revision(out: Path) -> str:
    return yaml.safe_load((out / "config.yaml").read_text())["data"]["hf_revision"]


@pytest.mark.slow
def test_hub_dataset_trains_on_one_and_two_ranks_and_evaluates(hub_repo, offline_datasets, tmp_path, capsys):
    """Both spellings read the cache's snapshot offline on 1 and 2 ranks; config.yaml records the cache's commit;
    evaluate.py reads the same commit back and scores every validation image."""
    one = tmp_path / "one"
    train_here(*HUB, f"data.root=hf-hub:{hub_repo}", f"output_dir={one}")
    assert recorded_revision(one) == COMMIT
    two = tmp_path / "two"
    run = run_on_ranks("train.py", *HUB, f"data.root=hfds/{hub_repo}", f"output_dir={two}", nproc=2,
                       env=offline_datasets)
    assert recorded_revision(two) == COMMIT
    assert torch.load(two / "best.pth", weights_only=True)["class_names"] == ["cat", "dog"]  # the ClassLabel's names
    assert f"Hugging Face dataset {hub_repo} at commit {COMMIT}" in run.stdout + run.stderr
    import evaluate
    from core.cli import report_errors

    capsys.readouterr()
    assert report_errors(evaluate.main, [str(two / "best.pth")]) == 0
    said = capsys.readouterr()
    assert "on 6 images" in said.out + said.err, said


def test_offline_and_uncached_is_one_line(hub_repo, offline_datasets, tmp_path, capsys):
    """A repo, or a commit, the cache does not hold: one line naming the dataset and the cache folder; a revision
    that is not a commit, or one for a local folder, is refused before any look-up."""
    import train
    from huggingface_hub import constants

    from core.cli import report_errors

    for root, revision, expected in (
            ("hf-hub:org/absent", "", f"Hugging Face dataset org/absent is not in the cache {constants.HF_HUB_CACHE}"),
            (f"hf-hub:{hub_repo}", "f" * 40, f"dataset {hub_repo} at commit {'f' * 40} is not in the cache"),
            (f"hf-hub:{hub_repo}", "main", "data.hf_revision=main is not a commit"),
            (str(tmp_path), COMMIT, f"data.root={tmp_path} is a local folder")):
        capsys.readouterr()
        args = [*HUB, f"data.root={root}", f"data.hf_revision={revision}", f"output_dir={tmp_path / 'run'}"]
        assert report_errors(train.main, args) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and expected in errors[0] and "Traceback" not in err, err
        assert not (tmp_path / "run").exists()


def test_the_recorded_commit_is_mains_and_a_resume_reads_it_after_main_moved(offline_datasets, tmp_path):
    """A fresh run without data.hf_revision records the commit main points at (config.yaml's data.hf_revision);
    a resume that does not give data.hf_revision reads that recorded commit again, though main has moved since."""
    import shutil

    from huggingface_hub import constants

    from assembly.start import resolve_start
    from core.config_load import load_config
    from core.dist import DistInfo
    from data.hf import card_files, hub_revision

    repo, moved = "org/moved-hub", "fedcba9876543210fedcba9876543210fedcba98"
    snapshot = write_hub_repo(Path(constants.HF_HUB_CACHE), repo, {"train": 4, "validation": 2})
    cfg = load_config("dummy", [*HUB[2:], f"data.root=hf-hub:{repo}", f"output_dir={tmp_path / 'run'}"])
    cfg, _, _ = resolve_start(cfg, DistInfo(0, 1, 0, 1, torch.device("cpu")))
    assert cfg.data.hf_revision == COMMIT
    shutil.copytree(snapshot, snapshot.parent / moved)
    (snapshot.parent.parent / "refs" / "main").write_text(moved)
    assert card_files(repo, "", "", offline=True)[0] == moved  # main's commit now
    unset = dataclasses.replace(cfg.data, hf_revision="")
    assert hub_revision(unset, {"data": {"hf_revision": COMMIT}}) == COMMIT


@pytest.mark.parametrize("root, expected", [
    ("hf-hub:../../etc", "data.root=hf-hub:../../etc does not name a Hugging Face dataset repo; write hf-hub:<org>/"),
    ("hf-hub:me/digits/x", "data.root=hf-hub:me/digits/x does not name a Hugging Face dataset repo"),
    ("hfds/me/digits/", "data.root=hfds/me/digits/ does not name a Hugging Face dataset repo; write hfds/<org>/<name>"),
    ("hf-hub:me/dig its", "data.root=hf-hub:me/dig its does not name a Hugging Face dataset repo"),
    ("hf-hub:", "data.root=hf-hub: does not name a Hugging Face dataset repo"),  # was "must be str, got {'hf-hub': None}"
    ("hf-hub:me/digits@main", "data.root=hf-hub:me/digits@main: a dataset's revision is not part of its name; write "
                              "data.root=hf-hub:me/digits data.hf_revision=<commit>"),
])
def test_a_malformed_hub_name_is_one_line(root, expected, tmp_path, capsys):
    """Was huggingface_hub's HFValidationError traceback; refused before any look-up."""
    import train
    from core.cli import report_errors

    from tests.helpers import last_error

    line = last_error(capsys, report_errors(train.main, [*HUB, f"data.root={root}", f"output_dir={tmp_path / 'run'}"]))
    assert line.startswith(f"error: {expected}"), line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("damage, expected", [
    ("no data files", "the hub cache holds no files of split(s) train, validation (data/train-*, data/validation-*)"),
    ("train only", "the hub cache holds no files of split(s) validation (data/validation-*)"),
    ("broken card", "README.md has a YAML header (between the --- lines) that does not read (line 3: expected ','"),
])
def test_a_damaged_hub_cache_is_one_line(damage, expected, offline_datasets, tmp_path, capsys):
    """A snapshot holding only the card (was DataFilesNotFoundError), one split's files only (was "Couldn't infer the
    same data file format for all splits"), or a card whose YAML header does not parse (was yaml's ParserError)."""
    import train
    from huggingface_hub import constants

    from core.cli import report_errors
    from tests.helpers import last_error

    repo = f"org/{damage.replace(' ', '-')}"
    snapshot = write_hub_repo(Path(constants.HF_HUB_CACHE), repo, {"train": 8, "validation": 4})
    if damage == "broken card":
        (snapshot / "README.md").write_text("---\ndataset_info: [unclosed\n  features: x\n---\n")
    for part in {"no data files": ["train", "validation"], "train only": ["validation"]}.get(damage, []):
        (snapshot / "data" / f"{part}-00000-of-00001.parquet").unlink()
    args = [*HUB, f"data.root=hf-hub:{repo}", f"output_dir={tmp_path / 'run'}"]
    line = last_error(capsys, report_errors(train.main, args))
    assert line.startswith(f"error: Hugging Face dataset {repo}") and expected in line, line
    assert not (tmp_path / "run").exists()


def test_only_the_config_files_are_fetched(hub_repo):
    """The snapshot is asked for the dataset card's files of data.hf_config (a repo of many configs is not
    downloaded whole), at the commit the card was read at."""
    from data.hf import card_files

    assert card_files(hub_repo, "", "", offline=True) == (
        COMMIT, ["README.md", ".huggingface.yaml", "data/train-*", "data/validation-*"])


def write_ordered_repo(cache: Path, repo: str, orders: dict[str, list[str]], card_names: list[str] | None) -> None:
    """A repo whose splits' Parquet files (written by datasets) each record their own ClassLabel order; the card
    declares `card_names` as every split's ClassLabel, or no features."""
    import datasets

    snapshot = write_hub_repo(cache, repo, {})
    card = CARD.replace("validation", "val")
    if card_names is None:
        card = card[:card.index("dataset_info")] + card[card.index("configs:"):]
    else:
        card = card.replace("'0': cat\n          '1': dog", "\n          ".join(
            f"'{i}': {name}" for i, name in enumerate(card_names))).replace(
            "configs:", "  - name: name\n    dtype: string\nconfigs:")
    (snapshot / "README.md").write_text(card)
    rng = np.random.default_rng(0)
    for split, names in orders.items():
        rows = [names.index(name) for name in ("cat", "dog", "eel") * 2]
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names),
                                      "name": datasets.Value("string")})
        datasets.Dataset.from_dict({"image": [{"bytes": png(40 * row, rng), "path": None} for row in rows],
                                    "label": rows, "name": [names[row] for row in rows]}, features=features
                                   ).to_parquet(str(snapshot / "data" / f"{split}-00000-of-00001.parquet"))


@pytest.mark.parametrize("card_names", [None, ["cat", "dog", "eel"]])
def test_a_split_naming_its_classes_in_another_order_is_mapped_by_name(card_names, offline_datasets):
    """A validation split whose ClassLabel lists the classes in another order was read by index (datasets reads every
    split with the card's, or the first file's, features): every label was another class's."""
    import albumentations as A
    from huggingface_hub import constants

    from data.hf import HFDataset

    repo = f"org/order-{len(card_names or [])}"
    write_ordered_repo(Path(constants.HF_HUB_CACHE), repo, {"train": ["cat", "dog", "eel"],
                                                            "val": ["eel", "cat", "dog"]}, card_names)
    train = HFDataset(f"hf-hub:{repo}", "train", A.Compose([]), seed=0, path_column="name")
    val = HFDataset(f"hf-hub:{repo}", "val", A.Compose([]), seed=0, classes=train.classes, path_column="name")
    assert train.classes == ["cat", "dog", "eel"]
    for split in (train, val):
        assert [split.classes[label] for label in split.labels] == [split.path(i) for i in range(len(split))]


def test_files_of_one_split_recording_different_class_orders_are_refused(tmp_path):
    import datasets

    from core.errors import UserError
    from data.hf import recorded_labels

    files = []
    for i, names in enumerate((["cat", "dog"], ["dog", "cat"])):
        files.append(str(tmp_path / f"val-{i}.parquet"))
        datasets.Dataset.from_dict({"label": [0, 1]}, features=datasets.Features(
            {"label": datasets.ClassLabel(names=names)})).to_parquet(files[-1])
    assert recorded_labels(files[:1], "label", "here").names == ["cat", "dog"]
    with pytest.raises(UserError, match="here: its Parquet files name the classes of column 'label' in different "
                                        "orders \\(val-0.parquet: cat, dog; val-1.parquet: dog, cat\\)"):
        recorded_labels(files, "label", "here")
