"""Data formats beyond class folders read the same images as ImageFolder: same classes, same per-sample
augmentation, same metrics and byte-identical predictions.csv, for 1 and 2 processes, and exact resume.

Every format is written from one ImageFolder tree (make_image_folder) by its converter or by hand.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import evaluate
import train
from core.cli import report_errors
from core.config import DataConfig
from core.dist import DistInfo
from core.errors import UserError
from data import make_shards
from data.datasets import ImageFolderDataset
from data.loader import build_datasets, build_eval_loader
from engine.checkpoint.formats import load_checkpoint
from tests.compare import allow_best_of_the_stop, assert_same, rows_without_timing
from tests.helpers import RUN, TINY, check_one_line, make_image_folder, read_jsonl, run_on_ranks, train_here

COUNTS = {"train": {"a": 7, "b": 5, "c": 6}, "val": {"a": 3, "b": 4, "c": 4}}  # 18 train, 11 val images


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("folder") / "data", COUNTS, size=20)


@pytest.fixture(scope="module")
def shards(folder, tmp_path_factory) -> Path:
    """The folder as tar shards of 4 samples (several shards per split, the last one short)."""
    out = tmp_path_factory.mktemp("wds") / "shards"
    assert report_errors(make_shards.main, [str(folder), str(out), "--shard-size", "4"]) == 0
    return out


@pytest.fixture(scope="module")
def lists(folder) -> Path:
    """List files beside the folder's splits: train.tsv labelled by index (classes.txt), val.csv by name."""
    classes = sorted(COUNTS["train"])
    (folder / "classes.txt").write_text("\n".join(classes) + "\n")
    for split, suffix, sep in (("train", ".tsv", "\t"), ("val", ".csv", ",")):
        rows = [f"{split}/{c}/{i:03d}.png{sep}{classes.index(c) if split == 'train' else c}"
                for c in classes for i in range(COUNTS[split][c])]
        (folder / f"{split}{suffix}").write_text(f"path{sep}label\n" + "\n".join(rows) + "\n")
    return folder


def hf_split(folder: Path, split: str, with_class_label: bool = True):
    """A datasets.Dataset of the folder's split: encoded image bytes, the label, the image's path."""
    import datasets

    images = ImageFolderDataset(folder / split, transform=None, seed=0)
    paths = [images.path(i) for i in range(len(images))]
    names = [images.classes[label] for label in images.labels]
    label = datasets.ClassLabel(names=images.classes) if with_class_label else datasets.Value("string")
    features = datasets.Features({"img": datasets.Image(), "target": label, "file": datasets.Value("string")})
    return datasets.Dataset.from_dict({"img": [{"bytes": Path(p).read_bytes(), "path": None} for p in paths],
                                       "target": names if not with_class_label else images.labels.tolist(),
                                       "file": paths}, features=features)


@pytest.fixture(scope="module")
def hf(folder, tmp_path_factory) -> Path:
    """The folder as a Hugging Face DatasetDict written by save_to_disk (columns img, target, file)."""
    import datasets

    out = tmp_path_factory.mktemp("hf") / "dataset"
    datasets.DatasetDict({split: hf_split(folder, split) for split in COUNTS}).save_to_disk(str(out))
    return out


HF_COLUMNS = ["data.image_column=img", "data.label_column=target", "data.path_column=file"]


@pytest.fixture(scope="module")
def formats(folder, shards, lists, hf) -> dict[str, list[str]]:
    """data.name -> the overrides reading the same images; ImageFolder first (the reference)."""
    return {"imagefolder": [f"data.root={folder}"], "wds": [f"data.root={shards}"],
            "listfile": [f"data.root={lists}"], "hf": [f"data.root={hf}", *HF_COLUMNS]}


def data_config(name: str, root: Path | str, **kw) -> DataConfig:
    return DataConfig(name=name, root=str(root), img_size=16, **{"num_workers": 0, **kw})


def assert_same_samples(reference: DataConfig, other: DataConfig) -> None:
    """Same classes, labels, paths, and per-sample augmented tensors (train: epochs 0 and 1; val)."""
    expected, got = build_datasets(reference, seed=5), build_datasets(other, seed=5)
    for want, have in zip(expected, got):
        assert have.classes == want.classes and have.labels.tolist() == want.labels.tolist()
        assert [have.path(i) for i in range(len(have))] == [want.path(i) for i in range(len(want))]
    for key in [(epoch, i) for epoch in (0, 1) for i in range(len(expected[0]))]:
        assert torch.equal(got[0][key][0], expected[0][key][0]), key
    for i in range(len(expected[1])):
        assert torch.equal(got[1][i][0], expected[1][i][0]), i


