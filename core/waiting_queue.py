"""The scheduler's waiting queue: requests that wait for a place in the batch, taken in turn by
client so that no client's backlog starves another's; under the ``priority`` policy, one such
queue per priority level, the lowest value first."""

from __future__ import annotations

import bisect
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator

from tidal.core.request import Request, RequestStatus


class _Headed:
    """``queue[0]``, the head, as a deque offers it: the one index the scheduler uses."""

    def peek(self) -> Request:
        raise NotImplementedError

    def __getitem__(self, index: int) -> Request:
        if index != 0:
            raise IndexError("only the head of the waiting queue is indexed")
        return self.peek()


class FairQueue(_Headed):
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

    def resume(self, request: Request) -> None:
        """A preempted request, among the resumed ones in order of arrival."""
        keys = [r.arrival_time for r in self._front]
        self._front.insert(bisect.bisect_right(keys, request.arrival_time), request)
        self._len += 1

    def lane_sizes(self) -> Counter[str]:
        """Waiting requests per client (resumed ones not counted by client)."""
        return Counter({client: len(lane) for client, lane in self._lanes.items()})

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


class PriorityQueue(_Headed):
    """The waiting requests under ``--scheduling-policy priority``: one ``FairQueue`` per
    priority level, the lowest value taken first (vLLM's meaning), ties by client in turn and
    then by arrival. A preempted request goes back among its level's resumed requests in order
    of arrival: ahead of everything it outranks, behind what outranks it. Offers the same
    operations as ``FairQueue``."""

    def __init__(self) -> None:
        self._levels: dict[int, FairQueue] = {}

    def _ordered(self) -> list[FairQueue]:
        return [self._levels[p] for p in sorted(self._levels)]

    def _level(self, priority: int) -> FairQueue:
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = FairQueue()
        return level

    def _prune(self, priority: int) -> None:
        if not self._levels[priority]:
            del self._levels[priority]

    def __len__(self) -> int:
        return sum(len(level) for level in self._levels.values())

    def __bool__(self) -> bool:
        return bool(self._levels)

    def __iter__(self) -> Iterator[Request]:
        for level in self._ordered():
            yield from level

    @property
    def num_clients(self) -> int:
        return len(self._lane_sizes())

    @property
    def max_per_client(self) -> int:
        return max(self._lane_sizes().values(), default=0)

    def _lane_sizes(self) -> Counter[str]:
        sizes: Counter[str] = Counter()
        for level in self._levels.values():
            sizes.update(level.lane_sizes())
        return sizes

    def peek(self) -> Request:
        if not self._levels:
            raise IndexError("the waiting queue is empty")
        return self._levels[min(self._levels)].peek()

    def append(self, request: Request) -> None:
        self._level(request.priority).append(request)

    def appendleft(self, request: Request) -> None:
        self._level(request.priority).resume(request)

    def putback(self, requests: list[Request]) -> None:
        for priority in dict.fromkeys(r.priority for r in requests):
            self._level(priority).putback([r for r in requests if r.priority == priority])

    def popleft(self) -> Request:
        request = self.peek()
        self.take(request)
        return request

    def remove(self, request: Request) -> None:
        level = self._levels.get(request.priority)
        if level is None:
            raise ValueError("the request is not waiting")
        level.remove(request)
        self._prune(request.priority)

    @property
    def clients(self) -> list[str]:
        return list(dict.fromkeys(c for level in self._ordered() for c in level.clients))

    def first(self, allowed: Callable[[str], bool]) -> Request | None:
        for level in self._ordered():
            request = level.first(allowed)
            if request is not None:
                return request
        return None

    def take(self, request: Request) -> None:
        self._levels[request.priority].take(request)
        self._prune(request.priority)
