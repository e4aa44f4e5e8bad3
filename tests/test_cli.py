"""The self-documenting CLI: --help lists every config key from the schema, --print-config, --dry-run."""

from __future__ import annotations

import dataclasses
import typing

import yaml

import train
from assembly import launch
from core.cli import report_errors
from core.config import FIRST_KEYS, Config
from core.config_load import config_from_dict, load_config
from tests.helpers import TINY, make_image_folder, train_here


def schema_leaves(cls: type = Config, prefix: str = "") -> list[str]:
    """Every leaf key of the dataclasses, walked independently of core.config's own listing."""
    keys = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        keys += schema_leaves(hint, f"{prefix}{f.name}.") if dataclasses.is_dataclass(hint) else [prefix + f.name]
    return keys


def test_help_lists_every_config_key_with_type_default_and_description(capsys):
    try:
        train.parse_args(["--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    assert out.index("--config finetune data.root=photos") < out.index("the keys people change first")
    first = out[out.index("the keys people change first"):out.index("every config key")].splitlines()[1:]
    assert [line.split()[0] for line in first if line.strip()] == list(FIRST_KEYS)  # the dozen, before the 140
    lines = out[out.index("every config key"):].splitlines()
    defaults = Config()
    for key in schema_leaves():
        [line] = [line for line in lines if line.split()[:1] == [key]]
        _, kind, *rest = line.split(maxsplit=2)
        value = defaults
        for part in key.split("."):
            value = getattr(value, part)
        assert kind.startswith(type(value).__name__) or (value is None and kind.endswith("|null")), line
        assert len(rest) == 1 and len(rest[0].split()) >= 2, f"{key} has no description: {line!r}"


def test_print_config_prints_the_resolved_config_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert report_errors(train.main, ["--config", "dummy", "--print-config", "optim.lr=0.3", "output_dir=x"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert config_from_dict(printed) == load_config("dummy", ["optim.lr=0.3", "output_dir=x"])
    assert printed["optim"]["lr"] == 0.3 and not any(tmp_path.iterdir())


def test_dry_run_passes_a_good_run_without_writing(tmp_path, capsys):
    out = tmp_path / "run"
    assert report_errors(train.main, [*TINY, f"output_dir={out}", "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("dry run passed: test_resnet on 32 train / 10 val images, 10 classes")
    assert not out.exists()


def test_dry_run_catches_a_missing_data_folder_and_a_misspelled_model(tmp_path, capsys):
    """And what the run refuses once the model is built (its placement: it passed --dry-run before)."""
    out = tmp_path / "run"
    root = make_image_folder(tmp_path / "data", {"train": {"a": 4, "b": 4}}, size=20)  # no val/
    cases = [(["data.name=imagefolder", f"data.root={root}"], f"data folder {root}/val does not exist"),
             (["model.name=resnet181"], "unknown model.name 'resnet181'; did you mean: resnet18"),
             ([f"output_dir={root}/train/a/000.png/run"], "cannot be created: " + f"{root}/train/a/000.png is a file"),
             (["model.freeze=backbone", "model.kwargs={num_classes: 0}"],
              "model.freeze=backbone: ResNet has no classifier parameters to train")]
    for args, message in cases:
        assert report_errors(train.main, [*TINY, f"output_dir={out}", *args, "--dry-run"]) == 2
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err and message in err.splitlines()[-1], err
        assert not out.exists()


def test_dry_run_of_a_finished_run_says_so_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    train_here(*TINY, f"output_dir={out}")
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    assert report_errors(train.main, [*TINY, f"output_dir={out}", "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("dry run passed: the resumed run is finished (the line above says why)")
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_readme_reference_table_is_the_schema():
    """docs/configuration.md's table is generated from the schema: every key, nothing hand-kept beside it."""
    from core.config import keys_markdown
    from tests.helpers import REPO

    readme = (REPO / "docs" / "configuration.md").read_text()
    table = readme.split("## Configuration reference", 1)[1].split("\n\n## ", 1)[0]
    assert [line.split("`")[1] for line in table.splitlines() if line.startswith("| `")] == schema_leaves()
    assert keys_markdown() in readme, ("docs/configuration.md's table is stale; regenerate it with "
                                       "python -c 'from core.config import keys_markdown; print(keys_markdown())'")


def test_overrides_in_any_form_and_place_give_one_config(capsys):
    """`key=value`, `--key=value` (a W&B sweep agent's form) and `--key value`, before, between or after the flags,
    give the same config (issue 38 item 3, issue 41 item 15); a misspelt key in either form is today's one line."""
    import evaluate
    import predict

    forms = [["--config", "dummy", "optim.lr=0.1", "--dry-run", "train.epochs=1", "seed=3"],
             ["--optim.lr=0.1", "--config", "dummy", "--train.epochs", "1", "--dry-run", "--seed=3"],
             ["--config", "dummy", "--dry-run", "--optim.lr", "0.1", "train.epochs=1", "--seed", "3"]]
    parsed = [train.parse_args(argv) for argv in forms]
    assert all(args.dry_run for args in parsed)
    configs = [load_config(args.config, args.overrides) for args in parsed]
    assert configs[0] == configs[1] == configs[2] and (configs[0].optim.lr, configs[0].seed) == (0.1, 3)
    for tool in (evaluate, predict):  # their own --output-dir stays theirs
        inputs = ["images"] if tool is predict else []
        args = tool.parse_args(["last.pth", *inputs, "--amp=bf16", "--output-dir", "out", "--data.num_workers", "0"])
        assert (args.overrides, args.output_dir) == (["amp=bf16", "data.num_workers=0"], "out"), args
    cases = [(["--optim.lrr=0.1"], "error: unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),
             (["--optim.lr"], "error: --optim.lr needs a value: --optim.lr=VALUE or optim.lr=VALUE"),
             (["--optim.lr", "--dry-run"], "error: --optim.lr needs a value: --optim.lr=VALUE or optim.lr=VALUE"),
             (["--output_dir", "optim.lr=0.3"],  # the next override is not output_dir's value (issue 51 item 3)
              "error: --output_dir needs a value: --output_dir=VALUE or output_dir=VALUE"),
             (["--model.name", "model.kwargs.drop_rate=0.1"],
              "error: --model.name needs a value: --model.name=VALUE or model.name=VALUE")]
    for args, line in cases:
        assert report_errors(train.main, ["--config", "dummy", "--print-config", *args]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [line]


def test_other_data_without_config_is_refused_not_trained_at_the_quickstarts_settings(tmp_path, capsys):
    """`python train.py data.root=photos` took the digits config (32 px, mean/std 0.5) for the user's photos."""
    for data in (["data.name=imagefolder", f"data.root={tmp_path}"], [f"--data.root={tmp_path}"]):
        assert report_errors(train.main, [*data, "--dry-run"]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert "without --config, whose default is the digits quickstart" in line and "--config finetune" in line
    assert launch.config_file(None, ["optim.lr=0.2"]) == "configs/digits.yaml"  # the quickstart stays the default
