"""GGUF files as models: the blocks unpack to what ``gguf.quants.dequantize`` (the reference)
gives, stay quantized, and a file written here serves the greedy tokens and logprobs HF
transformers gives on the same weights dequantized; its tokenizer comes from its metadata."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.device import on_test_device
from tests.gguf_writing import add_config, llama_cpp_permute, quantize, write_gguf
from tests.live_server import running_server
from tidal.core import LLM, SamplingParams
from tidal.core.config import EngineConfig, load_tokenizer
from tidal.gpu.checkpoints import checkpoint_weights, linears_arrive_quantized
from tidal.gpu.checkpoints.gguf_blocks import to_weight
from tidal.gpu.checkpoints.gguf_file import unpermute_rows
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.quantization.linear import QuantLinear
from tidal.gpu.quantization.weights import QuantizedWeight, cat_rows
from tidal.gpu.random_model import build_model_dir

NEW_TOKENS = 16
SHAPE = {"hidden_size": 256, "intermediate_size": 512}  # rows of 256: the K types fit
# per layer: mixed types, as llama.cpp's Q4_K_M mixes Q4_K and Q6_K (q/k/v fused across them)
LAYER_TYPES = [
    {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q8_0,
     "ffn_gate": T.Q4_0, "ffn_up": T.Q4_0, "ffn_down": T.Q6_K},
    {"attn_q": T.Q8_0, "attn_k": T.Q8_0, "attn_v": T.Q8_0, "attn_output": T.Q4_K,
     "ffn_gate": T.Q4_K, "ffn_up": T.Q4_K, "ffn_down": T.Q4_0},
]
# bits, group size, offsets: what each type is kept as
FORMATS = {T.Q8_0: (8, 32, False), T.Q4_0: (4, 32, True), T.Q4_K: (4, 32, True),
           T.Q6_K: (8, 16, False)}
TEXTS = ["Hello world! The quick brown fox.", "café naïve 你好世界 😀🎉", "<|user|>\nhi<|end|>",
         "Numbers like 12345 and 678.9 appear"]


def _types(config: dict) -> dict[str, T]:
    """Each weight's type; K types fall back to Q8_0 on rows not a multiple of 256."""
    q_width = config["num_attention_heads"] * (config.get("head_dim") or 64)
    types = {"token_embd.weight": T.Q8_0, "output.weight": T.Q6_K}
    for layer, parts in enumerate(LAYER_TYPES):
        for part, qtype in parts.items():
            width = q_width if part == "attn_output" else (
                config["intermediate_size"] if part == "ffn_down" else config["hidden_size"])
            fits = width % gguf.GGML_QUANT_SIZES[qtype][0] == 0
            types[f"blk.{layer}.{part}.weight"] = qtype if fits else T.Q8_0
    return types


_BUILT: dict[str, tuple[Path, Path, AutoModelForCausalLM]] = {}


def _model(arch: str, tmp_path_factory) -> tuple[Path, Path, AutoModelForCausalLM]:
    """The HF directory, the GGUF written from it, and the float HF twin of the GGUF's
    weights (dequantized by the reference), built once per session."""
    if arch not in _BUILT:
        root = tmp_path_factory.mktemp(f"gguf-{arch}")
        model_dir = build_model_dir(root / "hf", arch, **SHAPE)
        config = json.loads((model_dir / "config.json").read_text())
        path = root / f"{arch}.gguf"
        twin_weights = write_gguf(model_dir, path, arch, _types(config))
        twin = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in twin_weights.items()}
        missing, unexpected = twin.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        twin.generation_config.eos_token_id = None
        _BUILT[arch] = (model_dir, path, twin)
    return _BUILT[arch]


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def model(request, tmp_path_factory):
    return _model(request.param, tmp_path_factory)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K, T.BF16, T.F16, T.F32])
def test_blocks_unpack_to_the_reference_dequantization(qtype):
    rng = np.random.default_rng(int(qtype))
    w = (rng.standard_normal((6, 512)) * rng.uniform(0.01, 2, (6, 1))).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block
    packed = quantize(w, qtype)
    got = to_weight("blk.0.attn_q.weight", qtype, packed)
    reference = torch.from_numpy(gguf.quants.dequantize(packed, qtype).reshape(w.shape))
    if qtype in FORMATS:
        assert isinstance(got, QuantizedWeight)
        assert (got.bits, got.group_size, got.offsets is not None) == FORMATS[qtype]
        got = got.dequantize()
    torch.testing.assert_close(got.float(), reference, rtol=0, atol=1e-6)


def test_unpermute_undoes_llama_cpp_permute():
    rows = np.arange(4 * 16 * 3).reshape(4 * 16, 3)
    assert (llama_cpp_permute(rows, 4)[unpermute_rows(64, 4)] == rows).all()


def test_mixed_formats_fuse_exactly():
    rng = np.random.default_rng(0)
    parts = [to_weight("x", t, quantize(rng.standard_normal((4, 256)).astype(np.float32), t))
             for t in (T.Q4_K, T.Q6_K, T.Q4_0)]
    fused = cat_rows(parts)
    assert (fused.bits, fused.group_size) == (8, 16)
    torch.testing.assert_close(fused.dequantize(),
                               torch.cat([p.dequantize() for p in parts]), rtol=0, atol=0)


