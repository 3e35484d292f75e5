"""This process's pipeline stage: which decoder layers it holds, whether it embeds the tokens
(the first stage) or normalises and samples (the last), and what passes between stages.

A worker process joins its stage once (``gpu/distributed.py``'s ``init_tensor_parallel``)
before it builds its model; the model reads ``pipeline_stage()`` when it is built. A process
that joins none (one device, or tensor parallelism alone) is the one stage, first and last,
holding every layer.

Per step, a stage before the last sends its residual stream and the last layer's output still
to be added to it (``[tokens, hidden]`` each) to the same tensor-parallel rank of the next
stage, point to point and without waiting for it to be received (the stage goes on to the next
micro-batch, ``gpu/pipeline_rounds.py``); the last stage samples, and its first rank's
``ModelRunnerOutput`` is broadcast to every rank, so that each stage's persistent batch learns
the tokens (the first stage embeds them next) and rank 0 answers the engine as it does without
stages.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from tidal.core.scheduler_output import ModelRunnerOutput
from tidal.gpu.input_batch import InputBatch
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.quantization.weights import Weight

_LAYER = re.compile(r"^((?:model\.)?layers\.)(\d+)\.")


@dataclass(frozen=True)
class PipelineStage:
    index: int = 0  # this stage's place, from 0
    size: int = 1  # stages in all
    rank: int = 0  # this process's global rank
    ranks_per_stage: int = 1  # the tensor-parallel size: the next stage's peer is rank + this
    cpu_group: Any = None  # every rank's gloo group (the sampled tokens' broadcast)
    # the sends under way (works and their tensors), kept until ``take_sends``
    sends: list[Any] = field(default_factory=list, compare=False, repr=False)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def layer_range(self, num_layers: int) -> range:
        """This stage's decoder layers: a contiguous share, the earlier stages taking one more
        where they do not divide evenly (the last also runs the output head)."""
        base, extra = divmod(num_layers, self.size)
        start = self.index * base + min(self.index, extra)
        return range(start, start + base + (self.index < extra))

    def holds_embedding(self, cfg: ModelConfig) -> bool:
        """The first stage embeds; the last holds the embedding too where the head is tied."""
        return self.is_first or (self.is_last and cfg.tie_word_embeddings)

    def local(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with this stage's layers only (what its KV cache holds)."""
        if self.size == 1:
            return cfg
        return replace(cfg, num_layers=len(self.layer_range(cfg.num_layers)))

    # -- activations between stages -----------------------------------------------------
    def receive(self, num_tokens: int, hidden_size: int,
                like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's residual stream and pending layer output, in ``like``'s dtype
        and on its device."""
        src = self.rank - self.ranks_per_stage
        x, delta = (torch.empty(num_tokens, hidden_size, dtype=like.dtype, device=like.device)
                    for _ in range(2))
        dist.recv(x, src)
        dist.recv(delta, src)
        return x, delta

    def send(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Start passing the residual stream and the pending output on to the next stage,
        which receives them when it runs this step (``take_sends`` has the works to wait
        on); returns ``x`` (a stage before the last has no final hidden states)."""
        dst = self.rank + self.ranks_per_stage
        for t in (x.contiguous(), delta.contiguous()):
            self.sends.append((dist.isend(t, dst), t))
        return x

    def take_sends(self) -> list[Any]:
        """The sends started since the last call (their works, and the tensors they read)."""
        sends = list(self.sends)
        self.sends.clear()
        return sends

    # -- the sampled tokens ---------------------------------------------------------------
    def share_output(self, out: ModelRunnerOutput | None) -> ModelRunnerOutput:
        """The last stage's output (its first rank's ``out``) on every rank."""
        box = [out]
        dist.broadcast_object_list(box, src=(self.size - 1) * self.ranks_per_stage,
                                   group=self.cpu_group)
        return box[0]


def stage_inputs(model: Any, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A Llama-family model's first layer's inputs: the residual stream and the output still to
    be added to it, embedded on the first stage (none pending), received on the others."""
    stage: PipelineStage = model.stage
    if stage.is_first:
        return model.embed(input_ids), None
    like = model.layers[0].input_layernorm.weight  # the activations' dtype and device
    return stage.receive(input_ids.shape[0], model.config.hidden_size, like)


def stage_weights(weights: Iterable[tuple[str, Weight]],
                  stage: PipelineStage, num_layers: int) -> Iterator[tuple[str, Weight]]:
    """A checkpoint's weights (Hugging Face names) for this stage: its decoder layers', their
    indices counted from its first layer (``model.layers.5.`` is a second stage's
    ``model.layers.1.`` where it starts at 4); other layers' left out."""
    layers = stage.layer_range(num_layers)
    for name, value in weights:
        match = _LAYER.match(name)
        if match is None:
            yield name, value  # the embedding, norm and head: the model takes those it has
        elif int(match[2]) in layers:
            yield f"{match[1]}{int(match[2]) - layers.start}.{name[match.end():]}", value


def take_tokens(batch: InputBatch, out: ModelRunnerOutput) -> None:
    """On a stage before the last: the tokens the last stage sampled, into this stage's
    persistent batch (the first stage's next inputs). A request that finished (was aborted)
    while its step was in flight may have left this stage's batch already: its token is
    dropped, as the engine drops it."""
    kept = [(batch.states[r], t) for r, t in zip(out.req_ids, out.sampled_token_ids)
            if r in batch.states]
    for state, _ in kept:
        state.num_pending += 1  # as the sampling stage's runner counts them
    batch.append_tokens([s for s, _ in kept], [t for _, t in kept])


def check_pipeline_parallel(cfg: ModelConfig, size: int, quantization: str | None = None,
                            runner: str = "generate", speculative: bool = False) -> None:
    """``ValueError`` naming ``pipeline_parallel_size`` where the model or the options cannot
    run in ``size`` stages."""
    if size == 1:
        return
    from tidal.gpu.models import MODELS
    from tidal.gpu.models.llama import LlamaForCausalLM

    if MODELS.get(cfg.architecture) is not LlamaForCausalLM:
        raise ValueError(f"pipeline_parallel_size {size}: {cfg.architecture} is not split into "
                         "stages yet (Llama, Mistral, Qwen2 and Qwen3 are); use 1")
    if cfg.num_layers < size:
        raise ValueError(f"pipeline_parallel_size {size} is more than the model's "
                         f"{cfg.num_layers} layers")
    for name, refused in (("--quantization", quantization is not None),
                          ("--runner pooling", runner == "pooling"),
                          ("--speculative-config", speculative)):
        if refused:
            raise ValueError(f"pipeline_parallel_size {size} does not run with {name} yet; "
                             "use 1")


_STAGE = PipelineStage()


def pipeline_stage() -> PipelineStage:
    return _STAGE


def set_pipeline_stage(stage: PipelineStage) -> None:
    global _STAGE
    _STAGE = stage
