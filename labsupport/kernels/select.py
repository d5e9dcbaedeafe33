"""The one place that picks the kernels a model and its attention backend run, for a device and a dtype.

The model (``models/llama.py``) is plain PyTorch and calls its few replaceable operations through a
``Kernels`` set: ``Kernels()`` is the plain reference, what a model built by hand runs. The engine asks here
once, when it is built, and hands the answer to the model (``model.use_kernels``) and to the attention backend
(``PagedAttention`` asks ``attention`` below); no layer checks the device again at each call.

* ``cuda()``: Triton RoPE and SiLU-and-multiply (``triton_ops.py``), the fused RMSNorm, ``F.linear``.
* ``cpu()`` (float32): the C++ RoPE, RMSNorm and SiLU-and-multiply (``cpu_ops.py``) and the products routed by
  rows (``products.py``). Each steps back to the plain lines for an input it does not serve (autograd
  watching, not built yet), so the choice never changes what a model computes, only how fast.
* anything else: ``plain()``.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..models.llama import Kernels, apply_rope, rms_norm, silu_mul
from . import cpu_attention, cpu_ops, products


def plain() -> Kernels:
    """The reference: the lines of ``models/llama.py``, on any device."""
    return Kernels()


def cpu() -> Kernels:
    """The CPU's compiled kernels (``cpu_ops.build`` first, or they step back to the plain lines)."""
    return Kernels(rms_norm=_cpu_rms_norm, rope_qk=_cpu_rope_qk, silu_mul=_cpu_silu_mul, linear=products.product)


def cuda() -> Kernels:
    """A GPU's: the fused RMSNorm operator in every dtype, Triton RoPE and SiLU where Triton is installed."""
    triton = _triton_ops()
    if triton is None:
        return Kernels(rms_norm=_fused_rms_norm)
    return Kernels(rms_norm=_fused_rms_norm, rope_qk=_triton_rope_qk, silu_mul=triton.triton_silu_mul)


def select(device, dtype: torch.dtype) -> Kernels:
    """The model's kernels for ``device`` and ``dtype``: chosen once, when the engine is built."""
    kind = torch.device(device).type
    if kind == "cuda":
        return cuda()
    if kind == "cpu" and dtype == torch.float32:
        return cpu()
    return plain()


def attention(device, dtype: torch.dtype, head_dim: int, cpu_kernel: bool):
    """``(decode_attention, prefill_kernel)`` of a paged backend; None for either keeps ``paged_attention.py``'s
    PyTorch path. A GPU reads K/V in place with Triton; a CPU, if asked (``cpu_decode_kernel``) and a C++
    compiler built it, with the C++ kernels, for the float32 pools of whole vectors they serve."""
    kind = torch.device(device).type
    if kind == "cuda":
        from . import triton_attention  # imports triton only here, and only if it is installed
        return (triton_attention.triton_decode_attention if triton_attention.available(device) else None), None
    if kind != "cpu" or not cpu_kernel:
        return None, None
    if not cpu_attention.available()[0]:
        cpu_attention.warn_once_not_built()
        return None, None
    if not cpu_attention.kernel_applies(dtype, head_dim):
        return None, None
    return cpu_attention.cpu_decode_attention, cpu_attention.cpu_prefill_attention


def _cpu_rms_norm(x, weight, eps):
    normed = cpu_ops.cpu_rms_norm(x, weight, eps)
    return normed if normed is not None else rms_norm(x, weight, eps)


def _cpu_rope_qk(q, k, cos, sin):
    rotated = cpu_ops.cpu_rope_qk(q, k, cos, sin)
    return rotated if rotated is not None else (apply_rope(q, cos, sin), apply_rope(k, cos, sin))


def _cpu_silu_mul(gate_up):
    activated = cpu_ops.cpu_silu_mul(gate_up)
    return activated if activated is not None else silu_mul(gate_up)


def _fused_rms_norm(x, weight, eps):
    # one operator instead of six; in float32 bit-identical to the plain lines
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _triton_rope_qk(q, k, cos, sin):
    if q.shape[-1] not in (16, 32, 64, 128, 256):  # the kernel's head sizes: 2 x a power of two
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return _triton_ops().triton_rope_qk(q, k, cos, sin)


@functools.cache
def _triton_ops():
    from . import triton_ops  # imports triton only on a GPU, and only if it is installed
    return triton_ops if triton_ops.triton is not None else None
