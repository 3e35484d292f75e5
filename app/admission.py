"""Admission control: how many sequences the server takes in before it answers 429.

Every chat or completion request reserves its sequences (``n`` per prompt, no more than it
puts into the engine at once) from when it is admitted until its response ends. A request is
refused with 429 and a ``Retry-After`` header, instead of queueing without end, when

- the server's reserved sequences would pass ``max_num_seqs + max_waiting_seqs`` (a full batch
  running and ``--max-waiting-seqs`` waiting), or
- its client already holds sequences and would pass ``max_num_seqs +
  max_waiting_seqs_per_client`` (half of ``--max-waiting-seqs`` unless set): one client cannot
  take the whole queue, so the next client's request finds room.

A request is always admitted when nothing else is in flight, however large, so no request is
refused forever. Once admitted, the scheduler takes waiting requests round-robin by client
(``core/waiting_queue.py``), so a client's one sequence is not queued behind another's
thousands. The client is the peer address, the API key presented or the body's ``user``
(``--fair-share-by``); see docs/robustness.md.

All of this runs on the event loop, one counter update per request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.types import Receive, Scope, Send

from tidal.app.errors import ApiError

if TYPE_CHECKING:
    from tidal.app.metrics import ServerMetrics

FAIR_SHARE_BY = ("address", "api-key", "user", "none")
RETRY_AFTER_S = 1


def client_key(fair_share_by: str, scope: Mapping[str, Any], headers: Mapping[str, str],
               body: Mapping[str, Any], api_key: str | None = None) -> str:
    """Who a request counts as, for admission and the scheduler's turns. ``api_key``: the
    key presented, where it came some other way than ``Authorization: Bearer`` (the
    websocket's subprotocol); None: read the header."""
    if fair_share_by == "address":
        peer = scope.get("client")
        return str(peer[0]) if peer else ""
    if fair_share_by == "api-key":
        token = bearer_token(headers) if api_key is None else api_key
        return hashlib.sha256(token.encode()).hexdigest()[:16] if token else ""
    if fair_share_by == "user":
        user = body.get("user")
        return user[:256] if isinstance(user, str) else ""
    return ""


def bearer_token(headers: Mapping[str, str]) -> str:
    """The token of ``Authorization: Bearer <token>``; "" without one."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


@dataclass
class Ticket:
    """A request's reserved sequences; ``release`` (idempotent) gives them back."""

    admission: Admission
    client: str
    seqs: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission._release(self)


@dataclass
class Admission:
    max_num_seqs: int
    max_waiting_seqs: int
    max_waiting_seqs_per_client: int | None = None  # None: half of max_waiting_seqs
    metrics: ServerMetrics | None = None
    total: int = 0  # sequences reserved by admitted requests not yet ended
    by_client: dict[str, int] = field(default_factory=dict)

    @property
    def total_limit(self) -> int:
        return self.max_num_seqs + self.max_waiting_seqs

    @property
    def client_limit(self) -> int:
        per_client = self.max_waiting_seqs_per_client
        if per_client is None:
            per_client = self.max_waiting_seqs // 2
        return self.max_num_seqs + per_client

    def check_room(self, client: str) -> None:
        """Refuse now (429) a request that no size could get admitted: one sequence more
        would pass a limit. Called before its body is parsed, so a client that goes on
        sending past its 429s costs the server the reading of its bodies, not their parsing,
        validation and tokenizing."""
        self._check(client, 1)

    def admit(self, client: str, seqs: int) -> Ticket:
        """Reserve ``seqs`` sequences for ``client``, or raise a 429 ``ApiError``."""
        self._check(client, seqs)
        held = self.by_client.get(client, 0)
        self.total += seqs
        self.by_client[client] = held + seqs
        self._publish()
        return Ticket(self, client, seqs)

    def _check(self, client: str, seqs: int) -> None:
        held = self.by_client.get(client, 0)
        if self.total and self.total + seqs > self.total_limit:
            self._refuse("server", f"The server is busy: {self.total} sequences are running "
                         f"or waiting, and this request's {seqs} would pass its limit of "
                         f"{self.total_limit}")
        if held and held + seqs > self.client_limit:
            self._refuse("client", f"Too many sequences in flight from this client: it has "
                         f"{held}, and this request's {seqs} would pass its limit of "
                         f"{self.client_limit}")

    def _refuse(self, reason: str, message: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(reason=reason).inc()
        raise ApiError(429, f"{message}; retry later", type="rate_limit_error",
                       code="rate_limit_exceeded",
                       headers={"Retry-After": str(RETRY_AFTER_S)})

    def _release(self, ticket: Ticket) -> None:
        self.total -= ticket.seqs
        left = self.by_client.get(ticket.client, 0) - ticket.seqs
        if left > 0:
            self.by_client[ticket.client] = left
        else:
            self.by_client.pop(ticket.client, None)
        self._publish()

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.admitted_seqs.set(self.total)
            self.metrics.admitted_clients.set(len(self.by_client))


class Admitted:
    """An ASGI response that gives its request's reserved sequences back when it ends,
    however it ends (finished, failed, or the client gone before it started)."""

    def __init__(self, response: Any, ticket: Ticket) -> None:
        self.response, self.ticket = response, ticket

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.ticket.release()
