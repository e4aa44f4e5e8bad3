"""model.pretrained=true: timm's pretrained weights of model.name through timm's own loading and a real Hugging Face
cache (the session's, offline: tests/conftest.py), on 1 and 2 ranks; the one-line refusals."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants

import evaluate
import train
from core.cli import report_errors
from tests.helpers import TINY, cache_hub_weights, check_one_line, last_error, run_on_ranks, train_here

TAG = "test_resnet.r160_in1k"  # timm's tiny test model; its pretrained_cfg: timm/test_resnet.r160_in1k, mean/std 0.5
# model.freeze=backbone keeps every tensor but the classifier (BatchNorm statistics too) as the run started it.
PRETRAINED = [*TINY, f"model.name={TAG}", "model.pretrained=true", "model.freeze=backbone"]


@pytest.fixture
def cached() -> tuple[dict[str, torch.Tensor], Path]:
    """TAG's weights in the Hugging Face cache for one test, and their folder there; the cache is empty after it."""
    weights, repo = cache_hub_weights(TAG)
    yield weights, repo
    shutil.rmtree(repo, ignore_errors=True)


def check_started_from(out: Path, weights: dict[str, torch.Tensor]) -> None:
    """The run's model is the cached weights, bitwise, but for a classifier made for the data's 10 classes, and its
    config holds their mean/std and interpolation (dummy.yaml gives crop_pct itself)."""
    ckpt = torch.load(out / "last.pth", weights_only=True, map_location="cpu")
    model = ckpt["model"]
    assert model.keys() == weights.keys()
    assert all(torch.equal(model[k], v) for k, v in weights.items() if not k.startswith("fc.")), "not the cache's"
    assert weights["fc.weight"].shape[0] == 1000 and model["fc.weight"].shape[0] == 10
    data = ckpt["config"]["data"]
    assert (data["mean"], data["std"], data["interpolation"], data["crop_pct"]) == ([0.5] * 3, [0.5] * 3,
                                                                                      "bilinear", 1.0)
    assert ckpt["config"]["model"]["pretrained"] is True
    assert ckpt["started_from"] == STARTED_FROM  # the model card names them by it


STARTED_FROM = {"kind": "timm", "name": TAG, "hf_hub_id": f"timm/{TAG}", "revision": f"{0:040x}",  # cache_hub_weights'
                "file": "model.safetensors"}


def test_one_process_starts_from_the_cached_weights_and_later_tools_never_ask(cached, tmp_path):
    weights, repo = cached
    train_here(*PRETRAINED, f"output_dir={tmp_path / 'run'}")
    check_started_from(tmp_path / "run", weights)
    shutil.rmtree(repo)  # the cache is empty again: evaluate and resume find the weights in last.pth
    assert report_errors(evaluate.main, [str(tmp_path / "run" / "last.pth"), "--output-dir", str(tmp_path / "ev")]) == 0
    train_here(*PRETRAINED, "train.epochs=2", f"output_dir={tmp_path / 'run'}")  # resumes: the weights are in last.pth
    resumed = torch.load(tmp_path / "run" / "last.pth", weights_only=True)
    assert resumed["epoch"] == 2 and resumed["started_from"] == STARTED_FROM  # kept, though the cache is empty now


@pytest.mark.slow  # two ranks: ~6 s
def test_two_ranks_start_from_the_cached_weights_rank0_first(cached, tmp_path):
    run_on_ranks("train.py", *PRETRAINED, f"output_dir={tmp_path / 'run'}", nproc=2)
    check_started_from(tmp_path / "run", cached[0])


def test_weights_missing_from_the_cache_offline_are_one_line(tmp_path, capsys):
    argv = [*TINY, "model.name=test_efficientnet.r160_in1k", "model.pretrained=true", f"output_dir={tmp_path / 'r'}"]
    code = report_errors(train.main, argv)
    line = last_error(capsys, code)
    assert code == 2, line
    assert (f"model.name=test_efficientnet.r160_in1k: its pretrained files (timm/test_efficientnet.r160_in1k) are "
            f"not in the Hugging Face cache {constants.HF_HUB_CACHE} and HF_HUB_OFFLINE=1 forbids downloading them; "
            "run once where the Hub can be reached") in line, line
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("damage", [b"", b"not a safetensors file", "truncated"])
def test_a_damaged_cached_weights_file_is_one_line_naming_it(damage, cached, tmp_path, capsys):
    """A cut, garbage or empty cached model.safetensors raised SafetensorError (issue 51 item 9)."""
    _, repo = cached
    (file,) = repo.glob("snapshots/*/model.safetensors")
    file.write_bytes(file.read_bytes()[:100] if damage == "truncated" else damage)
    for extra in ([], ["--dry-run"]):
        line = last_error(capsys, report_errors(train.main, [*PRETRAINED, f"output_dir={tmp_path / 'r'}", *extra]))
        assert line.startswith(f"error: model.name={TAG}: the Hugging Face cache's copy of its weights, {file}, is "
                               f"damaged (") and f"remove {repo} and run again" in line, line
    assert not (tmp_path / "r").exists()


