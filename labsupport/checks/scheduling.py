"""Checks for chapters 04-05: the attendee's ``schedule()`` and chunking rule.

``check_schedule`` drives the attendee's policy with the engine's real ``Scheduler`` and
``KVCacheManager`` over scripted arrivals, playing the model's part (each fed request is
computed; a request that caught up gets one token), and checks invariants after every step:
never over the token budget, the sequence limit or the free blocks; running requests first;
admission in arrival order; no slot left idle while the head of the queue fits (that would be
static batching); progress every step, every request finished, every block returned. Then,
given an ``llm``, it runs the real engine on the attendee's policy and compares the tokens.
"""
from __future__ import annotations

from ..engine.config import EngineConfig
from ..engine.kv_cache_manager import KVCacheManager
from ..engine.outputs import ModelRunnerOutput
from ..engine.request import Request, SamplingParams
from ..engine.scheduler import Scheduler
from ..engine.scheduler import chunk_rule as reference_chunk_rule
from .base import CheckFailed, passed

# (name, max_num_seqs, max_num_batched_tokens, num_blocks, block_size, arrivals)
# arrivals: (step, prompt length, max_tokens)
SCENARIOS = [
    ("a busy queue", 4, 64, 256, 4,
     [(0, 20, 6), (0, 20, 12), (0, 20, 12), (1, 62, 4), (2, 8, 4), (8, 10, 3), (9, 6, 8), (9, 6, 2), (14, 30, 5)]),
    ("a pool too small for everyone", 4, 256, 12, 4,
     [(0, 8, 16), (0, 8, 16), (0, 8, 16), (3, 4, 6)]),
]


def _fail(scenario, step, message):
    raise CheckFailed(f"[{scenario}, step {step}] {message}")


def _simulate(schedule_fn, name, max_seqs, budget, num_blocks, block_size, arrivals, max_steps=400):
    """Run one scenario through ``schedule_fn``; raise CheckFailed at the first broken invariant."""
    kv = KVCacheManager(num_blocks, block_size)
    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, block_size=block_size,
                          num_blocks=num_blocks, max_model_len=10**6)
    s = Scheduler(config, kv)
    s.schedule_fn = schedule_fn
    pending = sorted(arrivals)
    requests = []
    for step in range(max_steps):
        while pending and pending[0][0] <= step:
            _, n, m = pending.pop(0)
            req = Request(list(range(1, n + 1)), SamplingParams(max_tokens=m, ignore_eos=True),
                          request_id=f"r{len(requests)}")
            requests.append(req)
            s.add_request(req)
        if not s.has_unfinished():
            if not pending:
                break
            continue
        running_before, waiting_before = list(s.running), list(s.waiting)
        remaining = {r.request_id: r.num_tokens - r.num_computed_tokens for r in requests}
        try:
            batch = s.schedule()
        except MemoryError:
            _fail(name, step, "a block was allocated with none free: check s.kv.can_allocate(req, n) before "
                              "s.add_to_batch(), and preempt a running request not yet in this step when blocks run out")
        except TypeError as exc:
            if "SchedulerOutput" not in str(exc):
                raise  # a bug inside the attendee's function: show its own traceback
            _fail(name, step, str(exc))
        _check_step(s, batch, name, step, running_before, waiting_before, remaining)
        # the model's part: token 0 for everyone
        s.lifecycle.update_from_output(batch, ModelRunnerOutput([0] * len(batch.requests)))
    else:
        stuck = [r.request_id for r in requests if not r.is_finished]
        raise CheckFailed(f"[{name}] after {max_steps} steps {stuck} have still not finished: starvation")
    if kv.allocator.num_free != num_blocks:
        raise CheckFailed(f"[{name}] every request finished but {num_blocks - kv.allocator.num_free} blocks "
                          "are still allocated: a leak")
    return s


