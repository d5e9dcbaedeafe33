"""Policy: which requests run in the next forward pass, and how many of their tokens.

One rule, as in vLLM's v1 scheduler: a request needs ``num_tokens - num_computed_tokens``
tokens fed to catch up. Running requests go first (they hold memory and users are waiting on
their next token), then waiting requests are admitted in arrival order while the batch has
room: ``max_num_seqs`` sequences, ``max_num_batched_tokens`` tokens and, with paged KV, free
blocks (after reusing whatever prefix the cache already holds). When a running request needs a
block and none is free, the most recently arrived running request is preempted by recompute:
its blocks are freed and it goes back to the front of the queue, to be recomputed later.
Nothing crashes and nobody waits forever. With chunked prefill, a prompt longer than what is
left of the step's token budget is fed in chunks over several steps, sharing each step with the
running decodes. ``policy="static"`` is the baseline chapter 04 measures against: a batch is
admitted together and held until its longest member ends.

The small methods (``num_new_tokens``, ``can_allocate``, ``take``, ``admit``, ``preempt``) are
the mechanism a policy is written with; chapter 04's exercise writes ``schedule`` from them and
plugs it in as ``schedule_fn``, chapter 05's writes the chunking rule and plugs it in as
``chunk_rule``.
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


def chunk_rule(num_remaining: int, budget_left: int, enable_chunked_prefill: bool,
               long_prefill_token_threshold: int = 0) -> int:
    """How many of a request's ``num_remaining`` tokens to feed this step; 0 means none this step.

    Without chunking a request goes in whole or waits. With chunking it takes what the budget has
    left, and a ``long_prefill_token_threshold`` caps any one request's chunk, so one long prompt
    cannot take the whole step from the others (vLLM's option of the same name).
    """
    n = num_remaining
    if enable_chunked_prefill and long_prefill_token_threshold > 0:
        n = min(n, long_prefill_token_threshold)
    if n <= budget_left:
        return n
    return max(budget_left, 0) if enable_chunked_prefill else 0


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, kv: KVCacheManager | None = None,
                 enable_chunked_prefill: bool = False, policy: str = "continuous",
                 long_prefill_token_threshold: int = 0):
        if policy not in ("continuous", "static"):
            raise ValueError(f"scheduling policy must be 'continuous' or 'static', got {policy!r}")
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.preempted_this_step: list[Request] = []
        # the exercises' plug points: the attendee's schedule(scheduler) and chunking rule
        self.schedule_fn = None
        self.chunk_rule = chunk_rule

    def add(self, req: Request):
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ policy

    def schedule(self) -> ScheduledBatch:
        self.preempted_this_step = []
        return self.schedule_fn(self) if self.schedule_fn is not None else self._schedule()

    def _schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        budget = self.max_num_batched_tokens
        for req in list(self.running):  # 1. running requests first
            if req not in self.running:
                continue  # preempted a moment ago to make room for an earlier one
            need = self.num_new_tokens(req, budget, batch)
            if need == 0:
                break  # the budget is spent: the rest run next step
            while not self.can_allocate(req, need):  # out of blocks: preempt the newest
                self.preempt(self.running[-1])
                if req not in self.running:
                    break
            if req in self.running:
                self.take(batch, req, need)
                budget -= need
        if self.policy == "static" and self.running:
            return batch  # the baseline: nobody joins until the whole batch has finished
        while self.waiting and len(self.running) < self.max_num_seqs:  # 2. admission, in arrival order
            req = self.waiting[0]
            hit = self.kv.match(req) if self.kv is not None else None  # prefix-cache reuse (chapter 03)
            skip = hit.num_blocks() * self.kv.block_size if hit else 0
            need = self.num_new_tokens(req, budget, batch, skip)
            if need == 0 or (hit is not None and not self.kv.can_admit(req, hit)):
                break  # FCFS: nobody overtakes the head of the queue
            if hit is not None:
                self.kv.admit(req, hit)
                need = self.num_new_tokens(req, budget, batch)
            self.admit(req)
            self.take(batch, req, need)
            budget -= need
        return batch

    # ------------------------------------------------------------------ mechanism a policy uses

    def num_new_tokens(self, req: Request, budget_left: int, batch: ScheduledBatch | None = None,
                       skip: int = 0) -> int:
        """Tokens of ``req`` to feed this step (0: none). ``skip``: tokens a prefix hit would cover.

        A request that can never fit the budget unchunked (a long sequence recomputed after
        preemption) still runs, alone in its step, so it cannot wait forever.
        """
        remaining = req.num_tokens - req.num_computed_tokens - skip
        n = self.chunk_rule(remaining, budget_left, self.enable_chunked_prefill, self.long_prefill_token_threshold)
        if n == 0 and not batch and remaining > 0:
            n = remaining
        return n

    def can_allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Are there free blocks for ``num_new_tokens`` more tokens of ``req``?"""
        return self.kv is None or self.kv.can_allocate(req, num_new_tokens)

    def take(self, batch: ScheduledBatch, req: Request, num_new_tokens: int):
        """Put ``num_new_tokens`` tokens of ``req`` in the batch, allocating the blocks they need."""
        if self.kv is not None:
            self.kv.allocate(req, num_new_tokens)
        batch.requests.append(req)
        batch.num_new_tokens.append(num_new_tokens)

    def admit(self, req: Request):
        """Move ``req`` from the waiting queue to the running list."""
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or time.perf_counter()
        self.running.append(req)

    def preempt(self, req: Request):
        """Recompute preemption: drop the request's KV, requeue it first; its tokens so far are kept."""
        self.running.remove(req)
        if self.kv is not None:
            self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.preempted_this_step.append(req)
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
