"""tidal installs as one package, ``tidal``, and nothing else at the top level: a fresh virtual
environment holds an editable install beside a user's own ``app`` and ``core`` packages, and
both sides import; the wheel holds ``tidal/`` alone, with every part and its data."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

from tests.paths import ROOT

PARTS = ("app", "core", "gpu", "templates")

USER_SIDE = textwrap.dedent("""
    import sys
    from pathlib import Path

    import app, core
    assert (app.OWNER, core.OWNER) == ("user", "user"), "tidal shadowed the user's packages"

    import tidal
    from tidal import LLM, SamplingParams
    from tidal.app.cli import build_parser
    import tidal.core, tidal.gpu, tidal.templates

    root = Path(sys.argv[1])
    for part in (tidal.app, tidal.core, tidal.gpu, tidal.templates):
        assert Path(part.__file__).resolve().parent.parent == root, part.__file__
    assert LLM.__module__ == "tidal.core.llm" and SamplingParams(max_tokens=3).max_tokens == 3
    assert build_parser().parse_args(["serve"]).command == "serve"
    print("both sides import")
""")


def fresh_venv(tmp_path: Path) -> Path:
    """A venv with no packages of its own; this interpreter's site-packages (torch and the rest
    of tidal's dependencies) reached through a path file, whose own ``.pth`` files (this
    checkout's editable install among them) are not read."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path("
                           "'purelib'))"], check=True, capture_output=True, text=True).stdout
    Path(site.strip(), "outer-site.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


def pip(*args: str, python: Path | None = None) -> None:
    target = ["--python", str(python)] if python else []
    subprocess.run([sys.executable, "-m", "pip", *target, "install", "-q", "--no-deps",
                    "--no-build-isolation", *args], check=True, timeout=300)


def test_an_editable_install_beside_packages_named_app_and_core(tmp_path: Path) -> None:
    python = fresh_venv(tmp_path)
    pip("-e", str(ROOT), python=python)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path("
                                "'purelib'))"], check=True, capture_output=True,
                               text=True).stdout.strip())
    installed = {p.name for p in site.iterdir()} - {"outer-site.pth", "__pycache__"}
    assert not installed & set(PARTS), installed
    assert all("tidal" in name for name in installed), installed

    project = tmp_path / "project"  # a user's project with packages of the same names
    for name in ("app", "core"):
        (project / name).mkdir(parents=True)
        (project / name / "__init__.py").write_text('OWNER = "user"\n')
    run = subprocess.run([str(python), "-c", USER_SIDE, str(ROOT)], cwd=project,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "both sides import" in run.stdout

    for argv in ([str(python), "-m", "tidal", "serve", "--help"],
                 [str(python.parent / "tidal"), "serve", "--help"]):
        shown = subprocess.run(argv, cwd=project, capture_output=True, text=True, timeout=300)
        assert shown.returncode == 0 and "--max-model-len" in shown.stdout, shown.stderr[-3000:]


def test_the_wheel_holds_tidal_alone_with_every_part(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy, so the build leaves nothing in the checkout
    for name in ("pyproject.toml", "README.md", "__init__.py", "__main__.py"):
        (source / name).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, source / name)
    for part in PARTS:
        shutil.copytree(ROOT / part, source / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(source)], check=True,
                   timeout=300, cwd=tmp_path)
    (wheel,) = tmp_path.glob("tidal-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"tidal", wheel.name.split("-")[0] + "-"
                                                 + wheel.name.split("-")[1] + ".dist-info"}
    packages = {str(p.parent.relative_to(ROOT)) for part in PARTS
                for p in (ROOT / part).rglob("__init__.py")}
    missing = sorted(p for p in packages if f"tidal/{p}/__init__.py" not in names)
    assert missing == [], f"pyproject.toml's packages leave out {missing}"
    for data in ("tidal/__main__.py", "tidal/core/default_model/config.json",
                 "tidal/templates/chat.html"):
        assert data in names, data
    assert any(n.startswith("tidal/gpu/cpu/csrc/") and n.endswith(".cpp") for n in names)
