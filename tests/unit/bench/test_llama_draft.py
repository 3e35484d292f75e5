"""llama.cpp's draft-model speculation as a peer: ``--llama-draft DIR`` hands llama-server the
draft's GGUF (made as the model's) after ``-md``, beside the model's own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import bench.peers as peers
import bench.serving_comparison as harness


def test_a_draft_directory_goes_to_llama_server_as_its_gguf(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\necho 'version: 9 (abc)' >&2\n")
    server.chmod(0o755)
    monkeypatch.setenv("TIDAL_BENCH_LLAMA_SERVER", str(server))
    dirs = {}
    for name in ("model", "draft"):
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
        (dirs[name] / "config.json").write_text("{}")
        peers.gguf_path(dirs[name]).write_bytes(b"GGUF")  # newer: no conversion
    args = harness.parse_args(["--peer", "llamacpp", "--llama-draft", str(dirs["draft"]),
                               "--llamacpp-arg=--spec-type", "--llamacpp-arg=draft-simple"])
    (llama,), skipped = peers.find_peers(args.peer, args, str(dirs["model"]),
                                         {"concurrency": 1, "sequence_tokens": 256})
    assert skipped == {}
    draft_gguf = str(tmp_path / "draft-f32.gguf")
    assert llama.args[llama.args.index("-md") + 1] == draft_gguf
    assert llama.args[-2:] == ["--spec-type", "draft-simple"]
    assert llama.describe()["draft_gguf"] == draft_gguf and "-t" in llama.args
    assert str(os.cpu_count()) in llama.args
