// The products x @ weight.T + bias for a few rows: thin (1-3 rows) and panel (4-128 rows) kernels
// (why, and their Python side: kernels/cpu_products.py).
#include "vectors.h"
#include <algorithm>
#include <vector>

// x [M, K] (a few rows), weight [N, K] row-major, bias [N] or empty -> x @ weight.T + bias, [M, N].
// Eight weight rows at a time, each streamed from memory once and dotted with every row of x.
torch::Tensor thin_product(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && K % W == 0 && N % 8 == 0 && weight.size(1) == K,
              "thin_product: unexpected inputs");
  auto out = torch::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  const float *bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float *op = out.data_ptr<float>();
  at::parallel_for(0, N / 8, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const float *r = wp + g * 8 * K;
      for (int64_t m = 0; m < M; ++m) {
        const float *xm = xp + m * K;
        vec a0 = vzero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t k = 0; k < K; k += W) {
          const vec xv = vload(xm + k);
          a0 = vfma(xv, vload(r + k), a0);         a1 = vfma(xv, vload(r + K + k), a1);
          a2 = vfma(xv, vload(r + 2 * K + k), a2); a3 = vfma(xv, vload(r + 3 * K + k), a3);
          a4 = vfma(xv, vload(r + 4 * K + k), a4); a5 = vfma(xv, vload(r + 5 * K + k), a5);
          a6 = vfma(xv, vload(r + 6 * K + k), a6); a7 = vfma(xv, vload(r + 7 * K + k), a7);
        }
        float *o = op + m * N + g * 8;
        o[0] = vsum(a0); o[1] = vsum(a1); o[2] = vsum(a2); o[3] = vsum(a3);
        o[4] = vsum(a4); o[5] = vsum(a5); o[6] = vsum(a6); o[7] = vsum(a7);
        if (bp) for (int i = 0; i < 8; ++i) o[i] += bp[g * 8 + i];
      }
    }
  });
  return out;
}

// Panels: weight [N, K] re-laid as [N / 2W][K][2W] (pack_panels), so the 2W outputs of a column block lie
// side by side for every k. A tile of R rows of x against one panel keeps R x 2W sums in registers (R = 12
// with AVX-512: 24 of its 32 registers), and each step of k broadcasts R numbers of x against two loads of
// the panel: 2R multiply-adds per two loads, where a dot product makes one per load.
constexpr int64_t MR = W == 16 ? 12 : 6;

template <int R>
static inline void panel_tile(const float *xt, int64_t K, const float *panel, const float *bias, float *out,
                              int64_t N) {
  vec acc[R][2];
  for (int m = 0; m < R; ++m) { acc[m][0] = vzero(); acc[m][1] = vzero(); }
  for (int64_t k = 0; k < K; ++k) {
    const vec w0 = vload(panel + k * 2 * W), w1 = vload(panel + k * 2 * W + W);
    for (int m = 0; m < R; ++m) {
      const vec xv = vset1(xt[k * R + m]);
      acc[m][0] = vfma(xv, w0, acc[m][0]);
      acc[m][1] = vfma(xv, w1, acc[m][1]);
    }
  }
  for (int m = 0; m < R; ++m) {
    if (bias) { acc[m][0] = acc[m][0] + vload(bias); acc[m][1] = acc[m][1] + vload(bias + W); }
    vstore(out + m * N, acc[m][0]); vstore(out + m * N + W, acc[m][1]);
  }
}

template <int R>
static void panel_rows(int64_t rows, const float *xt, int64_t K, const float *panel, const float *bias,
                       float *out, int64_t N) {  // the last tile of x may have fewer than MR rows
  if constexpr (R == 1) panel_tile<1>(xt, K, panel, bias, out, N);
  else if (rows == R) panel_tile<R>(xt, K, panel, bias, out, N);
  else panel_rows<R - 1>(rows, xt, K, panel, bias, out, N);
}

// x [M, K] contiguous, panels [N / 2W, K, 2W], bias [N] or empty -> x @ weight.T + bias, [M, N].
torch::Tensor panel_product(torch::Tensor x, torch::Tensor panels, c10::optional<torch::Tensor> bias) {
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), N = P * 2 * W;
  TORCH_CHECK(x.is_contiguous() && panels.is_contiguous() && panels.size(1) == K && panels.size(2) == 2 * W,
              "panel_product: unexpected inputs");
  auto out = torch::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *pp = panels.data_ptr<float>();
  const float *bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float *op = out.data_ptr<float>();
  const int64_t tiles = (M + MR - 1) / MR;
  std::vector<float> xt(tiles * MR * K);  // x in tiles of MR rows, each transposed: the R numbers of a k together
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = std::min<int64_t>(MR, M - t * MR);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t k = 0; k < K; ++k) xt[t * MR * K + k * rows + m] = xp[(t * MR + m) * K + k];
  }
  constexpr int64_t ROW_TILES = 8;  // rows in blocks of 8 tiles: x's block stays in cache across the panels
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = 0; t0 < tiles; t0 += ROW_TILES)
      for (int64_t j = begin; j < end; ++j)
        for (int64_t t = t0; t < std::min(tiles, t0 + ROW_TILES); ++t)
          panel_rows<MR>(std::min<int64_t>(MR, M - t * MR), xt.data() + t * MR * K, K, pp + j * K * 2 * W,
                         bp ? bp + j * 2 * W : nullptr, op + t * MR * N + j * 2 * W, N);
  });
  return out;
}

int64_t vector_width() { return W; }
