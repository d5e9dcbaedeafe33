"""Decode attention on the CPU that reads K/V in place through the block table: a small C++ kernel.

``paged_attention.paged_decode_attention`` stays in plain PyTorch, so it must *gather* each
sequence's blocks into a padded batch before its two matmuls: at batch 32 the gather writes and
re-reads as many bytes as the attention itself reads (about 350 MB per step, the weights are 540 MB).
vLLM's CPU backend and the GPU's Triton kernel (``triton_attention.py``) read the blocks where they
lie instead. This is the same idea for the CPU, written as plainly as the loop it replaces: for
each (sequence, KV head), scores of the head group's queries against every key of the context,
a softmax, then the weighted sum of the values. The slot of token ``t`` is
``block_table[t / block_size] * block_size + t % block_size``; the kernel walks the table block by
block instead of computing that for every token, because a division per token is a real part of a loop
this short. Each (sequence, KV head) is one task of PyTorch's own thread pool (``at::parallel_for``),
so ``torch.set_num_threads`` applies.

It is written with explicit vectors (``cpu_kernels.VECTORS``: AVX-512 where the CPU has it), because the
plain loop spent its time on arithmetic the compiler left scalar rather than on reading K/V: the dot
products of q and k reduce one register each, the softmax's ``exp`` is a polynomial the compiler
vectorises (``VECTORS``' ``exp_nonpositive``; ``std::exp`` is one scalar call per score), and the weighted
sum of the values stays in registers, four vectors of the head at a time, instead of adding into memory
token by token. What each version measured against the gather: ``benchmarks/README.md`` (the CPU decode kernel; a
vectorised decode kernel). Its output equals the gather's to float rounding (``tests/test_cpu_attention.py``).

The prefill rows' kernel (``cpu_prefill.py``: every prompt and chunk of a step in one call, read in place
the same way) is compiled into the same extension, and its Python side is ``cpu_prefill_attention`` below.

Both are compiled once per machine (``models/cpu_kernels.compile_cpu_extension``: a C++ compiler and about
40 s; the build is cached under ``~/.cache/torch_extensions``, one per instruction set; ``python -m
labsupport prepare`` builds it ahead). On by default on the CPU, ``EngineConfig.cpu_decode_kernel`` (the name
is older than the prefill kernel; it switches both): where they cannot be built, ``available()`` says why, the
engine warns once and keeps PyTorch's paths.
"""
from __future__ import annotations

import warnings

import torch

from ..models.cpu_kernels import VECTORS, compile_cpu_extension
from .cpu_prefill import PREFILL_SOURCE
from .paged_attention import paged_decode_attention

