"""Weight-only quantization: int8 and int4 weights in one affine form (``weights.py``), the
linear layer that multiplies by them (``linear.py``), and quantizing a float model at load
(``apply.py``)."""