def test_a_damaged_cache_on_two_ranks_is_rank_0s_one_line(cached, tmp_path):
    """Rank 0 reads the pretrained weights first and the others wait for it (core.dist.main_first, so N ranks do not
    download into one cache at once): its failure comes out once, as rank 0's line, and rank 1 stays quiet. Each rank
    reading the damaged file at once printed the line once per rank (issue 51's surviving mutant)."""
    _, repo = cached
    (file,) = repo.glob("snapshots/*/model.safetensors")
    file.write_bytes(b"not a safetensors file")
    proc = run_on_ranks("train.py", *PRETRAINED, f"output_dir={tmp_path / 'r'}", "--dry-run", nproc=2, exit_code=2)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"[rank 0] error: model.name={TAG}: the Hugging Face cache's "
                                                     f"copy of its weights, {file}, is damaged ("), proc.stderr


@pytest.mark.parametrize("args, expected", [
    ([f"model.name={TAG}"], f"model.name={TAG} names pretrained weights but model.pretrained is false, so the run "
                            "would start from random weights; set model.pretrained=true to start from them, or "
                            "model.name=test_resnet for a random start"),
    (["model.name=hf-hub:timm/test_resnet.r160_in1k"], "names pretrained weights but model.pretrained is false"),
    (["model.name=timm/test_resnet.r160_in1k", "model.pretrained=true"],
     "model.name 'timm/test_resnet.r160_in1k' looks like a Hugging Face Hub id; write "
     "model.name=hf-hub:timm/test_resnet.r160_in1k"),
    ([f"model.name={TAG}", "model.pretrained=true", "model.init_from=w.pth"],
     "model.pretrained=true and model.init_from=w.pth both name the weights to start from"),
    (["model.name=test_resnet.nope", "model.pretrained=true"], "Invalid pretrained tag (nope) for test_resnet"),
    # issue 51 item 14: a local path was sent to the Hub (`write model.name=hf-hub:/w/model.safetensors`)
    (["model.name=/w/model.safetensors", "model.pretrained=true"],
     "model.name=/w/model.safetensors names local weights, not a timm model; set "
     "model.init_from=/w/model.safetensors (with model.pretrained=false) and model.name to the timm architecture"),
    (["model.name=local-dir:/w", "model.pretrained=true"], "names local weights, not a timm model; set "
                                                           "model.init_from=/w (with model.pretrained=false)"),
])
def test_a_pretrained_name_without_model_pretrained_is_one_line(args, expected, tmp_path, capsys, monkeypatch):
    check_one_line(args, expected, tmp_path, tmp_path, capsys, monkeypatch)


def make_photos(root: Path, per_class: dict[str, int]) -> Path:
    """JPEG photos of two classes (cat darker than dog) in root/<split>/<class>/, 60 x 80 px."""
    import cv2
    import numpy as np

    rng = np.random.default_rng(0)
    for split, count in per_class.items():
        for c, name in enumerate(("cat", "dog")):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                photo = np.clip(rng.normal(80 + 90 * c, 40, (60, 80, 3)), 0, 255).astype(np.uint8)
                cv2.imwrite(str(root / split / name / f"{i}.jpg"), photo)
    return root


