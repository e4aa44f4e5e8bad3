"""The package layers of docs/architecture.md, checked on the source: no import runs the wrong way."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

BOTTOM = {"engine.errors", "engine.config", "engine.config_checks", "engine.config_load", "engine.dist", "engine.logs",
          "engine.metrics", "engine.precision", "engine.startup", "engine.host_memory", "engine.prefetch", "engine.signals",
          "engine.outputs"}
APP_PACKAGES = ("engine", "data", "models")


def app_imports(path: Path) -> set[str]:
    """The app modules (engine.x, data.x, models.x) a source file imports, at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found |= {name for name in names if name.split(".")[0] in APP_PACKAGES}
    return found


def modules(package: str) -> dict[str, set[str]]:
    return {f"{package}.{path.stem}": app_imports(path) for path in sorted((REPO / package).glob("*.py"))
            if path.stem != "__init__"}


def test_the_bottom_layer_imports_only_itself():
    engine = modules("engine")
    assert BOTTOM <= set(engine)
    wrong = {name: sorted(imports - BOTTOM) for name, imports in engine.items() if name in BOTTOM and imports - BOTTOM}
    assert not wrong, wrong


def test_engine_never_imports_data_or_models():
    wrong = {name: sorted(i for i in imports if not i.startswith("engine"))
             for name, imports in modules("engine").items()}
    assert not {name: bad for name, bad in wrong.items() if bad}


def test_data_and_models_import_only_the_bottom_layer_and_themselves():
    for package in ("data", "models"):
        wrong = {name: sorted(i for i in imports if not i.startswith(package) and i not in BOTTOM)
                 for name, imports in modules(package).items()}
        assert not {name: bad for name, bad in wrong.items() if bad}, package


def test_package_inits_do_nothing_on_import():
    for package in APP_PACKAGES:
        tree = ast.parse((REPO / package / "__init__.py").read_text())
        assert all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in tree.body), package
