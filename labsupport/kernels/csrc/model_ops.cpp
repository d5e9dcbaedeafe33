// The model's small operators in one call each: RoPE of q and k, RMSNorm, SiLU-and-multiply
// (why, and their Python side: kernels/cpu_ops.py).
#include "vectors.h"
#include <algorithm>
#include <vector>

// q [T, H, D], k [T, Hkv, D] (any strides but the last), cos/sin [T, D] contiguous -> q, k rotated, contiguous.
// Each half-pair (d, d + D/2) turns by the token's angle: x * cos + rotate_half(x) * sin, as apply_rope.
std::vector<torch::Tensor> rope_qk(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  const int64_t T = q.size(0), H = q.size(1), Hkv = k.size(1), D = q.size(2), half = D / 2;
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous() && D % 2 == 0
              && k.size(2) == D && cos.size(0) == T && cos.size(1) == D, "rope_qk: unexpected inputs");
  auto q_out = torch::empty({T, H, D}, q.options()), k_out = torch::empty({T, Hkv, D}, k.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qo = q_out.data_ptr<float>(), *ko = k_out.data_ptr<float>();
  auto rotate = [&](const float *x, float *y, const float *c, const float *s) {
    for (int64_t d = 0; d < half; ++d) {
      const float lo = x[d], hi = x[d + half];
      y[d] = lo * c[d] + (-hi) * s[d];
      y[d + half] = hi * c[d + half] + lo * s[d + half];
    }
  };
  const int64_t grain = std::max<int64_t>(1, 16384 / ((H + Hkv) * D));  // a decode step's few tokens: one thread
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = cp + t * D, *s = sp + t * D;
      for (int64_t h = 0; h < H; ++h) rotate(qp + t * q.stride(0) + h * q.stride(1), qo + (t * H + h) * D, c, s);
      for (int64_t h = 0; h < Hkv; ++h) rotate(kp + t * k.stride(0) + h * k.stride(1), ko + (t * Hkv + h) * D, c, s);
    }
  });
  return {q_out, k_out};
}


// x [M, K] (any K), weight [K] -> x / sqrt(mean(x^2) + eps) * weight: one pass over a row for the sum of squares,
// one to scale it. A decode step's few rows run on one thread (a thread pool wakes in more time than this takes).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  const int64_t K = x.size(-1), M = x.numel() / std::max<int64_t>(K, 1);
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.numel() == K, "rms_norm: unexpected inputs");
  auto out = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *op = out.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float *r = xp + m * K;
      float *o = op + m * K;
      vec acc = vzero();
      int64_t k = 0;
      for (; k + W <= K; k += W) { const vec a = vload(r + k); acc = vfma(a, a, acc); }
      float sum = vsum(acc);
      for (int64_t j = k; j < K; ++j) sum += r[j] * r[j];
      const float inv = 1.f / std::sqrt(sum / K + (float)eps);
      const vec iv = vset1(inv);
      for (k = 0; k + W <= K; k += W) vstore(o + k, vmul(vmul(vload(r + k), iv), vload(wp + k)));
      for (int64_t j = k; j < K; ++j) o[j] = r[j] * inv * wp[j];
    }
  });
  return out;
}

// gate_up [M, 2I] (gate, then up: fuse_projections' stack) -> silu(gate) * up, [M, I]; exp by exp_nonpositive.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(1) == 2 * I, "silu_mul: unexpected inputs");
  auto out = torch::empty({M, I}, gate_up.options());
  const float *gp = gate_up.data_ptr<float>();
  float *op = out.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float *g = gp + m * 2 * I, *u = g + I;
      float *o = op + m * I;
      #pragma omp simd
      for (int64_t i = 0; i < I; ++i) {  // sigmoid(a) = 1 / (1 + e^-a) = e^a / (1 + e^a): e^-|a| either way
        const float a = g[i], e = exp_nonpositive(-std::fabs(a));
        o[i] = a * (a >= 0.f ? 1.f / (1.f + e) : e / (1.f + e)) * u[i];
      }
    }
  });
  return out;
}

