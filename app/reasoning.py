"""A reasoning model's thinking kept apart from its answer: ``<think>...</think>`` goes to
``reasoning_content``, the rest to ``content`` (where tool calls are then read).

Three formats, as vLLM names them (``--reasoning-parser``):
- ``qwen3``: a reply that opens with ``<think>`` thinks until ``</think>``; one that does not
  (``"chat_template_kwargs": {"enable_thinking": false}``) is all answer.
- ``deepseek_r1``: the chat template opens the block in the prompt, so the reply starts inside
  it (a leading ``<think>`` is skipped) and thinks until ``</think>``.
- ``gpt_oss``: OpenAI's Harmony messages (``app/harmony.py``): the ``analysis`` channel is the
  thinking, the ``final`` channel the answer.

Where the prompt itself ends matters more than the format: a prompt that ends inside an
opened block (``<think>\n``) has a reply that starts thinking, one that ends with a closed
block (Qwen3's ``enable_thinking: false`` writes an empty one) has a reply that is all answer
(``ReasoningFormat.for_prompt``).

One state machine serves the whole reply and its deltas, deciding at each character with the
text up to a fixed distance past it, so a stream and the whole reply always agree. Whitespace
right after ``</think>`` is the block's, not the answer's.

A constraint on the reply (a JSON schema, a regex, the tools' grammar) holds the answer alone:
``thinking_format`` is the block as a grammar, which the constraint follows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from tidal.app.harmony import CHANNEL, FINAL_HEADER, HarmonySplitter, harmony_thinking

START, END = "<think>", "</think>"


class _State(Enum):
    OPENING = "opening"  # whether the reply opens with START is not yet known
    THINKING = "thinking"
    AFTER = "after"  # whitespace after END
    ANSWER = "answer"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_inside: bool  # the prompt opened the block (deepseek_r1)
    closed: bool = False  # the prompt holds the whole block: the reply is all answer
    harmony: bool = False  # Harmony messages (gpt_oss), whose markers are special tokens

    def for_prompt(self, prompt: str) -> ReasoningFormat:
        """This format after ``prompt``: one ending inside an opened block starts the reply
        inside it, one ending with a closed block leaves the reply all answer (for Harmony:
        one ending inside the final message's body)."""
        tail = prompt.rstrip()
        if self.harmony:
            return replace(self, closed=True) if prompt.endswith(FINAL_HEADER) else self
        if tail.endswith(END):
            return replace(self, closed=True)
        if tail.endswith(START):
            return replace(self, starts_inside=True)
        return self


FORMATS = {"qwen3": ReasoningFormat("qwen3", starts_inside=False),
           "deepseek_r1": ReasoningFormat("deepseek_r1", starts_inside=True),
           "gpt_oss": ReasoningFormat("gpt_oss", starts_inside=False, harmony=True)}


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def get_format(name: str) -> ReasoningFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; one of {', '.join(FORMATS)}"
                         ) from None


def default_format(chat_template_text: str | None) -> str | None:
    """The reasoning format a chat template teaches its model, by its markers."""
    text = chat_template_text or ""
    if CHANNEL in text:
        return "gpt_oss"
    if START not in text:
        return None
    return "deepseek_r1" if "<｜Assistant｜>" in text else "qwen3"


class ReasoningSplitter:
    """One reply's thinking and answer, fed as it arrives."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.text = ""
        self.pos = 0
        self.final = False
        self.state = _State.ANSWER if fmt.closed else _State.OPENING
        self.starts_inside = fmt.starts_inside

    def feed(self, text: str) -> ReasoningDelta:
        self.text += text
        return self._run()

    def finish(self) -> ReasoningDelta:
        self.final = True
        return self._run()

    def _run(self) -> ReasoningDelta:
        delta = ReasoningDelta()
        while self.pos < len(self.text) or self.final and self.state is _State.OPENING:
            if self.state is _State.OPENING and not self._opening():
                break
            if self.state is _State.THINKING:
                delta.reasoning += self._thinking()
                if self.state is _State.THINKING:
                    break
            if self.state is _State.AFTER:
                while self.pos < len(self.text) and self.text[self.pos].isspace():
                    self.pos += 1
                if self.pos == len(self.text):
                    break
                self.state = _State.ANSWER
            if self.state is _State.ANSWER:
                delta.content += self.text[self.pos:]
                self.pos = len(self.text)
        return delta

    def _opening(self) -> bool:
        """Whether the reply opens with START; False while too little has arrived to tell."""
        head = self.text[self.pos:self.pos + len(START)]
        if head == START:
            self.pos += len(START)
            self.state = _State.THINKING
        elif START.startswith(head) and not self.final:
            return False
        else:
            self.state = _State.THINKING if self.starts_inside else _State.ANSWER
        return True

    def _thinking(self) -> str:
        """The thinking up to END, or up to what may still become END."""
        end = self.text.find(END, self.pos)
        if end >= 0:
            out, self.pos, self.state = self.text[self.pos:end], end + len(END), _State.AFTER
            return out
        stop = len(self.text)
        if not self.final:  # hold back a possible start of END
            for keep in range(min(len(END) - 1, stop - self.pos), 0, -1):
                if END.startswith(self.text[stop - keep:]):
                    stop -= keep
                    break
        out, self.pos = self.text[self.pos:stop], stop
        return out


def thinking_format(fmt: ReasoningFormat) -> dict[str, Any] | None:
    """The reply's thinking as a format of xgrammar's structural tag, with the whitespace
    after it: any text up to END (the reply may skip writing an opened block's START, or,
    where the model decides, the whole block); None where the prompt closed the block."""
    if fmt.harmony:
        return harmony_thinking(fmt.closed)
    if fmt.closed:
        return None
    block = {"type": "tag", "begin": "" if fmt.starts_inside else START,
             "content": {"type": "any_text"}, "end": END}
    if not fmt.starts_inside:
        block = {"type": "optional", "content": block}
    return {"type": "sequence", "elements": [block, {"type": "regex", "pattern": "\\n{0,2}"}]}


def splitter_for(fmt: ReasoningFormat, calls: bool = False
                 ) -> ReasoningSplitter | HarmonySplitter:
    """A splitter for one reply in ``fmt``; ``calls``: a Harmony reply's tool calls are kept in
    the answer, for the ``openai`` tool parser (without tools they are dropped)."""
    if fmt.harmony:
        return HarmonySplitter(fmt.closed, calls)
    return ReasoningSplitter(fmt)


def split_reasoning(fmt: ReasoningFormat, text: str, calls: bool = False
                    ) -> tuple[str | None, str]:
    """A whole reply's thinking (None where it has none) and answer."""
    splitter = splitter_for(fmt, calls)
    first, last = splitter.feed(text), splitter.finish()
    return (first.reasoning + last.reasoning) or None, first.content + last.content
