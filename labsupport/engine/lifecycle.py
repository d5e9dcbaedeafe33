"""What a step did to its requests, and how they leave: the bookkeeping half of the scheduler.

``Scheduler`` (``scheduler.py``) is policy: who runs next and how many tokens each feeds. ``RequestLifecycle``
is the component it owns for the rest: the one place a request's state moves forward once the model has run
(``update_from_output``: computed tokens, the new token or tokens, full blocks offered to the prefix cache,
``n > 1`` samples forked from the computed prompt), where it stops (EOS, stop tokens, ``max_tokens``, the
context) and where it leaves with its memory freed (``finish``). Chapter 07's KV connector adds the two other
ways a request's blocks change hands: its prompt KV pulled from another engine (``start_remote_load``, then
``poll_connector`` when it landed) and its blocks held after it finished until another engine has pulled them.

vLLM keeps both halves in one ``Scheduler`` class (``v1/core/sched/scheduler.py``: ``schedule``,
``update_from_output``, ``_update_waiting_for_remote_kv``). Here they are split so each file holds one idea,
and joined by composition, not inheritance: the scheduler builds a ``RequestLifecycle`` and hands it what it
works on, by name. Both halves move requests between the same four places (the waiting queue, the running
list, KV loads in flight, finished requests whose blocks are held), so those live in one small
``RequestQueues`` that both hold; the KV manager, the connector, the EOS ids and the context length come in as
constructor arguments. A reader sees every dependency in ``__init__``, and no attribute is read from a class
this one was mixed into (``tests/test_structure.py`` checks that no class reads an attribute it never sets).
``SchedulerOutput``, the record of one step that both halves read and write, and ``RequestQueues`` live here,
in the lower of the two files: ``scheduler.py`` imports them from here, never the other way.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .kv_cache_manager import KVManager, PrefixHit
from .kv_connector import KVConnectorBase
from .outputs import ModelRunnerOutput
from .request import Request, RequestStatus
from .spec_decode import count_verification, spec_counters
from .stopping import token_stop_reason


@dataclass
class SchedulerOutput:
    """One step: what the scheduler chose and, once the step has run, what came of it.

    The engine keeps the last one as ``engine.last_step``: timelines and tests read the engine's
    own record of a step instead of reconstructing it.
    """

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each request feeds this step
    is_prefill: list[bool] = field(default_factory=list)  # feeding prompt (or recomputed) tokens, not one decode
    prefix_hit_tokens: dict[str, int] = field(default_factory=dict)  # admitted this step -> tokens reused
    preempted: list[Request] = field(default_factory=list)  # sent back to the queue this step
    running: list[str] = field(default_factory=list)  # after scheduling: the batch's slots, oldest first
    waiting: list[str] = field(default_factory=list)  # still queued, head first
    finished: list[Request] = field(default_factory=list)  # left during this step (filled as it runs)
    index: int = -1  # step number in the engine's life
    start: float = 0.0  # the engine's clock before scheduling
    end: float = 0.0  # after the step's tokens were detokenized

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def scheduled(self) -> dict[str, tuple[int, bool]]:
        """request id -> (tokens fed, was it prefill)."""
        return {r.request_id: (n, p) for r, n, p in zip(self.requests, self.num_new_tokens, self.is_prefill)}


@dataclass
class RequestQueues:
    """Where each request the scheduler knows is: the state its two halves share.

    The policy (``Scheduler``) admits from ``waiting`` and preempts from ``running``; the lifecycle
    (``RequestLifecycle``) removes a finished request from either, adds the samples of ``n > 1``, parks
    requests whose KV is on its way in ``loading`` and keeps finished ones whose blocks another engine
    still pulls in ``held``. A request is in at most one of the four.
    """

    waiting: deque[Request] = field(default_factory=deque)  # queued, head first
    running: list[Request] = field(default_factory=list)  # the batch's slots, oldest first
    loading: dict[str, Request] = field(default_factory=dict)  # ch. 07: prompt KV on its way; blocks, no slot
    held: dict[str, Request] = field(default_factory=dict)  # ch. 07: finished; blocks kept for a remote pull


class RequestLifecycle:
    """Moves requests forward after each step and frees what they held.

    A component the ``Scheduler`` owns (``scheduler.lifecycle``), not a base class it inherits: vLLM's one
    ``Scheduler`` does both, but as a mixin this half read the scheduler's lists, KV manager and counters as if
    they were its own, and a reader had to find where each was set. Now all it touches is handed to it here.
    ``queues``: the ``RequestQueues`` it shares with the scheduler. ``kv``: the KV manager whose blocks it
    caches, trims, forks and frees. ``eos_token_ids`` and ``max_model_len``: where a request stops (with the
    pool's capacity, ``longest``). ``connector``: chapter 07's KV connector, or None. ``num_speculative_tokens``:
    chapter 09's guesses per step, which add vLLM's spec-decode counters to ``counters`` (what the steps
    computed and generated; ``llm.stats()`` and ``/metrics`` report them). ``clock``: the engine's, which stamps
    token, admission and finish times (a simulation's virtual clock; else ``time.perf_counter``).
    """

    def __init__(self, queues: RequestQueues, kv: KVManager, eos_token_ids=(), max_model_len: int | None = None,
                 connector: KVConnectorBase | None = None, num_speculative_tokens: int = 0, clock=time.perf_counter):
        self.queues = queues
        self.clock = clock
        self.kv = kv
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.connector = connector
        self.land_transfers = land_transfers  # a plug point (Scheduler.PLUG_POINTS["land_transfers"], ch. 07)
        self.counters = {"prompt_tokens_computed": 0, "generation_tokens": 0}
        if num_speculative_tokens:
            self.counters |= spec_counters(num_speculative_tokens)

    @property
    def longest(self) -> int:
        """The most tokens a request may have: the context, or a pool smaller than it."""
        return min(self.max_model_len, self.kv.capacity)

    def update_from_output(self, out: SchedulerOutput, sampled: ModelRunnerOutput) -> list[Request]:
        """Advance every request of the step; returns those that received a token (finished ones too).

        A request that was fed its last pending token gets the sampled token; a prompt chunk that
        is not the last one gets nothing (its sample is not a next token). Without a KV cache
        nothing stays computed, so the next step feeds the whole sequence again. With speculative
        decoding (chapter 09) a request may get several tokens: its accepted guesses, then the
        sampled one; the K/V of its rejected guesses is rolled back (not computed, blocks freed).
        """
        now = self.clock()
        got_token = []
        self.record_prompt_logprobs(out, sampled)
        for i, (req, n, token, token_logprobs) in enumerate(zip(out.requests, out.num_new_tokens, sampled.token_ids,
                                                                 sampled.logprobs)):
            start = req.num_computed_tokens
            guessed = max(0, start + n - req.num_tokens)  # guesses fed after the real tokens
            fed = n - guessed
            self.counters["prompt_tokens_computed"] += max(0, min(len(req.prompt_token_ids), start + fed) - start)
            accepted = sampled.spec_accepted.get(i, [])
            if guessed:
                count_verification(self.counters, guessed, len(accepted))
            req.spec.drop()                             # verified now: the next guesses come after this step
            req.num_new_output_tokens = 0
            if start + fed < req.num_tokens:
                req.num_computed_tokens = start + fed if self.kv.keeps_kv else 0
                self.kv.cache_full_blocks(req)
                continue  # a prompt chunk: more to feed before the next token
            if req.params.max_tokens == 0:  # prompt only (its logprobs): scored, nothing generated
                req.num_computed_tokens = start + fed if self.kv.keeps_kv else 0
                got_token.append(req)
                self.finish(req, "length")
                out.finished.append(req)
                continue
            new_logprobs = [*sampled.spec_logprobs.get(i, [None] * len(accepted)), token_logprobs]
            reason = None
            for new_token, new_lp in zip([*accepted, token], new_logprobs):
                req.output_token_ids.append(new_token)
                if new_lp is not None:
                    req.logprobs.output.append(new_lp)
                req.metrics.token_times.append(now)
                req.metrics.first_token_time = req.metrics.first_token_time or now
                req.num_new_output_tokens += 1
                self.counters["generation_tokens"] += 1
                reason = self.stop_reason(req, new_token)
                if reason is not None:
                    break  # tokens after a stop are dropped, as plain decoding would never have made them
            # the K/V of the fed token and of the accepted guesses is valid; the rest is rolled back
            req.num_computed_tokens = min(start + fed + len(accepted), req.num_tokens - 1) if self.kv.keeps_kv else 0
            self.kv.cache_full_blocks(req)
            if guessed:
                self.kv.trim(req)                       # blocks that held only rejected guesses go back
            if req.num_seqs > 1:
                self.fork_samples(req)                  # n > 1: the prompt is computed, the samples start
            got_token.append(req)
            if reason is not None:
                self.finish(req, reason)
                out.finished.append(req)
        return got_token

    def mark_running(self, req: Request, hit: PrefixHit | None):
        """WAITING -> RUNNING (``Scheduler.admit``): its computed tokens are the prefix ``hit``'s (without a hit, a
        request whose KV arrived from another engine keeps its computed tokens)."""
        if hit is not None or not req.block_table:
            req.num_computed_tokens = self.kv.use_cached_prefix(req, hit) if hit is not None else 0
        if req.metrics.first_scheduled_time is None:  # usage reports the first admission's hit, not a re-admission's
            req.metrics.num_cached_tokens = req.num_computed_tokens
        req.status = RequestStatus.RUNNING
        req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or self.clock()

    def mark_preempted(self, req: Request):
        """RUNNING -> WAITING by recompute (``Scheduler.preempt``): its KV is freed, nothing of it stays computed,
        its guesses go; its tokens so far are kept."""
        self.kv.release(req)
        req.num_computed_tokens = req.spec.num_draft_computed = 0
        req.spec.drop()
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1

    def fork_samples(self, req: Request):
        """``n > 1``: the prompt's KV is computed (once), so samples 1 .. n-1 start now from the same blocks,
        shared. Each recomputes the prompt's last token to draw its own first token (the logits of that
        position are gone), and that write is the first copy-on-write of the shared last block."""
        for i in range(1, req.params.n):
            child = req.fork(i)
            child.num_computed_tokens = len(req.prompt_token_ids) - 1
            # what it reused rather than computed, so /metrics' prompt_tokens_cached and local_cache_hit hold it and
            # local_compute holds what was computed: the prompt once, then one token a sample (no prefix-cache
            # lookup was made, so the cache's queries and hits do not count it)
            child.metrics.num_cached_tokens = child.num_computed_tokens
            self.kv.fork(req, child)
            child.status = RequestStatus.RUNNING
            req.samples.append(child)
            self.queues.running.append(child)

    @staticmethod
    def record_prompt_logprobs(out: SchedulerOutput, sampled: ModelRunnerOutput):
        """Store the prompt logprobs the runner computed this step (a prompt may come in chunks)."""
        for i, (first, found) in sampled.prompt_logprobs.items():
            recorded = out.requests[i].logprobs.prompt
            recorded.extend([None] * (first - len(recorded)))  # no gap with the engine's own scheduling
            recorded[first:first + len(found)] = found

    def stop_reason(self, req: Request, token: int) -> str | None:
        """``stopping.token_stop_reason`` with this engine's EOS ids and longest request."""
        return token_stop_reason(req, token, self.eos_token_ids, self.longest)

    @staticmethod
    def drop_tokens_after(req: Request, keep: int):
        """A stop string ended ``req`` after its first ``keep`` output tokens: the tokens past it (accepted
        guesses of the same step) never were, as plain decoding would never have made them."""
        del req.output_token_ids[keep:], req.logprobs.output[keep:], req.metrics.token_times[keep:]

    def finish(self, req: Request, reason: str):
        """The request leaves (done, stopped by a stop string, aborted, failed): its memory is freed now,
        unless the KV connector keeps it for another engine to pull, or a load is still writing into it."""
        if req.status is RequestStatus.RUNNING:
            self.queues.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.queues.waiting.remove(req)
        elif req.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:
            return  # finished already
        loading = req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        req.metrics.finished_time = self.clock()
        if loading:
            return  # its blocks go when the load ends (poll_connector): the load may still be writing them
        if self.connector is not None:
            delay_free, req.remote_kv.transfer_params = self.connector.request_finished(req, list(req.block_table))
            if delay_free:
                self.queues.held[req.request_id] = req
                return
        self.kv.release(req)

    # ------------------------------------------------------------------ KV from and to other engines (ch. 07)

    def start_remote_load(self, req: Request, hit: PrefixHit) -> bool | None:
        """Ask the connector whether ``req``'s prompt KV can come from elsewhere; if so, reserve the blocks,
        tell the connector which, and park the request until it lands. False: compute it here. None: its
        KV can come, but there is no room for it yet; it waits at the head of the queue, as any request
        would (computing it here instead would put a prefill back on the decode worker)."""
        ext, load_async = self.connector.get_num_new_matched_tokens(req, hit.num_tokens)
        if ext <= 0 or not load_async:
            return False
        if not self.kv.can_allocate(req, ext, hit):
            return None
        self.queues.waiting.remove(req)
        req.num_computed_tokens = self.kv.use_cached_prefix(req, hit)
        self.kv.allocate(req, ext, offer=False)  # not offered to the prefix cache before the KV is in
        self.connector.update_state_after_alloc(req, list(req.block_table), ext)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.queues.loading[req.request_id] = req
        return True

    def poll_connector(self):
        """What the connector finished since the last step, handed to ``land_transfers`` (chapter 07's
        exercise plugs its own in: the decode side of the hand-off)."""
        done_sending, done_recving = self.connector.get_finished()
        self.land_transfers(self, done_sending, done_recving, self.connector.get_failed_loads())


