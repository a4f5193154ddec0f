"""The package's wings stand on each other in one order, and no module imports upward.

From the bottom: the settings, the operator's contract (``op``), the GPU executor
(``webgpu``), ONNX Runtime's side (``ort``), generation, the fixtures (``testing``), the
benchmarks, the CLI, and the facade (``sparse_attention_op/__init__.py``) on top. A module may
import its own wing and any wing below it, at module level or inside a function alike.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "sparse_attention_op"
FLOORS = ["settings", "op", "webgpu", "ort", "generation", "testing", "benchmarking", "cli", "__init__", "__main__"]


def wing_of(module: str) -> str:
    """The wing of a dotted module name inside the package ("sparse_attention_op.ort.model" -> "ort")."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def package_imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import of the package in the file, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: relative import (the package imports absolutely)")
        names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names] if isinstance(node, ast.Import) else []
        for name in names:
            if name and name.split(".")[0] == "sparse_attention_op":
                if isinstance(node, ast.ImportFrom) and name == "sparse_attention_op":
                    found.extend((node.lineno, f"sparse_attention_op.{a.name}") for a in node.names)
                else:
                    found.append((node.lineno, name))
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_known_wing():
    for path in MODULES:
        relative = path.relative_to(PACKAGE)
        wing = relative.parts[0].removesuffix(".py")
        assert wing in FLOORS, f"{relative}: not in a known wing"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_wing_above_its_own(path):
    own = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    upward = [f"line {line}: {module}" for line, module in package_imports(path) if FLOORS.index(wing_of(module)) > FLOORS.index(own)]
    assert not upward, f"{path.relative_to(PACKAGE)} ({own}) imports upward: {upward}"


def test_the_layering_rule_catches_an_upward_import(tmp_path):
    """The check itself can fail: a webgpu module that imports the CLI is caught."""
    module = tmp_path / "bad.py"
    module.write_text("def f():\n    from sparse_attention_op.cli.parser import main\n")
    ((line, imported),) = package_imports(module)
    assert FLOORS.index(wing_of(imported)) > FLOORS.index("webgpu")
