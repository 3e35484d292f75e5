"""Which cases of a parametrized test run in the README's quick suite (``-m "not slow"``): the
others are marked slow, and CI runs them after it (``.ci/run``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest


def quick_only(values: Iterable[Any], *quick: Any) -> list[Any]:
    """``values`` for ``parametrize`` or a fixture's ``params``: those in ``quick`` as they are,
    the others marked slow."""
    return [v if v in quick else pytest.param(v, marks=pytest.mark.slow) for v in values]
