"""The Python packages tidal and its GPU test suite need beside torch and Triton, as
``bench/gpu_packages.txt`` lists them: parsed, checked by importing each, and the wheels to
carry to a GPU machine that has no network (``python -m bench.gpu_check --packages``)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module, metadata
from pathlib import Path
from typing import Any

PACKAGES_FILE = Path(__file__).with_name("gpu_packages.txt")


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    module: str  # what ``import`` names
    preinstalled: bool = False  # on the GPU machine's image: checked, not carried
    optional: bool = False  # missing: reported, the check goes on


@dataclass
class PackageStatus:
    package: Package
    found: str | None  # the installed version, None if its metadata is absent
    error: str | None  # why it failed to import, None if it imported

    @property
    def missing(self) -> bool:
        return self.error is not None

    @property
    def other_version(self) -> bool:
        return not self.missing and self.found != self.package.version


def parse_packages(text: str) -> list[Package]:
    """``name==version [module] [(preinstalled)] [(optional)]`` lines; ``#`` starts a comment."""
    packages = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        flags = {w for w in words[1:] if w.startswith("(")}
        rest = [w for w in words[1:] if not w.startswith("(")]
        name, sep, version = words[0].partition("==")
        if not (sep and name and version) or len(rest) > 1 or \
                flags - {"(preinstalled)", "(optional)"}:
            raise ValueError(f"line {number}: expected 'name==version [module] [(flags)]': "
                             f"{line!r}")
        module = rest[0] if rest else name.lower().replace("-", "_")
        packages.append(Package(name, version, module, "(preinstalled)" in flags,
                                "(optional)" in flags))
    return packages


def read_packages(path: Path = PACKAGES_FILE) -> list[Package]:
    return parse_packages(path.read_text())


def check_packages(packages: list[Package]) -> list[PackageStatus]:
    """Import each package; read its installed version from its metadata."""
    statuses = []
    for package in packages:
        try:
            found: str | None = metadata.version(package.name)
        except metadata.PackageNotFoundError:
            found = None
        try:
            import_module(package.module)
            error = None
        except Exception as exc:  # ImportError, or a broken build failing as it loads
            error = f"{type(exc).__name__}: {exc}"
        statuses.append(PackageStatus(package, found, error))
    return statuses


def carried_requirements(packages: list[Package], every: bool = False) -> list[str]:
    """``name==version`` of the wheels to carry (``every``: the preinstalled ones too)."""
    return [f"{p.name}=={p.version}" for p in packages if every or not p.preinstalled]



def package_table(statuses: list[dict[str, Any]]) -> str:
    rows = [s for s in statuses if s["error"] or s["found"] != s["package"]["version"]]
    if not rows:
        return "Every package imports, at the listed version."
    lines = ["| package | listed | found | |", "|---|---|---|---|"]
    for s in rows:
        p = s["package"]
        kind = "optional" if p["optional"] else "required"
        note = f"missing ({kind}): {s['error']}" if s["error"] else "other version"
        lines.append(f"| {p['name']} | {p['version']} | {s['found'] or '-'} | "
                     f"{note.replace('|', '/')} |")
    return "\n".join(lines)