def _check_step(s, batch, name, step, running_before, waiting_before, remaining):
    budget, bs = s.config.max_num_batched_tokens, s.kv.block_size
    ids = [r.request_id for r in batch.requests]
    if len(batch.requests) != len(batch.num_new_tokens):
        _fail(name, step, "batch.requests and batch.num_new_tokens must have one entry per request")
    if not batch.requests:
        _fail(name, step, f"nothing was scheduled although {len(s.running)} requests run and {len(s.waiting)} "
                          "wait: the engine would stop here (a deadlock)")
    if len(set(ids)) != len(ids):
        _fail(name, step, f"a request appears twice in the batch: {ids}")
    if batch.total_tokens > budget:
        _fail(name, step, f"the batch has {batch.total_tokens} tokens, over max_num_batched_tokens={budget} "
                          "(token budget)")
    if len(s.running) > s.config.max_num_seqs:
        _fail(name, step, f"{len(s.running)} requests run, over max_num_seqs={s.config.max_num_seqs}")
    for req, n in zip(batch.requests, batch.num_new_tokens):
        if req in s.preempted:
            _fail(name, step, f"{req.request_id} was preempted after it was put in this step's batch: its blocks "
                              "are gone (preemption: the victim is never a request already in out)")
        if req not in s.running:
            _fail(name, step, f"{req.request_id} is in the batch but not in s.running (whole work: every request in "
                              "out is in s.running)")
        if n != remaining[req.request_id]:
            _fail(name, step, f"{req.request_id} needs {remaining[req.request_id]} tokens fed but got {n} (whole "
                              "work: the tokens s.num_new_tokens gives it)")
        if len(req.block_table) * bs < req.num_computed_tokens + n:
            _fail(name, step, f"{req.request_id} has no blocks for its new tokens (whole work: every request in "
                              "out has the blocks for them)")
    left = budget - batch.total_tokens
    for req in running_before:
        if req in s.running and req not in batch.requests and remaining[req.request_id] <= left:
            if not s.kv.can_allocate(req, remaining[req.request_id]):
                _fail(name, step, f"running request {req.request_id} was skipped for lack of a free block "
                                  "(preemption by recompute: a running request that needs a block when none is "
                                  "free is not skipped); skipping it would stall everyone once the pool is full")
            _fail(name, step, f"running request {req.request_id} was left out although the budget had room: "
                              "running requests go first, every step")
    admitted = [r.request_id for r in s.running if r not in running_before]
    left_out = [r.request_id for r in running_before if r in s.running and r not in batch.requests]
    if admitted and left_out:
        _fail(name, step, f"{admitted} joined while running {left_out} got no token: running requests go "
                          "first, and new ones only get what is left")
    queue = [r.request_id for r in waiting_before]
    if admitted != queue[:len(admitted)]:
        _fail(name, step, f"admitted {admitted} from the queue {queue} (FCFS admission: the requests admitted "
                          "in a step are the head of the queue, in arrival order; nobody overtakes the head)")
    if s.waiting and len(s.running) < s.config.max_num_seqs:
        head = s.waiting[0]
        need = head.num_tokens - head.num_computed_tokens
        if need <= left and s.kv.can_allocate(head, need) and not s.preempted:
            _fail(name, step, f"{head.request_id} waits although a slot, {left} tokens of budget and the blocks "
                              "it needs are free (no idle slot: waiting for the whole batch to finish is "
                              "static batching)")


def check_schedule(schedule_fn, llm=None):
    """Chapter 04: ``schedule_fn(scheduler) -> SchedulerOutput``, written with the scheduler's helpers."""
    preemptions = 0
    for scenario in SCENARIOS:
        preemptions += _simulate(schedule_fn, *scenario).num_preemptions
    if preemptions == 0:
        raise CheckFailed(f"[{SCENARIOS[1][0]}] the pool cannot hold every request at once, yet nobody was "
                          "preempted (preemption by recompute: when blocks run out, a running request "
                          "gives its blocks back)")
    message = f"schedule keeps every invariant over {len(SCENARIOS)} scenarios ({preemptions} preemptions)"
    if llm is not None:
        _same_tokens_in_engine(llm, {"schedule_fn": schedule_fn}, "your schedule()", num_blocks=6)
        message += ", and the real engine on it gives the reference tokens"
    passed(message)


