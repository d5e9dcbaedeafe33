"""Check for chapter 02's hard exercise: the paged read of a decode step.

A decode row's keys and values are scattered over the pool in whole blocks; the attendee gathers
them through the block table, masks every slot past the sequence's length, and attends with
grouped-query heads. The check compares with the engine's own ``paged_decode_attention`` on
pools whose unused slots hold garbage (so a missing mask shows), names the mistake when the
output matches a known wrong variant, then runs the real engine on the attendee's function.
"""
from __future__ import annotations

import math

import torch

from .base import CheckFailed, passed


def _rows(block_tables, context_lens, block_size):
    from ..engine.attention_metadata import DecodeRows

    width = block_tables.shape[1] * block_size
    padding = torch.arange(width)[None, :] >= context_lens[:, None]
    return DecodeRows(torch.arange(len(context_lens)), block_tables, context_lens, padding)


def reference_read(q, k_pool, v_pool, block_tables, context_lens, block_size):
    """The engine's own decode attention, called with the exercise's arguments."""
    from ..engine.paged_attention import paged_decode_attention

    return paged_decode_attention(q, k_pool, v_pool, _rows(block_tables, context_lens, block_size), block_size)


def _variant(kind, q, k_pool, v_pool, tables, lens, bs):
    """What a known mistake computes: slot by slot, one sequence at a time (slow and plain on purpose)."""
    hkv, _, d = k_pool.shape
    b, h, _ = q.shape
    out = torch.empty_like(q)
    for i in range(b):
        n = int(lens[i])
        visible = min({"no_mask": tables.shape[1] * bs, "one_short": n - 1, "one_long": n + 1}.get(kind, n),
                      tables.shape[1] * bs)
        slots = [int(tables[i, p // bs]) * bs + p % bs for p in range(max(visible, 1))]
        for head in range(h):
            kv = head % hkv if kind == "heads_interleaved" else head // (h // hkv)
            keys, values = k_pool[kv, slots].float(), v_pool[kv, slots].float()
            scale = 1.0 if kind == "no_scale" else 1 / math.sqrt(d)
            weights = (keys @ q[i, head].float() * scale).softmax(-1)
            out[i, head] = (weights @ values).to(q.dtype)
    return out


HINTS = {
    "no_mask": "keys past a sequence's length were attended: the slots after context_len[i] are padding "
               "(left-over values of other requests) and must be masked out before the softmax",
    "one_short": "the last key was left out: context_len already counts the new token, whose K/V were written "
                 "before the read, so positions 0 .. context_len - 1 are all attended",
    "one_long": "one key too many: position context_len is not part of the sequence (mask slots j >= context_len)",
    "heads_interleaved": "query heads read the wrong KV heads: query head h must use KV head h // (heads // kv_heads), "
                         "so a group is consecutive query heads, not every kv_heads-th one",
    "no_scale": "the scores were not scaled by 1 / sqrt(head_dim)",
}


def _cases():
    g = torch.Generator().manual_seed(0)
    # (heads, kv_heads, head_dim, block_size, contexts, dtype)
    specs = [(4, 2, 8, 4, [5, 8, 1], torch.float32), (6, 3, 16, 4, [13, 4, 9, 2], torch.float32),
             (4, 4, 8, 2, [3, 7], torch.float32), (8, 1, 8, 16, [17, 40, 16], torch.float32),
             (6, 2, 32, 8, [23, 9], torch.bfloat16)]
    for h, hkv, d, bs, lens, dtype in specs:
        num_blocks = 4 * sum(-(-n // bs) for n in lens) + 4
        k_pool = torch.randn(hkv, num_blocks * bs, d, generator=g).to(dtype)   # garbage everywhere: unused slots too
        v_pool = torch.randn(hkv, num_blocks * bs, d, generator=g).to(dtype)
        width = max(-(-n // bs) for n in lens)
        order = torch.randperm(num_blocks, generator=g)[: sum(-(-n // bs) for n in lens)].tolist()
        tables, used = [], 0
        for n in lens:                      # scattered blocks, padded with block 0 as the engine pads them
            k = -(-n // bs)
            tables.append(order[used:used + k] + [0] * (width - k))
            used += k
        q = torch.randn(len(lens), h, d, generator=g).to(dtype)
        yield q, k_pool, v_pool, torch.tensor(tables), torch.tensor(lens), bs


def check_paged_read(paged_read, llm=None):
    """``paged_read(q, k_pool, v_pool, block_tables, context_lens, block_size)`` -> [B, heads, head_dim].
    With ``llm`` (a paged engine), the engine then decodes on it and must give the same tokens."""
    for case_no, (q, k_pool, v_pool, tables, lens, bs) in enumerate(_cases()):
        args = (q, k_pool.clone(), v_pool.clone(), tables.clone(), lens.clone(), bs)
        try:
            got = paged_read(*args)
        except Exception as exc:  # noqa: BLE001 - the attendee's code: report it, with the case
            raise CheckFailed(f"paged_read raised {type(exc).__name__}: {exc} (case {case_no}: {q.shape[1]} heads, "
                              f"{k_pool.shape[0]} KV heads, block size {bs}, contexts {lens.tolist()})") from exc
        if not torch.equal(args[1], k_pool) or not torch.equal(args[2], v_pool):
            raise CheckFailed("paged_read changed the pool: a read must not write")
        if not isinstance(got, torch.Tensor) or got.shape != q.shape:
            raise CheckFailed(f"expected a tensor of shape {tuple(q.shape)} ([sequences, heads, head_dim]), got "
                              f"{getattr(got, 'shape', type(got).__name__)}")
        want = reference_read(q, k_pool, v_pool, tables, lens, bs)
        tol = 2e-2 if q.dtype == torch.bfloat16 else 1e-4
        if torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
            continue
        for kind, hint in HINTS.items():
            if torch.allclose(got.float(), _variant(kind, q, k_pool, v_pool, tables, lens, bs).float(), atol=tol, rtol=tol):
                raise CheckFailed(f"{hint} (case {case_no}: contexts {lens.tolist()}, block size {bs})")
        bad = [i for i in range(len(lens)) if not torch.allclose(got[i].float(), want[i].float(), atol=tol, rtol=tol)]
        raise CheckFailed(f"wrong output for sequences {bad} of case {case_no} (contexts {lens.tolist()}, block tables "
                          f"{tables.tolist()}, block size {bs}): largest difference "
                          f"{(got.float() - want.float()).abs().max().item():.3g}. Each query must attend over exactly the "
                          f"positions 0 .. context_len - 1 of its own sequence, wherever its blocks lie in the pool")
    passed("paged_read gathers scattered blocks, masks by length and groups query heads like the engine, "
           "in 5 cases (GQA, MHA, MQA, block sizes 2 to 16, bfloat16)")
    if llm is not None:
        _run_engine(paged_read, llm)


def _run_engine(paged_read, llm):
    from ..engine.request import SamplingParams

    def plug(q, k_pool, v_pool, rows, block_size):
        return paged_read(q, k_pool, v_pool, rows.block_tables, rows.context_lens, block_size)

    prompts = [{"prompt_token_ids": list(range(1000, 1000 + n))} for n in (5, 16, 37, 64)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    own = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with llm.plugged(decode_attention=plug):
        yours = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for n, a, b in zip((5, 16, 37, 64), yours, own):
        if a != b:
            raise CheckFailed(f"with your paged_read the engine decoded other tokens for a {n}-token prompt: {a} vs {b}")
    stats = llm.stats()
    if stats["kv_blocks_free"] != stats["kv_blocks_total"]:
        raise CheckFailed("blocks were left in use after the run")
    passed(f"the engine decoded 4 prompts (5 to 64 tokens, {4 * 11} decode steps' reads) on your paged_read: "
           "the same tokens as its own")


# ---------------------------------------------------------------- the mixed step: prefills and decodes in one read

def reference_mixed_read(q, k_pool, v_pool, block_tables, query_lens, context_lens, block_size):
    """The engine's own attention for a mixed step (decode rows batched, prefill rows causal one sequence at a
    time), run on a one-layer ``PagedAttention`` over these pools with the exercise's arguments."""
    from types import SimpleNamespace

    from ..engine.paged_attention import PagedAttention

    hkv, slots, d = k_pool.shape
    backend = PagedAttention(1, slots // block_size, block_size, hkv, d, k_pool.dtype, "cpu")
    backend.k_pool, backend.v_pool = [k_pool.clone()], [v_pool.clone()]
    seqs = [SimpleNamespace(request_id=str(i), block_table=[int(b) for b in table], num_computed_tokens=int(c - n))
            for i, (table, n, c) in enumerate(zip(block_tables, query_lens, context_lens))]
    batch = backend.prepare(seqs, [int(n) for n in query_lens])
    writes = batch.attn_metadata.slot_mapping  # the new tokens' K/V are in the pool already: write them back unchanged
    return backend.attend(0, q, k_pool[:, writes].transpose(0, 1), v_pool[:, writes].transpose(0, 1), batch)


def _mixed_variant(kind, q, k_pool, v_pool, tables, qlens, clens, bs):
    """What a known mistake of the mixed read computes, row by row (slow and plain on purpose)."""
    hkv, _, d = k_pool.shape
    h = q.shape[1]
    out, row = torch.empty_like(q), 0
    for i, (n, ctx) in enumerate(zip(qlens.tolist(), clens.tolist())):
        for j in range(n):
            pos = ctx - n + j  # where this row's token sits in its sequence
            first, last = {"no_causal": (0, ctx), "one_short": (0, pos), "one_long": (0, pos + 2),
                           "new_keys_only": (ctx - n, pos + 1)}.get(kind, (0, pos + 1))
            last = max(min(last, tables.shape[1] * bs), first + 1)
            slots = [int(tables[i, p // bs]) * bs + p % bs for p in range(first, last)]
            for head in range(h):
                kv = head // (h // hkv)
                weights = (k_pool[kv, slots].float() @ q[row, head].float() / math.sqrt(d)).softmax(-1)
                out[row, head] = (weights @ v_pool[kv, slots].float()).to(q.dtype)
            row += 1
    return out


MIXED_HINTS = {
    "no_causal": "every row of a prefill chunk saw the whole context: row j of a sequence sits at position "
                 "context_len - query_len + j and sees keys 0 .. that position only (the causal rule inside a chunk)",
    "new_keys_only": "a row saw only the keys of this step's new tokens: a decode row, or a chunk after cached "
                     "tokens, must read the earlier blocks of its sequence too (positions from 0)",
    "one_short": "each row missed its own key: its K/V were written before the read, so a row at position p sees "
                 "keys 0 .. p (p + 1 keys)",
    "one_long": "each row saw one key past its own position: the next token's key is the future",
}


def _mixed_cases():
    g = torch.Generator().manual_seed(1)
    # (heads, kv_heads, head_dim, block_size, [(new tokens, context)], dtype): fresh prompts, decodes, chunks
    specs = [(4, 2, 8, 4, [(6, 6), (1, 7), (3, 8)], torch.float32),      # the chapter's toy step
             (6, 3, 16, 4, [(1, 13), (5, 5), (1, 2), (4, 11)], torch.float32),
             (4, 4, 8, 2, [(7, 7), (1, 9)], torch.float32),
             (8, 1, 8, 16, [(1, 40), (20, 37), (1, 17)], torch.float32),
             (6, 2, 32, 8, [(9, 23), (1, 9), (12, 12)], torch.bfloat16)]
    for h, hkv, d, bs, rows, dtype in specs:
        need = [-(-c // bs) for _, c in rows]
        num_blocks = 4 * sum(need) + 4
        k_pool = torch.randn(hkv, num_blocks * bs, d, generator=g).to(dtype)   # garbage everywhere: unused slots too
        v_pool = torch.randn(hkv, num_blocks * bs, d, generator=g).to(dtype)
        order = torch.randperm(num_blocks - 1, generator=g)[:sum(need)].add(1).tolist()   # scattered, never block 0
        tables, used = [], 0
        for k in need:
            tables.append(order[used:used + k] + [0] * (max(need) - k))
            used += k
        qlens, clens = torch.tensor([n for n, _ in rows]), torch.tensor([c for _, c in rows])
        q = torch.randn(int(qlens.sum()), h, d, generator=g).to(dtype)
        yield q, k_pool, v_pool, torch.tensor(tables), qlens, clens, bs


def check_paged_read_mixed(paged_read_mixed, llm=None):
    """``paged_read_mixed(q, k_pool, v_pool, block_tables, query_lens, context_lens, block_size)`` -> [T, heads,
    head_dim]: one read for a step of fresh prompts, chunks and decodes. With ``llm`` (a paged engine), the engine
    then runs every step of a mixed batch on it (``mixed_attention``) and must give the same tokens."""
    for case_no, (q, k_pool, v_pool, tables, qlens, clens, bs) in enumerate(_mixed_cases()):
        what = f"case {case_no}: (new tokens, context) {list(zip(qlens.tolist(), clens.tolist()))}, block size {bs}"
        args = (q, k_pool.clone(), v_pool.clone(), tables.clone(), qlens.clone(), clens.clone(), bs)
        try:
            got = paged_read_mixed(*args)
        except Exception as exc:  # noqa: BLE001 - the attendee's code: report it, with the case
            raise CheckFailed(f"paged_read_mixed raised {type(exc).__name__}: {exc} ({what})") from exc
        if not torch.equal(args[1], k_pool) or not torch.equal(args[2], v_pool):
            raise CheckFailed("paged_read_mixed changed the pool: a read must not write")
        if not isinstance(got, torch.Tensor) or got.shape != q.shape:
            raise CheckFailed(f"expected a tensor of shape {tuple(q.shape)} ([new tokens, heads, head_dim]), got "
                              f"{getattr(got, 'shape', type(got).__name__)}")
        want = reference_mixed_read(q, k_pool, v_pool, tables, qlens, clens, bs)
        tol = 2e-2 if q.dtype == torch.bfloat16 else 1e-4
        if torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
            continue
        for kind, hint in MIXED_HINTS.items():
            variant = _mixed_variant(kind, q, k_pool, v_pool, tables, qlens, clens, bs)
            if torch.allclose(got.float(), variant.float(), atol=tol, rtol=tol):
                raise CheckFailed(f"{hint} ({what})")
        bad = sorted({int(i) for i in (got.float() - want.float()).abs().amax((1, 2)).gt(tol).nonzero().flatten()})
        raise CheckFailed(f"wrong output for rows {bad} ({what}, block tables {tables.tolist()}): a sequence's rows "
                          "come one after another in q; row j of sequence i sits at position context_lens[i] - "
                          "query_lens[i] + j and sees keys 0 .. that position of its own sequence")
    passed("paged_read_mixed serves fresh prompts, chunks after cached tokens and decodes in one read, causal "
           "inside each chunk, in 5 mixed steps (GQA, MHA, MQA, block sizes 2 to 16, bfloat16)")
    if llm is not None:
        _run_engine_mixed(paged_read_mixed, llm)


def _run_engine_mixed(paged_read_mixed, llm):
    """Requests arriving while others decode, so steps mix a prefill with decodes; every step's attention on
    the attendee's read, inside a ``with`` block. Same tokens as the engine's own."""
    from ..engine.request import SamplingParams

    def plug(q, k_pool, v_pool, seqs, block_size):
        return paged_read_mixed(q, k_pool, v_pool, seqs.block_tables, seqs.query_lens, seqs.context_lens, block_size)

    lengths = (5, 16, 37, 64)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def staggered():
        """One request every two steps: the prefill of each runs beside the decodes of the earlier ones."""
        engine, reqs, mixed = llm.engine, [], 0
        for n in lengths:
            reqs.append(engine.add_request(list(range(1000, 1000 + n)), params))
            for _ in range(2):
                feeding = [r.num_tokens - r.num_computed_tokens for r in reqs if not r.is_finished]
                mixed += len(feeding) > 1 and max(feeding) > 1  # a prefill beside decodes
                engine.step()
        while engine.has_unfinished_requests():
            engine.step()
        return [r.output_token_ids for r in reqs], mixed

    own, _ = staggered()
    with llm.plugged(mixed_attention=plug):
        yours, mixed = staggered()
    for n, a, b in zip(lengths, yours, own):
        if a != b:
            raise CheckFailed(f"with your paged_read_mixed the engine generated other tokens for a {n}-token prompt: "
                              f"{a} vs {b}")
    stats = llm.stats()
    if stats["kv_blocks_free"] != stats["kv_blocks_total"]:
        raise CheckFailed("blocks were left in use after the run")
    passed(f"the engine ran {len(lengths)} staggered requests ({mixed} steps mixing a prefill with decodes) with every "
           "step's attention on your paged_read_mixed: the same tokens as its own")
