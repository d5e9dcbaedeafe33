"""logit_bias and the presence, frequency and repetition penalties (``engine/logits_processors.py``) and
prompt-only requests (``max_tokens=0`` with ``prompt_logprobs``), offline.

The reference is written here independently, one token at a time in plain PyTorch on transformers'
logits, from the definitions (OpenAI's for presence/frequency, vLLM's for repetition and logit bias):
the engine's tokens must equal it, greedy and seeded-sampled, and its logprobs stay the raw logits'.
"""
import math

import pytest
import torch

from labsupport import SamplingParams

PROMPT = "List the numbers: 1, 2, 1, 2, 1, 2, 1, 2,"  # greedy repeats "1, 2," until told not to


def reference_processed(logits: torch.Tensor, prompt: list[int], output: list[int], params: dict) -> torch.Tensor:
    """One position's logits after bias and penalties, token by token from the definitions."""
    x = logits.clone().double()
    for token, bias in params.get("logit_bias", {}).items():
        x[token] += max(-100.0, min(100.0, bias))
    rep = params.get("repetition_penalty", 1.0)
    for token in set(prompt) | set(output):
        x[token] = x[token] / rep if x[token] > 0 else x[token] * rep
    for token in set(output):
        x[token] -= params.get("frequency_penalty", 0.0) * output.count(token) + params.get("presence_penalty", 0.0)
    return x


def reference_decode(hf_model, prompt: list[int], n: int, params: dict, temperature=0.0, seed=None):
    """``n`` tokens from transformers' logits with the rules applied; seeded: the draw our sampler makes
    (softmax of logits / temperature, then ``torch.multinomial`` with a generator seeded with ``seed``)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    out, raw_lps = [], []
    for _ in range(n):
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt + out])).logits[0, -1].float()
        x = reference_processed(logits, prompt, out, params).float()
        if temperature == 0:
            token = int(x.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(x / temperature, -1), 1, generator=gen))
        raw_lps.append(torch.log_softmax(logits, -1)[token].item())
        out.append(token)
    return out, raw_lps


def banana(llm) -> int:
    return llm.tokenizer(" banana").input_ids[0]


@pytest.mark.parametrize("params", [
    {"repetition_penalty": 1.3},
    {"frequency_penalty": 1.5, "presence_penalty": 2.0},
    {"presence_penalty": -2.0, "repetition_penalty": 0.6},  # below 1 and negative: rewards repeating
    {"logit_bias": "banana"},
])
def test_greedy_tokens_equal_a_reference_with_the_rules_applied(llm, hf_model, params):
    if params.get("logit_bias") == "banana":
        params = {"logit_bias": {banana(llm): 7.5, llm.tokenizer(" 1").input_ids[0]: -100}}
    prompt = llm.tokenizer(PROMPT).input_ids
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                                     logprobs=0, **params), use_tqdm=False)[0]
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                         use_tqdm=False)[0]
    ref, raw_lps = reference_decode(hf_model, prompt, 10, params)
    assert out.token_ids == ref
    assert out.token_ids != plain.token_ids, "the rule changed the greedy answer, as the reference predicts"
    got = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
    assert got == pytest.approx(raw_lps, abs=1e-4), "logprobs are the raw logits', before bias and penalties"
    assert not llm.engine.runner.sampler.penalties.counts, "per-request counts go when the request does"


def test_seeded_sampled_tokens_equal_a_reference_draw(llm, hf_model):
    params = {"frequency_penalty": 1.0, "repetition_penalty": 1.2, "logit_bias": {banana(llm): 3.0}}
    prompt = llm.tokenizer(PROMPT).input_ids
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=12, temperature=0.9, seed=5,
                                                                     ignore_eos=True, **params), use_tqdm=False)[0]
    ref, _ = reference_decode(hf_model, prompt, 12, params, temperature=0.9, seed=5)
    assert out.token_ids == ref
    unruled, _ = reference_decode(hf_model, prompt, 12, {}, temperature=0.9, seed=5)
    assert ref != unruled, "the same seed without the rules draws other tokens"


def test_a_big_logit_bias_makes_the_token_appear(llm):
    out = llm.generate("My favourite fruit is", SamplingParams(max_tokens=4, temperature=0,
                                                               logit_bias={str(banana(llm)): 100}), use_tqdm=False)[0]
    assert out.text == " banana" * 4


@pytest.mark.parametrize("bad, field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=math.nan), "frequency_penalty"),
    (dict(frequency_penalty="1"), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=math.inf), "repetition_penalty"), (dict(presence_penalty=True), "presence_penalty"),
    (dict(logit_bias={"banana": 1}), "logit_bias"), (dict(logit_bias={5: math.nan}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias=[5]), "logit_bias"),
    (dict(logit_bias={True: 1.0}), "logit_bias"), (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=0, prompt_logprobs=0, n=2), "max_tokens"),
])
def test_bad_values_are_refused_when_made(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_logit_bias_values_are_clamped_and_keys_become_ints():
    assert SamplingParams(logit_bias={"12": 500, 7: -1e9}).logit_bias == {12: 100.0, 7: -100.0}


def test_a_logit_bias_outside_the_vocabulary_is_refused_before_running(llm):
    vocab = llm.engine.model.config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("Hi", SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(llm, hf_model):
    prompt = llm.tokenizer("The capital of France is Paris").input_ids
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)[0]
    assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None
    got = [lp[t] for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    want = [ref[i, t].item() for i, t in enumerate(prompt[1:])]
    assert got == pytest.approx(want, abs=1e-4)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"] and not llm.engine.detokenizers


def test_speculative_decoding_refuses_the_rules_its_verification_does_not_apply():
    from labsupport import LLM
    spec = LLM(device="cpu", num_blocks=16, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    for rule in ({"logit_bias": {5: 1.0}}, {"repetition_penalty": 1.2}, {"structured_outputs": {"json_object": True}}):
        with pytest.raises(ValueError, match="speculative decoding"):
            spec.generate("1, 2, 1, 2,", SamplingParams(max_tokens=4, **rule), use_tqdm=False)
    assert spec.generate("1, 2, 1, 2,", SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].token_ids
    spec.shutdown()
