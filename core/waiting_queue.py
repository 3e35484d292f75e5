"""The scheduler's waiting queue: requests that wait for a place in the batch, taken in turn by
client so that no client's backlog starves another's."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator

from tidal.core.request import Request, RequestStatus


class FairQueue:
    """The waiting requests: resumed ones (preempted, their place kept) first, in order, then
    one lane per client (``Request.client``), taken round-robin: after a request of one client
    is taken, the next client's turn comes. One client's 2,048 waiting sequences then delay
    another client's one by at most one admission, not 2,048; with one client it is plain
    first come, first served.

    The deque operations the scheduler uses: ``append`` (a new request, at the back of its
    client's lane), ``appendleft`` (a preempted one, at the front of everything), ``[0]`` (the
    next to take), ``popleft``, ``remove``, ``len`` and iteration in taking order."""

    def __init__(self) -> None:
        self._front: deque[Request] = deque()
        self._lanes: OrderedDict[str, deque[Request]] = OrderedDict()  # rotation order
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        """In taking order, as if the rotation went on without new arrivals."""
        yield from self._front
        lanes = [iter(lane) for lane in self._lanes.values()]
        while lanes:
            alive = []
            for lane in lanes:
                request = next(lane, None)
                if request is not None:
                    yield request
                    alive.append(lane)
            lanes = alive

    def __getitem__(self, index: int) -> Request:
        if index != 0:
            raise IndexError("only the head of the waiting queue is indexed")
        return self.peek()

    @property
    def num_clients(self) -> int:
        """Clients with a request waiting (resumed requests are not counted by client)."""
        return len(self._lanes)

    @property
    def max_per_client(self) -> int:
        return max((len(lane) for lane in self._lanes.values()), default=0)

    def peek(self) -> Request:
        if self._front:
            return self._front[0]
        if not self._lanes:
            raise IndexError("the waiting queue is empty")
        return next(iter(self._lanes.values()))[0]

    def append(self, request: Request) -> None:
        lane = self._lanes.get(request.client)
        if lane is None:
            lane = self._lanes[request.client] = deque()
        lane.append(request)
        self._len += 1

    def appendleft(self, request: Request) -> None:
        self._front.appendleft(request)
        self._len += 1

    def putback(self, requests: list[Request]) -> None:
        """Requests taken off the head (in taking order) put back at the front of their
        lanes, keeping their place: those still waiting for a grammar."""
        for request in reversed(requests):
            if request.status == RequestStatus.PREEMPTED:
                self._front.appendleft(request)
            else:
                lane = self._lanes.get(request.client)
                if lane is None:
                    lane = self._lanes[request.client] = deque()
                    self._lanes.move_to_end(request.client, last=False)
                lane.appendleft(request)
            self._len += 1

    def popleft(self) -> Request:
        """Take the head; its client's turn then passes to the next client."""
        if self._front:
            self._len -= 1
            return self._front.popleft()
        if not self._lanes:
            raise IndexError("the waiting queue is empty")
        client, lane = next(iter(self._lanes.items()))
        request = lane.popleft()
        self._len -= 1
        if lane:
            self._lanes.move_to_end(client)
        else:
            del self._lanes[client]
        return request

    def remove(self, request: Request) -> None:
        lane = self._lanes.get(request.client)
        if lane is not None and request in lane:
            lane.remove(request)
            if not lane:
                del self._lanes[request.client]
        else:
            self._front.remove(request)  # ValueError if it is in neither, as deque's
        self._len -= 1

    @property
    def clients(self) -> list[str]:
        """The clients with a request waiting, resumed ones included, in taking order."""
        seen = dict.fromkeys(r.client for r in self._front)
        seen.update(dict.fromkeys(self._lanes))
        return list(seen)

    def first(self, allowed: Callable[[str], bool]) -> Request | None:
        """The next request ``popleft`` would take among those whose client is ``allowed``
        (the resumed ones first, then each lane's head in turn), or None."""
        for request in self._front:
            if allowed(request.client):
                return request
        for client, lane in self._lanes.items():
            if allowed(client):
                return lane[0]
        return None

    def take(self, request: Request) -> None:
        """Take ``request``, a resumed one or the head of its lane (as ``first`` returns
        them); its client's turn then passes to the next client, as in ``popleft``."""
        lane = self._lanes.get(request.client)
        if lane and lane[0] is request:
            lane.popleft()
            self._len -= 1
            if lane:
                self._lanes.move_to_end(request.client)
            else:
                del self._lanes[request.client]
            return
        self._front.remove(request)  # ValueError if it is neither
        self._len -= 1