SOURCE = VECTORS + r"""#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// q [B, H, D]; k_pool, v_pool [Hkv, slots, D]; block_tables [B, W]; context_lens [B]  ->  [B, H, D]
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                           torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_pool.size(0), slots = k_pool.size(1), Wt = block_tables.size(1), G = H / Hkv;
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() && block_tables.is_contiguous()
              && context_lens.is_contiguous() && block_tables.scalar_type() == torch::kLong
              && context_lens.scalar_type() == torch::kLong && H % Hkv == 0 && D % W == 0, "paged_decode: unexpected inputs");
  auto out = torch::empty_like(q);
  const float *qp = q.data_ptr<float>(), *kp = k_pool.data_ptr<float>(), *vp = v_pool.data_ptr<float>();
  const int64_t *tables = block_tables.data_ptr<int64_t>(), *lens = context_lens.data_ptr<int64_t>();
  float *op = out.data_ptr<float>();
  const int64_t block_floats = block_size * D;
  const float sc = (float)scale;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv, L = lens[b], num_blocks = (L + block_size - 1) / block_size;
      const int64_t *table = tables + b * Wt;
      const float *keys = kp + h * slots * D, *values = vp + h * slots * D;
      const float *queries = qp + (b * H + h * G) * D;          // the G query heads of KV head h
      float *outs = op + (b * H + h * G) * D;
      scores.resize(G * L);
      // Block by block through the table: block i holds tokens i*block_size .. and lies at table[i]*block_size.
      // A block is 4 KB here, so the hardware prefetcher stops at its end: while reading row j of a block,
      // ask for row j of the next one (27 % faster per layer than without, measured cold), and while reading
      // the keys, for the values of the same row (the values' walk then finds them in cache: 6 % more).
      auto walk = [&](const float *pool, const float *also, auto &&visit) {
        for (int64_t i = 0; i < num_blocks; ++i) {
          const float *block = pool + table[i] * block_floats;
          const float *next = i + 1 < num_blocks ? pool + table[i + 1] * block_floats : nullptr;
          const float *other = also ? also + table[i] * block_floats : nullptr;
          const int64_t first = i * block_size, n = std::min(block_size, L - first);
          for (int64_t j = 0; j < n; ++j) {
            if (next) for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(next + j * D + d);
            if (other) for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(other + j * D + d);
            visit(first + j, block + j * D);
          }
        }
      };
      walk(keys, values, [&](int64_t t, const float *k) {  // q . k for every key of the context
        for (int64_t g = 0; g < G; ++g) {
          const float *qg = queries + g * D;
          vec a = vmul(vload(qg), vload(k));
          for (int64_t d = W; d < D; d += W) a = vfma(vload(qg + d), vload(k + d), a);
          scores[g * L + t] = vsum(a) * sc;
        }
      });
      for (int64_t g = 0; g < G; ++g) {                          // softmax over the context
        float *s = scores.data() + g * L, top = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < L; ++t) top = std::max(top, s[t]);
        #pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < L; ++t) { s[t] = exp_nonpositive(s[t] - top); sum += s[t]; }
        const float inv = 1.f / sum;
        #pragma omp simd
        for (int64_t t = 0; t < L; ++t) s[t] *= inv;
      }
      // The weighted sum of the values, up to four vectors of the head dimension per walk, kept in registers.
      auto weighted_sum = [&](auto vectors, const float *p, int64_t d0, float *o) {
        constexpr int n = decltype(vectors)::value;
        vec a[n];
        for (int i = 0; i < n; ++i) a[i] = vzero();
        walk(values, nullptr, [&](int64_t t, const float *v) {
          const vec pt = vset1(p[t]);
          for (int i = 0; i < n; ++i) a[i] = vfma(pt, vload(v + d0 + i * W), a[i]);
        });
        for (int i = 0; i < n; ++i) vstore(o + d0 + i * W, a[i]);
      };
      for (int64_t g = 0; g < G; ++g) {
        const float *p = scores.data() + g * L;
        float *o = outs + g * D;
        int64_t d0 = 0;
        for (; d0 + 4 * W <= D; d0 += 4 * W) weighted_sum(std::integral_constant<int, 4>{}, p, d0, o);
        for (; d0 < D; d0 += W) weighted_sum(std::integral_constant<int, 1>{}, p, d0, o);
      }
    }
  });
  return out;
}
"""

_module = None
_why_not: str | None = None
_warned = False


def available() -> tuple[bool, str]:
    """Compile (or load the cached build of) the kernel once per process: (True, "") or (False, why not)."""
    global _module, _why_not
    if _module is None and _why_not is None:
        _module, why_not = compile_cpu_extension("cpu_paged_attention", "the CPU attention kernels",
                                                 SOURCE + PREFILL_SOURCE, ["paged_decode", "paged_prefill"])
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
    """``paged_attention.paged_decode_attention``'s contract (q: [B, H, D] -> [B, H, D]), read in place.
    Float32 heads of a whole number of vectors (16 floats: every supported model's 64 or 128) only; any other
    dtype or head size takes the PyTorch gather."""
    if q.dtype != torch.float32 or k_pool.dtype != torch.float32 or q.shape[-1] % 16:
        return paged_decode_attention(q, k_pool, v_pool, rows, block_size)
    scale = 1.0 / q.shape[-1] ** 0.5
    return _module.paged_decode(q.contiguous(), k_pool, v_pool, rows.block_tables, rows.context_lens,
                                block_size, scale)


def prefill_kernel_applies(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``cpu_prefill_attention`` serves a pool of this dtype and head size (float32, whole vectors)."""
    return dtype == torch.float32 and head_dim % 16 == 0


def cpu_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, seqs, block_size: int,
                          out: torch.Tensor):
    """Every prefill sequence of the step (``paged_attention.PrefillSeqs``) attending causally over its context,
    read in place from the pool (``cpu_prefill.py``), written into their rows of ``out`` ([T, H, D], like q)."""
    _module.paged_prefill(q.contiguous(), k_pool, v_pool, seqs.block_tables, seqs.starts, seqs.query_lens,
                          seqs.context_lens, block_size, 1.0 / q.shape[-1] ** 0.5, out)
