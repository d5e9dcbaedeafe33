// Prefill attention on the CPU, read in place through the block table: every prompt and chunk of a step in
// one call per layer (its Python side: kernels/cpu_attention.py, cpu_prefill_attention).
//
// A prompt (or a chunk of one) attends causally over its context. PyTorch's fused CPU kernel does that one
// sequence at a time (paged_attention.prefill_attention: flash attention, after gathering a chunk's earlier
// context out of the pool), and at the lengths a serving step mixes, 20-400 tokens, it runs far below the rate
// the same machine's products reach (benchmarks/README.md: the figures). This kernel serves every prefill
// sequence of a step in one call per layer, reading keys and values where they lie in the pool (the step's new
// K/V are written there first), the same way paged_decode.cpp serves the decode rows.
//
// How it is laid out, and why:
//
// * A task is 48 query rows of one KV head (16 positions x the 3 query heads that share it, for SmolLM2):
//   the rows that read the same keys. Tasks are taken from a shared counter, longest context first, so two
//   threads finish together however ragged the prompts are.
// * Scores with the queries across the vector lanes. The task's queries are transposed once to [D, rows];
//   each key is then read straight from its pool row, one broadcast per element, into a register tile of
//   8 keys x 48 rows. No key is copied or transposed, and a score row comes out as vectors of rows, so
// * the online softmax is vectorised across rows: the running maximum, the rescaling factor and the sum of
//   every row advance together, a chunk of 32 keys at a time, with no horizontal reductions. exp is the
//   decode kernel's polynomial (vectors.h). A key after a row's position (the causal rule) is masked only in
//   the chunks that reach past the tile's first position.
// * The weighted sum of the values keeps a tile of 6 rows x 64 floats of the output in registers while it
//   walks the chunk's value rows, scaling what came before by the softmax's factor as it loads it.
//
// What it measured against prefill_attention per sequence, on W1's, WV's and W3's prefills, is in
// benchmarks/README.md (a prefill attention kernel). Its outputs agree with that path to float rounding
// (tests/test_cpu_attention.py). Compiled in one translation unit after paged_decode.cpp.
#include "vectors.h"
#include <atomic>

constexpr int64_t KC = 32;               // keys per chunk
constexpr int64_t CB = 3;                // vectors of query rows per register tile of scores
constexpr int64_t KT = W == 16 ? 8 : 4;  // keys per register tile of scores (KT x CB accumulators)
constexpr int64_t OR = W == 16 ? 6 : 3;  // rows per register tile of the output (times four vectors)

// Scores with the queries across the vector lanes: st[t][r] = k_t . qt[:, r] for N keys, C vectors of rows.
// The keys are read where they lie in the pool (a broadcast per element), the queries once transposed per task.
template <int N, int C> static inline void scores_tile(const float *const *k, const float *qt, int64_t Rp,
                                                       int64_t D, float *st) {
  vec a[N][C];
  for (int t = 0; t < N; ++t) for (int j = 0; j < C; ++j) a[t][j] = vzero();
  for (int64_t d = 0; d < D; ++d) {
    vec q[C];
    for (int j = 0; j < C; ++j) q[j] = vload(qt + d * Rp + j * W);
    for (int t = 0; t < N; ++t) {
      const vec kd = vset1(k[t][d]);
      for (int j = 0; j < C; ++j) a[t][j] = vfma(kd, q[j], a[t][j]);
    }
  }
  for (int t = 0; t < N; ++t) for (int j = 0; j < C; ++j) vstore(st + t * Rp + j * W, a[t][j]);
}

template <int N> static inline void scores_keys(const float *const *k, const float *qt, int64_t Rp, int64_t D,
                                                float *st) {
  int64_t c = 0;
  for (; c + CB * W <= Rp; c += CB * W) scores_tile<N, CB>(k, qt + c, Rp, D, st + c);
  for (; c < Rp; c += W) scores_tile<N, 1>(k, qt + c, Rp, D, st + c);
}

