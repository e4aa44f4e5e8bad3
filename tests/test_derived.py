"""Issue 46 items 2-3: a key the user gave is never silently replaced by a start-up rule, --print-config and
--dry-run show the values the run uses, and an epoch that leaves images out says so. One test per derivation."""

from __future__ import annotations

import logging

import pytest
import torch
import yaml

import train
from core.cli import report_errors
from core.config import Config, with_derived
from core.config_load import load_config
from core.dist import DistInfo
from core.errors import UserError
from data.loader import build_data, dropped_images_note
from engine.batch_size import resolved_batch
from engine.optim import batch_and_lr
from tests.helpers import TINY

FINETUNE = ["data.root=photos"]  # configs/finetune.yaml: optim.lr_base 1e-3 (sqrt rule), train.global_batch_size 32


def with_batch_and_lr(cfg: Config, world_size: int) -> Config:
    """cfg with the batch and the lr start-up derives for `world_size` processes."""
    return with_derived(cfg, **batch_and_lr(cfg, world_size))


def test_an_lr_given_on_the_command_line_is_the_lr_used(caplog):
    """--find-lr's suggestion, given as optim.lr with a config that sets optim.lr_base, trains at that lr."""
    with caplog.at_level(logging.INFO, logger="engine.optim"):
        cfg = with_batch_and_lr(load_config("finetune", [*FINETUNE, "optim.lr=0.00475"]), world_size=2)
    assert (cfg.optim.lr, cfg.optim.lr_base) == (0.00475, 0.0)  # config.yaml then says how the lr came about
    assert "optim.lr 0.00475 as given: the config file's optim.lr_base 0.001" in caplog.text
    ruled = with_batch_and_lr(load_config("finetune", FINETUNE), world_size=2)  # no lr given: the file's rule
    assert ruled.optim.lr == pytest.approx(1e-3 * (32 / 256) ** 0.5) and ruled.optim.lr_base == 1e-3
    with pytest.raises(UserError, match=r"optim.lr=0.1 and optim.lr_base=0.002 are both given; .* give one"):
        with_batch_and_lr(load_config("finetune", [*FINETUNE, "optim.lr=0.1", "optim.lr_base=0.002"]), 1)


def test_a_batch_given_on_the_command_line_is_the_batch_used(caplog):
    """train.batch_size given beside the config file's train.global_batch_size: per process, as given."""
    with caplog.at_level(logging.INFO, logger="engine.optim"):
        cfg = with_batch_and_lr(load_config("finetune", [*FINETUNE, "train.batch_size=8"]), world_size=2)
    assert (cfg.train.batch_size, cfg.train.global_batch_size) == (8, 0)
    assert "train.batch_size=8 given: the config file's train.global_batch_size=32 is not applied" in caplog.text
    assert cfg.optim.lr == pytest.approx(1e-3 * (16 / 256) ** 0.5)  # lr_base follows the batch in use
    assert with_batch_and_lr(load_config("finetune", FINETUNE), 2).train.batch_size == 16  # the file's rule
    both = ["train.batch_size=8", "train.global_batch_size=32"]
    assert with_batch_and_lr(load_config("finetune", [*FINETUNE, *both]), 4).train.batch_size == 8  # they agree
    with pytest.raises(UserError, match=r"train.batch_size=8 and train.global_batch_size=32 are both given, but the "
                                        r"global batch sets 16 per process on 2 process\(es\)"):
        with_batch_and_lr(load_config("finetune", [*FINETUNE, *both]), 2)


def test_an_accumulation_given_on_the_command_line_is_kept_by_the_auto_batch():
    """train.batch_size=auto raises train.accum_steps until the global batch fits, unless the user gave it."""
    train_cfg = load_config(None, ["train.global_batch_size=64", "train.accum_steps=2"]).train
    assert resolved_batch(train_cfg, 8, 1, even=False) == {"batch_size": 8, "accum_steps": 8}
    with pytest.raises(UserError, match="train.accum_steps=2 as given does not split train.global_batch_size=64"):
        resolved_batch(train_cfg, 8, 1, even=False, fixed_accum=True)
    assert resolved_batch(train_cfg, 32, 1, even=False, fixed_accum=True) == {"batch_size": 32, "accum_steps": 2}
    # train.accum_steps is the least accumulation auto may choose, even where a batch of 64 would fit
    assert resolved_batch(train_cfg, 64, 1, even=False) == {"batch_size": 32, "accum_steps": 2}


def test_print_config_shows_the_batch_and_lr_the_launch_will_use(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert report_errors(train.main, ["--config", "finetune", *FINETUNE, "--print-config"]) == 0
    out = capsys.readouterr().out
    printed = yaml.safe_load(out)
    assert out.startswith("# as 2 process(es) run it\n")
    assert printed["train"]["batch_size"] == 16 and printed["optim"]["lr"] == pytest.approx(1e-3 * (32 / 256) ** 0.5)


def test_dry_run_says_the_values_the_run_uses(tmp_path, capsys):
    assert report_errors(train.main, [*TINY, f"output_dir={tmp_path}/run", "optim.lr_base=0.1", "--dry-run"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("the run uses: global batch 8 = 1 process(es) x batch x accumulation; train.batch_size 8 "
                           "(command line), train.accum_steps 1 (default), optim.lr 0.003125 (rule: optim.lr_base x the "
                           "global batch), data.img_size 16 (command line), data.mean [0.485, 0.456, 0.406] (the "
                           "weights', the resumed run's, or the default)"), last


@pytest.mark.parametrize("images, batch, world, expected", [
    (180, 64, 1, (logging.WARNING, "each epoch trains on 128 of the 180 training images (71%): 1 process(es) x 2 "
                                   "batch(es) of train.batch_size=64")),
    (180, 32, 2, (logging.WARNING, "each epoch trains on 128 of the 180 training images (71%): 2 process(es) x 2")),
    (1100, 50, 1, None),  # 1,100 / 50: nothing left out
    (1010, 50, 1, None),  # 10 of 1,010 left out: under 1%
    (1200, 50, 2, None),
    (1150, 100, 1, (logging.INFO, "each epoch trains on 1100 of the 1150 training images (96%)")),
])
def test_an_epoch_that_leaves_images_out_says_so(images, batch, world, expected):
    cfg = load_config("dummy", [f"data.dummy_train_size={images}", "data.num_workers=0"])
    data = build_data(cfg.data, batch, 0, DistInfo(0, world, 0, world, torch.device("cpu")))  # rank 0's loader
    note = dropped_images_note(data.train, world, 1, False)
    assert note == expected if expected is None else note[0] == expected[0] and note[1].startswith(expected[1])


def test_an_epoch_that_leaves_out_micro_batches_short_of_a_step_says_so():
    """train.drop_last_accum: 120 images in batches of 10 with train.accum_steps=5 are 12 batches, 2 short of a third
    step: the epoch trains on 100, and the note names that cause (no partial batch) and the key that keeps them."""
    cfg = load_config("dummy", ["data.dummy_train_size=120", "data.num_workers=0"])
    data = build_data(cfg.data, 10, 0, DistInfo(0, 1, 0, 1, torch.device("cpu")), accum_steps=5, drop_last_accum=True)
    level, line = dropped_images_note(data.train, 1, 5, True)
    assert line.startswith("each epoch trains on 100 of the 120 training images (83%): 1 process(es) x 10 batch(es) "
                           "of train.batch_size=10, the rest (2 batch(es) per process short of a whole step of "
                           "train.accum_steps=5, train.drop_last_accum=true) is left out"), line
    assert "partial batch" not in line and line.endswith("or train.drop_last_accum=false leave out fewer")
    assert dropped_images_note(data.train, 1, 5, False) is None  # the last, shorter group still steps: all 120


def test_weights_preprocessing_with_a_zero_std_is_not_used():
    """A weights' pretrained_cfg std with a 0 would divide by zero at normalization: the default stays (a mean of 0
    is fine)."""
    from engine.checkpoint.weights import usable

    assert not usable("std", [0.5, 0.0, 0.5]) and usable("std", [0.5, 0.25, 0.5])
    assert usable("mean", [0.0, 0.0, 0.0])


def test_the_keys_docs_outputs_md_says_a_continuation_may_change_are_continuation_keys():
    """docs/outputs.md's list of what resume=auto lets a continued run change is the schema's continues=True."""
    import re

    from core.config import key_facts
    from tests.helpers import REPO

    text = (REPO / "docs" / "outputs.md").read_text()
    paragraph = text[text.index("`resume=auto` continues only the folder's own run"):]
    paragraph = paragraph[:paragraph.index("stops with one line")]
    named = re.findall(r"`([a-z_]+\.[a-z_*]+)`", paragraph)
    assert "data.num_workers" in named and "train.epochs" in named
    facts = key_facts()
    for name in named:
        keys = [key for key in facts if key.startswith(name[:-1])] if name.endswith("*") else [name]
        assert keys and all(facts[key].continues for key in keys), name


def test_inference_computes_in_the_runs_eval_amp_not_its_training_amp():
    """The precision rule of every reported number (issue 46, docs/correctness.md 4b), in the fast tier: a stored
    config's training amp never reaches inference; its eval_amp does, fp32 for a run that predates the key."""
    from engine.checkpoint.inference import for_inference

    assert for_inference({"amp": "bf16", "eval_amp": "off"})["amp"] == "off"
    assert for_inference({"amp": "auto"})["amp"] == "off"  # a run from before eval_amp validated in fp32
    assert for_inference({"amp": "off", "eval_amp": "bf16"})["amp"] == "bf16"
    stored = {"amp": "bf16"}
    for_inference(stored)
    assert stored == {"amp": "bf16"}  # a private copy: the checkpoint's own config is left as stored
