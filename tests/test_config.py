"""Config: YAML + dotted overrides into the typed schema, and one-line errors for every mistake."""

from __future__ import annotations

import pytest

from core.config import Config, config_yaml, to_dict
from core.config_load import config_from_dict, load_config
from core.errors import UserError


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
    ("train.batch_size=0", "config key 'train.batch_size' must be > 0, or auto"),
    ("train.batch_size=big", "config key 'train.batch_size' must be > 0, or auto (the largest batch that fits: "
                             "docs/tuning.md), got 'big'"),
    ("tune.steps=3", "config key 'tune.steps' must be at least 10"),
    ("tune.lr_max=1e-7", "config keys 'tune.lr_min' and 'tune.lr_max' must satisfy 0 < lr_min < lr_max"),
    ("optim.lr=-0.1", "config key 'optim.lr' must be >= 0, got -0.1"),
    ("amp=fp8", "config key 'amp' is 'fp8'; choose one of auto, bf16, fp16, off"),
    ("model.sync_bn=maybe", "config key 'model.sync_bn' must be bool, got 'maybe'"),
    ("train=3", "config key 'train' must be a section"),
    ("epochs", "override 'epochs' must look like key=value"),
    ("train.epochs=3 #4", "config key 'train.epochs' must be int, got '3 #4'"),  # never silently cut at '#'
    ("data.scale=[0.2, 1.0] #x", "config key 'data.scale' must be a list of float, got '[0.2, 1.0] #x'"),
    ("optim.lr=.nan", "config key 'optim.lr' must be a finite number, got nan"),
    ("optim.lr=nan", "config key 'optim.lr' must be a finite number, got nan"),
    ("optim.lr=1e999", "config key 'optim.lr' must be a finite number, got inf"),
    ("sched.min_lr=-.inf", "config key 'sched.min_lr' must be a finite number, got -inf"),
    ("data.scale=[0.2, .inf]", "config key 'data.scale[1]' must be a finite number, got inf"),
    ("seed=-1", "config key 'seed' must be in [0, 4294967295], got -1"),
    ("seed=4294967296", "config key 'seed' must be in [0, 4294967295], got 4294967296"),
    ("model.drop_rate=2", "config key 'model.drop_rate' must be in [0, 1), got 2.0"),
    ("model.drop_path_rate=1", "config key 'model.drop_path_rate' must be in [0, 1), got 1.0"),
    ("data.hflip=5", "config key 'data.hflip' must be in [0, 1], got 5.0"),
    ("data.hflip=-0.5", "config key 'data.hflip' must be in [0, 1], got -0.5"),
    ("output_dir=", "config key 'output_dir' is empty"),
    ("output_dir=  ", "config key 'output_dir' is empty"),
    ("data.max_image_pixels=0", "config key 'data.max_image_pixels' must be > 0, got 0"),
    ("data.max_image_pixels=2000000000", "config key 'data.max_image_pixels' must be at most 1073741824"),
    ("logging.profile_steps=[3, 2]", "config key 'logging.profile_steps' must be [start, end] with 1 <= start"),
    ("logging.profile_steps=[0, 2]", "config key 'logging.profile_steps' must be [start, end] with 1 <= start"),
    ("logging.profile_steps=[5]", "config key 'logging.profile_steps' must be [start, end] with 1 <= start"),
    ("train.ckpt_format=dcp", "config key 'train.ckpt_format' is 'dcp'; choose one of file, sharded"),
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
    (tmp_path / "config.yaml").write_text(config_yaml(cfg))
    assert load_config(str(tmp_path / "config.yaml")) == cfg  # --config <run>/config.yaml repeats the run
    assert config_from_dict(to_dict(Config())) == Config()


def test_override_values_with_a_hash_arrive_intact():
    # YAML would read ` #1` as a comment and cut `runs/exp #1` to `runs/exp` (then `exp #2` resumed `exp #1`).
    assert load_config(None, ["output_dir=runs/exp #1"]).output_dir == "runs/exp #1"
    assert load_config(None, ["output_dir=#1"]).output_dir == "#1"
    assert load_config(None, ["logging.wandb_notes=lr 0.1 # try 0.2 next"]).logging.wandb_notes == "lr 0.1 # try 0.2 next"
    assert load_config(None, ["output_dir=runs/exp#1"]).output_dir == "runs/exp#1"  # (no comment without a space)
    assert load_config(None, ["amp='off'", "logging.wandb_tags=[a, 'b #2']"]).logging.wandb_tags == ["a", "b #2"]


def test_leading_zero_is_decimal_not_octal():
    """YAML 1.1 read `seed=010` as octal 8 (issue 51 item 6); YAML 1.2 core reads ten, and `0o10` is octal."""
    assert [load_config(None, [f"seed={text}"]).seed for text in ("010", "0o10", "0x10")] == [10, 8, 16]


def test_base_60_is_not_a_number():
    """YAML 1.1 read `train.epochs=1:30` as 90 (base 60) and trained 90 epochs (issue 51 item 6)."""
    with pytest.raises(UserError, match="config key 'train.epochs' must be int, got '1:30'"):
        load_config(None, ["train.epochs=1:30"])


def test_anchor_in_a_value_is_text():
    """YAML read `output_dir='&x y'` as an anchor named x on `y` (issue 51 item 6); a tag the same way."""
    cfg = load_config(None, ["output_dir=&x y", "logging.wandb_notes=!!int 3"])
    assert (cfg.output_dir, cfg.logging.wandb_notes) == ("&x y", "!!int 3")