def test_shards_hold_the_folder_in_its_order(folder, shards):
    assert sorted(p.name for p in shards.iterdir()) == [
        "train-g1-000000.tar", "train-g1-000001.tar", "train-g1-000002.tar", "train-g1-000003.tar",
        "train-g1-000004.tar", "train.json", "val-g1-000000.tar", "val-g1-000001.tar", "val-g1-000002.tar", "val.json"]
    index = json.loads((shards / "val.json").read_text())
    assert index["classes"] == ["a", "b", "c"] and [s["nsamples"] for s in index["shardlist"]] == [4, 4, 3]
    assert_same_samples(data_config("imagefolder", folder), data_config("wds", shards))


def test_hugging_face_datasets_on_disk_hold_the_folder_images(folder, hf, tmp_path, monkeypatch):
    columns = dict(image_column="img", label_column="target", path_column="file")
    assert_same_samples(data_config("imagefolder", folder), data_config("hf", hf, **columns))
    # Parquet files with class names as labels, through datasets' own cache (offline).
    import datasets
    import datasets.table

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    parquet = tmp_path / "parquet"
    for split in COUNTS:
        hf_split(folder, split, with_class_label=False).to_parquet(str(parquet / f"{split}.parquet"))
    assert_same_samples(data_config("imagefolder", folder), data_config("hf", parquet, **columns))
    for root in (hf, parquet):  # rows are read from the mapped file: forked workers share its pages
        assert isinstance(build_datasets(data_config("hf", root, **columns), seed=0)[0].ds.data,
                          datasets.table.MemoryMappedTable)
    with pytest.raises(UserError, match=f"Hugging Face dataset {hf} split train has no column 'image' "
                                        "\\(data.image_column\\); it has img, target, file"):
        build_datasets(data_config("hf", hf), seed=0)
    with pytest.raises(UserError, match=f"Hugging Face dataset {hf} has no split 'test' \\(it has train, val\\)"):
        build_datasets(data_config("hf", hf, val_split="test", **columns), seed=0)


