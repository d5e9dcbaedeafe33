"""Checks for chapters 00-01: the decode loop and attention over a KV cache."""
from __future__ import annotations

from ..engine.request import SamplingParams
from ..engine.runner import sequence_logits
from .base import CheckFailed, first_difference, passed

CHECK_PROMPTS = ["The capital of France is", "def add(a, b):", "My favourite colour is"]


def check_greedy_generate(greedy_generate, llm, max_new_tokens: int = 12):
    """Chapter 00: ``greedy_generate(logits_of, prompt_ids, max_new_tokens, eos_id) -> new ids``.

    Compared token for token with the engine's greedy decoding (which equals transformers'),
    including stopping right after EOS.
    """
    model, tok = llm.engine.model, llm.tokenizer
    eos_id = tok.eos_token_id
    cases = [(tok(p).input_ids, max_new_tokens) for p in CHECK_PROMPTS]
    # a chat prompt whose short answer ends with EOS inside the budget: stopping is checked too
    chat = llm.tokenize([{"role": "user", "content": "Say hi."}])[0]
    cases.append((chat, 40))
    for ids, budget in cases:
        want = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=budget, temperature=0),
                            use_tqdm=False)[0].token_ids
        calls = []

        def logits_of(seq):
            calls.append(list(seq))
            return sequence_logits(model, list(seq))

        got = greedy_generate(logits_of, list(ids), budget, eos_id)
        if not isinstance(got, list) or not all(isinstance(t, int) for t in got):
            raise CheckFailed(f"greedy_generate must return a list of int token ids, got {type(got).__name__} "
                              f"{str(got)[:80]}")
        if got[:len(ids)] == ids and len(got) > len(want):
            raise CheckFailed("return only the new tokens, not the prompt followed by them")
        if got != want:
            prompt = tok.decode(ids)[-60:]
            raise CheckFailed(f"for prompt ...{prompt!r} your tokens differ from the reference at "
                              f"{first_difference(got, want)}.\n  yours:    {tok.decode(got)!r}\n"
                              f"  expected: {tok.decode(want)!r}\n(each new token is the most likely one after "
                              "everything before it; generation ends right after EOS or after max_new_tokens)")
        if calls and calls[0] != ids:
            raise CheckFailed("the first call to logits_of must see the whole prompt")
    passed(f"greedy_generate equals the engine's greedy tokens on {len(cases)} prompts, EOS included")


# ---------------------------------------------------------------- chapter 01: KV cache

def check_cached_attention(cached_attention):
    """``cached_attention(cache_k, cache_v, start, q, k, v)`` appends and attends like the engine's."""
    import torch

    from ..engine.attention import causal_attention

    gen = torch.Generator().manual_seed(0)
    cases = [  # (heads, kv heads, head dim, tokens already cached, new tokens)
        (4, 4, 8, 0, 5, "prefill into an empty cache (MHA)"),
        (6, 2, 8, 0, 7, "prefill with grouped-query attention (3 query heads per KV head)"),
        (6, 2, 8, 9, 1, "one decode step after 9 cached tokens"),
        (6, 3, 16, 4, 3, "3 new tokens after 4 cached ones (the causal mask needs the offset)"),
    ]
    for heads, kv_heads, dim, start, n, what in cases:
        cap = start + n + 6
        full_k = torch.randn(start + n, kv_heads, dim, generator=gen)
        full_v = torch.randn(start + n, kv_heads, dim, generator=gen)
        q = torch.randn(n, heads, dim, generator=gen)
        cache_k = torch.zeros(cap, kv_heads, dim)
        cache_v = torch.zeros(cap, kv_heads, dim)
        cache_k[:start], cache_v[:start] = full_k[:start], full_v[:start]
        sentinel = 1234.5
        cache_k[start + n:], cache_v[start + n:] = sentinel, sentinel
        out = cached_attention(cache_k, cache_v, start, q.clone(), full_k[start:].clone(), full_v[start:].clone())
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (n, heads, dim):
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise CheckFailed(f"{what}: expected an output of shape {(n, heads, dim)}, got {shape}")
        if not torch.equal(cache_k[:start + n], full_k) or not torch.equal(cache_v[:start + n], full_v):
            raise CheckFailed(f"{what}: the new keys/values must be written to cache[start:start + n] "
                              "(and the cached ones left alone)")
        if (cache_k[start + n:] != sentinel).any() or (cache_v[start + n:] != sentinel).any():
            raise CheckFailed(f"{what}: you wrote past position start + n - 1 of the cache")
        want = causal_attention(q, full_k, full_v)
        if not torch.allclose(out, want, atol=1e-4, rtol=1e-4):
            err = (out - want).abs().max().item()
            raise CheckFailed(f"{what}: attention output differs from the reference (max abs diff {err:.3g}). "
                              "Hints: scale scores by 1/sqrt(head_dim); query i sits at position start + i and "
                              "may see keys 0..start + i; attend only to cache[:start + n]; repeat each KV head "
                              "for its group of query heads")
    passed(f"cached_attention appends and attends correctly in {len(cases)} cases (MHA, GQA, prefill, decode)")
