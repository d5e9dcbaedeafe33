"""Chapter 06's sampling and output features: top_k, min_tokens, stop_token_ids, logprobs,
prompt_logprobs, num_cached_tokens, and streaming text that never shows half a character.

References: transformers' logits (``hf_model``) and our own from-scratch forward
(``sequence_logits``); logprobs are the log-softmax of the raw logits, as vLLM returns them.
"""
import math

import pytest
import torch

from labsupport import LLM, SamplingParams
from labsupport.engine.detokenizer import IncrementalDetokenizer
from labsupport.engine.request import Request
from labsupport.engine.runner import sequence_logits
from labsupport.engine.sampler import Sampler

from conftest import PROMPTS

LOGPROB_TOLERANCE = 1e-4
GREEDY = dict(temperature=0)
CHAT = [{"role": "user", "content": "Reply with one word: yes or no?"}]  # greedy: "Yes", ".", EOS


def reference_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: row j is the distribution of token j + 1 given tokens 0..j."""
    return torch.log_softmax(sequence_logits(model, token_ids).float(), dim=-1)[:-1]


def assert_logprob_dicts(dicts, ref: torch.Tensor, chosen: list[int], k: int):
    """Each dict: the chosen token's logprob and the top-k's, equal to the reference row."""
    assert len(dicts) == len(chosen) == ref.shape[0]
    for d, row, token in zip(dicts, ref, chosen):
        top = row.topk(k).indices.tolist() if k else []
        assert next(iter(d)) == token, "the chosen token comes first"
        assert set(d) == {token, *top} and len(d) in (k, k + 1)
        for t, lp in d.items():
            assert abs(lp - row[t].item()) < LOGPROB_TOLERANCE


# ------------------------------------------------------------------ SamplingParams checks


@pytest.mark.parametrize("bad", [
    dict(top_k=-2), dict(top_k=1.5), dict(top_k=True), dict(top_k=2**70), dict(top_k=math.nan), dict(top_k=None),
    dict(min_tokens=-1), dict(min_tokens=17), dict(min_tokens=2**80), dict(min_tokens=1.0),
    dict(stop_token_ids=5), dict(stop_token_ids=[-1]), dict(stop_token_ids=["2"]), dict(stop_token_ids=[2**64]),
    dict(stop_token_ids=[True]), dict(logprobs=21), dict(logprobs=-1), dict(logprobs=True), dict(logprobs=1.0),
    dict(logprobs=math.nan), dict(prompt_logprobs=21), dict(prompt_logprobs="3"), dict(prompt_logprobs=-1),
])
def test_bad_sampling_values_raise_value_error(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(max_tokens=16, **bad)


def test_good_sampling_values_are_normalized():
    p = SamplingParams(top_k=0, min_tokens=16, stop_token_ids=(3, 5), logprobs=20, prompt_logprobs=0)
    assert (p.top_k, p.min_tokens, p.stop_token_ids, p.logprobs, p.prompt_logprobs) == (0, 16, [3, 5], 20, 0)
    assert SamplingParams().stop_token_ids == []


def test_stop_token_outside_the_vocabulary_is_refused_before_running(llm):
    vocab = llm.engine.model.config.vocab_size
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("Hi", SamplingParams(stop_token_ids=[vocab]), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


# ------------------------------------------------------------------ the sampler on its own


def test_sampler_top_k_draws_only_the_k_most_likely_and_is_reproducible():
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(0)) * 3
    top = set(logits[0].topk(5).indices.tolist())
    draws = []
    for _ in range(2):
        req = Request([1], SamplingParams(temperature=1.5, top_k=5, seed=11), request_id="r")
        sampler = Sampler()
        draws.append([sampler.sample(logits, [req]).token_ids[0] for _ in range(200)])
    assert draws[0] == draws[1]
    assert set(draws[0]) <= top and len(set(draws[0])) > 1


def test_sampler_min_tokens_holds_back_stop_tokens_and_logprobs_stay_raw():
    logits = torch.zeros(1, 10)
    logits[0, 7] = 5.0  # token 7 (a stop token) is the argmax
    req = Request([1], SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7], logprobs=1))
    out = Sampler().sample(logits, [req])
    token = out.token_ids[0]
    assert token != 7
    raw = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0] == {token: pytest.approx(raw[token].item()), 7: pytest.approx(raw[7].item())}
    req.output_token_ids = [token, token]
    assert Sampler().sample(logits, [req]).token_ids[0] == 7


def test_sampler_computes_no_logprobs_when_none_asked():
    out = Sampler().sample(torch.randn(2, 50), [Request([1], SamplingParams(temperature=0)) for _ in range(2)])
    assert out.logprobs == [None, None] and out.prompt_logprobs == {}


# ------------------------------------------------------------------ logprobs against transformers


def test_greedy_logprobs_equal_transformers_log_softmax(llm, hf_model):
    ks = [5, 0, 1, 20]
    params = [SamplingParams(max_tokens=4, logprobs=k, ignore_eos=True, **GREEDY) for k in ks]
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    for out, k in zip(outs, ks):
        ids = out.prompt_token_ids + out.token_ids
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        rows = ref[len(out.prompt_token_ids) - 1:-1]
        assert out.token_ids == rows.argmax(-1).tolist(), "greedy is still exactly argmax"
        assert_logprob_dicts(out.logprobs, rows, out.token_ids, k)
        assert out.prompt_logprobs is None


def test_sampled_tokens_carry_their_raw_logprob(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=1.3, top_p=0.9, seed=3, logprobs=2,
                                                  ignore_eos=True), use_tqdm=False)[0]
    ref = reference_logprobs(llm.engine.model, out.prompt_token_ids + out.token_ids)[len(out.prompt_token_ids) - 1:]
    assert_logprob_dicts(out.logprobs, ref, out.token_ids, 2)


def test_no_logprobs_unless_asked(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)[0]
    assert out.logprobs is None and out.prompt_logprobs is None and out.num_cached_tokens == 0


# ------------------------------------------------------------------ prompt logprobs


def check_prompt_logprobs(out, model, k: int):
    prompt = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    assert_logprob_dicts(out.prompt_logprobs[1:], reference_logprobs(model, prompt), prompt[1:], k)


def test_prompt_logprobs_equal_a_full_forward(llm):
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=1, prompt_logprobs=3, **GREEDY), use_tqdm=False)[0]
    check_prompt_logprobs(out, llm.engine.model, 3)


@pytest.fixture(scope="module")
def chunked():
    """Prompts fed 8 tokens a step, full blocks of 4 tokens shared through the prefix cache."""
    llm = LLM(device="cpu", num_blocks=64, enable_chunked_prefill=True, max_num_batched_tokens=8,
              enable_prefix_caching=True, block_size=4)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("options", [
    "chunked",
    dict(kv_cache="none"),  # every step feeds the whole prompt again: each position is recorded once
])
def test_prompt_logprobs_in_chunks_skip_the_prefix_cache(request, options):
    engine = request.getfixturevalue(options) if options == "chunked" else LLM(device="cpu", **options)
    prompt = " ".join(PROMPTS[:3])  # 21 tokens: 3 chunks of 8
    plain = SamplingParams(max_tokens=1, **GREEDY)
    engine.generate(prompt, plain, use_tqdm=False)  # caches the prompt's blocks (with prefix caching)
    asked, other = engine.generate([prompt, prompt], [SamplingParams(max_tokens=2, prompt_logprobs=2, logprobs=1,
                                                                     **GREEDY), plain], use_tqdm=False)
    check_prompt_logprobs(asked, engine.engine.model, 2)
    assert asked.num_cached_tokens == 0, "a request with prompt_logprobs computes every prompt position"
    cached_blocks = (len(other.prompt_token_ids) - 1) // 4  # one token at least is computed
    assert other.num_cached_tokens == (4 * cached_blocks if options == "chunked" else 0)
    assert asked.token_ids[:1] == other.token_ids and len(asked.logprobs) == 2


# ------------------------------------------------------------------ min_tokens, stop_token_ids, top_k


def test_stop_token_ids_and_min_tokens(llm):
    greedy = llm.chat(CHAT, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
    eos, n = greedy.token_ids[-1], len(greedy.token_ids)
    assert greedy.finish_reason == "stop" and eos in llm.engine.scheduler.lifecycle.eos_token_ids
    stop_at = next(i for i, t in enumerate(greedy.token_ids[:-1]) if i >= 1 and t not in greedy.token_ids[:i])
    stop = greedy.token_ids[stop_at]
    by_token, held_eos, held_stop = llm.chat([CHAT] * 3, [
        SamplingParams(max_tokens=8, stop_token_ids=[stop], **GREEDY),
        SamplingParams(max_tokens=n + 2, min_tokens=n, **GREEDY),
        SamplingParams(max_tokens=stop_at + 3, min_tokens=stop_at + 1, stop_token_ids=[stop], **GREEDY)],
        use_tqdm=False)
    # a stop token id ends the request with "stop"; the token is returned, its text is not
    assert by_token.token_ids == greedy.token_ids[:stop_at + 1] and by_token.finish_reason == "stop"
    assert by_token.text == llm.tokenizer.decode(greedy.token_ids[:stop_at], skip_special_tokens=True)
    # min_tokens: EOS is not drawn before n tokens, the answer is the same until then
    assert held_eos.token_ids[:n - 1] == greedy.token_ids[:n - 1] and eos not in held_eos.token_ids[:n]
    assert len(held_eos.token_ids) > n
    # and a stop token id is held back just the same
    assert held_stop.token_ids[:stop_at] == greedy.token_ids[:stop_at]
    assert stop not in held_stop.token_ids[:stop_at + 1]


def test_top_k_one_is_greedy_and_a_seed_repeats_with_top_k(llm):
    prompts = PROMPTS[4:6]
    greedy = SamplingParams(max_tokens=4, ignore_eos=True, **GREEDY)
    top1 = SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.0, top_k=1)
    seeded = SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.5, top_k=20, seed=7, logprobs=20)
    outs = llm.generate(prompts * 3 + prompts[:1], [greedy] * 2 + [top1] * 2 + [seeded] * 3, use_tqdm=False)
    assert [o.token_ids for o in outs[2:4]] == [o.token_ids for o in outs[:2]]
    alone = llm.generate(prompts[0], seeded, use_tqdm=False)[0]
    assert outs[4].token_ids == outs[6].token_ids == alone.token_ids
    for out in outs[4:]:  # every draw is among the 20 most likely: a 21-entry dict would mean it was not
        assert all(len(d) == 20 for d in out.logprobs)


def test_a_seed_gives_the_same_text_however_the_prompt_is_chunked(chunked):
    """Chunks that are not a prompt's last draw nothing: the seeded generator moves once per token."""
    seeded = SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.5, top_k=50, seed=5)
    prompt = " ".join(PROMPTS[4:6])  # 11 tokens: chunks of 8 + 3, then 3 after a prefix-cache hit of 8
    alone = chunked.generate(prompt, seeded, use_tqdm=False)[0]
    _, shifted = chunked.generate([PROMPTS[9], prompt], [SamplingParams(max_tokens=1), seeded], use_tqdm=False)
    assert shifted.token_ids == alone.token_ids


