"""Checks for the attendee's exercises. Each check runs the attendee's code against the real
engine and raises ``CheckFailed`` with a message saying what differs and where to look.

The tests prove every check passes the reference solution (taken from the chapter notebook
itself) and fails planted wrong implementations, so a check can never be a rubber stamp.
"""
from __future__ import annotations

from .engine.request import SamplingParams
from .engine.runner import sequence_logits


class CheckFailed(AssertionError):
    """An exercise result is wrong. The message says what to fix."""


def passed(message: str):
    print(f"\u2713 {message}")


def first_difference(got: list, want: list) -> str:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"position {i}: got {a!r}, expected {b!r}"
    return f"lengths differ: got {len(got)} items, expected {len(want)}"


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
                              f"{str(got)[:80]} (hint: int(tensor.argmax()))")
        if got[:len(ids)] == ids and len(got) > len(want):
            raise CheckFailed("return only the new tokens, not the prompt followed by them")
        if got != want:
            prompt = tok.decode(ids)[-60:]
            raise CheckFailed(f"for prompt ...{prompt!r} your tokens differ from the reference at "
                              f"{first_difference(got, want)}.\n  yours:    {tok.decode(got)!r}\n"
                              f"  expected: {tok.decode(want)!r}\n(hint: take the argmax at the *last* "
                              "position, append it to the sequence, stop after EOS or max_new_tokens)")
        if calls and calls[0] != ids:
            raise CheckFailed("the first call to logits_of must see the whole prompt")
    passed(f"greedy_generate equals the engine's greedy tokens on {len(cases)} prompts, EOS included")


# ---------------------------------------------------------------- chapter 01: KV cache

def check_cached_attention(cached_attention):
    """``cached_attention(cache_k, cache_v, start, q, k, v)`` appends and attends like the engine's."""
    import torch

    from .engine.attention import causal_attention

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


# ---------------------------------------------------------------- chapter 02: PagedAttention

def check_slot_mapping(slot_mapping):
    """``slot_mapping(block_table, start, n, block_size)`` -> pool slot of each of the n tokens."""
    from .engine.blocks import slot_mapping as reference

    cases = [([0], 0, 3, 4), ([5, 2], 0, 8, 4), ([5, 2, 9], 3, 6, 4), ([7, 1], 15, 1, 16), ([3, 8, 4], 31, 2, 16),
             ([2, 6], 4, 1, 4)]
    for table, start, n, bs in cases:
        got, want = slot_mapping(list(table), start, n, bs), reference(table, start, n, bs)
        if list(got) != want:
            raise CheckFailed(f"slot_mapping({table}, start={start}, n={n}, block_size={bs}): "
                              f"{first_difference(list(got), want)} (hint: token p lives in block "
                              f"table[p // block_size] at offset p % block_size)")
    passed(f"slot_mapping is right in {len(cases)} cases, block boundaries included")


def check_block_allocator(allocator_cls):
    """An allocator with ``allocate() -> block`` and ``free(block)``, ref counts, and errors on misuse."""
    alloc = allocator_cls(4)
    got = [alloc.allocate() for _ in range(4)]
    if sorted(got) != [0, 1, 2, 3]:
        raise CheckFailed(f"allocating all 4 blocks gave {got}: each block must be handed out exactly once")
    if alloc.num_free != 0:
        raise CheckFailed(f"after allocating every block num_free should be 0, not {alloc.num_free}")
    try:
        alloc.allocate()
    except MemoryError:
        pass
    else:
        raise CheckFailed("allocate() on an empty pool must raise MemoryError (never hand out a used block)")
    alloc.free(got[2])
    if alloc.num_free != 1 or alloc.allocate() != got[2]:
        raise CheckFailed("a freed block must go back to the free list and be allocatable again")
    alloc.share(got[0])
    alloc.free(got[0])
    if alloc.num_free != 0:
        raise CheckFailed("a shared block (ref count 2) freed once is still in use: it must not be free yet")
    alloc.free(got[0])
    if alloc.num_free != 1:
        raise CheckFailed("freeing the last reference must return the block (leak)")
    try:
        alloc.free(got[0])
    except ValueError:
        pass
    else:
        raise CheckFailed("freeing a free block must raise ValueError: a double free would let two "
                          "sequences write the same memory")
    for b in (got[1], got[2], got[3]):
        alloc.free(b)
    if alloc.num_free != 4 or any(alloc.ref_counts):
        raise CheckFailed(f"after freeing everything, all 4 blocks must be free with ref count 0 "
                          f"(num_free={alloc.num_free}, ref_counts={list(alloc.ref_counts)})")
    passed("the allocator hands out each block once, counts references, and refuses exhaustion and double frees")


# ---------------------------------------------------------------- chapter 03: prefix cache

def check_chain_hashes(chain_hashes):
    """``chain_hashes(token_ids, block_size, salt) -> list of bytes``: one chained hash per full block."""
    from .engine.prefix_cache import chain_hashes as reference

    tokens = list(range(100, 150))
    cases = [(tokens, 16, None), (tokens, 16, "tenant-a"), (tokens[:32], 16, None), (tokens[:15], 16, None),
             (tokens, 4, "t")]
    for toks, bs, salt in cases:
        got, want = chain_hashes(list(toks), bs, salt), reference(toks, bs, salt)
        if len(got) != len(want):
            raise CheckFailed(f"{len(toks)} tokens in blocks of {bs}: expected {len(want)} hashes (full blocks only: "
                              f"a partial block is still being written), got {len(got)}")
        if got != want:
            raise CheckFailed(f"{len(toks)} tokens, block_size={bs}, salt={salt!r}: hash of block "
                              f"{next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)} differs. "
                              "Hint: hash_block(parent, block_tokens, salt) with parent = the previous block's "
                              "hash (None for the first block)")
    # the properties the chain exists for, stated on their own
    a = chain_hashes([1] * 8 + [2] * 8, 8, None)
    b = chain_hashes([3] * 8 + [2] * 8, 8, None)
    if a[1] == b[1]:
        raise CheckFailed("the same block after different prefixes got the same hash: chain in the parent's hash")
    if chain_hashes([1] * 8, 8, "x") == chain_hashes([1] * 8, 8, "y"):
        raise CheckFailed("different cache_salt values gave the same hash: tenants would share KV")
    passed("chain_hashes hashes full blocks only, chained on the parent and the salt")


def check_longest_prefix(longest_prefix):
    """``longest_prefix(hashes, lookup) -> blocks`` of the leading hashes that ``lookup(i, h)`` finds."""
    table = {b"h0": 7, b"h1": 3, b"h3": 9}
    cases = [([b"h0", b"h1", b"h2", b"h3"], [7, 3]), ([b"h2", b"h0"], []), ([b"h0"], [7]), ([], []),
             ([b"h0", b"h1", b"h3"], [7, 3, 9])]
    for hashes, want in cases:
        got = list(longest_prefix(list(hashes), lambda i, h: table.get(h)))
        if got != want:
            raise CheckFailed(f"hashes {[h.decode() for h in hashes]} with cached {sorted(k.decode() for k in table)}: "
                              f"expected blocks {want}, got {got}. Stop at the first miss: a block's KV is only "
                              "valid after exactly the blocks before it")
    passed("longest_prefix returns the cached blocks of the leading hashes and stops at the first miss")
