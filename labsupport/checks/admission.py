"""Check for chapter 05's hard exercise: admitting the head of the queue with chunked prefill.

``admit_one(s, req, out, budget_left) -> tokens fed`` decides whether the request at the head of
the queue joins this step and with how many tokens. The check runs the engine's real
``Scheduler`` twice in lockstep over scripted arrivals (with a prefix cache, chunking, a per-
request threshold, a tight pool, a prompt over the budget), once on the engine's ``admit_one``
and once on the attendee's, playing the model's part, and compares every step: who was fed how
many tokens, and how many came from the prefix cache. At the first difference it says which
rule the attendee's version broke. Then it runs the real engine on it.
"""
from __future__ import annotations

from ..engine.config import EngineConfig
from ..engine.kv_cache_manager import KVCacheManager
from ..engine.outputs import ModelRunnerOutput
from ..engine.request import Request, SamplingParams
from ..engine.scheduler import Scheduler, admit_one
from .base import CheckFailed, passed
from .scheduling import _same_tokens_in_engine

SHARED = list(range(500, 524))  # 24 tokens: 6 blocks of 4 that later requests find in the prefix cache

# (name, options, arrivals); arrivals: (step, prompt token ids, max_tokens)
SCENARIOS = [
    ("chunked, with prefix hits and a threshold",
     dict(max_num_seqs=4, max_num_batched_tokens=32, num_blocks=64, enable_chunked_prefill=True,
          long_prefill_token_threshold=16),
     [(0, SHARED + list(range(1, 11)), 4), (0, list(range(20, 26)), 6), (3, SHARED + list(range(30, 38)), 4),
      (4, list(range(40, 80)), 3), (5, SHARED + list(range(90, 93)), 3), (6, list(range(100, 106)), 2)]),
    ("without chunking, one prompt over the budget",
     dict(max_num_seqs=4, max_num_batched_tokens=16, num_blocks=64, enable_chunked_prefill=False),
     [(0, list(range(1, 9)), 5), (1, list(range(10, 50)), 3), (1, list(range(60, 64)), 4)]),
    ("chunked, a pool too small for whole prompts",
     dict(max_num_seqs=4, max_num_batched_tokens=24, num_blocks=12, enable_chunked_prefill=True),
     [(0, list(range(1, 13)), 8), (1, list(range(20, 60)), 3), (2, list(range(70, 74)), 3)]),
    ("chunked, two slots",
     dict(max_num_seqs=2, max_num_batched_tokens=32, num_blocks=64, enable_chunked_prefill=True),
     [(0, list(range(1, 9)), 6), (0, list(range(10, 18)), 6), (0, SHARED + [7, 8], 3), (1, SHARED + [9], 2)]),
]


def _scheduler(admit_fn, options):
    config = EngineConfig(block_size=4, max_model_len=10**6, enable_prefix_caching=True, **options)
    s = Scheduler(config, KVCacheManager(options["num_blocks"], 4, enable_prefix_caching=True))
    s.admit_fn = admit_fn
    return s


def _hint(step_no, rid, got, want, req, s_ref, got_hits):
    fed_got, fed_want = got.get(rid, (0,))[0], want.get(rid, (0,))[0]
    cfg, hit = s_ref.config, s_ref.last_hits.get(rid, 0)
    where = f"step {step_no}, request {rid} ({len(req.prompt_token_ids)}-token prompt)"
    if fed_got > fed_want and fed_want and hit:
        return (f"{where}: fed {fed_got} tokens, but {hit} of its prompt tokens are in the prefix cache "
                "(cached tokens are never fed again, and the engine knows them as computed)")
    if fed_got == fed_want and got_hits.get(rid, 0) != hit:
        return (f"{where}: fed the right {fed_got} tokens, but it was admitted with {got_hits.get(rid, 0)} tokens "
                f"from the prefix cache instead of {hit} (the engine must know the cached tokens as computed, "
                "or it computes the next ones at the wrong positions)")
    if cfg.long_prefill_token_threshold and fed_got > cfg.long_prefill_token_threshold:
        return (f"{where}: fed {fed_got} tokens, over long_prefill_token_threshold="
                f"{cfg.long_prefill_token_threshold} (the first chunk is what the chunking rule gives)")
    if fed_got == 0 and fed_want and not cfg.enable_chunked_prefill:
        return (f"{where}: never admitted. It is longer than the whole budget ({cfg.max_num_batched_tokens}) and "
                "chunking is off, so the chunk rule says 0 every step (progress: a request alone in its step "
                "starts whatever its size, or it waits forever)")
    if fed_got == 0 and fed_want:
        return (f"{where}: the engine admits it with a first chunk of {fed_want} tokens; yours made it wait (the "
                "first chunk is what the chunking rule gives, and it needs memory for that chunk only, not the "
                "whole prompt)")
    if fed_got and not fed_want:
        return (f"{where}: admitted with {fed_got} tokens, but the engine makes it wait here: the budget left, "
                "the chunking rule or the pool (the hit and this chunk) does not allow it to start")
    return f"{where}: fed {fed_got} tokens, the engine's admission feeds {fed_want}"


