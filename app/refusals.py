"""A client whose requests keep being refused is slowed down before its next body is read.

Every refusal (a 4xx: a cap passed, a bad field, a 429, a body too large or too slow) costs
the server the reading of a body and often its parsing, and a client that sends refused
requests as fast as it can takes that much CPU from everyone else on a small host. Each client
(its address, or its API key under ``--fair-share-by api-key``) has a bucket of refusals that
refills at ``rate`` a second up to ``burst``. A request from a client with an empty bucket
waits, holding only its connection, until the bucket has room (at most ``max_wait`` seconds)
and then goes on as usual; one that would wait longer is answered 429 with ``Retry-After``
and its connection closed once it has waited ``max_wait``, before its body is read. A client
refused at most ``rate`` times a second never waits. At most ``max_held`` requests wait at
once; past that they get the 429 at once.

A refusal costs more the larger the body the server had to read for it: one refusal per
``REFUSAL_BYTES`` of its declared length (at least one, at most a burst), so a client refused
for bodies of megabytes is slowed to a body or two a second, and one refused for small mistakes
as before.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tidal.app.admission import client_key
from tidal.app.errors import ApiError

REFUSAL_BYTES = 256 << 10  # the body length that counts as one more refusal


@dataclass
class RefusalMeter:
    rate: float = 16.0  # refusals a second a client may have without waiting
    burst: float = 64.0  # refusals it may have at once
    max_wait: float = 1.0  # seconds a request of a client past its rate may be held
    max_held: int = 256  # requests held at once, over all clients
    held: int = 0
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict)  # tokens, stamp

    def _tokens(self, client: str, now: float) -> float:
        tokens, stamp = self._buckets.get(client, (self.burst, now))
        return min(self.burst, tokens + (now - stamp) * self.rate)

    def record(self, client: str, cost: float = 1.0) -> None:
        """Count a refusal of ``client``'s, as ``cost`` refusals (its debt bounded by one
        burst)."""
        now = time.monotonic()
        tokens = max(-self.burst, self._tokens(client, now) - min(max(cost, 1.0), self.burst))
        self._buckets[client] = (tokens, now)
        if len(self._buckets) > 4096:
            self._forget_full(now)

    def wait_for(self, client: str) -> float:
        """Seconds until ``client`` may be refused again without waiting (0: now)."""
        if client not in self._buckets:
            return 0.0
        tokens = self._tokens(client, time.monotonic())
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate

    async def hold(self, client: str) -> None:
        """Wait while ``client`` is past its rate of refusals; raise the 429 where it would
        have to wait longer than ``max_wait``."""
        wait = self.wait_for(client)
        if wait <= 0.0:
            return
        if self.held < self.max_held:
            self.held += 1
            try:
                await asyncio.sleep(min(wait, self.max_wait))
            finally:
                self.held -= 1
            wait = self.wait_for(client)
            if wait <= 0.0:
                return
        raise ApiError(429, "Too many of this client's requests were refused lately; retry "
                       "later", type="rate_limit_error", code="too_many_refusals",
                       headers={"Retry-After": str(max(1, math.ceil(wait))),
                                "Connection": "close"})

    def _forget_full(self, now: float) -> None:
        """Drop the buckets that have refilled: they hold nothing a new one would not."""
        for client in [c for c in self._buckets if self._tokens(c, now) >= self.burst]:
            del self._buckets[client]


def refusal_cost(headers: Mapping[str, str]) -> float:
    """What a refused request counts as: one refusal per ``REFUSAL_BYTES`` of its declared
    body (a chunked body, of no declared length, as one)."""
    try:
        length = int(headers.get("content-length") or 0)
    except ValueError:
        return 1.0
    return max(1.0, length / REFUSAL_BYTES)


def refusal_key(fair_share_by: str, scope: Mapping[str, Any],
                headers: Mapping[str, str]) -> str:
    """Whose refusals a request counts among: its API key's under ``api-key``, else its
    address's (a ``user`` field is the client's to choose, so it cannot be trusted here)."""
    by = "api-key" if fair_share_by == "api-key" else "address"
    return client_key(by, scope, headers, {})