def test_seed_and_probability_bounds_are_accepted():
    cfg = load_config(None, ["seed=4294967295", "data.hflip=1", "model.drop_rate=0.99", "optim.lr=1e-3"])
    assert cfg.seed == 2**32 - 1 and cfg.data.hflip == 1.0 and cfg.optim.lr == 0.001


def test_duplicate_keys_are_refused_but_merge_keys_may_be_overridden(tmp_path):
    with pytest.raises(UserError, match=r"c.yaml: line 4 is not valid YAML \(duplicate key 'lr', first on line 2\)"):
        load_config(write(tmp_path, "optim:\n  lr: 0.1\n  momentum: 0.8\n  lr: 0.2\n"))
    with pytest.raises(UserError, match="line 3 is not valid YAML .duplicate key 'optim', first on line 1"):
        load_config(write(tmp_path, "optim: {lr: 0.1}\ntrain: {epochs: 2}\noptim: {momentum: 0.8}\n"))
    # An explicit key beside a `<<` merge overrides the merged one: that is YAML's meaning, not a duplicate.
    cfg = load_config(write(tmp_path, "optim:\n  <<: {lr: 0.1, momentum: 0.8}\n  lr: 0.3\n"))
    assert cfg.optim.lr == 0.3 and cfg.optim.momentum == 0.8


def test_config_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"train:\n  epochs: 3\noutput_dir: runs/caf\xe9\n")
    with pytest.raises(UserError, match=r"config file .*c.yaml is not UTF-8 text \(line 3, byte 0xe9\)"):
        load_config(str(path))


def test_kwargs_mappings_reach_timm_and_bad_ones_are_one_line_errors():
    from engine.optim import build_optimizer
    from models.factory import create_model

    cfg = load_config(None, ["model.name=vit_tiny_patch16_224", "model.kwargs.img_size=32",
                             "model.kwargs={global_pool: avg}", "optim.name=adamw", "optim.kwargs.eps=1e-6"])
    assert cfg.model.kwargs == {"global_pool": "avg"}  # a whole mapping replaces the keys set before it
    cfg = load_config(None, ["model.name=vit_tiny_patch16_224", "model.kwargs.img_size=32",
                             "model.kwargs.global_pool=avg", "optim.name=adamw", "optim.kwargs.eps=1e-6"])
    model = create_model(cfg.model, num_classes=3)
    assert model.patch_embed.img_size == (32, 32) and model.global_pool == "avg"
    assert build_optimizer(model, cfg.optim).defaults["eps"] == 1e-6
    with pytest.raises(UserError, match="config key 'model.kwargs' must be a mapping"):
        load_config(None, ["model.kwargs=[1, 2]"])
    with pytest.raises(UserError, match="rejected optim.kwargs"):
        build_optimizer(model, load_config(None, ["optim.kwargs.no_such_option=1"]).optim)
    with pytest.raises(UserError, match="rejected its options"):
        create_model(load_config(None, ["model.name=resnet10t", "model.kwargs.no_such_option=1"]).model, 3)


def test_init_from_on_the_command_line_overrules_the_config_files_pretrained(tmp_path):
    """Issue 61: `--config finetune model.init_from=w.safetensors` starts from the file (finetune.yaml's
    model.pretrained: true becomes false, and a note for the run's first lines says so); both given on the command
    line are still refused."""
    cfg = load_config("finetune", ["model.init_from=w.safetensors"])
    assert cfg.model.pretrained is False and cfg.model.init_from == "w.safetensors"
    assert cfg.notes == ("model.pretrained=false: model.init_from=w.safetensors on the command line names the "
                         "starting weights, over the config file's model.pretrained: true",)
    assert load_config("finetune").notes == ()
    with pytest.raises(UserError, match="model.pretrained=true and model.init_from=w.safetensors"):
        load_config("finetune", ["model.init_from=w.safetensors", "model.pretrained=true"])
    with pytest.raises(UserError, match="model.pretrained=true and model.init_from"):  # both in one file: its own
        load_config(write(tmp_path, "model:\n  pretrained: true\n  init_from: w.safetensors\n"))


def test_default_loader_workers_are_capped_at_the_cpus_a_given_value_is_kept():
    """Issue 61: finetune.yaml leaves data.num_workers at its default, which a run caps at the process's share of
    the CPUs (torch warns above the cores), saying so; a value the user gave is used as given."""
    from core.startup import cpu_share, default_workers

    assert "data.num_workers" not in load_config("finetune").given
    share = cpu_share(4096)  # 4096 processes on this node: 1 CPU each
    assert default_workers(2, False, 4096) == (share, f"data.num_workers {share}: the default 2, capped at this "
                                                      f"process's {share} CPU(s) (4096 process(es) on this node); "
                                                      "set data.num_workers to choose")
    assert default_workers(4, True, 4096) == (4, None)
    assert default_workers(0, False, 4096) == (0, None)


def test_a_section_given_as_a_mapping_merges_into_the_config_files_section():
    """`data={img_size: 48}` on the digits config keeps its hflip 0.0 and mean/std (was: the section's defaults,
    hflip 0.5 and ImageNet's mean); a free-options mapping inside it still replaces (model.kwargs above)."""
    digits = load_config("digits")
    cfg = load_config("digits", ["data={img_size: 48}", "optim={lr: 0.3}", "model={kwargs: {drop_rate: 0.1}}"])
    assert cfg.data.img_size == 48 and cfg.optim.lr == 0.3 and cfg.model.kwargs == {"drop_rate": 0.1}
    assert to_dict(cfg.data) == {**to_dict(digits.data), "img_size": 48}
    assert cfg.optim.weight_decay == digits.optim.weight_decay == 5e-4 and cfg.model.name == digits.model.name
    assert "data.img_size" in cfg.from_command_line and "data.hflip" not in cfg.from_command_line
