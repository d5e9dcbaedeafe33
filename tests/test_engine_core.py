"""The engine's bookkeeping without a model: BlockAllocator, KVCacheManager and Scheduler driven by a
fake runner over random workloads (hypothesis), with invariants checked after every step.

The fake runner plays the model honestly enough to catch wrong KV: it writes each fed token's id
into a real pool tensor at the slot the block table gives, and "samples" the next token from the
ids it reads back through the block table. A block reused from the prefix cache or copied back
from the CPU tier with the wrong contents therefore changes the output, which is compared with
the same function applied to the true tokens.
"""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from labsupport.engine.block_pool import BlockAllocator, blocks_needed, slot_mapping
from labsupport.engine.config import EngineConfig
from labsupport.engine.kv_cache_manager import KVCacheManager
from labsupport.engine.outputs import ModelRunnerOutput
from labsupport.engine.prefix_cache import CPUTier, chain_hashes
from labsupport.engine.request import Request, RequestStatus, SamplingParams
from labsupport.engine.scheduler import Scheduler

VOCAB, EOS = 61, 0
PREFIXES = [[], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [5, 6, 7, 8, 9, 10, 20, 21], [30] * 11]


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of every token before, so wrong KV shows."""
    h = 0
    for t in context:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


def reference_output(prompt: list[int], params: SamplingParams, longest: int) -> list[int]:
    tokens, out = list(prompt), []
    while True:
        t = next_token(tokens)
        out.append(t)
        tokens.append(t)
        if (t == EOS and not params.ignore_eos) or len(out) >= params.max_tokens or len(tokens) >= longest:
            return out


class FakeRunner:
    """Writes token ids as K into a one-layer pool and samples from what it reads back."""

    def __init__(self, num_blocks: int, block_size: int):
        self.bs = block_size
        self.k = [torch.full((1, num_blocks * block_size, 1), -1.0)]  # the engine's layout: [Hkv, slots, D]
        self.v = [torch.zeros(1, num_blocks * block_size, 1)]

    def execute(self, out) -> ModelRunnerOutput:
        sampled = []
        for req, n in zip(out.requests, out.num_new_tokens):
            start = req.num_computed_tokens
            slots = slot_mapping(req.block_table, start, n, self.bs)
            self.k[0][0, slots, 0] = torch.tensor(req.all_token_ids[start:start + n], dtype=torch.float32)
            seen = self.k[0][0, slot_mapping(req.block_table, 0, start + n, self.bs), 0].long().tolist()
            sampled.append(next_token(seen))
        return ModelRunnerOutput(sampled)


def check_invariants(s: Scheduler, kv: KVCacheManager, runner: FakeRunner, requests: list[Request]):
    alloc, bs = kv.allocator, kv.block_size
    holders = [0] * kv.num_blocks
    for req in kv.tables.values():
        for b in req.block_table:
            holders[b] += 1
    assert holders == alloc.ref_counts, "a block's ref count differs from the tables holding it"
    assert set(alloc.free_blocks) == {b for b in range(kv.num_blocks) if alloc.ref_counts[b] == 0}
    if kv.prefix_cache is not None:
        for h, b in kv.prefix_cache.block_of.items():
            _, tokens = kv.prefix_cache.entry_of[b]
            held = runner.k[0][0, b * bs:(b + 1) * bs, 0].long().tolist()
            assert held == list(tokens), f"cached block {b} does not hold the tokens its hash names"
    for req in requests:
        assert 0 <= req.num_computed_tokens <= req.num_tokens
        if req.status is RequestStatus.RUNNING:
            assert len(req.block_table) * bs >= req.num_computed_tokens
            assert req.kv.block_hashes == chain_hashes(req.all_token_ids[:len(req.kv.block_hashes) * bs], bs,
                                                    req.kv.cache_salt)
        else:
            assert req.block_table == [] and req.request_id not in kv.tables
    assert {id(r) for r in s.running} == {id(r) for r in requests if r.status is RequestStatus.RUNNING}


request_specs = st.lists(st.tuples(
    st.integers(0, 12),                      # arrival step
    st.sampled_from(range(len(PREFIXES))),   # shared system prompt
    st.integers(1, 20),                      # own tokens
    st.integers(1, 12),                      # max_tokens
    st.sampled_from([None, None, "a", "b"]),  # tenant
    st.booleans(),                           # ignore_eos
    st.one_of(st.none(), st.integers(0, 25)),  # aborted at this step
), min_size=1, max_size=10)

engine_configs = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4, 8]),
    "num_blocks": st.integers(6, 40),
    "max_num_seqs": st.integers(1, 6),
    "max_num_batched_tokens": st.integers(4, 64),
    "enable_chunked_prefill": st.booleans(),
    "long_prefill_token_threshold": st.sampled_from([0, 0, 3, 8]),
    "enable_prefix_caching": st.booleans(),
    "cpu_offload_blocks": st.sampled_from([0, 0, 2, 8]),
    "scheduling_policy": st.sampled_from(["continuous", "continuous", "static"]),
    "max_model_len": st.sampled_from([24, 64, 1000]),
})


FIXED = {"max_num_seqs": 6, "max_num_batched_tokens": 64, "enable_chunked_prefill": False,
         "long_prefill_token_threshold": 0, "enable_prefix_caching": False, "cpu_offload_blocks": 0,
         "scheduling_policy": "continuous", "max_model_len": 1000}


def make_engine(options: dict):
    o = {**FIXED, **options}
    if not o["enable_chunked_prefill"]:
        o["long_prefill_token_threshold"] = 0
    if not o["enable_prefix_caching"]:
        o["cpu_offload_blocks"] = 0
    config = EngineConfig(**o)
    runner = FakeRunner(config.num_blocks, config.block_size)
    tier = CPUTier(config.cpu_offload_blocks, runner.k, runner.v, config.block_size) if config.cpu_offload_blocks else None
    kv = KVCacheManager(config.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching,
                        cpu_tier=tier)
    return Scheduler(config, kv, eos_token_ids={EOS}), kv, runner


def drive(s, runner, requests, max_steps=2000, check=None):
    """Add ``requests`` and step until all finish (or ``max_steps``); ``check()`` after every step."""
    for r in requests:
        s.add_request(r)
    for _ in range(max_steps):
        if not s.has_unfinished():
            return
        out = s.schedule()
        s.lifecycle.update_from_output(out, runner.execute(out))
        if check is not None:
            check()


def run_workload(s, kv, runner, specs, max_steps=3000):
    """Feed the specs' requests at their arrival steps; return (requests, aborted ids)."""
    cfg = s.config
    pending, requests, aborted = sorted(enumerate(specs), key=lambda x: x[1][0]), [], set()
    for step in range(max_steps):
        while pending and pending[0][1][0] <= step:
            i, (_, prefix, own, max_tokens, salt, ignore_eos, _) = pending.pop(0)
            prompt = PREFIXES[prefix] + [1 + (i * 7 + j) % (VOCAB - 1) for j in range(own)]
            # the engine's own prompt check refuses what could never run; mirror it
            if (len(prompt) >= cfg.max_model_len or blocks_needed(len(prompt) + 1, cfg.block_size) > cfg.num_blocks
                    or (not cfg.enable_chunked_prefill and len(prompt) > cfg.max_num_batched_tokens)):
                continue
            req = Request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos),
                          request_id=f"r{i}", cache_salt=salt)
            requests.append(req)
            s.add_request(req)
        for req in requests:
            if specs[int(req.request_id[1:])][6] == step and not req.is_finished:
                s.lifecycle.finish(req, "abort")
                aborted.add(req.request_id)
        if not s.has_unfinished() and not pending:
            break
        out = s.schedule()
        if s.has_unfinished():
            assert out.requests, "nothing scheduled while requests wait: the engine would hang"
        assert len(s.running) <= cfg.max_num_seqs
        assert len(out.requests) == 1 or out.total_tokens <= cfg.max_num_batched_tokens
        if cfg.scheduling_policy == "continuous" and cfg.enable_chunked_prefill:
            assert out.total_tokens <= cfg.max_num_batched_tokens
        s.lifecycle.update_from_output(out, runner.execute(out))
        check_invariants(s, kv, runner, requests)
    else:
        raise AssertionError(f"not finished after {max_steps} steps")
    return requests, aborted


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(options=engine_configs, specs=request_specs)
def test_random_workloads_keep_every_invariant_and_the_reference_tokens(options, specs):
    s, kv, runner = make_engine(options)
    requests, aborted = run_workload(s, kv, runner, specs)
    assert kv.allocator.num_free == kv.num_blocks and not kv.tables, "blocks leaked"
    longest = min(s.config.max_model_len, kv.capacity)
    for req in requests:
        assert req.is_finished
        if req.request_id not in aborted:
            assert req.output_token_ids == reference_output(req.prompt_token_ids, req.params, longest)
    counters = kv.counters
    if kv.prefix_cache is None:
        assert counters == {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "cpu_tier_hits": 0, "cow_copies": 0}
    assert counters["prefix_cache_hits"] <= counters["prefix_cache_queries"]


