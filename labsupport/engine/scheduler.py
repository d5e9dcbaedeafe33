"""Policy: which requests run in the next forward pass, and how many of their tokens.

One rule, as in vLLM's v1 scheduler: a request needs ``num_tokens - num_computed_tokens``
tokens fed to catch up. Running requests go first (they hold memory and users are waiting on
their next token), then waiting requests are admitted in arrival order while the batch has
room: ``max_num_seqs`` sequences, ``max_num_batched_tokens`` tokens and, with paged KV, free
blocks (after reusing whatever prefix the cache already holds). When a running request needs a
block and none is free, the most recently arrived
running request is preempted by recompute: its blocks are freed and it goes back to the front
of the queue, to be recomputed later. Nothing crashes and nobody waits forever. With chunked
prefill, a prompt longer than what is left of the step's token budget is fed in chunks over
several steps, sharing each step with the running decodes. ``policy="static"`` is the baseline
chapter 04 measures against: a batch is admitted together and held until its longest member ends.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from .blocks import KVCacheManager
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
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, kv: KVCacheManager | None = None,
                 enable_chunked_prefill: bool = False, policy: str = "continuous"):
        if policy not in ("continuous", "static"):
            raise ValueError(f"scheduling policy must be 'continuous' or 'static', got {policy!r}")
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request):
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _fits(self, req: Request, n: int) -> bool:
        return self.kv is None or self.kv.can_allocate(req, n)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        budget = self.max_num_batched_tokens
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            need = self._chunk(req.num_tokens - req.num_computed_tokens, budget)
            if need > budget and batch or need == 0:
                break  # the rest run next step
            while not self._fits(req, need):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            self._take(batch, req, need)
            budget -= need
        # static batching, the baseline: a new batch only once the whole previous one has finished
        admitting = self.policy == "continuous" or not self.running
        while admitting and self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit = self.kv.match(req) if self.kv is not None else None  # prefix-cache reuse, if any
            need = self._chunk(req.num_tokens - (hit.num_blocks() * self.kv.block_size if hit else 0), budget)
            if (need > budget and batch) or need == 0 or (hit is not None and not self.kv.can_admit(req, hit)):
                break  # FCFS: nobody overtakes the head of the queue
            if hit is not None:
                self.kv.admit(req, hit)
                need = self._chunk(req.num_tokens - req.num_computed_tokens, budget)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or time.perf_counter()
            self.running.append(req)
            self._take(batch, req, need)
            budget -= need
        return batch

    def _chunk(self, need: int, budget: int) -> int:
        """Chunked prefill: feed only what the step's token budget has room for; the rest next step."""
        return min(need, max(budget, 0)) if self.enable_chunked_prefill else need

    def _take(self, batch: ScheduledBatch, req: Request, need: int):
        if self.kv is not None:
            self.kv.allocate(req, need)
        batch.requests.append(req)
        batch.num_new_tokens.append(need)

    def preempt(self, req: Request):
        """Recompute preemption: drop the request's KV, requeue it first; its tokens so far are kept."""
        self.running.remove(req)
        if self.kv is not None:
            self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str):
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.kv is not None:
            self.kv.free(req)
