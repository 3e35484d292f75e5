"""The KV tier's copies beside the forward (gpu/kv_copier.py, gpu/kv_layer_gate.py): a step's
copies wait for the step in flight only where they touch a block it may still use
(core/kv_cache_manager.py's ``take_copies``), and on the CPU the forward takes each layer once
that layer's copies are done, so the later layers' copies run beside the earlier layers'
compute; the tokens are those of a cold prefill."""

from __future__ import annotations

import threading
from pathlib import Path

from tidal.core.host_tier import HostTier
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.llm import LLM
from tidal.core.sampling_params import SamplingParams
from tidal.gpu.kv_layer_gate import LayerGate
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.random_model import build_model_dir


def test_copies_wait_for_the_step_in_flight_only_for_blocks_it_may_use():
    kv = KVCacheManager(4, 2, host_tier=HostTier(8))
    pool = kv.pool
    old = pool.get_new_blocks(2)
    for i, block in enumerate(old):
        pool.cache_block(block, bytes([i]))
    pool.free_blocks(old)
    assert kv.take_copies() is None  # the step that freed them: nothing to copy yet
    held = pool.get_new_blocks(4)  # the next step evicts them: freed before it was scheduled
    copies = kv.take_copies()
    assert copies is not None and copies.out == [(0, 0), (1, 1)]
    assert not copies.after_step, "no block of the step in flight: beside its forward"
    pool.cache_block(held[2], b"late")
    pool.free_blocks(held[2:])  # freed after the step in flight was scheduled...
    pool.get_new_blocks(1)  # ...and evicted by this one: its copy waits for that step
    copies = kv.take_copies()
    assert copies is not None and copies.out == [(0, 2)] and copies.after_step


def test_the_forward_runs_beside_its_own_copies(tmp_path: Path, monkeypatch) -> None:
    """A's prefix comes back from the host tier: the copy thread, having copied the first
    layer, holds until the forward has taken that layer (it would wait in vain if the forward
    waited for every copy); the tokens and logprobs are those of A's cold prefill."""
    path = build_model_dir(tmp_path / "llama", "llama")
    started, overlapped = threading.Event(), []
    real_open, real_wait = LayerGate.open, LayerGate.wait

    def open_layer(gate: LayerGate, layer: int) -> None:
        real_open(gate, layer)
        if layer == 0 and not overlapped:
            overlapped.append(started.wait(timeout=20))

    def wait_layer(gate: LayerGate, layer: int) -> None:
        real_wait(gate, layer)
        started.set()

    monkeypatch.setattr(LayerGate, "open", open_layer)
    monkeypatch.setattr(LayerGate, "wait", wait_layer)
    block = 16 * ModelConfig.from_dir(path).kv_bytes_per_token(4)
    llm = LLM(str(path), device="cpu", kv_cache_memory=8 * block, kv_offload_size=20 * block,
              max_num_seqs=1)
    prompts = {name: [(seed * 37 + i * 11) % 500 + 3 for i in range(48)]
               for seed, name in enumerate("ABC", start=1)}
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
    outs = [llm.generate(prompts[name], params, use_tqdm=False)[0] for name in "ABCA"]
    assert llm.engine.kv.host.stats.hits == 2 and outs[3].num_cached_tokens == 32
    assert overlapped == [True], "the forward took layer 0 while later layers were copied"
    first, again = outs[0].outputs[0], outs[3].outputs[0]
    assert again.token_ids == first.token_ids
    for got, want in zip(again.logprobs, first.logprobs):
        assert got.keys() == want.keys()
        assert all(abs(got[t] - want[t]) < 1e-5 for t in want)
    llm.shutdown()
