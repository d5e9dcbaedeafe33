"""KV cache backends (chapters 01-02): same tokens as recomputing, memory handed back, no leaks."""
import pytest

from labsupport import LLM, SamplingParams
from labsupport.engine.block_pool import BlockAllocator, slot_mapping
from labsupport.engine.kv_cache_manager import KVCacheManager
from labsupport.engine.request import Request

from conftest import PROMPTS

GREEDY = SamplingParams(max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def reference_tokens(llm):
    """Greedy tokens of the default (paged) engine; test_parity proves they equal transformers'."""
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("kv_cache", ["none", "contiguous"])
def test_every_backend_generates_the_same_tokens(kv_cache, reference_tokens):
    other = LLM(device="cpu", kv_cache=kv_cache)
    assert [o.token_ids for o in other.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference_tokens


def test_contiguous_cache_is_released_when_requests_finish():
    llm = LLM(device="cpu", kv_cache="contiguous")
    llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    assert llm.engine.kv.reserved_bytes == 0 and not llm.engine.kv.caches


def test_all_blocks_are_free_after_every_request_finishes(llm):
    llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False)
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] > 0
    assert all(c == 0 for c in llm.engine.kv.allocator.ref_counts)


def test_blocks_are_held_while_running_and_match_the_token_count(llm):
    engine = llm.engine
    req = engine.add_request(list(range(100, 140)), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for _ in range(5):
        engine.step()
    bs = engine.kv.block_size
    assert len(req.block_table) == -(-req.num_computed_tokens // bs)
    assert llm.stats()["kv_blocks_total"] - llm.stats()["kv_blocks_free"] == len(req.block_table)
    engine.abort(req)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"] and req.block_table == []


def test_a_request_joining_mid_decode_gets_the_same_tokens(llm, reference_tokens):
    engine = llm.engine
    first = engine.add_request(llm.tokenizer(PROMPTS[0]).input_ids, GREEDY)
    for _ in range(6):
        engine.step()  # first is decoding when second arrives: one step mixes a prefill and a decode
    second = engine.add_request(llm.tokenizer(PROMPTS[1]).input_ids, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert first.output_token_ids == reference_tokens[0]
    assert second.output_token_ids == reference_tokens[1]


def test_small_pool_preempts_and_still_gets_the_same_tokens(reference_tokens):
    small = LLM(device="cpu", num_blocks=12, block_size=8)
    outs = small.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference_tokens
    stats = small.stats()
    assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == 12


def test_prompt_larger_than_the_pool_is_refused():
    tiny = LLM(device="cpu", num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="blocks"):
        tiny.generate("one two three four five six seven eight nine ten", GREEDY)


def test_stats_report_the_pool_and_the_queues(llm):
    stats = llm.stats()
    for key in ("kv_blocks_total", "kv_blocks_free", "num_requests_running", "num_requests_waiting",
                "prompt_tokens_computed", "generation_tokens"):
        assert key in stats


def test_allocator_hands_out_each_block_once_and_refuses_double_free():
    alloc = BlockAllocator(4)
    blocks = [alloc.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3] and alloc.num_free == 0
    with pytest.raises(MemoryError):
        alloc.allocate()
    alloc.share(blocks[0])
    alloc.free(blocks[0])
    assert alloc.num_free == 0  # still used by the other sharer
    alloc.free(blocks[0])
    assert alloc.num_free == 1
    with pytest.raises(ValueError, match="double free"):
        alloc.free(blocks[0])


def test_slot_mapping_follows_the_block_table():
    assert slot_mapping([7, 2, 5], 0, 10, 4) == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
    assert slot_mapping([7, 2, 5], 6, 3, 4) == [10, 11, 20]


def test_kv_manager_allocates_only_the_blocks_new_tokens_need():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = Request(list(range(10)), SamplingParams(max_tokens=4))
    kv.allocate(req, 10)
    assert len(req.block_table) == 3
    req.num_computed_tokens = 10
    kv.allocate(req, 1)
    assert len(req.block_table) == 3  # token 11 fits in block 3
    req.num_computed_tokens = 12
    kv.allocate(req, 1)
    assert len(req.block_table) == 4
    snap = kv.snapshot()
    assert sum(1 for o in snap["owners"] if o) == 4
    kv.release(req)
    assert kv.allocator.num_free == 8


def test_chunked_prefill_gives_the_same_tokens_and_shares_steps_with_decodes(reference_tokens):
    chunked = LLM(device="cpu", enable_chunked_prefill=True, max_num_batched_tokens=8)
    engine = chunked.engine
    first = engine.add_request(chunked.tokenizer(PROMPTS[0]).input_ids, GREEDY)
    engine.step()
    engine.step()  # first is decoding now
    long_ids = chunked.tokenizer(PROMPTS[2] * 3).input_ids
    second = engine.add_request(long_ids, GREEDY)
    engine.step()
    assert 0 < second.num_computed_tokens < len(long_ids) and not second.output_token_ids  # a chunk only
    assert len(first.output_token_ids) == 3  # the decode went on in the same step
    while engine.has_unfinished_requests():
        engine.step()
    assert first.output_token_ids == reference_tokens[0]
    unchunked = LLM(device="cpu").generate({"prompt_token_ids": long_ids}, GREEDY, use_tqdm=False)[0]
    assert second.output_token_ids == unchunked.token_ids


def test_prompt_over_the_token_budget_needs_chunked_prefill():
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        LLM(device="cpu", max_num_batched_tokens=8).generate("one two three four five six seven eight nine", GREEDY)


def test_contiguous_budget_admits_only_whole_reservations(reference_tokens):
    per_token = 2 * 30 * 3 * 64 * 4                       # SmolLM2-135M, fp32
    llm = LLM(kv_cache="contiguous", device="cpu", kv_cache_memory_bytes=2 * (16 + 24) * per_token)
    ids = [llm.tokenize(p)[0] for p in PROMPTS]
    assert all(len(i) <= 16 for i in ids), "fixture prompts should be short"
    reqs = [llm.engine.add_request(i, GREEDY) for i in ids]
    peak_running = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        assert llm.engine.kv.reserved_bytes <= llm.engine.kv.budget_bytes
        peak_running = max(peak_running, len(llm.engine.kv.caches))
    assert peak_running == 2                               # two whole reservations fit, never three
    assert [r.output_token_ids for r in reqs] == reference_tokens and llm.engine.kv.reserved_bytes == 0
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        llm.engine.add_request(ids[0], SamplingParams(max_tokens=200))
