"""Small compiled C++ kernels for the model on the CPU, and the one way this package builds them.

A decode step of one sequence is mostly the products' weight reads (``cpu_products.py``); around them
each layer runs a dozen small operators on a few thousand numbers, where PyTorch spends its time in
dispatch, not arithmetic. These kernels do that work in one call each (``fused_kernels.py`` has their
twins for GPUs; what each saved, measured: ``benchmarks/README.md``):

**RoPE of q and k in one call** (``cpu_rope_qk``).
``apply_rope`` in PyTorch is about a dozen small operators for q and k together (slices, a negation,
a concatenation, broadcast products and sums), each a few microseconds of dispatch around almost no
arithmetic, in every layer of every step. One C++ loop does both rotations and writes q and k
contiguous, which the decode kernel
(``engine/cpu_attention.py``) reads without a copy. It computes exactly what ``apply_rope`` computes,
product by product and sum by sum (no fused multiply-add: ``-ffp-contract=off``), so its output is
bit-identical.

**RMSNorm in one pass** (``cpu_rms_norm``). A decode step calls the norm 61 times, so at one token
``F.rms_norm``'s dispatch outweighs its arithmetic; one C++ pass (the sum of squares in vector lanes, then
the scaling) is faster at one token and at prefill sizes too. Summing in lanes, its result differs from
the reference in the last bits (a few units in the last place); tokens are checked against transformers
as for every product.

**SiLU-and-multiply** (``cpu_silu_mul``) from the stacked gate/up product, with ``exp_nonpositive``
instead of a scalar ``exp`` call: one pass over the product instead of two over its strided halves.

**Building.** ``compile_cpu_extension`` compiles a source once per machine with
``torch.utils.cpp_extension`` (a C++ compiler, ``ninja``, 20-40 s; cached under
``~/.cache/torch_extensions``, one build per instruction set so a shared cache stays safe, and one per
Python environment: ninja rebuilds whenever the compile command changes, and two environments' commands
differ in their include paths, so two venvs sharing one folder would rebuild each other's every start).
The engine builds these kernels when it starts on a CPU, and ``python -m labsupport prepare`` ahead
of that, so no chapter waits on a compiler mid-step; a forward pass only uses what is already built.
Where nothing can be built (a laptop without a compiler), the reason is kept and PyTorch's code runs.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import time

import torch

# The vector type every kernel here is written with: sixteen floats where the build has AVX-512, eight with
# AVX2, else eight in the compiler's portable vectors (an Arm laptop). A kernel says ``vfma(a, b, c)`` once.
VECTORS = r"""#include <torch/extension.h>
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
"""

SOURCE = VECTORS + r"""#include <algorithm>
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

