"""The layers of docs/architecture.md, checked on the source by folder: no import runs the wrong way.

core/ is the ground floor; data/ and models/ stand on it; engine/ on core/ alone; engine/checkpoint/ (the one
place checkpoints are read, written and put back) on core/ alone; assembly/ (the one package that combines data,
models and engine into runs) on all of them; the entry points at the top make one call into assembly/.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from tests.helpers import REPO

APP_PACKAGES = ("core", "data", "engine", "models", "assembly")
ENTRY_POINTS = ("train.py", "evaluate.py", "predict.py", "export.py", "benchmark.py", "average_checkpoints.py",
                "audit.py")


def app_imports(path: Path) -> set[str]:
    """The app modules (core.x, data.x, engine.x, models.x) a source file imports, at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        found |= {name for name in names if name.split(".")[0] in APP_PACKAGES}
    return found


def modules(folder: str) -> dict[str, set[str]]:
    """Each module under `folder` (at any depth) with the app modules it imports."""
    return {str(path.relative_to(REPO)): app_imports(path) for path in sorted((REPO / folder).rglob("*.py"))}


def outside(folder: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    """The imports of `folder`'s modules that are not under one of the `allowed` dotted prefixes."""
    wrong = {name: sorted(i for i in imports if not i.startswith(allowed) and not is_package_only(i))
             for name, imports in modules(folder).items()}
    return {name: bad for name, bad in wrong.items() if bad}


def is_package_only(name: str) -> bool:
    """`from engine.checkpoint import sharded` also yields the package name itself: judged by its module."""
    return (REPO / name.replace(".", "/")).is_dir()


def test_core_imports_only_core():
    assert not outside("core", ("core.",))


def test_data_and_models_import_only_core_and_themselves():
    assert not outside("data", ("core.", "data."))
    assert not outside("models", ("core.", "models."))


def test_engine_imports_only_core_and_itself():
    assert not outside("engine", ("core.", "engine."))


def test_the_checkpoint_wing_imports_only_core_and_itself():
    assert not outside("engine/checkpoint", ("core.", "engine.checkpoint."))


def combined(imports: set[str]) -> set[str]:
    """Which of data/, models/ and engine/ a module's imports reach."""
    return {name.split(".")[0] for name in imports} & {"data", "models", "engine"}


def test_only_the_assembly_floor_combines_data_models_and_engine():
    """Any module that needs two of data/, models/ and engine/ belongs in assembly/; the entry points use assembly/
    and core/ alone, and nothing below assembly/ imports it."""
    below = {name: combined(imports) for folder in ("core", "data", "models", "engine")
             for name, imports in modules(folder).items()}
    assert not {name: found for name, found in below.items() if len(found) > 1}
    assert not {name: bad for folder in ("core", "data", "models", "engine")
                for name, bad in outside(folder, ("core.", "data.", "models.", "engine.")).items()}
    entries = {name: sorted(i for i in app_imports(REPO / name) if i.split(".")[0] not in ("assembly", "core"))
               for name in ENTRY_POINTS}
    assert not {name: bad for name, bad in entries.items() if bad}


def test_the_entry_points_are_thin():
    """Argument parsing and one call: each entry point well under 150 lines (issue 47)."""
    assert {name: n for name in ENTRY_POINTS if (n := len((REPO / name).read_text().splitlines())) >= 150} == {}


def test_the_rules_see_a_wrong_import(tmp_path, monkeypatch):
    """The folder rule fails on a module that breaks it (a test of the test: it reads what it should)."""
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "bad.py").write_text("from engine.trainer import TrainParts\n")
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    assert outside("core", ("core.",)) == {"core/bad.py": ["engine.trainer", "engine.trainer.TrainParts"]}


def test_no_test_module_imports_another():
    """Helpers shared by tests live in tests/helpers.py, tests/compare.py and the like, never in a test module:
    trimming one test module must not break another."""
    wrong = {name: sorted(i for i in app_imports_of_tests(REPO / name) if i.startswith("tests.test_"))
             for name in modules("tests")}
    assert not {name: bad for name, bad in wrong.items() if bad}


def app_imports_of_tests(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def test_package_inits_do_nothing_on_import():
    for init in [REPO / package / "__init__.py" for package in APP_PACKAGES] + [REPO / "engine/checkpoint/__init__.py"]:
        tree = ast.parse(init.read_text())
        assert all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in tree.body), init


def module_graph() -> dict[str, set[str]]:
    """Each app module (dotted) with the app modules it imports, at any depth (deferred imports included)."""
    graph = {}
    for package in APP_PACKAGES:
        for name, imports in modules(package).items():
            graph[name.removesuffix(".py").replace("/", ".")] = {i for i in imports
                                                                 if (REPO / f"{i.replace('.', '/')}.py").is_file()}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of `graph` (a list that starts and ends with the same module), or [] when there is none."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return []
        for imported in sorted(graph.get(node, ())):
            if cycle := visit(imported, path + [node]):
                return cycle
        done.add(node)
        return []

    return next((cycle for node in sorted(graph) if (cycle := visit(node, []))), [])


def test_no_import_circle():
    """No app module reaches itself through its imports (data.loader and data.mixing did, one import deferred)."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]  # it sees one
    assert find_cycle(module_graph()) == []


def test_each_fact_on_a_schema_field_is_what_the_app_uses():
    """The choices and ranges on the fields are what loading refuses, and continues= is what a resume may change:
    every field, in a loop over the schema (no table beside it can drift)."""
    from core.config import Config, key_facts, to_dict
    from core.config_load import load_config
    from core.errors import UserError
    from engine.checkpoint.resume import continuation_changes

    outside = {"> 0": 0, ">= 0": -1, "[0, 1]": 1.5, "[0, 1)": 1}
    for key, facts in key_facts().items():
        refused = ([(f"{key}=nonsense", f"config key {key!r} is 'nonsense'; choose one of {', '.join(facts.choices)}")]
                   if facts.choices else [])
        if facts.within:
            where = f"in {facts.within}" if facts.within.startswith("[") else facts.within
            refused.append((f"{key}={outside[facts.within]}", f"config key {key!r} must be {where}, got "))
        for override, message in refused:
            with pytest.raises(UserError) as err:
                load_config(None, [override])
            assert str(err.value).startswith(message), (override, str(err.value))
        if key != "resume":  # how the run was started: never a change (resume.config_diff)
            saved = to_dict(Config())
            *sections, leaf = key.split(".")
            functools.reduce(dict.__getitem__, sections, saved)[leaf] = "another value"
            assert (continuation_changes(saved, Config()) == []) == facts.continues, key
