"""llama.cpp's ``convert_hf_to_gguf.py``, run with one change: a byte-level BPE pre-tokenizer
missing from its table of known tokenizers is written as ``gpt-2`` instead of being an error.

The random benchmark models (``gpu/random_model.py``) train their byte-level BPE on the spot,
so no hash in that table matches them; their pre-tokenizer, ``ByteLevel`` with its default
regex, is GPT-2's. Any other tokenizer the table knows converts as it always does. Runs in the
Python that has the converter's dependencies (torch, transformers, gguf, sentencepiece): this
file imports nothing of tidal's.

    PYTHON bench/gguf_convert.py /path/to/llama.cpp/convert_hf_to_gguf.py MODEL_DIR \\
        --outtype f32 --outfile MODEL.gguf
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType

FALLBACK_PRE_TOKENIZER = "gpt-2"


def load_converter(script: Path) -> ModuleType:
    """The converter script as a module (not run), its folder on ``sys.path`` for its own
    ``gguf-py`` and ``conversion`` packages."""
    sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", script)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{script}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def lenient_pre_tokenizer(module: ModuleType) -> int:
    """Patch every ``get_vocab_base_pre`` of the converter (in the script itself in older
    llama.cpp, in ``conversion.base`` in newer); returns how many were patched."""
    owners = {getattr(module, "TextModel", None)}
    base = sys.modules.get("conversion.base")
    if base is not None:
        owners.add(getattr(base, "TextModel", None))
    patched = 0
    for cls in owners:
        if cls is None or not hasattr(cls, "get_vocab_base_pre"):
            continue
        original = cls.get_vocab_base_pre

        def get_vocab_base_pre(self, tokenizer, _original=original) -> str:  # type: ignore
            try:
                return _original(self, tokenizer)
            except NotImplementedError:
                logging.warning("BPE pre-tokenizer not in llama.cpp's table: written as %r",
                                FALLBACK_PRE_TOKENIZER)
                return FALLBACK_PRE_TOKENIZER

        cls.get_vocab_base_pre = get_vocab_base_pre
        patched += 1
    return patched


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    script = Path(argv[0]).resolve()
    sys.argv = [str(script), *argv[1:]]  # the converter parses its own arguments
    here = Path(__file__).resolve().parent  # bench/'s modules must not shadow the converter's
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    module = load_converter(script)
    if not lenient_pre_tokenizer(module):
        raise SystemExit(f"{script}: no get_vocab_base_pre to patch; is it convert_hf_to_gguf?")
    module.main()


if __name__ == "__main__":
    main(sys.argv[1:])
