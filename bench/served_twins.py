"""A quantized model served on a device against its CPU twin: the same greedy completions
from a real server, asked through the official ``openai`` client, and from the offline engine
on the CPU over the same weights in float32 on torch's paths (each weight dequantized, then
plain float32 maths). Where the two part, the twin's two best tokens there must be a near tie:
float32 sums taken in another order may flip those, and nothing else.

Used by ``bench.gpu_check``'s ``served`` step and ``tests/integration/test_device_twins.py``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.processes import LaunchedServer

SERVED_PROMPTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n",
    "KING HENRY V:\nOnce more unto the breach, dear friends,",
    "HAMLET:\nTo be, or not to be:",
]
SERVED_MAX_TOKENS = 32
# The served engine kept small: fewer CUDA graphs to capture, a KV cache it cannot outgrow.
SERVER_ARGS = ["--max-num-seqs", "8", "--kv-cache-memory", "256MiB", "--log-level", "warning"]
NEAR_TIE = 0.02  # nats between the twin's two best tokens where a flip is allowed


@dataclass
class Completion:
    text: str
    tokens: list[str]  # each token's text, as the completions API's logprobs give them
    logprobs: list[float]
    # the twin's: at each token, its best logprob less its second best (none for a server)
    margins: list[float] = field(default_factory=list)


@dataclass
class Comparison:
    prompt: str
    served: Completion
    twin: Completion
    same_text: bool
    chars: int  # leading characters alike
    tokens: int  # leading tokens alike
    max_logprob_diff: float  # over the leading tokens alike
    agrees: bool  # every token alike, or they part where the twin's best two nearly tie


def leading_match(a: list[Any] | str, b: list[Any] | str) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def compare(prompt: str, served: Completion, twin: Completion) -> Comparison:
    tokens = leading_match(served.tokens, twin.tokens)
    diffs = [abs(a - b) for a, b in zip(served.logprobs[:tokens], twin.logprobs[:tokens])]
    same = tokens == len(twin.tokens) == len(served.tokens)
    parted = tokens < min(len(served.tokens), len(twin.margins))  # at a token, not its end
    agrees = same or (parted and twin.margins[tokens] < NEAR_TIE)
    return Comparison(prompt, served, twin, served.text == twin.text,
                      leading_match(served.text, twin.text), tokens, max(diffs, default=0.0),
                      agrees)


class EmbeddedServer(LaunchedServer):
    """``python -m tidal serve`` with no ``--model``: the embedded model, as a user starts it."""

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tidal", "serve", "--port", str(self.port),
                *self.server_args]


def twin_completions(prompts: list[str], max_tokens: int, model: str | None = None,
                     **engine_args: object) -> list[Completion]:
    """Greedy completions from the offline engine on the CPU (the embedded model unless
    ``model``), in float32 on torch's paths (``cpu_kernels="off"``): no C++ build, and no
    integer dot kernel rounding the activations to int8 first."""
    from tidal.core import LLM, SamplingParams

    llm = LLM(model, device="cpu", dtype="float32", cpu_kernels="off", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    completions = []
    for out in llm.generate(prompts, params, use_tqdm=False):
        choice = out.outputs[0]
        tops = [sorted(entry.values(), reverse=True) for entry in choice.logprobs]
        completions.append(Completion(
            choice.text, [llm.tokenizer.decode([t], skip_special_tokens=False)
                          for t in choice.token_ids],
            [entry[t] for t, entry in zip(choice.token_ids, choice.logprobs)],
            [top[0] - top[1] for top in tops]))
    return completions


def served_completions(url: str, prompts: list[str], max_tokens: int) -> list[Completion]:
    """Greedy completions from the server at ``url``, through the ``openai`` client."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    completions = []
    for prompt in prompts:
        choice = client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True}).choices[0]
        completions.append(Completion(choice.text, list(choice.logprobs.tokens),
                                      list(choice.logprobs.token_logprobs)))
    return completions


def served_run(quantization: str, device: str, server_args: list[str],
               prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """Start the server, compute the CPU twin's completions while it loads, then ask it."""
    start = time.monotonic()
    server = EmbeddedServer("", ["--device", device, "--quantization", quantization,
                                 *server_args])
    try:
        twin = twin_completions(prompts, max_tokens, quantization=quantization)
        twin_s = time.monotonic() - start
        server.wait_ready(timeout=300)
        ready_s = time.monotonic() - start
        served = served_completions(server.url, prompts, max_tokens)
    finally:
        server.stop()
    return {"quantization": quantization, "server_args": server_args, "ready_s": ready_s,
            "twin_s": twin_s,
            "comparisons": [asdict(compare(p, s, t))
                            for p, s, t in zip(prompts, served, twin)]}


def run_served(device: str, quantizations: list[str], dtype: str, out: Path) -> None:
    """Each quantization in turn, the JSON rewritten after each (a kill keeps the ones done)."""
    server_args = [*SERVER_ARGS, "--dtype", dtype]
    if not device.startswith("cuda"):
        server_args += ["--cpu-kernels", "off"]
    runs: list[dict[str, Any]] = []
    for quantization in quantizations:
        runs.append(served_run(quantization, device, server_args, SERVED_PROMPTS,
                               SERVED_MAX_TOKENS))
        out.write_text(json.dumps(runs, indent=2))


def served_table(run: dict[str, Any]) -> str:
    lines = [f"**{run['quantization']}** (`{' '.join(run['server_args'])}`; ready after "
             f"{run['ready_s']:.0f} s, the CPU twin's {run['twin_s']:.0f} s among them): served "
             "against the CPU twin (float32, torch's ops)", "",
             "| prompt | agrees | same text | leading chars | leading tokens | "
             "max \\|Δ logprob\\| |",
             "|---|---|---|---:|---:|---:|"]
    for c in run["comparisons"]:
        prompt = c["prompt"].replace("\n", " ").replace("|", "/")[:40]
        lines.append(f"| {prompt} | {'yes' if c['agrees'] else 'no'} | "
                     f"{'yes' if c['same_text'] else 'no'} | "
                     f"{c['chars']}/{len(c['twin']['text'])} | "
                     f"{c['tokens']}/{len(c['twin']['tokens'])} | {c['max_logprob_diff']:.4f} |")
    for c in run["comparisons"]:
        if not c["same_text"]:
            lines += ["", f"- `{c['prompt']!r}`: served `{c['served']['text']!r}`, CPU "
                      f"`{c['twin']['text']!r}`"]
    return "\n".join(lines)