def test_weights_stay_quantized(tmp_path_factory):
    _, path, _ = _model("llama", tmp_path_factory)
    weights = dict(checkpoint_weights(path))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantizedWeight) and q.bits == 4 and q.q.dtype == torch.uint8
    assert isinstance(weights["model.layers.0.input_layernorm.weight"], torch.Tensor)


def test_float_linears_are_never_allocated(model):
    """Every decoder linear of these files is quantized: the model leaves out their float
    weights (biases stay floats and do not count)."""
    assert linears_arrive_quantized(model[1])
    assert not linears_arrive_quantized(model[0])


def test_config_from_metadata_matches_the_directory(model):
    model_dir, path, _ = model
    got, want = ModelConfig.load(path), ModelConfig.from_dir(model_dir)
    assert got.rope_theta == want.rope_theta
    got.rope_scaling = want.rope_scaling = {}  # the directory's names the default rope type
    assert got == want


@pytest.mark.gpu
def test_greedy_tokens_and_logprobs_match_hf_on_the_dequantized_weights(model):
    _, path, twin = model
    llm = LLM(str(path), dtype="float32", **on_test_device())
    layers = llm.engine.executor.runner.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj, QuantLinear)
    _check_against_twin(llm, twin)


@pytest.mark.slow
def test_two_tensor_parallel_ranks_match_hf_on_the_dequantized_weights(tmp_path_factory):
    """Each rank holds its cut of the quantized blocks (mixed types fused across q/k/v)."""
    _, path, twin = _model("llama", tmp_path_factory)
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2)
    try:
        _check_against_twin(llm, twin)
    finally:
        llm.shutdown()


def _check_against_twin(llm: LLM, twin: AutoModelForCausalLM) -> None:
    prompts = [[5 + (7 * i + 3 * j) % 400 for j in range(n)] for i, n in enumerate((1, 9, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        ref = twin.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                            output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        ref_ids = ref.sequences[0, len(prompt):].tolist()
        ref_logprobs = torch.log_softmax(torch.stack(ref.logits)[:, 0].float(), dim=-1)
        assert out.outputs[0].token_ids == ref_ids
        for step, got in enumerate(out.outputs[0].logprobs):
            top = torch.topk(ref_logprobs[step], 3)
            for ref_id, ref_value in zip(top.indices.tolist(), top.values.tolist()):
                assert got[ref_id] == pytest.approx(ref_value, abs=1e-4)


def test_tokenizer_and_chat_template_from_metadata(tmp_path_factory):
    model_dir, path, _ = _model("llama", tmp_path_factory)
    ours = load_tokenizer(EngineConfig(model=str(path)))
    hf = AutoTokenizer.from_pretrained(model_dir)
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text)
        assert ours.decode(hf.encode(text)) == text
    assert (ours.bos_token, ours.eos_token) == (hf.bos_token, hf.eos_token)
    chat = [{"role": "user", "content": "Tell me a joke"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    named = load_tokenizer(EngineConfig(model=str(path), tokenizer=str(model_dir)))
    assert named.encode(TEXTS[1]) == hf.encode(TEXTS[1])


def _tiny_gguf(path: Path, arch: str) -> gguf.GGUFWriter:
    """A writer with a one-layer model's settings: for metadata-only tests."""
    writer = gguf.GGUFWriter(path, arch)
    add_config(writer, {"num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 64,
                        "num_hidden_layers": 1, "max_position_embeddings": 64,
                        "intermediate_size": 128, "rms_norm_eps": 1e-6})
    return writer


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.add_tensor("output_norm.weight", np.ones(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_tokenizer_from_metadata(tmp_path):
    """A Llama 2 / Mistral style vocabulary (``llama``: scores, byte fallback, BOS added)."""
    pieces = ["▁", "▁H", "ello", "▁world", "e", "l", "o", "H", "w", "r", "d"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256)), *pieces]
    writer = _tiny_gguf(tmp_path / "sp.gguf", "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}")
    _finish(writer)
    tok = load_tokenizer(EngineConfig(model=str(tmp_path / "sp.gguf")))
    for text in ("Hello world", "héllo wörld"):  # é and ö by byte fallback
        ids = tok.encode(text)
        assert ids[0] == 1 and tok.decode(ids, skip_special_tokens=True) == text
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "[INST] hi [/INST]"


def test_unsupported_type_names_the_tensor(tmp_path_factory, tmp_path):
    model_dir, _, _ = _model("llama", tmp_path_factory)
    path = tmp_path / "q5.gguf"
    write_gguf(model_dir, path, "llama", {"blk.1.ffn_up.weight": T.Q5_0})
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_up\.weight' is Q5_0"):
        list(checkpoint_weights(path))


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "gemma.gguf"
    _finish(_tiny_gguf(path, "gemma"))
    with pytest.raises(ValueError, match="architecture 'gemma'"):
        ModelConfig.load(path)
    with pytest.raises(ValueError, match="directory with a config.json or a .gguf file"):
        EngineConfig(model=str(tmp_path / "missing.gguf"))


@pytest.mark.gpu
@pytest.mark.slow
def test_server_serves_a_gguf_file(tmp_path_factory, monkeypatch):
    _, path, _ = _model("llama", tmp_path_factory)
    monkeypatch.setenv("TIDAL_CPU_KERNELS", "off")  # the GGUF path end to end, no C++ build
    with running_server(path) as server:
        models = httpx.get(f"{server.url}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [str(path)]
        body = {"model": str(path), "prompt": "Hello world", "max_tokens": 8, **{
            "temperature": 0.0, "ignore_eos": True}}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 8
