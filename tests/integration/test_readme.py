"""The README's commands, run as written: the quick tour (curl, the ``openai`` client, the
websocket client, the chat page, the offline ``LLM``) against a live server started by the
README's own serve command, the ``tidal`` commands and the model-directory serve line of its
"Serving" section, its flags table against ``tidal serve --help``, its length, and the links
of the README and of ``docs/``. A README edit that breaks a command fails here.

The set-up lines (install and serve, the test command, the CPU-only install) are run by CI,
``.ci/run``, which finds them by their trailing markers; this module checks that every other
command in the README is one it runs.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.processes import ROOT, LaunchedServer
from tidal.gpu.random_model import build_model_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]

README = ROOT / "README.md"
MAX_LINES = 250
# the address the README's commands use, replaced by the test server's
README_HOSTS = ("localhost:8000", "127.0.0.1:8000")
# the set-up lines .ci/run runs, by their markers
CI_MARKERS = ("# serve-command", "# test-command", "# cpu-install")
SNIPPET_TIMEOUT = 600  # the offline LLM may build the CPU kernels on a first run


@dataclass
class Block:
    section: str  # the "## " heading it sits under
    lang: str
    body: str


def readme_blocks(text: str) -> list[Block]:
    blocks, section = [], ""
    for match in re.finditer(r"^## ([^\n]+)$|^```(\w*)\n(.*?)^```$", text, re.M | re.S):
        if match.group(1) is not None:
            section = match.group(1).strip()
        else:
            blocks.append(Block(section, match.group(2), match.group(3)))
    return blocks


def commands(block: Block) -> list[str]:
    return [line.strip() for line in block.body.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


TEXT = README.read_text()
BLOCKS = readme_blocks(TEXT)
TOUR = [b for b in BLOCKS if b.section == "Quick tour"]
SERVING = [b for b in BLOCKS if b.section == "Serving"]
# its commands are run by tests/integration/test_router.py
REPLICAS_SECTION = "Several replicas behind a router"


def at(url: str, port: int) -> str:
    for host in README_HOSTS:
        url = url.replace(host, f"127.0.0.1:{port}")
    return url


class ReadmeServer(LaunchedServer):
    """A server started by a command line from the README, on a free port."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        super().__init__("", [])

    def command(self) -> list[str]:
        return [*self.argv, "--port", str(self.port)]


def python_argv(command: str) -> list[str]:
    """``python -m tidal ...`` or ``tidal ...`` as this interpreter runs it, on this checkout."""
    argv = shlex.split(command)
    if argv[0] == "tidal":
        return [sys.executable, "-m", "tidal", *argv[1:]]
    assert argv[:3] == ["python", "-m", "tidal"], command
    return [sys.executable, *argv[1:]]


@pytest.fixture(scope="module")
def server() -> Iterator[ReadmeServer]:
    """The server of the README's first set-up command: ``python -m tidal serve``, the embedded
    model, on its defaults but for the port."""
    (setup,) = [line for b in BLOCKS for line in commands(b) if line.endswith("# serve-command")]
    serve = setup.removesuffix("# serve-command").split("&&")[-1].strip()
    srv = ReadmeServer(python_argv(serve))
    try:
        srv.wait_ready(600)
        yield srv
    finally:
        srv.stop()


# -- the README itself ---------------------------------------------------------------------
def test_readme_is_short_and_every_command_is_run_somewhere() -> None:
    assert len(TEXT.splitlines()) <= MAX_LINES
    set_up = [line for b in BLOCKS if b.section == "Set up" for line in commands(b)]
    assert len(set_up) == 2, "the set-up is two commands: install and serve, and the tests"
    assert all(" && " in line and line.startswith("python3 -m venv") for line in set_up)
    assert set_up[0].endswith("# serve-command") and set_up[1].endswith("# test-command")
    ci = (ROOT / ".ci" / "run").read_text()
    for marker in CI_MARKERS:
        assert marker.removeprefix("# ") in ci, f".ci/run does not run the {marker!r} line"
    for block in BLOCKS:
        if block.lang not in ("bash", "sh", "shell"):
            continue
        for line in commands(block):
            run_here = block.section in ("Quick tour", "Serving", REPLICAS_SECTION)
            assert run_here or line.endswith(CI_MARKERS), (
                f"a README command that no test or CI step runs: {line!r}")


