// The vector type every kernel here is written with: sixteen floats where the build has AVX-512, eight with
// AVX2, else eight in the compiler's portable vectors (an Arm laptop). A kernel says ``vfma(a, b, c)`` once.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifdef __AVX512F__
using vec = __m512; constexpr int64_t W = 16;
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vset1(float a) { return _mm512_set1_ps(a); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vec a) { _mm512_storeu_ps(p, a); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__)
using vec = __m256; constexpr int64_t W = 8;
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vset1(float a) { return _mm256_set1_ps(a); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vec a) { _mm256_storeu_ps(p, a); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s); s = _mm_hadd_ps(s, s); return _mm_cvtss_f32(s);
}
#else
typedef float vec __attribute__((vector_size(32))); constexpr int64_t W = 8;
static inline vec vzero() { return vec{}; }
static inline vec vset1(float a) { return vec{} + a; }
static inline vec vload(const float *p) { vec a; __builtin_memcpy(&a, p, sizeof a); return a; }
static inline void vstore(float *p, vec a) { __builtin_memcpy(p, &a, sizeof a); }
static inline vec vmul(vec a, vec b) { return a * b; }
static inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
static inline float vsum(vec a) { float s = 0.f; for (int i = 0; i < 8; ++i) s += a[i]; return s; }
#endif

// exp(x) for x <= 0, written so the compiler vectorises the loops of a softmax or a SiLU (std::exp is a scalar call):
// x = n ln2 + r, |r| <= ln2 / 2; e^r by its degree-6 Taylor polynomial; 2^n written into the exponent bits.
static inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = std::fma(n, -0.693359375f, std::fma(n, 2.12194440e-4f, x));
  float p = 1.f / 720;
  p = std::fma(p, r, 1.f / 120); p = std::fma(p, r, 1.f / 24); p = std::fma(p, r, 1.f / 6);
  p = std::fma(p, r, 0.5f); p = std::fma(p, r, 1.f); p = std::fma(p, r, 1.f);
  const int32_t bits = ((int32_t)n + 127) << 23;
  float two_n; std::memcpy(&two_n, &bits, 4);
  return p * two_n;
}
