"""Paged decode attention as a Triton kernel: K/V are read in place, through the block table.

``paged_decode_attention`` (plain PyTorch) first *copies* every decode row's blocks into a padded
batch, then attends over the copy: the KV cache is read once, written once and read again, and
decode is bound by exactly those bytes. This kernel computes the same thing reading each K/V
row once, from wherever its block lives, which is what vLLM's kernels do.

One program per (sequence, KV head). It serves all G = H / Hkv query heads of that KV head at
once, as the rows of a small matrix, so each K/V tile is loaded once per group instead of once
per query head (grouped-query attention is a bandwidth saving only if the kernel keeps it). The
program walks the context in tiles of ``TILE`` tokens; each token finds its slot through the
block table (``table[tok // block_size] * block_size + tok % block_size``), so any power-of-two
block size works and a tile may span several blocks. Softmax is online, in fp32 (the running
maximum ``m``, the running sum ``l``, the rescaled accumulator ``acc``: flash attention's trick),
so nothing of length ``context`` is ever stored. With 64 sequences x 8 KV heads there are enough
programs to fill a GPU; splitting one context over several programs (flash-decoding's split-K)
would only pay for small batches of long contexts, and is left out to keep the kernel short.

Without a GPU, ``TRITON_INTERPRET=1`` (set before this module is imported) runs the kernel on
CPU tensors with numpy: slow, but it checks the very same code (``tests/test_triton_attention.py``).
"""
from __future__ import annotations

import dataclasses
import math
import os
import warnings

import torch

try:  # optional: a CPU install has no use for triton, and then available() says False
    import triton
    import triton.language as tl
except ImportError:
    triton = None

TILE = 64  # context tokens per loop iteration: [TILE, head_dim] of K and of V in flight
# The interpreter is chosen when the kernel is defined (at import), like the @triton.jit decorator does.
INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device) -> bool:
    """True if ``triton_decode_attention`` can run on ``device``: a GPU, or the CPU under the interpreter."""
    return triton is not None and (torch.device(device).type == "cuda" or INTERPRETED)


def kernel_applies(head_dim: int, block_size: int) -> bool:
    """The shapes the kernel serves: power-of-two blocks, and heads of a power of two >= 16 (``tl.arange`` sizes)."""
    return not (block_size & (block_size - 1) or head_dim & (head_dim - 1) or head_dim < 16)


def triton_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows,
                            block_size: int) -> torch.Tensor:
    """Same contract as ``paged_decode_attention``: q [B, H, D], pools [Hkv, slots, D] -> [B, H, D].

    Where the kernel cannot serve the call, it steps back to ``paged_decode_attention`` and says so once: a shape
    it does not serve (``kernel_applies``: an attendee's block size of 12, a model's head of 80), or a kernel that
    fails to compile here (a triton or GPU the kernel was never built for). An engine then runs slower, not wrong,
    and a failure of a kernel that once ran still raises."""
    b, h, d = q.shape
    hkv = k_pool.shape[0]
    group = h // hkv
    key = (q.dtype, group, d, block_size)
    if not kernel_applies(d, block_size) or key in _FAILED:
        return _step_back(q, k_pool, v_pool, rows, block_size, key)
    q = q.contiguous()
    assert k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1 and k_pool.stride() == v_pool.stride()
    tables, lens = rows.block_tables.contiguous(), rows.context_lens.contiguous()
    out = torch.empty_like(q)
    if b == 0:
        return out
    try:
        _decode_kernel[(b, hkv)](
            q, k_pool, v_pool, out, tables, lens,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), tables.stride(0), 1.0 / math.sqrt(d),
            **launch_options(q.dtype, group, d, block_size))
    except Exception as exc:  # raised by the launch itself: compiling failed (a kernel's run fails asynchronously)
        if key in _LAUNCHED:
            raise
        _FAILED[key] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        return _step_back(q, k_pool, v_pool, rows, block_size, key)
    _LAUNCHED.add(key)
    return out