def _run(admit_fn, name, options, arrivals, max_steps=300):
    ref, yours = _scheduler(admit_one, options), _scheduler(admit_fn, options)
    ref.last_hits = {}
    pending, reqs = sorted(arrivals, key=lambda a: a[0]), {"ref": [], "yours": []}
    for step in range(max_steps):
        while pending and pending[0][0] <= step:
            _, prompt, max_tokens = pending.pop(0)
            for key, s in (("ref", ref), ("yours", yours)):
                r = Request(list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                            request_id=f"r{len(reqs[key])}")
                reqs[key].append(r)
                s.add_request(r)
        if not ref.has_unfinished() and not pending:
            break
        want_out = ref.schedule()
        ref.last_hits = dict(want_out.prefix_hit_tokens)
        try:
            got_out = yours.schedule()
        except MemoryError:
            raise CheckFailed(f"[{name}, step {step}] a block was allocated with none free (memory for this chunk: "
                              "the pool must hold the hit and this chunk when the request starts)") from None
        got, want = got_out.scheduled, want_out.scheduled
        if got != want or got_out.prefix_hit_tokens != want_out.prefix_hit_tokens:
            diff = next((rid for rid in sorted(set(got) | set(want)) if got.get(rid) != want.get(rid)), None)
            if diff is None:
                diff = next(rid for rid in set(got_out.prefix_hit_tokens) | set(want_out.prefix_hit_tokens)
                            if got_out.prefix_hit_tokens.get(rid) != want_out.prefix_hit_tokens.get(rid))
            req = next(r for r in reqs["ref"] if r.request_id == diff)
            raise CheckFailed(f"[{name}] {_hint(step, diff, got, want, req, ref, got_out.prefix_hit_tokens)} (the step's batch: yours "
                              f"{ {k: v[0] for k, v in got.items()} }, the engine's { {k: v[0] for k, v in want.items()} })")
        for s, out in ((ref, want_out), (yours, got_out)):
            s.lifecycle.update_from_output(out, ModelRunnerOutput([7] * len(out.requests)))
    else:
        raise CheckFailed(f"[{name}] the requests did not finish in {max_steps} steps")
    if yours.has_unfinished() or yours.kv.allocator.num_free != options["num_blocks"]:
        raise CheckFailed(f"[{name}] after the run, requests or blocks were left behind")
    return sum(len(r.output_token_ids) for r in reqs["yours"])


def check_admission(admit_fn, llm=None):
    """``admit_fn(s, req, out, budget_left) -> tokens fed`` (0: the head waits), step for step like the
    engine's ``admit_one`` in 4 scenarios; with ``llm``, the real engine then runs on it."""
    tokens = sum(_run(admit_fn, *scenario) for scenario in SCENARIOS)
    message = (f"your admission schedules every step like the engine's in {len(SCENARIOS)} scenarios "
               f"({tokens} tokens generated): prefix hits skipped, first chunks, the threshold, memory for the "
               "chunk only, the over-budget prompt alone")
    if llm is not None:
        _same_tokens_in_engine(llm, {"admit_fn": admit_fn}, "your admission", chunked=True, budget=48, threshold=32)
        message += "; the real engine on it gives the reference tokens"
    passed(message)
