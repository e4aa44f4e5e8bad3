"""data.train_transform / data.eval_transform: a user's albumentations pipeline file (data/pipeline.py)."""

from __future__ import annotations

import hashlib
import json
import random

import albumentations as A
import numpy as np
import pytest
import torch
import yaml
from albumentations.pytorch import ToTensorV2

from core.config import DataConfig
from core.errors import UserError
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
    "misspelled argument": ({"__version__": A.__version__, "transform": {
        "__class_fullname__": "Compose", "p": 1.0, "transforms": [
            {"__class_fullname__": "RandomCrop", "height": 16, "width": 16, "p": 1.0},
            {"__class_fullname__": "Affine", "scael": 1.5, "p": 1.0}]}},  # was trained at the default scale
        "Affine has no argument 'scael' (albumentations would ignore it and use the default); it takes "),
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

    for dry_run in ([], ["--dry-run"]) if case == "misspelled argument" else ([],):  # --dry-run said "passed"
        code = report_errors(train.main, [*dry_run, *TINY, f"data.train_transform={file}",
                                          f"output_dir={tmp_path / 'run'}"])
        assert code == 2
        line = last_error(capsys, code)
        assert line.startswith(f"error: data.train_transform={file}: ") and expected in line, line
        assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("nested, name", [
    (A.OneOf([A.Normalize(), A.HorizontalFlip()], p=0.5), "Normalize"),
    (A.Sequential([A.HorizontalFlip(), A.Sequential([ToTensorV2()])]), "ToTensorV2"),
])
def test_a_step_the_app_owns_is_refused_inside_a_nested_composition(nested, name, tmp_path):
    """Normalize inside OneOf (or ToTensorV2 in a Sequential) would normalize some images twice: refused at any
    depth, as at the top."""
    from data.pipeline import load_pipeline

    file = saved(tmp_path / "aug.yaml", A.Compose([A.RandomCrop(16, 16), nested]))
    with pytest.raises(UserError, match=f"data.train_transform={file}: remove {name} from the pipeline"):
        load_pipeline(file, "data.train_transform")


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


def test_evaluate_and_predict_read_the_runs_checked_copy_of_the_eval_pipeline(split_pipeline_run, tmp_path, capsys):
    """Issue 65 item 1: the pipeline file at the run's recorded path, edited after training (a CenterCrop(8) and a
    Resize), changed evaluate.py's numbers without a word, and removed, stopped evaluate.py and predict.py though the
    run folder holds its copy. They read the copy (its sha256 checked: tests/test_bad_input.py); a file given as
    data.eval_transform=FILE is used instead, and said."""
    import evaluate
    import predict
    from core.cli import report_errors

    run = split_pipeline_run
    original, images = run.parent / "centre.yaml", str(run.parent / "data" / "photos" / "a")
    kept = original.read_bytes()
    other = A.Compose([A.CenterCrop(8, 8), A.Resize(16, 16)])
    try:
        saved(original, other)
        assert report_errors(evaluate.main, [str(run / "best.pth"), "--output-dir", str(tmp_path / "eval")]) == 0
        loss = json.loads((tmp_path / "eval" / "eval.json").read_text())["loss"]
        assert loss == read_jsonl(run / "metrics.jsonl")[-1]["val_loss"]  # the run's own number, to the last bit
        original.unlink()
        assert report_errors(predict.main, [str(run / "best.pth"), images, "--output-dir", str(tmp_path / "own")]) == 0
        assert f"eval pipeline: the run's data.eval_transform, its copy {run / 'eval_transform.yaml'}" in \
            capsys.readouterr().err
        given = saved(tmp_path / "other.yaml", other)
        assert report_errors(predict.main, [str(run / "best.pth"), images, f"data.eval_transform={given}",
                                            "--output-dir", str(tmp_path / "given")]) == 0
        assert f"eval pipeline: data.eval_transform={given} given on the command line" in capsys.readouterr().err
    finally:
        original.write_bytes(kept)
    own, chosen = ((tmp_path / name / "predictions.csv").read_text() for name in ("own", "given"))
    assert own.splitlines()[0] == chosen.splitlines()[0] and own != chosen  # the file given was used


@pytest.mark.slow  # an export and two predict.py runs (5-6 s of CPU)
def test_the_model_folder_carries_the_eval_pipeline_and_predicts_as_its_checkpoint(split_pipeline_run, tmp_path):
    """Issue 65 item 2: export.py dropped data.eval_transform, so predict.py on the model folder used the preset and
    disagreed with best.pth, the card stated the preset, and the export check printed 0. The folder now holds the
    run's file (config.json names it with its sha256), predict.py gives byte-identical predictions on both, the card
    states the pipeline, and the check refuses a folder that would preprocess otherwise."""
    import export
    import predict
    from core.cli import report_errors

    run, folder = split_pipeline_run, tmp_path / "hf"
    images = str(run.parent / "data" / "photos" / "a")
    assert report_errors(export.main, [str(run / "best.pth"), "--format", "safetensors", "--output", str(folder)]) == 0
    for model, name in ((run / "best.pth", "checkpoint"), (folder, "folder")):
        assert report_errors(predict.main, [str(model), images, "--output-dir", str(tmp_path / name)]) == 0
    assert (tmp_path / "folder/predictions.csv").read_bytes() == (tmp_path / "checkpoint/predictions.csv").read_bytes()
    assert (folder / "eval_transform.yaml").read_bytes() == (run / "eval_transform.yaml").read_bytes()
    config = json.loads((folder / "config.json").read_text())
    assert config["eval_transform_sha256"] == hashlib.sha256((run / "eval_transform.yaml").read_bytes()).hexdigest()
    card = (folder / "README.md").read_text()
    assert "the albumentations pipeline eval_transform.yaml in this folder" in card and "CenterCrop(" in card
    assert "centre crop 16 x 16" not in card  # the preset's words

    from assembly.export import check_folder_preprocessing, check_sources
    from assembly.inference import open_trained
    from core.errors import UserError

    del config["eval_transform"], config["eval_transform_sha256"]  # the folder as export.py wrote it before
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "eval_transform.yaml").unlink()
    _, cfg = open_trained(run / "best.pth", False, may_override=False)
    raw, where = check_sources(cfg, images, 4, None)
    with pytest.raises(UserError, match="preprocesses the check images .* differently from the checkpoint"):
        check_folder_preprocessing(cfg, folder, raw, where, folder)
    config.update(eval_transform="../centre.yaml", eval_transform_sha256="0" * 64)
    (folder / "config.json").write_text(json.dumps(config))  # a name that leaves the folder: refused, never read
    with pytest.raises(UserError, match="eval_transform must be one of eval_transform.yaml, "):
        open_trained(folder, False)
