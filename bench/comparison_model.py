"""The model directory a serving benchmark runs on: a given directory (``--model``), the
embedded model, the random benchmark Llama, or a random model of a real model's shape
(``--shape``, ``bench/model_shapes.py``), optionally its tiny variant (``--tiny``), in
``--shape-dtype``, built once under ``--shape-dir``.

A shape's directory is named for everything that makes it: ``tidal-bench-SHAPE`` for float32
(as before these flags), ``-tiny`` and ``-bfloat16`` added where they apply.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

from bench.common import bench_model_dir
from bench.model_shapes import ALL_SHAPES

SHAPE_DTYPES = ("float32", "bfloat16")


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """``--model``, ``--shape`` and the flags that say how a shape's directory is built."""
    ap.add_argument("--model", default=None,
                    help="HF model directory; 'default' for the embedded model (default: the "
                    "random ~30M-parameter benchmark Llama)")
    ap.add_argument("--shape", choices=list(ALL_SHAPES), default=None,
                    help="instead of --model: a random model of this shape "
                    "(bench/model_shapes.py), built once under --shape-dir; llama-28m is the "
                    "vLLM / llama.cpp comparison's, qwen3-30b-a3b the MoE one's")
    ap.add_argument("--tiny", action="store_true",
                    help="with --shape: its tiny variant (same architecture, every size "
                    "shrunk; a MoE keeps several experts), for smoke runs")
    ap.add_argument("--shape-dtype", choices=SHAPE_DTYPES, default="float32",
                    help="with --shape: the checkpoint's dtype")
    ap.add_argument("--shape-dir", default=None,
                    help="with --shape: the folder its directory is built in (default: the "
                    "temporary directory); a GGUF made for llama.cpp lands beside it")


def check_model_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.model and args.shape:
        ap.error("--model and --shape are alternatives: give one")


def shape_dir(shape: str, tiny: bool = False, dtype: str = "float32",
              where: str | Path | None = None) -> Path:
    """Where ``shape``'s directory is built."""
    name = f"tidal-bench-{shape}" + ("-tiny" if tiny else "")
    name += "" if dtype == "float32" else f"-{dtype}"
    return Path(where or tempfile.gettempdir()) / name


def resolve_model(model: str | None, shape: str | None = None, tiny: bool = False,
                  dtype: str = "float32", where: str | Path | None = None) -> str:
    """The model directory of the flags, built now if it is a shape's and not there yet."""
    if shape:
        import torch

        from bench.model_shapes import build_shaped_model_dir

        return str(build_shaped_model_dir(shape_dir(shape, tiny, dtype, where), shape,
                                          tiny=tiny, dtype=getattr(torch, dtype)))
    if model == "default":
        from tidal.core import DEFAULT_MODEL

        if not DEFAULT_MODEL:
            raise SystemExit("tidal has no embedded default model")
        return str(DEFAULT_MODEL)
    if model:
        return model
    return str(bench_model_dir(Path(tempfile.gettempdir()) / "tidal-bench-llama"))


def resolve_args_model(args: argparse.Namespace) -> str:
    """``resolve_model`` of the flags ``add_model_args`` added."""
    return resolve_model(args.model, args.shape, args.tiny, args.shape_dtype, args.shape_dir)


def model_params_m(model: str) -> float | None:
    """Millions of parameters in the model directory's safetensors files."""
    from safetensors import safe_open

    total = 0
    for path in Path(model).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    return round(total / 1e6, 1) if total else None
