"""A first start that serves at once: where this machine has no build of the CPU kernels yet,
they are compiled on a thread of their own while the model serves on torch's paths, and once
built a model planned on them (``op_plans``) is prepared on that thread too and swapped in
between two steps.

The swap reads the model's weights again, so for that moment the process holds two copies.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

from tidal.gpu.cpu import selector
from tidal.gpu.cpu.kernels import build_in_background, is_built

logger = logging.getLogger(__name__)

Model = TypeVar("Model")  # what the runner loads: its model and what goes with it


def needs_background_build() -> bool:
    """Whether kernels are wanted here but this machine has no build of them yet."""
    return selector.mode() != "off" and not is_built()


class KernelUpgrade(Generic[Model]):
    """The model ``make_model`` builds once the kernels are: ``ready()`` says when to swap."""

    def __init__(self, make_model: Callable[[], Model]) -> None:
        self.make_model = make_model
        self.future: Future = Future()
        logger.info("serving on torch's paths while the C++ CPU kernels build in the "
                    "background (once per machine)")
        build_in_background().add_done_callback(self._start)

    def _start(self, build: Future) -> None:
        threading.Thread(target=self._prepare, args=(build,), name="tidal-kernel-model",
                         daemon=True).start()

    def _prepare(self, build: Future) -> None:
        try:
            model = self.make_model() if build.result() is not None else None
        except Exception:  # keep serving on torch's paths
            logger.exception("could not prepare the model on the CPU kernels")
            model = None
        self.future.set_result(model)

    def ready(self) -> bool:
        return self.future.done()

    def model(self) -> Model | None:
        """The model on the kernels, or ``None`` where they could not be built."""
        return self.future.result()
