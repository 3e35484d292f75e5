"""Embeddings throughput: tidal's offline ``LLM.embed`` (``runner="pooling"``) against
sentence-transformers' ``SentenceTransformer.encode`` on the same texts, same dtype, same host.

The model is a random Qwen3-0.6B-shaped one (``bench/model_shapes.py``'s ``qwen3-0.6b``) in a
sentence-transformers layout: last-token pooling and a ``Normalize`` module, as
Qwen3-Embedding ships. Each round embeds ``--batch`` texts that tokenize to at least
``--seq-len`` tokens, cut to ``--seq-len`` by both sides (sentence-transformers'
``max_seq_length``; tidal's tokenizer call with the same truncation, inside the timed region,
as sentence-transformers' tokenization is inside ``encode``). sentence-transformers runs them
as one batch (``batch_size=--batch``); tidal as its scheduler chooses (its default token
budget unless ``--max-num-batched-tokens``), without prefix caching, as every round repeats
the texts. Each side runs in a fresh process of its own; the median of ``--rounds`` timed
rounds after one warm-up round is reported, with every round's time, and the largest
difference between the two sides' embeddings as a check that both computed the same thing.
Writes ``bench/results/embeddings_throughput-<device>-<shape>.json``, naming the host.

sentence-transformers is needed for this benchmark only (``pip install
sentence-transformers``), never by tidal itself.

    python -m bench.embeddings_throughput                       # the target: float32, bf16
    python -m bench.embeddings_throughput --layers 2 --rounds 3 --name smoke   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from bench.common import write_result
from bench.model_shapes import build_shaped_model_dir

SHAPE = "qwen3-0.6b"
TEXT_IDS = range(10, 500)  # the random tokenizer's trained tokens (above: filler tokens)


def sentence_transformers_layout(path: Path, hidden: int, seq_len: int) -> None:
    """The sentence-transformers files over a model directory: the transformer cut to
    ``seq_len`` tokens, last-token pooling, then normalisation."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": seq_len, "do_lower_case": False}))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, "pooling_mode_lasttoken": True,
         "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": False}))
    (path / "2_Normalize").mkdir(exist_ok=True)


def make_texts(model: Path, batch: int, seq_len: int, seed: int = 0) -> list[str]:
    """``batch`` texts of at least ``seq_len`` tokens each."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    gen = torch.Generator().manual_seed(seed)
    texts = []
    for _ in range(batch):
        ids = torch.randint(TEXT_IDS.start, TEXT_IDS.stop, (2 * seq_len,), generator=gen)
        text = tokenizer.decode(ids.tolist())
        if len(tokenizer.encode(text, add_special_tokens=False)) < seq_len:
            raise RuntimeError("a benchmark text tokenized to fewer than --seq-len tokens")
        texts.append(text)
    return texts


def _timed(fn, rounds: int, after_warm_up=lambda: None) -> tuple[list[float], object]:
    """Seconds of each of ``rounds`` calls after a warm-up call, and the last call's result."""
    out = fn()
    after_warm_up()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return times, out


