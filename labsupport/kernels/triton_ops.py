"""Small fused kernels of the model, in Triton, for GPUs (the CPU keeps the PyTorch code of ``llama.py``).

**RoPE of q and k in one kernel** (``triton_rope_qk``).

``apply_rope`` in PyTorch is five small kernels per tensor (negate, concatenate, two products, a
sum), ten per layer for q and k. In a decode step of an 8B model on a GPU each is a few microseconds
that moves almost no bytes, and together they are a visible part of the step: launch and latency, not
work (``benchmarks/README.md``: their H200 figures). This
kernel does both rotations in one launch, one program per token over all its heads, in fp32, and
writes q and k contiguous (what the attention kernel reads).

Same contract as ``apply_rope`` (q: [T, H, D], k: [T, Hkv, D], cos/sin: [T, D] whose two halves are
equal, as ``LlamaForCausalLM.rope_cos_sin`` builds them). Checked against ``apply_rope`` on the CPU
under ``TRITON_INTERPRET=1`` (``tests/test_triton_attention.py`` runs the interpreter tests).

**SiLU-and-multiply** (``triton_silu_mul``): ``silu(gate) * up`` from the stacked gate/up product
([T, 2I], ``fuse_projections``), one kernel instead of two that read strided halves.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device) -> bool:
    return triton is not None and (torch.device(device).type == "cuda" or INTERPRETED)


def triton_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    t, h, d = q.shape
    hkv = k.shape[1]
    if d % 2 or (d // 2) & (d // 2 - 1):
        raise ValueError(f"the RoPE kernel needs head_dim = 2 x a power of two, got {d}")
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride()
    q_out, k_out = torch.empty(t, h, d, dtype=q.dtype, device=q.device), torch.empty(t, hkv, d, dtype=k.dtype,
                                                                                      device=k.device)
    if t:
        _rope_kernel[(t,)](q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                           cos.stride(0), **rope_constants(h, hkv, d))
    return q_out, k_out


def rope_constants(heads: int, kv_heads: int, head_dim: int) -> dict:
    """The RoPE kernel's compile-time constants (the launch and the ahead-of-time compile for sm_90 share them)."""
    return dict(HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), KV_HEADS=kv_heads,
                KV_HEADS_PAD=triton.next_power_of_2(kv_heads), HALF=head_dim // 2)


SILU_BLOCK = 1024  # columns of one program of the SiLU-and-multiply kernel


def triton_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> silu(gate) * up, [T, I]."""
    t, width = gate_up.shape
    half = width // 2
    gate_up = gate_up.contiguous()
    out = torch.empty(t, half, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        _silu_mul_kernel[(t, triton.cdiv(half, SILU_BLOCK))](gate_up, out, half, BLOCK=SILU_BLOCK)
    return out


if triton is not None:
    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, half, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < half
        gate = tl.load(x_ptr + row * 2 * half + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * half + half + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * half + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate(x_ptr, out_ptr, stride_t, stride_h, tok, c, s, NUM: tl.constexpr, NUM_PAD: tl.constexpr,
                HALF: tl.constexpr):
        heads = tl.arange(0, NUM_PAD)[:, None]
        dims = tl.arange(0, HALF)[None, :]
        mask = heads < NUM
        first = x_ptr + tok * stride_t + heads * stride_h + dims
        x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
        out = out_ptr + tok * NUM * 2 * HALF + heads * 2 * HALF + dims  # contiguous [T, NUM, 2 * HALF]
        tl.store(out, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out, k_out, stride_qt, stride_qh, stride_kt, stride_kh,
                     stride_ct, HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS: tl.constexpr,
                     KV_HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
        tok = tl.program_id(0)
        dims = tl.arange(0, HALF)[None, :]
        c = tl.load(cos_ptr + tok * stride_ct + dims).to(tl.float32)  # [1, HALF]: both halves are equal
        s = tl.load(sin_ptr + tok * stride_ct + dims).to(tl.float32)
        _rotate(q_ptr, q_out, stride_qt, stride_qh, tok, c, s, HEADS, HEADS_PAD, HALF)
        _rotate(k_ptr, k_out, stride_kt, stride_kh, tok, c, s, KV_HEADS, KV_HEADS_PAD, HALF)
