"""Waiting queues: FCFS is a deque; priority is a heap, where "prepend" is just "add"."""

from __future__ import annotations

import heapq
from collections import deque
from typing import Iterable

from .request import Request


class FCFSQueue(deque):
    def add(self, r: Request) -> None:
        self.append(r)

    def pop_request(self) -> Request:
        return self.popleft()

    def peek(self) -> Request:
        return self[0]

    def prepend(self, r: Request) -> None:
        self.appendleft(r)

    def prepend_all(self, rs: Iterable[Request]) -> None:
        """Like deque.extendleft: the last of ``rs`` ends up first."""
        self.extendleft(rs)

    def remove_all(self, rs: set) -> None:
        kept = [r for r in self if r not in rs]
        self.clear()
        self.extend(kept)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add(self, r: Request) -> None:
        heapq.heappush(self._heap, r)

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)

    def peek(self) -> Request:
        return self._heap[0]

    prepend = add

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


def make_queue(policy: str):
    return PriorityQueue() if policy == "priority" else FCFSQueue()