def test_flags_table_is_tidal_serve_help() -> None:
    """Every flag of ``tidal serve``, in the README's table under its --help group, and no
    other."""
    from tidal.app.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    groups = {group.title: {opt for action in group._group_actions
                            for opt in action.option_strings if opt != "-h" and opt != "--help"}
              for group in serve._action_groups if group._group_actions}
    groups = {title: flags for title, flags in groups.items() if flags}
    table, title = {}, None
    for row in section(TEXT, "Serving").splitlines():
        if row.startswith("| **"):
            title = row.split("**")[1]
            table[title] = set()
        elif row.startswith("| `--") and title is not None:
            table[title] |= set(re.findall(r"`(--[a-z-]+)", row.split("|")[1]))
    assert table == groups


def test_links_resolve() -> None:
    """The README's and the docs' relative links, and the repository paths they name."""
    pages = [README, *sorted((ROOT / "docs").glob("*.md")),
             ROOT / "bench" / "results" / "README.md"]
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not target.startswith(("http://", "https://")):
                assert (page.parent / target).exists(), f"{page.name}: broken link {target}"
        for path in re.findall(r"`((?:app|bench|core|docs|gpu|templates|tests)/[\w./-]+)`"
                               r"(?! in git history)", text):
            assert (ROOT / path.rstrip(".")).exists(), f"{page.name}: no such path {path}"


# -- the quick tour, against the README's server -------------------------------------------
def test_quick_tour_has_every_client() -> None:
    bodies = "\n".join(b.body for b in TOUR)
    curls = [line for b in TOUR if b.lang == "bash" for line in commands(b)]
    assert len(curls) >= 2 and all(line.startswith("curl ") for line in curls)
    for needle in ("from openai import OpenAI", "websockets.connect", "LLM("):
        assert needle in bodies, f"the quick tour lost its {needle!r} example"


@pytest.mark.parametrize("command", [line for b in TOUR if b.lang == "bash"
                                     for line in commands(b)])
def test_quick_tour_curl(server: ReadmeServer, command: str) -> None:
    done = subprocess.run(["bash", "-o", "pipefail", "-c", at(command, server.port)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and '"error"' not in done.stdout, done.stdout
    if " -N " in command:  # a stream ends with [DONE]
        assert done.stdout.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("snippet", [b.body for b in TOUR if b.lang == "python"],
                         ids=lambda body: body.splitlines()[0][:40])
def test_quick_tour_python(server: ReadmeServer, snippet: str, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(at(snippet, server.port))
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=SNIPPET_TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), done.stderr


def test_quick_tour_page(server: ReadmeServer) -> None:
    (url,) = set(re.findall(r"<(http://[^>]+/)>", section(TEXT, "Quick tour")))
    with urllib.request.urlopen(at(url, server.port), timeout=30) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/html")


def test_startup_banner(server: ReadmeServer) -> None:
    """The server says what it will do, once its engine is up."""
    log = Path(server.log.name).read_text()
    url = f"http://127.0.0.1:{server.port}"
    for line in ("serving tidal-shakespeare", "model     ", "device    cpu, float32",
                 "context   256 tokens", "requests of the full context", "kernels   --cpu-kernels",
                 f"API       {url}/v1", f"page      {url}/", f"metrics   {url}/metrics"):
        assert line in log, f"{line!r} not in the start-up log:\n{log}"


# -- the "Serving" section ----------------------------------------------------------------
def test_serving_commands(tmp_path: Path) -> None:
    from tidal.app.banner import package_version

    lines = [line for b in SERVING for line in commands(b)]
    assert lines, "the Serving section lost its commands"
    for line in lines:
        argv = python_argv(line)
        if "serve" in argv and "--help" not in argv:  # a model directory, served
            model = build_model_dir(tmp_path / "hf-model-dir", "llama",
                                    max_position_embeddings=4096)
            argv = [str(model) if a == "path/to/hf-model-dir" else a for a in argv]
            port = argv.index("--port")
            srv = ReadmeServer(argv[:port] + argv[port + 2:])
            try:
                srv.wait_ready(600)
                with urllib.request.urlopen(srv.url + "/v1/models", timeout=30) as resp:
                    assert str(model) in resp.read().decode()
            finally:
                srv.stop()
            continue
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        if "--version" in argv:
            assert done.stdout.strip() == f"tidal {package_version()}"
        else:  # tidal serve --help, grouped by topic
            for group in ("model:", "server:", "engine and scheduler:",
                          "device (CPU and GPU):", "API and security:", "logging:"):
                assert f"\n{group}\n" in done.stdout
