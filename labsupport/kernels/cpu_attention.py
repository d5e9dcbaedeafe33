"""Decode attention on the CPU that reads K/V in place through the block table: a small C++ kernel
(``csrc/paged_decode.cpp``), and the prefill rows' kernel beside it (``csrc/paged_prefill.cpp``).

``paged_attention.paged_decode_attention`` stays in plain PyTorch, so it must *gather* each
sequence's blocks into a padded batch before its two matmuls: at batch 32 the gather writes and
re-reads as many bytes as the attention itself reads (``benchmarks/README.md`` has the step's bytes).
vLLM's CPU backend and the GPU's Triton kernel (``triton_attention.py``) read the blocks where they
lie instead. This is the same idea for the CPU, written as plainly as the loop it replaces: for
each (sequence, KV head), scores of the head group's queries against every key of the context,
a softmax, then the weighted sum of the values. The slot of token ``t`` is
``block_table[t / block_size] * block_size + t % block_size``; the kernel walks the table block by
block instead of computing that for every token, because a division per token is a real part of a loop
this short. Each (sequence, KV head) is one task of PyTorch's own thread pool (``at::parallel_for``),
so ``torch.set_num_threads`` applies.

It is written with explicit vectors (``csrc/vectors.h``: AVX-512 where the CPU has it), because the
plain loop spent its time on arithmetic the compiler left scalar rather than on reading K/V: the dot
products of q and k reduce one register each, the softmax's ``exp`` is a polynomial the compiler
vectorises (``vectors.h``' ``exp_nonpositive``; ``std::exp`` is one scalar call per score), and the weighted
sum of the values stays in registers, four vectors of the head at a time, instead of adding into memory
token by token. What each version measured against the gather: ``benchmarks/README.md`` (the CPU decode kernel; a
vectorised decode kernel). Its output equals the gather's to float rounding (``tests/test_cpu_attention.py``).

The prefill rows' kernel (``csrc/paged_prefill.cpp``, whose comment says how and why: every prompt and chunk
of a step in one call, read in place the same way) is compiled into the same extension, and its Python side is
``cpu_prefill_attention`` below.

Both are compiled once per machine (``jit.compile_extension``: a C++ compiler and a wait, paid once
per machine and better before a chapter; the build is cached under ``~/.cache/torch_extensions``, one per instruction set; ``python -m
labsupport prepare`` builds it ahead). On by default on the CPU, ``EngineConfig.cpu_decode_kernel`` (the name
is older than the prefill kernel; it switches both): where they cannot be built, ``available()`` says why, the
engine warns once and keeps PyTorch's paths. Both serve float32 heads of a whole number of vectors
(``kernel_applies``); the attention backend keeps the gather for any other (``engine/paged_attention.py``).
"""
from __future__ import annotations

import warnings

import torch

from .jit import compile_extension

_module = None
_why_not: str | None = None
_warned = False


def available() -> tuple[bool, str]:
    """Compile (or load the cached build of) the kernel once per process: (True, "") or (False, why not)."""
    global _module, _why_not
    if _module is None and _why_not is None:
        _module, why_not = compile_extension("cpu_paged_attention", "the CPU attention kernels", ["paged_decode.cpp",
                                             "paged_prefill.cpp"], ["paged_decode", "paged_prefill"])
        _why_not = why_not or None
    return _module is not None, _why_not or ""


def warn_once_not_built():
    """Say once per process why the engine keeps the PyTorch gather (a laptop without a C++ compiler)."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(available()[1] + "; decode attention keeps the PyTorch gather "
                      "(cpu_decode_kernel=False says so without this warning)", stacklevel=3)


def cpu_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows, block_size: int):
    """``paged_attention.paged_decode_attention``'s contract (q: [B, H, D] -> [B, H, D]), read in place,
    for pools ``kernel_applies`` to."""
    scale = 1.0 / q.shape[-1] ** 0.5
    return _module.paged_decode(q.contiguous(), k_pool, v_pool, rows.block_tables, rows.context_lens,
                                block_size, scale)


def kernel_applies(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether these kernels serve a pool of this dtype and head size: float32, heads of a whole number of
    vectors (16 floats: every supported model's 64 or 128)."""
    return dtype == torch.float32 and head_dim % 16 == 0


def cpu_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, seqs, block_size: int,
                          out: torch.Tensor):
    """Every prefill sequence of the step (``attention_metadata.PrefillSeqs``) attending causally over its context,
    read in place from the pool (``csrc/paged_prefill.cpp``), written into their rows of ``out`` ([T, H, D],
    like q)."""
    _module.paged_prefill(q.contiguous(), k_pool, v_pool, seqs.block_tables, seqs.starts, seqs.query_lens,
                          seqs.context_lens, block_size, 1.0 / q.shape[-1] ** 0.5, out)
