"""One grammar compile at a time per client.

A compile runs on the engine's compile threads until it ends or passes its time limit
(``core/structured_output/compiler.py``), and one past its limit goes on to its end. A client
sending many distinct slow grammars at once would hold every compile thread, and the CPU they
take, however low their priority. So a client's grammar waits until its previous one is done
(compiled, failed, or given up by its request); other clients' compiles start at once. A
grammar the cache already holds passes through as fast as ever once its turn comes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class CompileGate:
    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._holders: dict[str, int] = {}  # client -> requests holding or awaiting its lock

    @asynccontextmanager
    async def turn(self, client: str) -> AsyncIterator[None]:
        """Held while ``client``'s grammar compiles."""
        lock = self._locks.setdefault(client, asyncio.Lock())
        self._holders[client] = self._holders.get(client, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._holders[client] -= 1
            if not self._holders[client]:  # nobody left: forget the client
                del self._holders[client], self._locks[client]

    @property
    def num_clients(self) -> int:
        return len(self._locks)
