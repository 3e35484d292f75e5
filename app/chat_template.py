"""Chat messages -> prompt text, through the model's own Jinja2 chat template.

Templates run in Jinja2's immutable sandbox with the same environment Hugging Face uses
(trim_blocks, lstrip_blocks, loop controls, ``raise_exception``, ``tojson``,
``strftime_now``), so a model's template renders here exactly as it does in transformers.
Models that ship no template get ``templates/chat_fallback.jinja`` (ChatML).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tidal.templates import TEMPLATES_DIR

FALLBACK_TEMPLATE = TEMPLATES_DIR / "chat_fallback.jinja"


class ChatTemplateError(ValueError):
    """The template rejected the conversation (``raise_exception``) or failed to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass
class ChatTemplate:
    template: jinja2.Template
    special_tokens: dict[str, str]
    source: str  # "tokenizer" or the template file's path
    text: str = ""  # the template's own text

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, path: str | None = None) -> ChatTemplate:
        """The template at ``path`` if given, else the tokenizer's, else the fallback."""
        text = getattr(tokenizer, "chat_template", None)
        source = "tokenizer"
        if isinstance(text, dict):  # several named templates: the default one
            text = text.get("default") or next(iter(text.values()), None)
        if path:
            text, source = Path(path).read_text(), str(path)
        if not text:
            text, source = FALLBACK_TEMPLATE.read_text(), str(FALLBACK_TEMPLATE)
        tokens = {name: str(getattr(tokenizer, name, None) or "")
                  for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        return cls(_environment().from_string(text), tokens, source, text)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None,
               extra: dict[str, Any] | None = None) -> str:
        """The prompt for ``messages`` (each ``{"role", "content"}`` with string content, and
        ``tool_calls`` or ``tool_call_id`` where the API gave them), offering ``tools``;
        ``extra`` are the request's ``chat_template_kwargs`` (``enable_thinking``, ...)."""
        context = {**(extra or {}), "messages": messages, "tools": tools,
                   "add_generation_prompt": add_generation_prompt, **self.special_tokens}
        try:
            return self.template.render(**context)
        except ChatTemplateError:
            raise
        except Exception as exc:  # a broken template must fail one request, not the server
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc
