"""n > 1: samples fork after the prompt, share its blocks and copy a shared block on the first write.

Each sample must be exactly what a request alone with seed ``seed + i`` gives (the fork changes
where KV lives, never what it holds), the prompt must be computed once, and every block must
come back, also when the request is aborted mid-run."""
import pytest

from labsupport import LLM, SamplingParams

CHAT = [{"role": "user", "content": "Name a colour and say why you like it."}]


@pytest.fixture(scope="module")
def paged():
    return LLM(device="cpu", num_blocks=64, block_size=16, max_num_seqs=8)


def sampled(seed, n=1, max_tokens=10):
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def test_samples_equal_independent_seeded_requests_and_the_prompt_is_computed_once(paged):
    before = paged.stats()
    out = paged.generate(CHAT, sampled(99, n=3), use_tqdm=False)[0]
    after = paged.stats()
    assert [o.request_id for o in out.outputs] == [out.request_id, f"1_{out.request_id}", f"2_{out.request_id}"]
    prompt_len = len(out.prompt_token_ids)
    # once for the prompt, then one recomputed last token per extra sample
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == prompt_len + 2
    assert after["cow_copies"] - before["cow_copies"] >= 2
    assert after["kv_blocks_free"] == after["kv_blocks_total"]
    alone = [paged.generate(CHAT, sampled(99 + i), use_tqdm=False)[0] for i in range(3)]
    assert [o.token_ids for o in out.outputs] == [a.token_ids for a in alone]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # different seeds, different samples


def test_samples_count_against_max_num_seqs(paged):
    with paged.engine.options(max_num_seqs=4):
        a = paged.engine.add_request(paged.tokenize(CHAT)[0], sampled(1, n=3))
        b = paged.engine.add_request(paged.tokenize(CHAT)[0], sampled(2, n=2))
        paged.engine.step()
        assert a.status.value == "running" and b.status.value == "waiting"  # 3 + 2 > 4 slots
        while paged.engine.has_unfinished_requests():
            paged.engine.step()
            assert paged.engine.scheduler.num_running_seqs() <= 4
    assert paged.stats()["kv_blocks_free"] == paged.stats()["kv_blocks_total"]


def test_abort_after_the_fork_frees_every_sample(paged):
    req = paged.engine.add_request(paged.tokenize(CHAT)[0], sampled(5, n=4, max_tokens=40))
    while not req.samples:
        paged.engine.step()
    paged.engine.step()
    paged.engine.abort(req)
    assert all(s.is_finished for s in req.samples) and not paged.engine.has_unfinished_requests()
    assert paged.stats()["kv_blocks_free"] == paged.stats()["kv_blocks_total"]


@pytest.mark.parametrize("bad", [dict(n=0), dict(n=1.5), dict(n=10**6), dict(n=4, seed=2**63 - 2)])
def test_bad_n_is_refused_when_the_request_is_made(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_n_over_the_slots_or_without_paged_kv_is_refused_before_running(paged):
    with pytest.raises(ValueError, match="max_num_seqs"):
        paged.generate(CHAT, sampled(1, n=9), use_tqdm=False)
    contiguous = LLM(device="cpu", kv_cache="contiguous")
    with pytest.raises(ValueError, match="paged"):
        contiguous.generate(CHAT, sampled(1, n=2), use_tqdm=False)
    assert not paged.engine.has_unfinished_requests() and not contiguous.engine.has_unfinished_requests()


def test_greedy_samples_with_prefix_caching_are_identical_and_leave_the_cache_sound():
    llm = LLM(device="cpu", num_blocks=64, block_size=16, max_num_seqs=8, enable_prefix_caching=True,
              enable_result_cache=True)
    greedy = SamplingParams(n=3, temperature=0, max_tokens=8)
    first = llm.generate(CHAT, greedy, use_tqdm=False)[0]
    assert len({tuple(o.token_ids) for o in first.outputs}) == 1 and not first.cached  # n > 1: no result cache
    again = llm.generate(CHAT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert again.token_ids == first.token_ids and again.num_cached_tokens > 0
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_samples_share_the_prompts_logprobs_computed_once(paged):
    out = paged.generate(CHAT, SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=3, prompt_logprobs=1),
                         use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
    assert all(o.prompt_logprobs == out.prompt_logprobs for o in out.outputs[1:])


def test_the_engine_limits_hold_the_rules_for_n_and_the_context(paged):
    """One place for the rules the frontend checks before queueing and the engine trusts: ``EngineLimits``."""
    limits = paged.engine.limits
    assert limits.forks_samples and limits.max_num_seqs == 8
    with pytest.raises(ValueError, match="n=9 samples .* max_num_seqs is 8"):
        limits.check_params(sampled(1, n=9))
    with paged.engine.options(max_num_seqs=16):  # read afresh: chapter 04's dial moves it
        paged.engine.limits.check_params(sampled(1, n=9))
    assert limits.output_budget(10) == limits.max_model_len - 10 and limits.output_budget(10, 5) == 5
    with pytest.raises(ValueError, match="However, you requested") as too_long:
        limits.check_prompt([1] * 10, limits.max_model_len)
    assert too_long.value.field == "max_tokens"
    with pytest.raises(ValueError, match="input tokens") as too_long:
        limits.check_prompt([1] * limits.max_model_len)
    assert too_long.value.field == "prompt"


def test_sample_params_are_the_seed_plus_index_draw():
    params = sampled(2**63 - 4, n=4)
    assert [params.for_sample(i).seed for i in range(4)] == [2**63 - 4 + i for i in range(4)]
    assert {params.for_sample(i).n for i in range(4)} == {1} and sampled(None, n=2).for_sample(1).seed is None
