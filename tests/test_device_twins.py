"""Quantized models served on ``TIDAL_TEST_DEVICE`` give their CPU twins' greedy tokens.

``--quantization int8`` and ``int4`` on the embedded model, and a GGUF file of Q4_K blocks
(Q8_0 where a row is no multiple of 256) written here from it, each served by a real server
and asked through the official ``openai`` client, against the offline engine on the CPU over
the same weights, both in float32, the twin on torch's paths (each weight dequantized, then
plain float32 maths). On a GPU that is the Triton GEMMs, the int8 head and embedding on the
device, CUDA graphs and async scheduling against that; on the CPU, tidal's kernels. Where
the texts part, the CPU twin's two best tokens there must be a near tie: float32 sums taken in
another order may flip those, and nothing else.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import openai
import pytest
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file

from core import LLM, SamplingParams
from core.config import DEFAULT_MODEL
from tests.gguf_writing import write_gguf
from tests.live_server import running_server

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.slow]

PROMPTS = ["ROMEO:", "To be, or not to be", "KING HENRY:\nOnce more unto the breach",
           "First Citizen:\nBefore we proceed any further"]
TOKENS = 32
NEAR_TIE = 0.02  # nats between the twin's two best tokens where a flip is allowed


def _twin(model: str, **engine_args: object) -> tuple[list, object]:
    llm = LLM(model, device="cpu", dtype="float32", cpu_kernels="off", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=2)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    return outs, llm.tokenizer


def _served(model: str, *args: str) -> list[str]:
    # four requests at most: as few CUDA graphs to capture as that needs
    with running_server(Path(model), "--dtype", "float32", "--max-num-seqs", "4",
                        *args) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        name = client.models.list().data[0].id
        return [client.completions.create(model=name, prompt=p, max_tokens=TOKENS,
                                          temperature=0.0, extra_body={"ignore_eos": True}
                                          ).choices[0].text for p in PROMPTS]


def _assert_twins(served: list[str], twin: list, tokenizer) -> None:
    for text, out in zip(served, twin):
        if text == out.text:
            continue
        step = next(i for i in range(1, len(out.token_ids) + 1)
                    if not text.startswith(tokenizer.decode(out.token_ids[:i])))
        best = sorted(out.logprobs[step - 1].values(), reverse=True)[:2]
        assert best[0] - best[1] < NEAR_TIE, (
            f"served {text!r} left the CPU twin's {out.text!r} at token {step - 1}, where the "
            f"twin's best tokens are {best[0] - best[1]:.3f} nats apart")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_model_serves_its_cpu_twins_tokens(quantization):
    model = DEFAULT_MODEL
    twin, tokenizer = _twin(model, quantization=quantization)
    _assert_twins(_served(model, "--quantization", quantization), twin, tokenizer)


def _q4_k_gguf(out: Path) -> Path:
    """The embedded model as a GGUF file: its decoder linears in Q4_K where their rows take
    256-wide blocks, else Q8_0; the embedding in Q8_0."""
    source, float_dir = Path(DEFAULT_MODEL), out / "float32"
    float_dir.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            (float_dir / f.name).write_bytes(f.read_bytes())
    weights = load_file(source / "model.safetensors")
    save_file({k: v.float().contiguous() for k, v in weights.items()},
              str(float_dir / "model.safetensors"))
    types = {"token_embd.weight": T.Q8_0}
    for name, w in weights.items():
        if w.ndim == 2 and ".layers." in name:
            block = gguf.GGML_QUANT_SIZES[T.Q4_K][0]
            layer, part = name.split(".")[2], name.split(".")[-2]
            gguf_part = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
                         "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
                         "down_proj": "ffn_down"}[part]
            types[f"blk.{layer}.{gguf_part}.weight"] = T.Q4_K if w.shape[1] % block == 0 else T.Q8_0
    path = out / "shakespeare-q4_k.gguf"
    write_gguf(float_dir, path, "llama", types)
    assert sum(t == T.Q4_K for t in types.values()) >= 6 * 6
    return path


def test_a_q4_k_gguf_file_serves_its_cpu_twins_tokens(tmp_path):
    path = str(_q4_k_gguf(tmp_path))
    twin, tokenizer = _twin(path)
    _assert_twins(_served(path), twin, tokenizer)


def test_a_flip_away_from_a_near_tie_is_caught():
    class Out:
        text, token_ids = "ab", [1, 2]
        logprobs = [{1: -0.1, 7: -3.0}, {2: -0.2, 8: -2.0}]

    class Tok:
        @staticmethod
        def decode(ids: list[int]) -> str:
            return "".join({1: "a", 2: "b"}[i] for i in ids)

    _assert_twins(["ab"], [Out()], Tok())
    with pytest.raises(AssertionError, match="at token 1"):
        _assert_twins(["ax"], [Out()], Tok())
    Out.logprobs = [{1: -0.1, 7: -3.0}, {2: -0.70, 8: -0.71}]
    _assert_twins(["ax"], [Out()], Tok())