@pytest.mark.slow  # two short runs at the config's 224 px, one on 2 ranks
def test_the_finetune_config_trains_the_same_model_on_1_and_2_processes(cached, tmp_path):
    """README's "8 GPUs, same model" (issue 46 item 4): configs/finetune.yaml as shipped (its global batch of 32,
    SyncBN, lr_base, pretrained weights) trains the same model on 1 and 2 processes; only what a test must shrink
    is overridden (the model tag, the steps, workers, fp32 arithmetic)."""
    from tests.compare import assert_same_model

    root = make_photos(tmp_path / "photos", {"train": 32, "val": 16})  # 64 images: 2 steps of the global 32
    args = ["--config", "finetune", f"data.root={root}", f"model.name={TAG}", "train.epochs=1", "amp=off",
            "data.num_workers=0", "logging.progress=false"]
    train_here(*args, f"output_dir={tmp_path}/one")
    run_on_ranks("train.py", *args, f"output_dir={tmp_path}/two", nproc=2)
    assert_same_model(tmp_path / "one", tmp_path / "two", steps=2)
    one, two = (torch.load(tmp_path / name / "last.pth", weights_only=True)["config"] for name in ("one", "two"))
    assert (one["train"]["batch_size"], two["train"]["batch_size"], one["optim"]["lr"]) == (32, 16, two["optim"]["lr"])


@pytest.mark.slow  # 224 px, a real training epoch and predict.py: ~3 s
def test_the_first_pages_own_photos_commands_train_and_predict(cached, tmp_path):
    """README's "Train on your own photos": `--config finetune data.root=<folder>` (a pretrained timm model, here
    timm's tiny test tag from the session's cache) on a folder of JPEG photos in class folders, then predict.py on
    new photos. Only what a test must shrink is overridden: the model tag, epochs, batch, workers and log."""
    import predict

    root = make_photos(tmp_path / "photos", {"train": 6, "val": 2})
    out = tmp_path / "run"
    train_here("--config", "finetune", f"data.root={root}", f"model.name={TAG}", "train.epochs=1",
               "train.batch_size=4", "data.num_workers=0", "logging.progress=false", f"output_dir={out}")
    ckpt = torch.load(out / "best.pth", weights_only=True, map_location="cpu")
    assert ckpt["class_names"] == ["cat", "dog"] and ckpt["config"]["model"]["pretrained"] is True
    assert ckpt["config"]["data"]["mean"] == [0.5] * 3  # the weights' pretrained_cfg, not ImageNet's defaults
    assert report_errors(predict.main, [str(out / "best.pth"), str(root / "val"), "--output-dir",
                                        str(tmp_path / "pred")]) == 0
    assert len((tmp_path / "pred" / "predictions.csv").read_text().splitlines()) == 1 + 4


def rewrite_cached_weights(repo: Path, edit) -> Path:
    """The cached model.safetensors of `repo` rewritten with edit(state dict) applied; the file."""
    from safetensors.torch import load_file, save_file

    (file,) = repo.glob("snapshots/*/model.safetensors")
    state = load_file(file)
    edit(state)
    save_file(state, file, metadata={"format": "pt"})
    return file


def test_a_tensor_missing_from_the_cached_weights_is_refused_unless_it_is_the_classifier(cached, tmp_path, capsys):
    """Issue 51 item 2: timm loads non-strictly when the class count changes, so a cache lacking conv1.0.weight
    trained a random stem with exit 0 (model.init_from refused the same file)."""
    _, repo = cached
    file = rewrite_cached_weights(repo, lambda state: state.pop("conv1.0.weight"))
    line = last_error(capsys, report_errors(train.main, [*PRETRAINED, f"output_dir={tmp_path / 'r'}", "--dry-run"]))
    assert line == (f"error: model.name={TAG}: the pretrained weights {file} lack conv1.0.weight, which would train "
                    f"from random values (only the classifier may be missing); fetch the weights again (remove {repo}) "
                    "or choose other weights"), line
    rewrite_cached_weights(repo, lambda state: [state.pop("conv1.0.weight", None), state.pop("fc.weight"),
                                                state.pop("fc.bias")])
    line = last_error(capsys, report_errors(train.main, [*PRETRAINED, f"output_dir={tmp_path / 'r'}", "--dry-run"]))
    assert "lack conv1.0.weight, which" in line, line  # the classifier is not named: it may be missing


HUB_NAME = f"hf-hub:timm/{TAG}"  # the cached repository by its Hub id: timm reads its config.json


def hub_config_error(repo: Path, edit, tmp_path: Path, capsys, *extra: str) -> tuple[str, Path]:
    """The one line a dry run from HUB_NAME gives once edit(config) has changed the cached config.json; the file."""
    import json

    (file,) = repo.glob("snapshots/*/config.json")
    config = json.loads(file.read_text())
    edit(config)
    file.write_text(json.dumps(config))
    argv = [*PRETRAINED, f"model.name={HUB_NAME}", f"output_dir={tmp_path / 'r'}", "--dry-run", *extra]
    return last_error(capsys, report_errors(train.main, argv)), file


