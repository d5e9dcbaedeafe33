// Decode attention read in place through the block table (why, and its Python side: kernels/cpu_attention.py).
#include "vectors.h"
#include <algorithm>
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
      // ask for row j of the next one (faster per layer than without, measured cold), and while reading the
      // keys, for the values of the same row (the values' walk then finds them in cache).
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