def land_transfers(lc: RequestLifecycle, done_sending: set[str], done_recving: set[str], failed: dict[str, str]):
    """The decode side of the hand-off, after each step (``poll_connector``): ``done_sending``, the finished
    requests whose held blocks another engine has pulled, or whose lease expired; ``done_recving``, the parked
    requests whose prompt KV landed; ``failed``, those whose load failed (request id -> why).

    Pulled or expired: the held blocks go back to the pool. Landed: the request goes back to the head of the
    queue with all but its last prompt token computed (that one is recomputed: its logits give the first new
    token). Failed: ``kv_load_failure_policy`` says compute the whole prompt here ("recompute") or fail the
    request ("fail"). A request aborted while its load ran keeps its blocks until the load ends (the load may
    still be writing them), then frees them here."""
    for rid in done_sending:
        req = lc.queues.held.pop(rid, None)
        if req is not None:
            lc.kv.release(req)
    for rid in [*done_recving, *failed]:
        req = lc.queues.loading.pop(rid, None)
        if req is None:
            continue
        req.remote_kv.load_done = True
        if req.is_finished:  # aborted while loading: the load has ended, the blocks may go
            lc.kv.release(req)
            continue
        if rid in failed and lc.connector.failure_policy == "fail":
            req.status = RequestStatus.WAITING
            lc.queues.waiting.appendleft(req)
            lc.finish(req, "error")
            continue
        if rid not in failed:
            req.remote_kv.num_external_tokens = len(req.prompt_token_ids) - 1 - req.num_computed_tokens
            req.num_computed_tokens = len(req.prompt_token_ids) - 1
        req.status = RequestStatus.WAITING
        lc.queues.waiting.appendleft(req)
