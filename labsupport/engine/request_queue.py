"""The waiting queue, in the order the scheduling policy serves it (vLLM's ``v1/core/sched/request_queue.py``).

``scheduling_policy="continuous"`` (and chapter 04's ``"static"``) is first come, first served, vLLM's
``fcfs``: a ``deque`` in arrival order, and a preempted request goes back to its *front*, because it
arrived before everyone still waiting. ``"priority"`` is vLLM's ``priority`` policy: the smallest
``priority`` value first and, among equals, the earliest arrival (vLLM's ``PriorityRequestQueue``,
ordered by ``Request.__lt__``: priority, then ``arrival_time``). There a preempted request goes back
to *its place* in that order, not to the front: "In a priority queue, there is no concept of
prepending to the front" (vLLM's ``PriorityRequestQueue.prepend_request``).

vLLM keeps a heap; this keeps a sorted list, so that ``waiting[0]`` is the head and iterating gives
the serving order, exactly as with the deque: the scheduler, the chapters' exercises and the
engine's step records read either queue the same way, and the policy lives here, not in branches
of the scheduler.
"""
from __future__ import annotations

import bisect
from collections import deque

POLICIES = ("continuous", "static", "priority")


def priority_order(req) -> tuple[int, float]:
    """The priority policy's order: a smaller ``priority`` first, then the earlier arrival (vLLM's
    ``Request.__lt__``; where both are equal vLLM compares request ids, this keeps the order they came in)."""
    return req.priority, req.metrics.arrival_time


class PriorityQueue:
    """Waiting requests, the most urgent first. The deque methods the scheduler calls are all here:
    ``append`` (a new request), ``appendleft`` (a preempted one, or one whose KV arrived), ``remove``,
    ``[0]``, ``len`` and iteration."""

    def __init__(self, requests=()):
        self._keys: list[tuple[int, float]] = []  # each request's order, taken when it came in: the list
        self._requests: list = []                 # stays sorted whatever is later written into a request
        for req in requests:
            self.append(req)

    def append(self, req):
        key = priority_order(req)
        i = bisect.bisect_right(self._keys, key)  # after its equals: ties keep the order they came in
        self._keys.insert(i, key)
        self._requests.insert(i, req)

    appendleft = append  # a preempted request goes back to its place in the order, not to the front (vLLM)

    def remove(self, req):
        i = self._requests.index(req)
        del self._keys[i], self._requests[i]

    def __getitem__(self, i):
        return self._requests[i]

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self):
        return iter(self._requests)

    def __repr__(self):
        return f"PriorityQueue({self._requests!r})"


def waiting_queue(policy: str, requests=()):
    """The queue ``policy`` serves from, holding ``requests``; ``requests`` itself if it is that kind already
    (the policy may change on a live engine: ``LLMEngine.set_options(scheduling_policy=...)``)."""
    if policy not in POLICIES:
        raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {policy!r}")
    kind = PriorityQueue if policy == "priority" else deque
    return requests if isinstance(requests, kind) else kind(requests)