@settings(max_examples=60, deadline=None)
@example(block_size=2, num_blocks=11, lengths=[10, 10, 10])
@given(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(11, 20), lengths=st.lists(
    st.integers(2, 10), min_size=2, max_size=6))
def test_recomputed_tokens_are_never_counted_as_prefix_hits(block_size, num_blocks, lengths):
    """Distinct prompts share nothing, so every hit would be a preempted request finding its own
    blocks again: recompute avoided, not a prefix shared (vLLM #25780)."""
    s, kv, runner = make_engine({"block_size": block_size, "num_blocks": num_blocks, "enable_prefix_caching": True})
    reqs = [Request([40 + i] + [1] * (n - 1), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                    request_id=f"r{i}") for i, n in enumerate(lengths)]
    drive(s, runner, reqs, check=lambda: check_invariants(s, kv, runner, reqs))
    assert all(r.is_finished for r in reqs)
    if (block_size, num_blocks, lengths) == (2, 11, [10, 10, 10]):
        assert s.num_preemptions > 0  # the example above: a pool too small for all three at once
    assert kv.counters["prefix_cache_hits"] == 0
    assert kv.counters["prefix_cache_queries"] == sum(lengths)
    assert kv.allocator.num_free == kv.num_blocks


def test_a_shared_prefix_is_counted_once_per_first_admission():
    s, kv, runner = make_engine({"block_size": 4, "num_blocks": 40, "max_num_seqs": 1, "enable_prefix_caching": True})
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    reqs = [Request(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), request_id=f"r{i}")
            for i in range(2)]
    drive(s, runner, reqs)
    assert kv.counters == {"prefix_cache_queries": 26, "prefix_cache_hits": 12, "cpu_tier_hits": 0, "cow_copies": 0}
    assert reqs[0].output_token_ids == reqs[1].output_token_ids


def test_allocator_refuses_double_free_and_exhaustion():
    alloc = BlockAllocator(2)
    a, b = alloc.allocate(), alloc.allocate()
    try:
        alloc.allocate()
        raise AssertionError("allocate on an empty pool must raise")
    except MemoryError:
        pass
    alloc.share(a)
    alloc.free(a)
    alloc.free(a)
    alloc.free(b)
    assert alloc.num_free == 2 and alloc.ref_counts == [0, 0]
    try:
        alloc.free(a)
        raise AssertionError("a double free must raise")
    except ValueError:
        pass


def test_a_request_that_outgrows_the_pool_finishes_instead_of_hanging():
    s, kv, runner = make_engine({"block_size": 4, "num_blocks": 6, "max_num_seqs": 2})
    req = Request([1, 2, 3], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    drive(s, runner, [req], max_steps=200)
    assert req.finish_reason == "length" and req.num_tokens == kv.capacity == 24
    assert kv.allocator.num_free == 6
