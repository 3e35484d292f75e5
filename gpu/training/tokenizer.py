"""The default model's tokenizer: byte-level BPE with chat special tokens and a chat template.

A conversation renders as ``<|begin_of_text|><|user|>\\n...<|end|>\\n<|assistant|>\\n...<|end|>``;
``<|end|>`` closes every turn and is the end-of-sequence token, so a reply stops on it.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOT, SYSTEM, USER, ASSISTANT, EOS = ("<|begin_of_text|>", "<|end_of_text|>", "<|system|>",
                                          "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = [BOS, EOT, SYSTEM, USER, ASSISTANT, EOS]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] | trim }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def render_turn(role: str, content: str) -> str:
    """One turn exactly as the chat template writes it."""
    return f"<|{role}|>\n{content.strip()}{EOS}\n"


def train_tokenizer(text: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of ``vocab_size`` tokens (special tokens included) learnt on ``text``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([block + "\n\n" for block in text.split("\n\n")], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOT,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT], chat_template=CHAT_TEMPLATE,
        model_max_length=None)
