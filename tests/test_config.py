"""Config: YAML + dotted overrides into the typed schema, and one-line errors for every mistake."""

from __future__ import annotations

import pytest
import yaml

from engine.config import Config, config_from_dict, load_config, save_config, to_dict
from engine.errors import UserError


def write(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_and_overrides(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 0.5\ntrain:\n  epochs: 7\n")
    cfg = load_config(path, ["optim.lr=0.2", "data.scale=[0.2, 1.0]", "model.sync_bn=true", "output_dir=x"])
    assert cfg.optim.lr == 0.2 and cfg.train.epochs == 7
    assert cfg.data.scale == [0.2, 1.0] and cfg.model.sync_bn is True and cfg.output_dir == "x"
    assert isinstance(load_config(path, ["optim.lr=1"]).optim.lr, float)  # int accepted for a float


def test_off_and_no_stay_strings(tmp_path):
    # YAML 1.1 would read off/no/on/yes as booleans; `amp: off` is what the README tells users to write.
    assert load_config(write(tmp_path, "amp: off\n")).amp == "off"
    assert load_config(None, ["amp=off", "output_dir=no"]).output_dir == "no"
    assert load_config(None, ["amp=off"]).amp == "off"
    with pytest.raises(UserError, match="config key 'model.sync_bn' must be bool, got 'yes'"):
        load_config(None, ["model.sync_bn=yes"])


def test_bare_name_is_looked_up_in_configs():
    assert load_config("dummy").data.name == "dummy"
    assert load_config("resnet50.yaml").model.name == "resnet50"


@pytest.mark.parametrize("override, message", [
    ("optim.lrr=0.1", "unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),
    ("trian.epochs=3", "unknown config key 'trian'; did you mean 'train'?"),
    ("train.epochs=three", "config key 'train.epochs' must be int, got 'three'"),
    ("train.batch_size=0", "config key 'train.batch_size' must be > 0, got 0"),
    ("optim.lr=-0.1", "config key 'optim.lr' must be >= 0, got -0.1"),
    ("amp=fp8", "config key 'amp' is 'fp8'; choose one of auto, bf16, fp16, off"),
    ("model.sync_bn=maybe", "config key 'model.sync_bn' must be bool, got 'maybe'"),
    ("train=3", "config key 'train' must be a section"),
    ("epochs", "override 'epochs' must look like key=value"),
])
def test_errors_name_the_key(override, message):
    with pytest.raises(UserError) as err:
        load_config(None, [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(UserError, match="config file 'nope.yaml' not found"):
        load_config("nope.yaml")
    with pytest.raises(UserError, match=r"c.yaml: line 3 is not valid YAML"):
        load_config(write(tmp_path, "train:\n  epochs: 3\n  batch_size: 1: 2\n"))


def test_saved_config_round_trips(tmp_path):
    cfg = load_config("digits", ["train.epochs=3"])
    path = save_config(cfg, tmp_path)
    assert config_from_dict(yaml.safe_load(path.read_text())) == cfg
    assert config_from_dict(to_dict(Config())) == Config()