"""

_lock = threading.Lock()
_built: dict[str, tuple[object, str]] = {}  # name -> (module or None, why not)


def compile_cpu_extension(name: str, what: str, source: str, functions: list[str],
                          extra_cflags=()) -> tuple[object, str]:
    """Compile ``source`` (or load its cached build) once per process: (module, "") or (None, why not),
    the reason naming ``what`` was being built."""
    with _lock:
        if name not in _built:
            try:
                from torch.utils.cpp_extension import load_inline
                _put_ninja_on_path()
                cap = torch.backends.cpu.get_cpu_capability()  # one build per instruction set
                vector = ["-mavx2", "-mfma"] if cap in ("AVX2", "AVX512") else []  # 16 % faster than SSE2 here
                vector += ["-mavx512f"] if cap == "AVX512" else []  # VECTORS: sixteen floats wide
                module_name = f"labsupport_{name}_{cap.lower()}"
                module = load_inline(module_name, cpp_sources=[source], functions=functions,
                                     extra_cflags=["-O3", "-fopenmp", *vector, *extra_cflags],
                                     extra_ldflags=["-fopenmp"], build_directory=_build_directory(module_name),
                                     verbose=False)
                _built[name] = (module, "")
            except Exception as exc:  # no compiler, no headers, an unsupported platform: keep the PyTorch path
                _built[name] = (None, f"{what} could not be built ({type(exc).__name__}: {str(exc)[:300]})")
        return _built[name]


STALE_LOCK_S = 900  # a build takes a minute or two; a lock this old was left by a process killed mid-build


def _build_directory(module_name: str) -> str:
    """``~/.cache/torch_extensions/labsupport-<environment>/<module>`` (``TORCH_EXTENSIONS_DIR`` moves the root):
    one folder per Python environment, torch version and copy of this package, so that two venvs (a clone's CI
    run beside a working copy, a notebook kernel beside a terminal) or two checkouts sharing a venv never rebuild
    each other's extensions.

    torch's builder holds a ``lock`` file in the folder while it compiles, and every other process waits for
    it to go: a build killed midway (Ctrl-C, a timeout) leaves it behind and every later start waits forever.
    One older than ``STALE_LOCK_S`` is removed."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environment = hashlib.sha1(f"{sys.prefix}|{torch.__version__}|{package}".encode()).hexdigest()[:10]
    path = os.path.join(root, f"labsupport-{environment}", module_name)
    os.makedirs(path, exist_ok=True)
    lock = os.path.join(path, "lock")
    try:
        if time.time() - os.path.getmtime(lock) > STALE_LOCK_S:
            os.remove(lock)
    except OSError:
        pass  # no lock (the usual case), or another process removed it first
    return path


def _put_ninja_on_path():
    """The build runs ``ninja``: the pip package's copy (a dependency) is found even where the venv is not
    activated (``.venv/bin/python -m pytest``, a Jupyter kernel), where PATH has none of its own."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def build() -> tuple[bool, str]:
    """Build the model's CPU kernels now, these and ``cpu_products.py``'s in one extension, or say why they
    cannot be (then PyTorch's code runs)."""
    from . import cpu_products  # it imports this file for the build
    module, why_not = compile_cpu_extension(
        "cpu_model_kernels", "the CPU model kernels (RoPE, norms, products)", SOURCE + cpu_products.SOURCE,
        ["rope_qk", "rms_norm", "silu_mul", "thin_product", "panel_product", "vector_width"], ["-ffp-contract=off"])
    return module is not None, why_not


def extension():
    """The built extension of ``build()`` (these kernels and the products'), or None: not built (yet)."""
    return _built.get("cpu_model_kernels", (None,))[0]


def cpu_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``(apply_rope(q, cos, sin), apply_rope(k, cos, sin))`` in one call, or None where this kernel does not
    apply: not built yet (a forward pass never waits for a compiler), not float32 on the CPU, or autograd
    watching (the kernel has no backward)."""
    module = extension()
    if (module is None or q.device.type != "cpu" or q.dtype != torch.float32 or k.dtype != torch.float32
            or cos.dtype != torch.float32 or q.stride(-1) != 1 or k.stride(-1) != 1 or q.requires_grad or k.requires_grad):
        return None
    return module.rope_qk(q, k, cos.contiguous(), sin.contiguous())


def _applies(*tensors) -> bool:
    """Whether the element-wise kernels serve these tensors: float32 on the CPU, autograd not watching."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors) and not (
        torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """``F.rms_norm(x, (K,), weight, eps)`` in one C++ pass, or None where it does not apply (not built,
    not float32 on the CPU, autograd watching)."""
    module = extension()
    if module is None or not _applies(x, weight):
        return None
    return module.rms_norm(x.contiguous(), weight.contiguous(), eps)


def cpu_silu_mul(gate_up: torch.Tensor):
    """``silu(gate) * up`` of the stacked [T, 2I] gate/up product in one C++ pass, or None where it does not
    apply; the CPU's twin of ``fused_kernels.triton_silu_mul``."""
    module = extension()
    if module is None or gate_up.dim() != 2 or not _applies(gate_up):
        return None
    return module.silu_mul(gate_up.contiguous())
