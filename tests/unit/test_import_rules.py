"""The layers' rule, read from the source: ``app/`` never imports ``gpu/``, and ``core/`` reaches
it only through its one door, ``core/executor.py``; and every part is imported as ``tidal.*``.
Every import counts, those inside functions and under ``TYPE_CHECKING`` included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.paths import ROOT

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


def is_device_module(name: str) -> bool:
    """``tidal.gpu`` and what is under it, torch and Triton."""
    return name == "tidal.gpu" or name.startswith("tidal.gpu.") or (
        name.split(".")[0] in ("torch", "triton"))


def device_imports(package: str) -> dict[str, list[str]]:
    """The modules of ``package`` that import ``tidal.gpu`` (or torch, Triton), and what."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in DOORS:
            continue
        bad = sorted(name for name in imported_modules(path) if is_device_module(name))
        if bad:
            found[rel] = bad
    return found


@pytest.mark.parametrize("package", ["app", "core"])
def test_no_device_code_outside_the_door(package: str) -> None:
    assert device_imports(package) == {}


def test_the_walk_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from tidal.gpu.executor import x\n    import torch.nn\n"
                      "from tidal import gpu\n")
    found = {name for name in imported_modules(module) if is_device_module(name)}
    assert found >= {"tidal.gpu.executor", "torch.nn", "tidal.gpu"}


PARTS = ("app", "core", "gpu", "templates")


@pytest.mark.parametrize("folder", [*PARTS, "tests", "bench"])
def test_the_parts_are_imported_through_tidal(folder: str) -> None:
    """``app``, ``core``, ``gpu`` and ``templates`` are installed as ``tidal.*`` alone: an import
    of the bare name would find some other project's package, or none."""
    bare = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        names = sorted(n for n in imported_modules(path) if n.split(".")[0] in PARTS)
        if names:
            bare[path.relative_to(ROOT).as_posix()] = names
    assert bare == {}


def test_model_files_hold_only_the_architecture() -> None:
    """A file under ``gpu/models/`` composes the shared layers: which backend runs each one (the
    CPU's plans and one-call decode step, quantized layers) is decided in the layers and the
    runner, never here."""
    backend = ("tidal.gpu.cpu", "tidal.gpu.quantization")
    found = {}
    for path in sorted((ROOT / "gpu" / "models").rglob("*.py")):
        bad = sorted(n for n in imported_modules(path)
                     if any(n == b or n.startswith(b + ".") for b in backend))
        if bad:
            found[path.relative_to(ROOT).as_posix()] = bad
    assert found == {}


def test_the_dense_model_file_stays_small() -> None:
    assert len((ROOT / "gpu" / "models" / "llama.py").read_text().splitlines()) <= 150
