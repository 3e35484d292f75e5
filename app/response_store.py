"""The Responses API's stored responses (``store``, ``previous_response_id``, ``GET`` and
``DELETE /v1/responses/{id}``), in memory and bounded.

Each entry holds the response object as it was answered and the conversation a follow-up
continues: the chat messages of every turn up to and including this response's output (its
``instructions`` left out, as OpenAI leaves them out of a follow-up). A chain of follow-ups
then needs only its last entry, so evicting an older one breaks nothing that came after it.

The store keeps at most ``max_entries`` entries and ``max_bytes`` bytes (their JSON size); past
either, the oldest entries go first. Lookups happen on the prepare threads and writes on the
event loop, hence the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as answered
    conversation: list[dict[str, Any]]  # chat messages, this response's output included
    size: int  # bytes counted against the store's bound


class ResponseStore:
    """Responses by id, oldest evicted first past ``max_entries`` or ``max_bytes``."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Store ``response`` under its ``id``; False where it alone is past ``max_bytes``
        (it is then not kept)."""
        size = len(orjson.dumps(response)) + len(orjson.dumps(conversation))
        if size > self.max_bytes or self.max_entries < 1:
            return False
        entry = StoredResponse(response, conversation, size)
        with self._lock:
            self._remove(response["id"])
            self._entries[response["id"]] = entry
            self.bytes += size
            while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
                _, oldest = self._entries.popitem(last=False)
                self.bytes -= oldest.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        """Whether there was such a response."""
        with self._lock:
            return self._remove(response_id)

    def _remove(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