# ------------------------------------------------------------------ streaming text: whole characters only


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: the token string of each single byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def stream(tokenizer, prompt_ids: list[int], ids: list[int]) -> list[str]:
    """The deltas a client receives when ``ids`` come one at a time (flushed at the end)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    return [detok.update(ids[:i], flush=i == len(ids))[0] for i in range(1, len(ids) + 1)]


@pytest.mark.parametrize("text", ["KV缓存是一种优化技术。", "北京是中国的首都", "😀 emoji ñandú 測試"])
def test_deltas_of_split_characters_are_whole_and_join_to_the_text(llm, text):
    tok = llm.tokenizer
    byte_token = {b: tok.convert_tokens_to_ids(s) for b, s in bytes_to_unicode().items()}
    prompt = [byte_token[b] for b in "前".encode()[:2]]  # the context itself ends inside a character
    for ids in (tok(text, add_special_tokens=False).input_ids, [byte_token[b] for b in text.encode()]):
        deltas = stream(tok, prompt, ids)
        assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
        assert deltas.count("") > 0, "some token ended inside a character: the case under test"


def test_an_unfinished_character_is_flushed_at_the_end(llm):
    tok = llm.tokenizer
    byte_token = {b: tok.convert_tokens_to_ids(s) for b, s in bytes_to_unicode().items()}
    ids = tok("北京", add_special_tokens=False).input_ids + [byte_token["京".encode()[0]]]
    assert "".join(stream(tok, [], ids)) == tok.decode(ids) == "北京\ufffd"


def test_streamed_chinese_answer_has_no_broken_characters(llm):
    engine = llm.engine
    ids, _ = llm.tokenize([{"role": "user", "content": "用一句话介绍北京。"}])
    req = engine.add_request(ids, SamplingParams(max_tokens=40, **GREEDY))
    deltas, sent = [], 0
    while not req.is_finished:
        engine.step()
        deltas.append(req.text[sent:])
        sent = len(req.text)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == req.text == llm.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
    assert any("\ufffd" in llm.tokenizer.decode([t]) for t in req.output_token_ids), "no split character seen"
