"""The layers' rule, read from the source: ``app/`` never imports ``gpu/``, and ``core/`` reaches
it only through its one door, ``core/executor.py``. Every import counts, those inside
functions and under ``TYPE_CHECKING`` included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOORS = {"core/executor.py"}  # the modules outside gpu/ that may import it


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def device_imports(package: str) -> dict[str, list[str]]:
    """The modules of ``package`` that import ``gpu`` (or torch, Triton), and what."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in DOORS:
            continue
        bad = sorted(name for name in imported_modules(path)
                     if name.split(".")[0] in ("gpu", "torch", "triton"))
        if bad:
            found[rel] = bad
    return found


@pytest.mark.parametrize("package", ["app", "core"])
def test_no_device_code_outside_the_door(package: str) -> None:
    assert device_imports(package) == {}


def test_the_walk_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from gpu.executor import x\n    import torch.nn\n")
    assert {"gpu.executor", "torch.nn"} <= imported_modules(module)
