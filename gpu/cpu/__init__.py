"""The CPU backend's room: the C++ kernels (``csrc/``), their builder (``kernels.py``), the
packed linear layers, the one-call decode step (which the runner tries first, ``backend.py``),
and the selector that times the candidates for each op on this host and keeps the fastest
(``selector.py``)."""
