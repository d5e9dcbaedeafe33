"""Policy: which requests run in the next forward pass, and how many of their tokens.

One rule, as in vLLM's v1 scheduler: a request needs ``num_tokens - num_computed_tokens``
tokens fed to catch up. Running requests go first (they hold memory and users are waiting on
their next token), then waiting requests are admitted in arrival order while the batch has
room (``max_num_seqs`` sequences, ``max_num_batched_tokens`` tokens). Chapters 02-05 add
blocks, preemption and chunking to this same loop.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from .request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self):
        return bool(self.requests)


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request):
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        budget = self.max_num_batched_tokens
        for req in self.running:
            need = req.num_tokens - req.num_computed_tokens
            if need > budget and batch:
                break  # the rest run next step
            batch.requests.append(req)
            batch.num_new_tokens.append(need)
            budget -= need
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            need = req.num_tokens - req.num_computed_tokens
            if need > budget and batch:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or time.perf_counter()
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(need)
            budget -= need
        return batch

    def finish(self, req: Request, reason: str):
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
