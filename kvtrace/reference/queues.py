"""Waiting queues: FCFS is an ordered dict, in queue order; priority is a heap,
where "prepend" is just "add"."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Iterable

from .request import Request


class FCFSQueue:
    """First come, first served, as vLLM's FCFSRequestQueue
    (v1/core/sched/request_queue.py:75-128), a deque that filters the whole
    queue to take out an aborted request (:109-116). Here the requests are an
    ordered dict's keys, in queue order: the same order, and an abort costs
    the same however many requests wait."""

    def __init__(self) -> None:
        self._queue: OrderedDict[Request, None] = OrderedDict()

    def add(self, r: Request) -> None:
        self._queue[r] = None

    def pop_request(self) -> Request:
        return self._queue.popitem(last=False)[0]

    def peek(self) -> Request:
        return next(iter(self._queue))

    def prepend(self, r: Request) -> None:
        self._queue[r] = None
        self._queue.move_to_end(r, last=False)

    def prepend_all(self, rs: Iterable[Request]) -> None:
        """Like deque.extendleft: the last of ``rs`` ends up first."""
        for r in rs:
            self.prepend(r)

    def remove_all(self, rs: set) -> None:
        for r in rs:
            self._queue.pop(r, None)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self):
        return iter(self._queue)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add(self, r: Request) -> None:
        heapq.heappush(self._heap, r)

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)

    def peek(self) -> Request:
        return self._heap[0]

    def prepend(self, r: Request) -> None:
        """By priority, as any other: the heap has no head to put it at."""
        self.add(r)

    def prepend_all(self, rs: Iterable[Request]) -> None:
        for r in rs:
            self.add(r)

    def remove_all(self, rs: set) -> None:
        self._heap = [r for r in self._heap if r not in rs]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self):
        return iter(sorted(self._heap))


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