_LAUNCHED: set = set()  # (dtype, group, head_dim, block_size) the kernel compiled and launched for
_FAILED: dict = {}  # the same keys whose compile failed, with the error
_WARNED: set = set()


def _step_back(q, k_pool, v_pool, rows, block_size: int, key) -> torch.Tensor:
    from ..engine.paged_attention import paged_decode_attention
    if key not in _WARNED:
        _WARNED.add(key)
        why = _FAILED.get(key) or f"it serves power-of-two block sizes and heads >= 16, got {block_size} and {key[2]}"
        warnings.warn(f"the Triton decode kernel steps back to the PyTorch path for {key[0]} heads of {key[2]} "
                      f"in blocks of {block_size}: {why}", RuntimeWarning, stacklevel=3)
    if rows.padding is None:  # CUDA graphs leave the mask out for the kernel: made from the lengths, on the device
        width = rows.block_tables.shape[1] * block_size
        rows = dataclasses.replace(rows, padding=torch.arange(width, device=q.device)[None, :]
                                   >= rows.context_lens[:, None])
    return paged_decode_attention(q, k_pool, v_pool, rows, block_size)


def launch_options(dtype: torch.dtype, group: int, head_dim: int, block_size: int, interpreted: bool = None) -> dict:
    """The kernel's compile-time constants and launch settings for a dtype and head shape: the launch above uses
    them, and so does the ahead-of-time compile for sm_90 (``tests/test_gpu_path_cpu.py``), so both build the
    same kernel."""
    interpreted = INTERPRETED if interpreted is None else interpreted
    return dict(
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot wants >= 16 rows
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, TILE=TILE,
        # fp32 in, fp32 products (not TF32): the kernel must agree with the PyTorch path to ~1e-6
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        # the interpreter's tl.dot multiplies bfloat16 *bit patterns* (triton 3.7-3.9): give it fp32
        DOT_TYPE=tl.float32 if interpreted and dtype == torch.bfloat16 else _TL_TYPES[dtype],
        num_warps=2, num_stages=2)  # the fastest of 36 settings on an H200 (B=64, contexts 512-1024, bf16)


if triton is not None:  # the kernel can only be defined where triton is installed
    _TL_TYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr,
                       stride_qb, stride_qh, stride_kh, stride_ks, stride_tb, scale,
                       GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
                       DOT_TYPE: tl.constexpr):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        rows = tl.arange(0, GROUP_PAD)  # this KV head's query heads (padding rows masked)
        is_head = rows < GROUP
        dims = tl.arange(0, HEAD_DIM)
        q_rows = q_ptr + seq * stride_qb + (kv_head * GROUP + rows)[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_rows, mask=is_head[:, None], other=0.0).to(DOT_TYPE)        # [G, D]
        context = tl.load(lens_ptr + seq)
        kv_base = kv_head.to(tl.int64) * stride_kh

        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of each head's scores
        l = tl.zeros([GROUP_PAD], tl.float32)                # running sum of exp(score - m)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)    # running sum of exp(score - m) * v
        for start in range(0, context, TILE):
            tok = start + tl.arange(0, TILE)
            valid = tok < context
            block = tl.load(tables_ptr + seq * stride_tb + tok // BLOCK_SIZE, mask=valid, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + tok % BLOCK_SIZE          # read in place
            offsets = kv_base + slot[:, None] * stride_ks + dims[None, :]
            k = tl.load(k_ptr + offsets, mask=valid[:, None], other=0.0).to(DOT_TYPE)  # [TILE, D]
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G, TILE], fp32
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)  # rescales what was summed under the old maximum
            v = tl.load(v_ptr + offsets, mask=valid[:, None], other=0.0).to(DOT_TYPE)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_TYPE), v, input_precision=PRECISION)
            l = l * alpha + tl.sum(p, 1)
            m = m_new

        out = acc / l[:, None]
        out_rows = out_ptr + seq * stride_qb + (kv_head * GROUP + rows)[:, None] * stride_qh + dims[None, :]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=is_head[:, None])
