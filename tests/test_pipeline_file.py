"""data.train_transform / data.eval_transform: a user's albumentations pipeline file (data/pipeline.py)."""

from __future__ import annotations

import hashlib
import random

import albumentations as A
import numpy as np
import pytest
import torch
import yaml
from albumentations.pytorch import ToTensorV2

from core.config import DataConfig
from data.loader import build_datasets
from tests.helpers import TINY, last_error, read_jsonl, train_here

AUGMENT = A.Compose([A.RandomCrop(16, 16), A.HorizontalFlip(p=0.5), A.RandomBrightnessContrast(p=0.8),
                     A.Rotate(limit=20, p=0.5)])


def saved(path, pipeline: A.Compose) -> str:
    """The file albumentations' own A.save writes (YAML or JSON, by the suffix)."""
    A.save(pipeline, str(path), data_format="json" if str(path).endswith(".json") else "yaml")
    return str(path)


def test_pipeline_file_trains_and_augments_as_albumentations(tmp_path, capsys):
    import train
    from core.cli import report_errors

    file = saved(tmp_path / "aug.yaml", AUGMENT)
    centre = saved(tmp_path / "centre.json", A.Compose([A.CenterCrop(16, 16)]))
    out = tmp_path / "run"
    args = [*TINY, f"data.train_transform={file}", f"data.eval_transform={centre}", f"output_dir={out}"]
    train_here(*args)
    assert len(read_jsonl(out / "metrics.jsonl")) == 1
    assert (out / "train_transform.yaml").read_bytes() == (tmp_path / "aug.yaml").read_bytes()
    assert (out / "eval_transform.json").read_bytes() == (tmp_path / "centre.json").read_bytes()
    recorded = yaml.safe_load((out / "config.yaml").read_text())["data"]["train_transform_sha256"]
    assert recorded == hashlib.sha256((tmp_path / "aug.yaml").read_bytes()).hexdigest()
    saved(tmp_path / "aug.yaml", A.Compose([A.RandomCrop(16, 16)]))  # another pipeline in the same file
    code = report_errors(train.main, [*args, "train.epochs=2"])
    assert "data.train_transform_sha256" in last_error(capsys, code)  # a resume with another pipeline: refused
    assert len(read_jsonl(out / "metrics.jsonl")) == 1
    saved(tmp_path / "aug.yaml", AUGMENT)

    cfg = DataConfig(name="dummy", img_size=16, dummy_image_size=20, dummy_train_size=16, train_transform=file)
    dataset = build_datasets(cfg, seed=7)[0]
    reference = A.load(file, data_format="yaml")
    differ = 0
    for epoch, index in [(0, 0), (0, 5), (1, 5), (3, 11)]:
        rng = np.random.default_rng([7, epoch, index])  # the sample's seeding (data/datasets.py)
        reference.set_random_state(rng, random.Random(int(rng.integers(2**63))))
        expected = torch.from_numpy(reference(image=dataset.load_image(index))["image"]).permute(2, 0, 1)
        got = dataset[(epoch, index)][0]
        assert torch.equal(got, expected), (epoch, index)
        differ += not torch.equal(got, dataset[(epoch + 1, index)][0])
    assert differ  # the augmentation is random, not a fixed crop


BAD = {
    "missing": (None, "cannot read it"),
    "unparsable": ("transform: [unclosed\n  - {", "albumentations cannot load it"),
    "unknown": ({"__version__": A.__version__, "transform": {"__class_fullname__": "Compose", "p": 1.0,
                 "transforms": [{"__class_fullname__": "NoSuchTransform", "p": 1.0}]}},
                "albumentations cannot load it"),
    "float": (A.Compose([A.RandomCrop(16, 16), A.ToFloat()]), "made a float32 image of 16x16x3"),
    "shape": (A.Compose([A.RandomCrop(12, 12)]), "made a uint8 image of 12x12x3"),
    "to_tensor": (A.Compose([A.RandomCrop(16, 16), ToTensorV2()]), "remove ToTensorV2"),
    "normalize": (A.Compose([A.RandomCrop(16, 16), A.Normalize()]), "remove Normalize"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_pipeline_file_is_one_line(case, tmp_path, capsys, monkeypatch):
    content, expected = BAD[case]
    file = tmp_path / "aug.yaml"
    if isinstance(content, A.Compose):
        saved(file, content)
    elif isinstance(content, dict):
        file.write_text(yaml.safe_dump(content))
    elif content is not None:
        file.write_text(content)
    import train
    from core.cli import report_errors

    code = report_errors(train.main, [*TINY, f"data.train_transform={file}", f"output_dir={tmp_path / 'run'}"])
    assert code == 2
    line = last_error(capsys, code)
    assert line.startswith(f"error: data.train_transform={file}: ") and expected in line, line
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.slow  # three short runs, one on 2 ranks
def test_a_pipeline_file_trains_the_same_model_on_1_and_2_processes(tmp_path):
    """Issue 49's acceptance for item 1: a pipeline file written by A.save trains alike on one process and on two
    gloo ranks at the same global batch (fp32, a model without BatchNorm): its draws follow each sample's seed, not
    the process that loads it."""
    from tests.compare import assert_same_model
    from tests.helpers import COMMON, NO_BN_MODEL, run_on_ranks

    file = saved(tmp_path / "aug.yaml", A.Compose([A.RandomCrop(14, 14), A.Resize(16, 16), A.HorizontalFlip(p=0.5),
                                                    A.RandomBrightnessContrast(p=0.8)]))
    args = [*COMMON, NO_BN_MODEL, "data.augment=true", f"data.train_transform={file}"]
    train_here(*args, "train.batch_size=12", f"output_dir={tmp_path}/one")
    run_on_ranks("train.py", *args, "train.batch_size=6", f"output_dir={tmp_path}/two", nproc=2)
    assert_same_model(tmp_path / "one", tmp_path / "two")


def test_a_pipeline_that_fails_on_an_image_is_one_line_in_this_process_and_in_a_worker(tmp_path):
    """Issue 61: a RandomCrop larger than one small photo names the file, the transform and the image in one line,
    whether the image is read here (data.num_workers=0) or in a loader worker mid-epoch."""
    from core.errors import UserError
    from data.loader import OneLineErrorLoader
    from tests.helpers import make_image_folder

    root = make_image_folder(tmp_path / "photos", {"train": {"cat": 2}, "val": {"cat": 1}}, size=40)
    make_image_folder(tmp_path / "small", {"train": {"cat": 1}}, size=20)
    (tmp_path / "small/train/cat/000.png").rename(root / "train/cat/small.png")  # sorted last: index 2
    file = saved(tmp_path / "aug.yaml", A.Compose([A.HorizontalFlip(p=0.5), A.RandomCrop(32, 32)]))
    cfg = DataConfig(name="imagefolder", root=str(root), img_size=32, train_transform=file)
    train = build_datasets(cfg, seed=0)[0]
    expected = (f"data.train_transform={file}: RandomCrop failed on image {root}/train/cat/small.png (20x20x3): "
                "CropSizeError: Crop size (height, width) exceeds image dimensions (height, width): (32, 32) vs "
                "(20, 20); make the pipeline fit every image (a resize, or PadIfNeeded before a crop), or remove the "
                "image")
    with pytest.raises(UserError) as err:
        train[(0, 2)]
    assert str(err.value) == expected
    loader = OneLineErrorLoader(train, batch_size=1, sampler=[(0, 0), (0, 2)], num_workers=1)
    with pytest.raises(UserError) as err:
        list(loader)
    assert str(err.value) == expected