def check_chunk_rule(rule, llm=None):
    """Chapter 05: ``rule(num_remaining, budget_left, enable_chunked_prefill, long_prefill_token_threshold)``."""
    cases = [  # (remaining, budget left, chunking, threshold, why it matters)
        (1, 10, False, 0, "a decode fits"),
        (50, 100, False, 0, "a prompt that fits goes in whole"),
        (150, 100, False, 0, "without chunking, a prompt over the budget waits (0)"),
        (150, 100, True, 0, "with chunking, it takes what the budget has left"),
        (150, 0, True, 0, "a spent budget feeds nothing"),
        (1, 0, False, 0, "a spent budget feeds nothing, decodes included"),
        (150, 100, True, 64, "the threshold caps one request's chunk"),
        (30, 100, True, 64, "a short prompt is not padded up to the threshold"),
        (150, 40, True, 64, "the budget is smaller than the threshold: the budget wins"),
        (64, 64, True, 0, "exactly the budget fits"),
    ]
    for remaining, left, chunked, threshold, why in cases:
        want = reference_chunk_rule(remaining, left, chunked, threshold)
        got = rule(remaining, left, chunked, threshold)
        if got != want:
            raise CheckFailed(f"rule({remaining}, budget_left={left}, chunked={chunked}, threshold={threshold}) "
                              f"returned {got!r}, expected {want} ({why})")
    message = f"the chunking rule is right in {len(cases)} cases"
    if llm is not None:
        _same_tokens_in_engine(llm, {"chunk_rule": rule}, "your chunking rule",
                               chunked=True, budget=48, threshold=32)
        message += ", and the real engine on it gives the reference tokens"
    passed(message)


def _same_tokens_in_engine(llm, pieces, what, num_blocks=None, chunked=False, budget=None, threshold=0):
    """Run a small batch on ``llm``'s engine with the attendee's pieces plugged in, then without."""
    engine = llm.engine
    kv = engine.kv
    if not isinstance(kv, KVCacheManager) or kv.prefix_cache is not None or engine.has_unfinished_requests():
        raise ValueError("the check needs an idle engine with kv_cache='paged' and no prefix caching")
    texts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village",
             "The three primary colours are"]
    if chunked:  # one prompt longer than the budget, so it must go in chunks
        texts[1] = "The printing press changed how knowledge spread across Europe. " * 10 + texts[1]
    prompts = [engine.tokenizer(p).input_ids for p in texts]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    options = {"long_prefill_token_threshold": threshold}
    if chunked:
        options["enable_chunked_prefill"] = True
    if budget:
        options["max_num_batched_tokens"] = budget
    runs = []
    with engine.options(**options):
        for plugged in (True, False):
            small_pool = {} if num_blocks is None else {"block_allocator": type(kv.allocator)(num_blocks)}
            with engine.plugged(**small_pool, **(pieces if plugged else {})):  # a small pool: preemption happens
                reqs = [engine.add_request(p, params) for p in prompts]
                steps = partial = 0
                try:
                    while engine.has_unfinished_requests():
                        engine.step()
                        steps += 1
                        partial += any(0 < r.num_computed_tokens < r.num_tokens - 1 for r in reqs)
                        if steps > 2000:
                            raise CheckFailed(f"the engine on {what} did not finish 4 requests in 2,000 steps")
                finally:
                    engine.abort_requests(reqs)  # after an error nothing of the check stays queued
                if engine.kv.allocator.num_free != engine.kv.num_blocks:
                    raise CheckFailed(f"the engine on {what} finished with blocks still allocated")
            if plugged and chunked and not partial:
                raise CheckFailed(f"with {what}, a {len(prompts[1])}-token prompt and a {budget}-"
                                  "token budget, no prompt was ever fed in chunks")
            runs.append([r.output_token_ids for r in reqs])
    if runs[0] != runs[1]:
        raise CheckFailed(f"the engine on {what} generated different tokens from the reference scheduler")
