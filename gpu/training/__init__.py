"""Training and evaluation of the embedded default model (a small Llama on Tiny Shakespeare)."""
