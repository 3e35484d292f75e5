"""``docs/architecture.md``'s module map matches the code: every module of app/, core/, gpu/
and templates/ has its line, and every path the map names exists."""

from __future__ import annotations

import re

from tests.paths import ROOT

PARTS = ("app", "core", "gpu", "templates")
MAP = ROOT / "docs" / "architecture.md"


def modules() -> set[str]:
    """Every module and template file of the package, as a path from the root."""
    found = {"__init__.py", "__main__.py"}  # the package itself, at the root
    for part in PARTS:
        for path in (ROOT / part).rglob("*"):
            if path.suffix in (".py", ".html", ".jinja") and path.name != "__init__.py":
                found.add(path.relative_to(ROOT).as_posix())
    return found


def mapped() -> set[str]:
    """The paths the module map's lines start with."""
    text = MAP.read_text()
    section = text[text.index("## Module map"):]
    return set(re.findall(r"^- `([^`]+)`:", section, re.M))


def test_every_module_has_its_line() -> None:
    assert sorted(modules() - mapped()) == []


def test_every_line_names_a_module_that_exists() -> None:
    assert sorted(mapped() - modules()) == []
