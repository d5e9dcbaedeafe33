"""Policy: which requests run next, and with how many tokens each (what a step did to them is written by the
scheduler's ``RequestLifecycle``, ``lifecycle.py``).

One rule, as in vLLM's v1 scheduler: a request needs ``num_tokens - num_computed_tokens``
tokens fed to catch up. Running requests go first (they hold memory and users are waiting on
their next token), then waiting requests are admitted in arrival order while the batch has
room: ``max_num_seqs`` sequences, ``max_num_batched_tokens`` tokens and free KV memory (after
reusing whatever prefix the cache already holds). When a running request needs a block and
none is free, the most recently arrived running request is preempted by recompute: its blocks
are freed and it goes back to the front of the queue. Nothing crashes and nobody waits forever.
With chunked prefill, a prompt longer than what is left of the step's token budget is fed in
chunks over several steps, sharing each step with the running decodes. ``scheduling_policy=
"static"`` is chapter 04's baseline: a batch is admitted together and held until it has drained.
``"priority"`` is vLLM's priority policy (chapter 05's online and offline work on one engine): the
queue is ordered by (priority, arrival) instead (``request_queue.py``), and the running requests
are visited in that order too, so the one preempted when memory runs out is the least urgent, newest
one, vLLM's ``max(self.running, key=lambda r: (r.priority, r.arrival_time))``. (vLLM visits them in
admission order, and when that victim was already scheduled this step it takes it back out of the
step; visited most urgent first, the victim is always one not yet scheduled, and the budget, when it
runs short, goes to the urgent ones first.)

``schedule()`` decides; ``lifecycle.update_from_output()`` is the only place a request moves forward
after the model ran: computed tokens, the new token, full blocks offered to the prefix cache, and
finishing (EOS, ``max_tokens``, the context length) with its memory freed at once. That half is
bookkeeping, not policy: it is ``RequestLifecycle`` (``lifecycle.py``), a component the scheduler
builds and owns as ``self.lifecycle``, with chapter 07's requests whose KV comes from, or goes to,
another engine. vLLM has both halves in one class; here each file holds one idea, and the two share
only what they both move requests between, ``self.queues`` (``RequestQueues``: waiting, running,
loading, held), and the KV manager and connector they are both handed.

The small methods (``num_new_tokens``, ``add_to_batch``, ``admit``, ``preempt``) and the KV
manager's ``can_allocate`` are what a policy is written with: chapter 04's exercise writes
``schedule`` from them, chapter 05's writes the chunking rule and the admission of the head of the
queue (``admit_one``: prefix hit, first chunk, memory for that chunk), and ``LLMEngine.plugged`` puts
them in for the length of a ``with`` block.
"""
from __future__ import annotations

import math
import time
from collections import deque

from .kv_cache_manager import KVManager, PrefixHit
from .lifecycle import RequestLifecycle, RequestQueues, SchedulerOutput
from .plug_points import PlugPoint
from .request import Request
from .request_queue import PriorityQueue, priority_order, waiting_queue


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


def admit_one(s, req: Request, out: SchedulerOutput, budget_left: int) -> int:
    """Admit ``req``, the head of the queue, into this step if it can start; return the tokens it feeds
    (0: it waits, and so does everyone behind it). Chapter 05's hard exercise writes this.

    What the prefix cache holds is not fed again, so the chunk counts only what is left after the
    hit; with chunked prefill the first chunk may be less than the prompt, and only that chunk
    needs KV memory now (the rest is allocated step by step, as vLLM does); a request alone in its
    step runs even if it exceeds the budget, or it would wait forever.
    """
    hit = s.kv.find_cached_prefix(req)                  # what the prefix cache holds already (chapter 03)
    n = s.num_new_tokens(req, budget_left, out, skip=hit.num_tokens)  # the chunk rule; alone, it runs whole
    if n == 0 or not s.kv.can_allocate(req, n, hit):    # blocks for the hit (unless live) and this chunk
        return 0
    s.admit(req, hit)                                   # its computed tokens are now the hit's
    s.add_to_batch(out, req, n)
    return n