// o[r][d0 : d0 + N W] = alpha[r] o[r][...] + sum_t p[t][r] v_t[...] for R rows
template <int R, int N> static inline void values_tile(const float *p, int64_t Rp, const float *const *v,
                                                       int64_t nkeys, const float *alpha, int64_t d0, float *o,
                                                       int64_t D) {
  vec a[R][N];
  for (int r = 0; r < R; ++r) {
    const vec s = vset1(alpha[r]);
    for (int j = 0; j < N; ++j) a[r][j] = vmul(s, vload(o + r * D + d0 + j * W));
  }
  for (int64_t t = 0; t < nkeys; ++t) {
    vec x[N];
    for (int j = 0; j < N; ++j) x[j] = vload(v[t] + d0 + j * W);
    for (int r = 0; r < R; ++r) {
      const vec pr = vset1(p[t * Rp + r]);
      for (int j = 0; j < N; ++j) a[r][j] = vfma(pr, x[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) for (int j = 0; j < N; ++j) vstore(o + r * D + d0 + j * W, a[r][j]);
}

template <int R> static inline void values_rows(const float *p, int64_t Rp, const float *const *v, int64_t nkeys,
                                                const float *alpha, float *o, int64_t D) {
  int64_t d0 = 0;
  for (; d0 + 4 * W <= D; d0 += 4 * W) values_tile<R, 4>(p, Rp, v, nkeys, alpha, d0, o, D);
  for (; d0 < D; d0 += W) values_tile<R, 1>(p, Rp, v, nkeys, alpha, d0, o, D);
}

// q [T, H, D] (the step's rows), k_pool/v_pool [Hkv, slots, D], block_tables [S, Wt]: the prefill sequences'.
// Sequence s's queries are rows starts[s] .. starts[s] + query_lens[s] of q, at positions
// context_lens[s] - query_lens[s] ..; each sees the keys up to its own position (written to the pool already).
void paged_prefill(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor block_tables,
                   torch::Tensor starts, torch::Tensor query_lens, torch::Tensor context_lens,
                   int64_t block_size, double scale, torch::Tensor out) {
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_pool.size(0), slots = k_pool.size(1);
  const int64_t S = starts.size(0), Wt = block_tables.size(1), G = H / Hkv;
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() && block_tables.is_contiguous()
              && out.is_contiguous() && H % Hkv == 0 && D % W == 0, "paged_prefill: unexpected inputs");
  const float *qp = q.data_ptr<float>(), *kp = k_pool.data_ptr<float>(), *vp = v_pool.data_ptr<float>();
  const int64_t *tables = block_tables.data_ptr<int64_t>(), *st = starts.data_ptr<int64_t>();
  const int64_t *ql = query_lens.data_ptr<int64_t>(), *cl = context_lens.data_ptr<int64_t>();
  float *op = out.data_ptr<float>();
  const int64_t QT = std::max<int64_t>(1, 48 / G);   // query positions per task: G * QT ~ 48 rows
  struct Task { int64_t s, h, i0, cost; };
  std::vector<Task> tasks;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i0 = 0; i0 < ql[s]; i0 += QT)
      for (int64_t h = 0; h < Hkv; ++h)
        tasks.push_back({s, h, i0, cl[s] - ql[s] + std::min(i0 + QT, ql[s])});
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task &a, const Task &b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t ntasks = (int64_t)tasks.size();
  const float sc = (float)scale;
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const int64_t Rmax = (G * QT + W - 1) / W * W;
    std::vector<float> qt(D * Rmax), o(Rmax * D), pt(KC * Rmax), m(Rmax), l(Rmax), alpha(Rmax), pos(Rmax);
    const float *krows[KC], *vrows[KC];
    for (int64_t ti; (ti = next.fetch_add(1)) < ntasks;) {
      const Task &task = tasks[ti];
      const int64_t s = task.s, h = task.h, n = ql[s], ctx = cl[s], first = ctx - n;
      const int64_t i1 = std::min(task.i0 + QT, n), R = (i1 - task.i0) * G, Rp = (R + W - 1) / W * W;
      const int64_t *table = tables + s * Wt;
      const float *keys = kp + h * slots * D, *values = vp + h * slots * D;
      // row r = (i - i0) * G + g: query head h * G + g at position first + i, its lane of qt [D][Rp], pre-scaled
      std::fill(qt.begin(), qt.begin() + D * Rp, 0.f);
      for (int64_t r = 0; r < Rp; ++r) {
        m[r] = -INFINITY; l[r] = 0.f;
        pos[r] = r < R ? (float)(first + task.i0 + r / G) : (float)(first + i1 - 1);
        if (r >= R) continue;
        const float *src = qp + ((st[s] + task.i0 + r / G) * H + h * G + r % G) * D;
        for (int64_t d = 0; d < D; ++d) qt[d * Rp + r] = src[d] * sc;
      }
      std::fill(o.begin(), o.begin() + Rp * D, 0.f);
      const int64_t last = first + i1 - 1, lowest = first + task.i0;   // the tile's last and first positions
      for (int64_t c0 = 0; c0 <= last; c0 += KC) {
        const int64_t nk = std::min(KC, last + 1 - c0);
        for (int64_t t = 0; t < nk; ++t) {
          const int64_t p = c0 + t, slot = table[p / block_size] * block_size + p % block_size;
          krows[t] = keys + slot * D; vrows[t] = values + slot * D;
        }
        int64_t t = 0;
        for (; t + KT <= nk; t += KT) scores_keys<KT>(krows + t, qt.data(), Rp, D, pt.data() + t * Rp);
        for (; t < nk; ++t) scores_keys<1>(krows + t, qt.data(), Rp, D, pt.data() + t * Rp);
        // online softmax, every row at once across the lanes: p = exp(s - running max), what came before rescaled
        float *top = alpha.data();  // the new running max, then the factor for what came before
        #pragma omp simd
        for (int64_t r = 0; r < Rp; ++r) top[r] = m[r];
        const bool masked = c0 + nk - 1 > lowest;  // some key of the chunk lies after some row's position
        for (t = 0; t < nk; ++t) {
          float *row = pt.data() + t * Rp;
          const float kpos = (float)(c0 + t);
          if (masked) {
            #pragma omp simd
            for (int64_t r = 0; r < Rp; ++r) row[r] = kpos > pos[r] ? -INFINITY : row[r];
          }
          #pragma omp simd
          for (int64_t r = 0; r < Rp; ++r) top[r] = std::max(top[r], row[r]);
        }
        #pragma omp simd
        for (int64_t r = 0; r < Rp; ++r) {
          const float a = exp_nonpositive(m[r] - top[r]);
          m[r] = top[r]; l[r] *= a; top[r] = a;
        }
        for (t = 0; t < nk; ++t) {
          float *row = pt.data() + t * Rp;
          #pragma omp simd
          for (int64_t r = 0; r < Rp; ++r) {
            const float e = row[r] == -INFINITY ? 0.f : exp_nonpositive(row[r] - m[r]);
            row[r] = e; l[r] += e;
          }
        }
        int64_t r = 0;
        for (; r + OR <= Rp; r += OR) values_rows<OR>(pt.data() + r, Rp, vrows, nk, alpha.data() + r, o.data() + r * D, D);
        for (; r < Rp; ++r) values_rows<1>(pt.data() + r, Rp, vrows, nk, alpha.data() + r, o.data() + r * D, D);
      }
      for (int64_t r = 0; r < R; ++r) {
        float *dst = op + ((st[s] + task.i0 + r / G) * H + h * G + r % G) * D;
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < D; ++d) dst[d] = o[r * D + d] * inv;
      }
    }
  });
}
