"""Decode attention on the CPU that reads K/V in place through the block table: a small C++ kernel.

``paged_attention.paged_decode_attention`` stays in plain PyTorch, so it must *gather* each
sequence's blocks into a padded batch before its two matmuls: at batch 32 the gather writes and
re-reads as many bytes as the attention itself reads (about 350 MB per step, the weights are 540 MB).
vLLM's CPU backend and the GPU's Triton kernel (``triton_attention.py``) read the blocks where they
lie instead. This is the same idea for the CPU, written as plainly as the loop it replaces: for
each (sequence, KV head), scores of the head group's queries against every key of the context,
a softmax, then the weighted sum of the values, with the slot of token ``t`` found as
``block_table[t / block_size] * block_size + t % block_size``. Each (sequence, KV head) is one task
of PyTorch's own thread pool (``at::parallel_for``), so ``torch.set_num_threads`` applies.

Measured on the 2-core course machine (batch 32, ~240-token contexts, SmolLM2's 9 query and 3 KV
heads, 30 layers' pools cold): 1.38 ms per layer against 2.98 ms for the gather and two matmuls, the
same output to 3e-7; a batch-32 decode step 1.35x faster (README, "Performance"). Walking the table block
by block, rather than finding each token's slot with a division, halved it again on the Zen 5 machine
(batch 32, contexts of 250-500 tokens: 1.07 ms per layer against 2.1, bit-identical output).

It is compiled once per machine (``models/cpu_kernels.compile_cpu_extension``: a C++ compiler and about
40 s; the build is cached under ``~/.cache/torch_extensions``, one per instruction set; ``python -m
labsupport prepare`` builds it ahead). On by default on the CPU, ``EngineConfig.cpu_decode_kernel``: where it
cannot be built, ``available()`` says why, the engine warns once and keeps the PyTorch gather.
"""
from __future__ import annotations

import warnings

import torch

from ..models.cpu_kernels import compile_cpu_extension
from .paged_attention import paged_decode_attention

SOURCE = r"""#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// q [B, H, D]; k_pool, v_pool [Hkv, slots, D]; block_tables [B, W]; context_lens [B]  ->  [B, H, D]
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                           torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_pool.size(0), slots = k_pool.size(1), W = block_tables.size(1), G = H / Hkv;
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() && block_tables.is_contiguous()
              && context_lens.is_contiguous() && block_tables.scalar_type() == torch::kLong
              && context_lens.scalar_type() == torch::kLong && H % Hkv == 0, "paged_decode: unexpected inputs");
  auto out = torch::empty_like(q);
  const float *qp = q.data_ptr<float>(), *kp = k_pool.data_ptr<float>(), *vp = v_pool.data_ptr<float>();
  const int64_t *tables = block_tables.data_ptr<int64_t>(), *lens = context_lens.data_ptr<int64_t>();
  float *op = out.data_ptr<float>();
  const int64_t block_floats = block_size * D;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(G * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv, L = lens[b], num_blocks = (L + block_size - 1) / block_size;
      const int64_t *table = tables + b * W;
      const float *keys = kp + h * slots * D, *values = vp + h * slots * D;
      const float *queries = qp + (b * H + h * G) * D;          // the G query heads of KV head h
      scores.resize(G * L);
      // Block by block through the table: block i holds tokens i*block_size .. and lies at table[i]*block_size.
      // A block is 4 KB here, so the hardware prefetcher stops at its end: while reading row j of a block,
      // ask for row j of the next one (27 % faster per layer than without, measured cold).
      auto walk = [&](const float *pool, auto &&visit) {
        for (int64_t i = 0; i < num_blocks; ++i) {
          const float *block = pool + table[i] * block_floats;
          const float *next = i + 1 < num_blocks ? pool + table[i + 1] * block_floats : nullptr;
          const int64_t first = i * block_size, n = std::min(block_size, L - first);
          for (int64_t j = 0; j < n; ++j) {
            if (next) for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(next + j * D + d);
            visit(first + j, block + j * D);
          }
        }
      };
      walk(keys, [&](int64_t t, const float *k) {                // q . k for every key of the context
        for (int64_t g = 0; g < G; ++g) {
          const float *qg = queries + g * D;
          float dot = 0.f;
          #pragma omp simd reduction(+:dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
          scores[g * L + t] = dot * (float)scale;
        }
      });
      for (int64_t g = 0; g < G; ++g) {                          // softmax over the context
        float *s = scores.data() + g * L, top = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < L; ++t) top = std::max(top, s[t]);
        for (int64_t t = 0; t < L; ++t) { s[t] = std::exp(s[t] - top); sum += s[t]; }
        for (int64_t t = 0; t < L; ++t) s[t] /= sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      walk(values, [&](int64_t t, const float *v) {              // the values, weighted
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float *a = acc.data() + g * D;
          #pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
        }
      });
      std::copy(acc.begin(), acc.end(), op + (b * H + h * G) * D);
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
        _module, why_not = compile_cpu_extension("cpu_paged_decode", "the CPU decode kernel", SOURCE, ["paged_decode"])
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
    Float32 only (the kernel's one type); any other dtype takes the PyTorch gather."""
    if q.dtype != torch.float32 or k_pool.dtype != torch.float32:
        return paged_decode_attention(q, k_pool, v_pool, rows, block_size)
    scale = 1.0 / q.shape[-1] ** 0.5
    return _module.paged_decode(q.contiguous(), k_pool, v_pool, rows.block_tables, rows.context_lens,
                                block_size, scale)