def run_tidal(model: str, texts: list[str], seq_len: int, dtype: str, device: str,
              rounds: int, max_num_batched_tokens: int | None) -> dict:
    from tidal.core import LLM
    from tidal.gpu.model_config import ModelConfig

    cfg = ModelConfig.load(model)
    tokens = len(texts) * (seq_len + 16)  # each sequence's blocks, its last one partly used
    kv_bytes = int(1.1 * tokens * cfg.kv_bytes_per_token(torch.finfo(
        getattr(torch, dtype)).bits // 8))
    llm = LLM(model, runner="pooling", dtype=dtype, device=device, max_num_seqs=len(texts),
              max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_bytes,
              enable_prefix_caching=False, max_model_len=seq_len + 16)
    tokenizer = llm.tokenizer

    def embed() -> list[list[float]]:
        ids = tokenizer(texts, truncation=True, max_length=seq_len)["input_ids"]
        return [o.outputs.embedding for o in llm.embed(ids, use_tqdm=False)]

    prof = llm.engine.profiler
    times, out = _timed(embed, rounds, prof.reset)
    return {"rounds_s": times, "embeddings": out,
            "max_num_batched_tokens": llm.engine.config.max_num_batched_tokens,
            "steps_per_round": prof.num_steps / rounds, "step_ms": prof.breakdown()}


def run_sentence_transformers(model: str, texts: list[str], dtype: str, device: str,
                              rounds: int) -> dict:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model, device=device,
                             model_kwargs={"dtype": getattr(torch, dtype)})

    def encode() -> list[list[float]]:
        return st.encode(texts, batch_size=len(texts), convert_to_numpy=True).tolist()

    times, out = _timed(encode, rounds)
    return {"rounds_s": times, "embeddings": out}


def _in_fresh_process(fn, *args: object) -> dict:
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        try:
            return pool.submit(fn, *args).result()
        except Exception as exc:  # a side that cannot run this dtype: said in the result
            return {"error": f"{type(exc).__name__}: {exc}"}


def summarise(side: dict, batch: int, seq_len: int) -> dict:
    """One side's rounds as a median and rates (its embeddings left out)."""
    if "error" in side:
        return side
    median = statistics.median(side["rounds_s"])
    return {**{k: v for k, v in side.items() if k != "embeddings"}, "median_s": median,
            "seq_per_s": batch / median, "tok_per_s": batch * seq_len / median}


def compare(dtype: str, args: argparse.Namespace, model: str, texts: list[str]) -> dict:
    tidal = _in_fresh_process(run_tidal, model, texts, args.seq_len, dtype, args.device,
                              args.rounds, args.max_num_batched_tokens)
    st = _in_fresh_process(run_sentence_transformers, model, texts, dtype, args.device,
                           args.rounds)
    result = {"tidal": summarise(tidal, args.batch, args.seq_len),
              "sentence_transformers": summarise(st, args.batch, args.seq_len)}
    if "error" not in tidal and "error" not in st:
        diff = torch.tensor(tidal["embeddings"]) - torch.tensor(st["embeddings"])
        result["max_abs_diff"] = float(diff.abs().max())
        result["speedup"] = (result["sentence_transformers"]["median_s"]
                             / result["tidal"]["median_s"])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a smoke run)")
    ap.add_argument("--tiny", action="store_true", help="every size shrunk (a smoke run)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--model-dir", default=None, help="where to build the model (reused)")
    ap.add_argument("--name", default=None, help="the result file's suffix")
    args = ap.parse_args()
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    root = Path(args.model_dir or tempfile.mkdtemp(prefix="embed-bench-"))
    model = build_shaped_model_dir(root, SHAPE, tiny=args.tiny, dtype=torch.float32,
                                   **overrides)
    config = json.loads((model / "config.json").read_text())
    sentence_transformers_layout(model, config["hidden_size"], args.seq_len)
    texts = make_texts(model, args.batch, args.seq_len)
    results = {dtype: compare(dtype, args, str(model), texts)
               for dtype in args.dtypes.split(",")}
    for dtype, r in results.items():
        print(dtype, {side: r[side].get("median_s", r[side].get("error"))
                      for side in ("tidal", "sentence_transformers")},
              "speedup", r.get("speedup"), "max_abs_diff", r.get("max_abs_diff"))
    suffix = args.name or f"{args.device}-{SHAPE}" + ("-tiny" if args.tiny else "") + (
        f"-{args.layers}layers" if args.layers is not None else "")
    path = write_result(f"embeddings_throughput-{suffix}", {
        "shape": SHAPE, "tiny": args.tiny, "layers": config["num_hidden_layers"],
        "batch": args.batch, "seq_len": args.seq_len, "rounds": args.rounds,
        "device": args.device, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