@pytest.mark.parametrize("edit, why", [
    (lambda c: c.pop("architecture"), "has no 'architecture' (the timm model its weights are for)"),  # KeyError
    (lambda c: c.update(architecture=["test_resnet"]),  # AttributeError: 'list' object has no attribute 'split'
     "gives 'architecture' as list ['test_resnet'], not one timm model name"),
])
def test_a_hub_config_without_one_architecture_is_one_line_naming_the_file(edit, why, cached, tmp_path, capsys):
    """Issue 51 item 10: tracebacks from timm's reading of the repository's config.json."""
    line, file = hub_config_error(cached[1], edit, tmp_path, capsys)
    assert line == f"error: model.name={HUB_NAME}: the repository's {file} {why}; check model.name, or fix that file " \
                   "(timm's push_to_hf_hub writes it)", line


def test_a_hub_config_whose_first_conv_misses_its_architecture_is_one_line(cached, tmp_path, capsys):
    """Issue 51 item 10: resnet18's stem is one Conv2d, the config's first_conv (conv1.0) test_resnet's deep stem:
    `AttributeError: Conv2d has no attribute '0'` from timm's input-conv adaptation."""
    line, file = hub_config_error(cached[1], lambda c: c.update(architecture="resnet18"), tmp_path, capsys)
    (weights,) = cached[1].glob("snapshots/*/model.safetensors")
    assert line.startswith(f"error: model.name={HUB_NAME}: timm cannot load {weights} into the architecture the "
                           f"repository's {file} names (") and "check model.name, or fix the file" in line, line


def test_hub_load_errors_name_their_source(cached, tmp_path, capsys):
    """Issue 51 item 13: `error:  does not fit model ...` (an empty source) and `(Unknown model (nonexistent_net))`."""
    line, file = hub_config_error(cached[1], lambda c: c.update(architecture="nonexistent_net"), tmp_path, capsys)
    assert f"the repository's {file} names architecture 'nonexistent_net', which timm" in line, line
    weights = rewrite_cached_weights(cached[1], lambda state: state.update({"conv1.0.weight": torch.zeros(8, 3, 3, 3)}))
    line = last_error(capsys, report_errors(train.main, [*PRETRAINED, f"output_dir={tmp_path / 'r'}", "--dry-run"]))
    assert line.startswith(f"error: {weights} does not fit model {TAG} (shape differs: conv1.0.weight: file [8, 3, 3, "
                           "3] vs model [16, 3, 3, 3]"), line


def test_unknown_model_args_in_a_hub_config_point_at_that_file(cached, tmp_path, capsys):
    """Issue 51 item 15: said `remove them from the model section`, where the option is in the repository's file;
    an option of the user's own model section is still sent there."""
    line, file = hub_config_error(cached[1], lambda c: c.update(model_args={"bogus": 1}), tmp_path, capsys)
    assert line.startswith(f"error: model.name={HUB_NAME}: the repository's {file} gives model_args its architecture "
                           "rejects (") and "the option is in that file, not in your config" in line, line
    line, _ = hub_config_error(cached[1], lambda c: c.pop("model_args"), tmp_path, capsys, "model.kwargs.mine=1")
    assert "'mine'); remove them from the model section" in line, line


def test_a_folder_in_place_of_the_cached_weights_file_is_one_line(cached, tmp_path, capsys):
    """Issue 51 item 18: said `No such device (os error 19); check model.name`."""
    _, repo = cached
    (file,) = repo.glob("snapshots/*/model.safetensors")
    file.unlink()
    file.mkdir()
    line = last_error(capsys, report_errors(train.main, [*PRETRAINED, f"output_dir={tmp_path / 'r'}", "--dry-run"]))
    assert line == (f"error: model.name={TAG}: the Hugging Face cache holds a folder, {file}, where its weights file "
                    f"belongs; remove {repo} and run again where the Hub can be reached to download it afresh"), line


def test_a_teachers_local_path_as_its_name_points_at_distill_teacher_weights():
    """Issue 51 item 14 for distill.teacher_name: its local weights go in distill.teacher_weights."""
    from core.errors import UserError
    from models.factory import check_model_name

    with pytest.raises(UserError, match=r"^distill.teacher_name=/w/t.pth names local weights, not a timm model; set "
                                        r"distill.teacher_weights=/w/t.pth and distill.teacher_name to the timm"):
        check_model_name("/w/t.pth", key="distill.teacher_name")