def test_make_shards_errors_are_one_line(folder, tmp_path, capsys):
    assert make_shards.run([str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: data folder {tmp_path}/nope/train does not exist; expected " \
        "<data.root>/<split>/<class>/* for data.train_split and data.val_split (set data.root, or the split names)\n"
    assert make_shards.run([str(folder), str(tmp_path / "out"), "--shard-size", "0"]) == 2
    assert "error: --shard-size must be > 0, got 0" in capsys.readouterr().err


def test_list_files_name_the_folder_images(folder, lists, tmp_path):
    assert_same_samples(data_config("imagefolder", folder), data_config("listfile", lists))
    (tmp_path / "train.csv").write_text("path,label\ntrain/a/000.png,a\ntrain/b/000.png\n")
    with pytest.raises(UserError, match=f"{tmp_path}/train.csv line 3: expected two fields, path,label, got "):
        build_datasets(data_config("listfile", tmp_path), seed=0)
    (tmp_path / "train.csv").write_text("path,label\ntrain/a/000.png,a\ntrain/b/000.png,7\n")
    (tmp_path / "classes.txt").write_text("a\nb\n")
    with pytest.raises(UserError, match="train.csv line 3: label '7' is neither a class of classes.txt nor an index"):
        build_datasets(data_config("listfile", tmp_path), seed=0)
    (tmp_path / "train.csv").write_text("path,label\ntrain/a/000.png,a\ntrain/b/000.png,1\n")
    with pytest.raises(UserError, match=f"list file {tmp_path}/nope.csv \\(or .tsv\\) does not exist"):
        build_datasets(data_config("listfile", tmp_path, val_split="nope"), seed=0)


def test_shards_read_through_workers_and_from_a_url(folder, shards, tmp_path):
    """Forked DataLoader workers give the same batches; a file:// root goes through fsspec (core/store.py)."""
    url = data_config("wds", f"file://{shards}", shard_cache=str(tmp_path / "cache"), num_workers=2)
    assert_same_samples(data_config("imagefolder", folder), url)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if p.suffix == ".tar")  # downloaded there
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    batches = {}
    for cfg in (data_config("imagefolder", folder), url):
        loader = build_eval_loader(build_datasets(cfg, seed=0)[1], cfg, 4, info)
        batches[cfg.name] = list(loader)
    for (a, la), (b, lb) in zip(batches["imagefolder"], batches["wds"], strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)


def train_args(name: str, data: list[str], out: Path) -> list[str]:
    return [*TINY, f"data.name={name}", *data, "train.batch_size=4", f"output_dir={out}"]


@pytest.mark.slow
def test_formats_train_and_evaluate_like_the_folder(formats, tmp_path, capsys):
    """One process: the same metrics rows and weights, then byte-identical predictions.csv and eval.json."""
    outputs = {}
    for name, data in formats.items():
        out = tmp_path / name
        assert report_errors(train.main, train_args(name, data, out)) == 0, capsys.readouterr().err
        assert report_errors(evaluate.main, [str(out / "last.pth"), "--output-dir", str(out / "eval")]) == 0
        result = json.loads((out / "eval/eval.json").read_text())
        del result["checkpoint"], result["scored"]  # where they are: the checkpoint, and the images by format
        outputs[name] = (rows_without_timing(out), load_checkpoint(out / "last.pth")["model"],
                         (out / "eval/predictions.csv").read_bytes(), result)
    rows, weights, predictions, result = outputs["imagefolder"]
    for name, (wrows, wweights, wpredictions, wresult) in outputs.items():
        assert (wrows, wpredictions, wresult) == (rows, predictions, result), name
        assert_same(weights, wweights, "model")
    assert formats["wds"][0].split("=", 1)[1].encode() not in predictions  # shards name the converted image


@pytest.mark.slow
def test_formats_train_and_evaluate_like_the_folder_on_two_processes(formats, tmp_path):
    """Every format is dealt to the ranks by the same EpochSampler; what a format adds on 2 ranks is its reading in
    each rank's worker: the folder, and the shards (tar members through wids' index, opened per worker). List files
    and Hugging Face datasets read files and Arrow tables like these and equal the folder in one process (above)."""
    outputs = {}
    for name, data in ((name, formats[name]) for name in ("imagefolder", "wds")):
        out = tmp_path / name
        run_on_ranks("train.py", *train_args(name, data, out), "data.num_workers=1", nproc=2)
        run_on_ranks("evaluate.py", str(out / "best.pth"), "--output-dir", str(out / "eval"), nproc=2)
        outputs[name] = (rows_without_timing(out), (out / "eval/predictions.csv").read_bytes())
    assert outputs["wds"] == outputs["imagefolder"]


@pytest.mark.slow
def test_evaluate_data_dir_on_another_split(folder, tmp_path, capsys):
    """--data-dir with data.val_split=test: a test/ split holding val's images gives val's predictions."""
    out = tmp_path / "run"
    assert report_errors(train.main, train_args("imagefolder", [f"data.root={folder}"], out)) == 0
    data = tmp_path / "data"
    shutil.copytree(folder / "val", data / "test")
    for split, where in (("val", folder), ("test", data)):
        argv = [str(out / "last.pth"), "--data-dir", str(where), f"data.val_split={split}", "--output-dir",
                str(tmp_path / split)]
        assert report_errors(evaluate.main, argv) == 0, capsys.readouterr().err
    val, test = ((tmp_path / split / "predictions.csv").read_text() for split in ("val", "test"))
    assert test == val.replace(f"{folder}/val/", f"{data}/test/")
    # A split without class b: accepted, b keeps its index, its per-class top-1 is null.
    shutil.rmtree(data / "test/b")
    argv = [str(out / "last.pth"), "--data-dir", str(data), "data.val_split=test", "--output-dir", str(tmp_path / "ac")]
    assert report_errors(evaluate.main, argv) == 0
    assert f"{data}/test has no images of 1 class(es): b" in capsys.readouterr().err
    def labels_and_predictions(lines: list[str]) -> list[list[str]]:  # (other batches: other last digits)
        return [[cells[i] for i in (2, 3, 6, 7)] for cells in (line.split(",") for line in lines)]

    rows = labels_and_predictions((tmp_path / "ac/predictions.csv").read_text().splitlines()[1:])
    assert rows == labels_and_predictions([line for line in val.splitlines()[1:] if "/val/b/" not in line])
    per_class = json.loads((tmp_path / "ac/eval.json").read_text())["per_class"]
    assert [(c["class"], c["n"]) for c in per_class] == [("a", 3), ("b", 0), ("c", 4)] and per_class[1]["top1"] is None


@pytest.mark.slow
@pytest.mark.parametrize("at", ["folder", "url"])
def test_mid_epoch_resume_from_shards_is_bitwise_identical(shards, tmp_path, at):
    """test_resume's run (augmentation, dropout, drop-path, EMA; fp32) on shards, stopped mid-epoch, resumed: from a
    folder (data.shard_order=auto: global), and at a URL (file://: by_rank, the shards copied into data.shard_cache
    from threads of the training process and of its loader worker)."""
    root = f"file://{shards}" if at == "url" else str(shards)
    args = [*RUN, "data.name=wds", f"data.root={root}", "train.batch_size=4", "data.num_workers=1",
            f"data.shard_cache={tmp_path / 'cache'}"]
    straight, out = tmp_path / "straight", tmp_path / "run"
    train_here(*args, f"output_dir={straight}")
    train_here(*args, f"output_dir={out}", "train.max_steps=6")  # epoch 1, step 2 of 4
    partial = load_checkpoint(out / "last.pth")
    assert (partial["epoch"], partial["epoch_step"]) == (1, 2)
    partial_top1 = read_jsonl(out / "metrics.jsonl")[1][partial["best_metric"]]  # the evaluation at the stop
    train_here(*args, f"output_dir={out}")  # (its metrics.jsonl then holds the whole epoch's row there instead)
    expected, resumed = load_checkpoint(straight / "last.pth"), load_checkpoint(out / "last.pth")
    allow_best_of_the_stop(expected, resumed, partial_top1, partial["epoch"])
    assert_same(expected, resumed)
    assert rows_without_timing(out) == rows_without_timing(straight)


def broken_copies(shards: Path, root: Path) -> None:
    """Copies of the shards with one fault each."""
    for name in ("corrupt", "missing", "cut", "badjson", "noclasses", "noindex", "relabelled"):
        shutil.copytree(shards, root / name)
    tar = root / "corrupt/train-g1-000000.tar"
    data = bytearray(tar.read_bytes())
    start = data.index(b"00000003.png") + 512  # the member's data follows its 512-byte header
    data[start:start + 64] = bytes(64)  # the PNG signature and header gone
    tar.write_bytes(bytes(data))
    (root / "missing/train-g1-000002.tar").unlink()
    cut = root / "cut/train-g1-000001.tar"
    cut.write_bytes(cut.read_bytes()[:3000])
    text = (root / "badjson/val.json").read_text()
    (root / "badjson/val.json").write_text(text[:len(text) // 2])
    index = json.loads((root / "noclasses/train.json").read_text())
    del index["classes"]
    (root / "noclasses/train.json").write_text(json.dumps(index))
    (root / "noindex/train.json").unlink()
    index = json.loads((root / "relabelled/train.json").read_text())
    index["shardlist"][1]["labels"][2] = 2  # sample 6 is of class a (0): the .cls member says so
    (root / "relabelled/train.json").write_text(json.dumps(index))


SHARD_CASES = {  # name: (data.root under the broken copies, text the last line must contain)
    "corrupt sample": ("corrupt", "cannot read image 00000003.png in shard {root}/corrupt/train-g1-000000.tar "
                       "(corrupt, truncated or not an image)"),
    "missing shard": ("missing", "shard {root}/missing/train-g1-000002.tar of index {root}/missing/train.json does "
                      "not exist"),
    "shard cut short": ("cut", "shard {root}/cut/train-g1-000001.tar is cut short or replaced (3000 bytes, "),
    "index not JSON": ("badjson", "shard index {root}/badjson/val.json is not valid JSON (line 1"),
    "index without classes": ("noclasses", "shard index {root}/noclasses/train.json is broken (no 'classes')"),
    "no index": ("noindex", "cannot read shard index {root}/noindex/train.json (No such file or directory)"),
    "index labels not the shard's": ("relabelled", "shard {root}/relabelled/train-g1-000001.tar disagrees with its "
                                     "index {root}/relabelled/train.json (sample 00000006 has '0' in its .cls member, "
                                     "the index 2)"),
}


@pytest.fixture(scope="module")
def broken(shards, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("broken")
    broken_copies(shards, root)
    return root


def test_corrupt_sample_in_a_shard_is_skipped_and_counted(broken, tmp_path, capsys):
    out = tmp_path / "run"
    argv = [*train_args("wds", [f"data.root={broken / 'corrupt'}"], out), "data.skip_corrupt=true"]
    assert report_errors(train.main, argv) == 0, capsys.readouterr().err
    assert [(r["skipped_images"], r["train_images"]) for r in read_jsonl(out / "metrics.jsonl")] == [(1, 15)]
    assert "00000003.png in shard" in capsys.readouterr().err


@pytest.mark.parametrize("name, workers", [(name, 0) for name in SHARD_CASES] + [
    ("corrupt sample", 2), ("index labels not the shard's", 2)])
def test_shard_faults_are_one_line(name, workers, broken, tmp_path, capsys, monkeypatch):
    """Found at start-up, or while reading (then also in a DataLoader worker)."""
    folder, expected = SHARD_CASES[name]
    args = ["data.name=wds", f"data.root={broken / folder}", "train.batch_size=4", f"data.num_workers={workers}"]
    check_one_line(args, expected, broken, tmp_path, capsys, monkeypatch)