class Scheduler:
    """The policy. It holds the requests' state through two parts: ``queues`` (where each request is) and ``lifecycle``
    (``RequestLifecycle``: what each step did to them), a component built here and handed the queues, the KV
    manager and the connector; the engine calls ``scheduler.lifecycle.update_from_output`` after each step."""

    PLUG_POINTS = {  # the exercises' pieces (plug_points.py): a whole policy, a chunking rule, admission
        "schedule_fn": PlugPoint("schedule_fn", "schedule(scheduler) -> SchedulerOutput, the whole policy (ch. 04); "
                                 "None: the engine's own", kind="function or None"),
        "chunk_rule": PlugPoint("chunk_rule", "the tokens one request feeds this step (ch. 05)"),
        "admit_fn": PlugPoint("admit_fn", "the head of the queue joins, or waits (ch. 05)"),
        "land_transfers": PlugPoint("lifecycle.land_transfers", "land_transfers(lifecycle, done_sending, "
                                    "done_recving, failed): the decode side of the KV hand-off (ch. 07)"),
    }

    def __init__(self, config, kv: KVManager, eos_token_ids=(), connector=None, clock=time.perf_counter):
        self.config = config  # the engine's EngineConfig, read at every step: one truth for every option
        self.kv = kv
        # where each request is (waiting, running, and chapter 07's loading and held): shared with the lifecycle,
        # which moves requests between them after each step
        self.queues = RequestQueues(waiting=waiting_queue(config.scheduling_policy))  # a deque, or by priority
        # what each step did to its requests, and how they leave (lifecycle.py): owned, handed what it works on
        spec = config.speculative_config  # chapter 09: the lifecycle counts the guesses it verifies
        self.lifecycle = RequestLifecycle(self.queues, kv, eos_token_ids, config.max_model_len, connector,
                                          num_speculative_tokens=spec["num_speculative_tokens"] if spec else 0,
                                          clock=clock)
        self.preempted: list[Request] = []  # this step's preemptions
        self.num_preemptions = 0
        # the exercises' plug points (PLUG_POINTS above; set them through LLMEngine.plugged)
        self.schedule_fn = None
        self.chunk_rule = chunk_rule
        self.admit_fn = admit_one
        # chapter 07: a KV connector (engine/kv_connector.py); the lifecycle parks and frees requests through it
        self.connector = connector

    # The policy's own view of the queues. Chapter 04's exercise writes ``schedule(s)`` against ``s.waiting`` and
    # ``s.running`` (and ``s.admit``, ``s.preempt``), chapter 05's admission against the same, so they stay names
    # of the scheduler; they are the lists in ``self.queues``, never copies, so the lifecycle sees every change.
    @property
    def waiting(self) -> deque[Request] | PriorityQueue:  # by scheduling_policy (request_queue.py)
        return self.queues.waiting

    @property
    def running(self) -> list[Request]:
        return self.queues.running

    def add_request(self, req: Request):
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or any(not r.is_finished for r in self.queues.loading.values()))

    def has_pending_transfers(self) -> bool:
        """KV on its way in or out: the engine must keep polling the connector even with nothing to run."""
        return bool(self.queues.loading or self.queues.held)

    # ------------------------------------------------------------------ policy

    def schedule(self) -> SchedulerOutput:
        self.preempted = []
        self.queues.waiting = waiting_queue(self.config.scheduling_policy, self.waiting)  # the policy may change
        if self.connector is not None:
            self.lifecycle.poll_connector()
        out = self.schedule_fn(self) if self.schedule_fn is not None else self._schedule()
        if not isinstance(out, SchedulerOutput):
            raise TypeError(f"a schedule function must return a SchedulerOutput, not {type(out).__name__}")
        out.preempted = self.preempted
        out.running = [r.request_id for r in self.running]
        out.waiting = [r.request_id for r in self.waiting]
        return out

    def _schedule(self) -> SchedulerOutput:
        out, budget = SchedulerOutput(), self.config.max_num_batched_tokens
        if self.config.scheduling_policy == "priority":
            self.running.sort(key=priority_order)       # the most urgent first, the first victim last (see below)
        # 1. running requests first, oldest (by priority: most urgent) first: they hold KV memory, their users wait
        i = 0
        while i < len(self.running):
            req = self.running[i]
            n = self.num_new_tokens(req, budget, out)
            if n == 0:
                break                                   # the budget is spent: the rest run next step
            if req.spec.token_ids and not self.kv.can_allocate(req, n):
                req.spec.drop()                         # drop guesses before preempting anyone
                n = self.num_new_tokens(req, budget, out)
            fits = self.kv.can_allocate(req, n)
            while not fits and self.running[-1] is not req:
                self.preempt(self.running[-1])          # out of blocks: the newest (or least urgent) goes back
                fits = self.kv.can_allocate(req, n)
            if not fits:
                self.preempt(req)                       # it was the newest itself
                break
            self.add_to_batch(out, req, n)
            budget -= self.step_cost(req, n)
            i += 1
        if self.config.scheduling_policy == "static" and self.running:
            return out                                  # the baseline: nobody joins a batch in flight
        # 2. then the queue, in arrival order (or priority's), while a slot, the budget and the blocks allow
        while self.waiting and self.num_running_seqs() + self.waiting[0].num_seqs <= self.config.max_num_seqs:
            req = self.waiting[0]                       # (num_seqs: n for a request that will fork, else 1)
            if req.block_table:                         # its KV came from another engine (chapter 07)
                n = self.num_new_tokens(req, budget, out)
                if n == 0 or not self.kv.can_allocate(req, n):
                    break
                self.admit(req)
                self.add_to_batch(out, req, n)
                budget -= self.step_cost(req, n)
                continue
            if self.connector is not None:
                loading = self.lifecycle.start_remote_load(req, self.kv.find_cached_prefix(req))
                if loading is None:
                    break                               # its KV waits elsewhere, but no room for it here yet
                if loading:
                    continue                            # it waits for its KV without taking a slot
            n = self.admit_fn(self, req, out, budget)   # the head joins this step, maybe with a first chunk
            if n == 0:
                break                                   # FCFS: nobody overtakes the head of the queue
            out.prefix_hit_tokens[req.request_id] = req.num_computed_tokens  # not yet advanced: the hit
            budget -= self.step_cost(req, n)
        return out

    # ------------------------------------------------------------------ mechanism a policy uses

    def num_new_tokens(self, req: Request, budget_left: int, out: SchedulerOutput, skip: int = 0) -> int:
        """Tokens of ``req`` to feed this step (0: none). ``skip``: tokens a prefix hit would cover.

        A request that can never fit the budget unchunked (a long sequence recomputed after
        preemption) still runs, alone in its step, so it cannot wait forever.
        """
        remaining = req.num_tokens - req.num_computed_tokens - skip + len(req.spec.token_ids)  # guesses: chapter 09
        priced = remaining - len(req.spec.token_ids) > 1  # a prompt chunk (a decode row counts 1: step_cost)
        n = self.chunk_rule(remaining, self.affordable(req, budget_left, skip) if priced else budget_left,
                            self.config.enable_chunked_prefill, self.config.long_prefill_token_threshold)
        if n == 0 and not out.requests and remaining > 0:
            n = remaining
        return n

    @property
    def cost_context(self) -> int:
        """``chunk_cost_context`` where it applies (chunked prefill on), else 0."""
        return self.config.chunk_cost_context if self.config.enable_chunked_prefill else 0

    def step_cost(self, req: Request, n: int) -> int:
        """What feeding ``n`` tokens of ``req`` takes from the step's token budget: ``n``, unless
        ``chunk_cost_context`` (K) is set and this is a prompt chunk. Then each token counts 1 + c/K, c the
        earlier tokens it attends to (on average ``num_computed_tokens + n/2``): a token's products cost
        the same at any position, its attention grows with its context, and once c passes K the attention
        is most of the step. A decode row counts 1: the budget is for chunks, as in vLLM."""
        k = self.cost_context
        if not k or n - len(req.spec.token_ids) <= 1:
            return n
        return math.ceil(n * (1 + (req.num_computed_tokens + n / 2) / k))

    def affordable(self, req: Request, budget_left: int, skip: int = 0) -> int:
        """The most tokens of ``req`` whose ``step_cost`` fits in ``budget_left`` (the inverse of step_cost:
        n (1 + (c + n/2) / K) <= budget, solved for n), at least 1 while any budget is left."""
        k = self.cost_context
        if not k or budget_left <= 1:
            return budget_left
        a = 1 + (req.num_computed_tokens + skip) / k
        n = int(k * (math.sqrt(a * a + 2 * budget_left / k) - a))
        while n > 1 and n * (a + n / (2 * k)) > budget_left:  # float rounding
            n -= 1
        return max(n, 1)

    def add_to_batch(self, out: SchedulerOutput, req: Request, num_new_tokens: int):
        """Feed ``num_new_tokens`` tokens of ``req`` this step, reserving the KV memory they need."""
        if num_new_tokens <= 0:
            return
        self.kv.allocate(req, num_new_tokens)
        out.requests.append(req)
        out.num_new_tokens.append(num_new_tokens)
        out.is_prefill.append(req.num_computed_tokens < req.num_tokens - 1)  # a decode feeds its last token (+ guesses)

    def admit(self, req: Request, hit: PrefixHit | None = None):
        """Move ``req`` from the queue to the running list, reusing the prefix ``hit`` found for it."""
        self.waiting.remove(req)  # the head, in FCFS order: found at once
        self.lifecycle.mark_running(req, hit)
        self.running.append(req)

    def preempt(self, req: Request):
        """Recompute preemption: free the request's KV, requeue it first (by priority: at its place); its tokens
        so far are kept."""
        self.running.remove(req)
        self.lifecycle.mark_preempted(req)
        self.num_preemptions += 1
        self.preempted.append(req)
        self.waiting.appendleft(req)

    def num_running_seqs(self) -> int:
        return sum(r.num_seqs for r in self.running)

    def stats(self) -> dict:
        return {"num_preemptions": self.num_preemptions, "num_requests_running": len(self.running),
                "num_requests_waiting": len(self.waiting),
                **{k: list(v) if isinstance(v, list) else v for k, v in self.lifecycle.counters.items()}}
