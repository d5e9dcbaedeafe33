"""Chapter 03: prefix cache (hash chain, ref counts, LRU), CPU tier, result cache, tenant isolation."""
import time

import pytest

from labsupport import LLM, SamplingParams
from labsupport.engine import prefix_cache
from labsupport.engine.prefix_cache import hash_block
from labsupport.result_cache import ResultCache

SYSTEM = "You are a careful assistant for a bakery. " + "Answer briefly, politely and precisely. " * 40
QUESTIONS = ["What is sourdough?", "Do you sell rye bread?", "When do you open?", "Is there a gluten-free cake?"]
GREEDY = SamplingParams(max_tokens=10, temperature=0)


def chats(salt=None):
    msgs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    return msgs


@pytest.fixture(scope="module")
def uncached(llm):
    return [o.token_ids for o in llm.generate(chats(), GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def cached_llm():
    return LLM(device="cpu", enable_prefix_caching=True, enable_result_cache=True)


def prompt_dicts(llm, salt=None):
    return [{"prompt_token_ids": llm.tokenize(m)[0], "cache_salt": salt} for m in chats()]


def test_later_requests_compute_under_10_percent_and_outputs_are_unchanged(uncached):
    llm = LLM(device="cpu", enable_prefix_caching=True)
    computed, outs = [], []
    for p in prompt_dicts(llm):
        before = llm.stats()["prompt_tokens_computed"]
        outs.append(llm.generate(p, GREEDY, use_tqdm=False)[0].token_ids)
        computed.append(llm.stats()["prompt_tokens_computed"] - before)
    assert outs == uncached
    assert all(c < 0.1 * computed[0] for c in computed[1:]), computed
    stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0.8 * stats["prefix_cache_queries"] * (len(QUESTIONS) - 1) / len(QUESTIONS)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # cached blocks count as free


def test_concurrent_requests_share_blocks_with_reference_counts(uncached):
    llm = LLM(device="cpu", enable_prefix_caching=True)
    first, second = prompt_dicts(llm)[:2]
    llm.generate(first, GREEDY, use_tqdm=False)  # fills the cache
    engine = llm.engine
    a = engine.add_request(first["prompt_token_ids"], GREEDY)
    b = engine.add_request(second["prompt_token_ids"], GREEDY)
    engine.step()
    shared = set(a.block_table) & set(b.block_table)
    assert len(shared) >= len(llm.tokenizer(SYSTEM).input_ids) // engine.kv.block_size - 1
    assert all(engine.kv.allocator.ref_counts[blk] == 2 for blk in shared)
    while engine.has_unfinished_requests():
        engine.step()
    assert [a.output_token_ids, b.output_token_ids] == uncached[:2]
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_hash_chains_on_the_parent_and_the_salt():
    tokens = tuple(range(16))
    assert hash_block(None, tokens) == hash_block(None, tokens)
    assert hash_block(b"parent-a", tokens) != hash_block(b"parent-b", tokens)
    assert hash_block(None, tokens, "tenant-a") != hash_block(None, tokens, "tenant-b")


def test_a_hash_collision_never_returns_wrong_kv(monkeypatch, uncached):
    monkeypatch.setattr(prefix_cache, "hash_block", lambda parent, tokens, salt=None: b"same for everything")
    llm = LLM(device="cpu", enable_prefix_caching=True)
    outs = [llm.generate(p, GREEDY, use_tqdm=False)[0].token_ids for p in prompt_dicts(llm)]
    assert outs == uncached


def test_tenants_with_different_salts_share_nothing(uncached):
    llm = LLM(device="cpu", enable_prefix_caching=True, enable_result_cache=True)
    a = prompt_dicts(llm, "tenant-a")
    b = prompt_dicts(llm, "tenant-b")
    llm.generate(a[0], GREEDY, use_tqdm=False)
    hits = llm.stats()["prefix_cache_hits"]
    out_b = llm.generate(b[0], GREEDY, use_tqdm=False)[0]  # same prompt, other tenant
    assert llm.stats()["prefix_cache_hits"] == hits and not out_b.cached
    llm.generate(a[1], GREEDY, use_tqdm=False)  # same tenant, shared system prompt
    assert llm.stats()["prefix_cache_hits"] > hits
    assert llm.generate(a[0], GREEDY, use_tqdm=False)[0].cached  # same tenant repeats: result cache
    assert out_b.token_ids == uncached[0]


def test_cached_blocks_are_evicted_lru_only_when_new_blocks_are_needed(uncached):
    llm = LLM(device="cpu", enable_prefix_caching=True, num_blocks=48)
    p = prompt_dicts(llm)
    llm.generate(p[0], GREEDY, use_tqdm=False)
    cached = sum(llm.engine.kv.snapshot()["cached"])
    assert cached > 0 and llm.stats()["kv_blocks_free"] == 48
    llm.generate("a short unrelated prompt", GREEDY, use_tqdm=False)  # takes never-used blocks first
    assert sum(llm.engine.kv.snapshot()["cached"]) >= cached
    llm.generate("filler " * 600, SamplingParams(max_tokens=2), use_tqdm=False)  # needs most of the pool
    hits = llm.stats()["prefix_cache_hits"]
    assert llm.generate(p[1], GREEDY, use_tqdm=False)[0].token_ids == uncached[1]
    assert llm.stats()["prefix_cache_hits"] - hits < 16 * cached  # the system prompt was (partly) evicted


def test_cpu_tier_copies_evicted_blocks_back_instead_of_recomputing(uncached):
    llm = LLM(device="cpu", enable_prefix_caching=True, num_blocks=48, cpu_offload_blocks=256)
    p = prompt_dicts(llm)
    outs = []
    for prompt in p:
        outs.append(llm.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids)
        llm.generate("filler " * 600, SamplingParams(max_tokens=2), use_tqdm=False)  # evicts the prefix
    stats = llm.stats()
    assert outs == uncached
    assert stats["cpu_tier_hits"] > 0 and stats["cpu_tier_blocks"] > 0


def test_reset_prefix_cache_makes_the_next_run_compute_its_whole_prompt(uncached):
    """vLLM's ``LLM.reset_prefix_cache``: a benchmark's repeat starts cold. Device index and CPU tier forgotten,
    refused (False, nothing forgotten) while a request holds blocks; the answers do not change."""
    llm = LLM(device="cpu", enable_prefix_caching=True, num_blocks=48, cpu_offload_blocks=256)
    first, second = prompt_dicts(llm)[:2]
    llm.generate(first, GREEDY, use_tqdm=False)
    llm.generate("filler " * 600, SamplingParams(max_tokens=2), use_tqdm=False)  # some of it into the CPU tier
    assert llm.stats()["cpu_tier_blocks"] > 0
    running = llm.engine.add_request(second["prompt_token_ids"], GREEDY)
    llm.engine.step()
    assert llm.reset_prefix_cache() is False and llm.stats()["cpu_tier_blocks"] > 0
    llm.engine.abort(running)
    assert llm.reset_prefix_cache() is True and llm.stats()["cpu_tier_blocks"] == 0
    before = llm.stats()
    again = llm.generate(first, GREEDY, use_tqdm=False)[0]
    after = llm.stats()
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == len(again.prompt_token_ids)
    assert after["prefix_cache_hits"] == before["prefix_cache_hits"] and after["cpu_tier_hits"] == before["cpu_tier_hits"]
    assert again.token_ids == uncached[0]
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_result_cache_only_for_deterministic_requests(cached_llm):
    sampled = SamplingParams(max_tokens=6, temperature=0.9)
    seeded = SamplingParams(max_tokens=6, temperature=0.9, seed=7)
    cached_llm.generate("Tell me a joke", sampled, use_tqdm=False)
    assert not cached_llm.generate("Tell me a joke", sampled, use_tqdm=False)[0].cached
    first = cached_llm.generate("Tell me a joke", seeded, use_tqdm=False)[0]
    again = cached_llm.generate("Tell me a joke", seeded, use_tqdm=False)[0]
    assert again.cached and again.token_ids == first.token_ids
    assert not cached_llm.generate("Tell me a joke", seeded, use_tqdm=False, use_result_cache=False)[0].cached
    assert cached_llm.stats()["result_cache_hits"] >= 1


def test_result_cache_is_bounded_and_expires():
    cache = ResultCache(max_entries=2, ttl_s=0.05)
    cache.put("a", 1), cache.put("b", 2), cache.put("c", 3)
    assert len(cache) == 2 and cache.get("a") is None and cache.get("c") == 3
    time.sleep(0.06)  # the time to live running out is the behaviour under test
    assert cache.get("c") is None


def test_prefix_caching_needs_the_paged_cache():
    with pytest.raises(ValueError, match="paged"):
        LLM(device="cpu", kv_cache="contiguous", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(device="cpu", cpu_offload_blocks=8)


def test_result_cache_hands_out_independent_copies(cached_llm):
    sp = SamplingParams(max_tokens=4, temperature=0)
    first = cached_llm.generate("The capital of Spain is", sp, use_tqdm=False)[0]
    expected = list(first.token_ids)
    first.token_ids.append(999)
    first.text = "edited by the caller"
    again = cached_llm.generate("The capital of Spain is", sp, use_tqdm=False)[0]
    assert again.cached and again.token_ids == expected and again.text != "edited by the caller"
    assert again.request_id != first.request_id
