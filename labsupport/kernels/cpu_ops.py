"""Small compiled C++ kernels for the model on the CPU (``csrc/model_ops.cpp``): RoPE, RMSNorm, SiLU.

A decode step of one sequence is mostly the products' weight reads (``cpu_products.py``); around them
each layer runs a dozen small operators on a few thousand numbers, where PyTorch spends its time in
dispatch, not arithmetic. These kernels do that work in one call each (``triton_ops.py`` has their
twins for GPUs; what each saved, measured: ``benchmarks/README.md``):

**RoPE of q and k in one call** (``cpu_rope_qk``).
``apply_rope`` in PyTorch is about a dozen small operators for q and k together (slices, a negation,
a concatenation, broadcast products and sums), each a few microseconds of dispatch around almost no
arithmetic, in every layer of every step. One C++ loop does both rotations and writes q and k
contiguous, which the decode kernel
(``cpu_attention.py``) reads without a copy. It computes exactly what ``apply_rope`` computes,
product by product and sum by sum (no fused multiply-add: ``-ffp-contract=off``), so its output is
bit-identical.

**RMSNorm in one pass** (``cpu_rms_norm``). A decode step calls the norm 61 times, so at one token
``F.rms_norm``'s dispatch outweighs its arithmetic; one C++ pass (the sum of squares in vector lanes, then
the scaling) is faster at one token and at prefill sizes too. Summing in lanes, its result differs from
the reference in the last bits (a few units in the last place); tokens are checked against transformers
as for every product.

**SiLU-and-multiply** (``cpu_silu_mul``) from the stacked gate/up product, with ``exp_nonpositive``
instead of a scalar ``exp`` call: one pass over the product instead of two over its strided halves.

**Building.** ``build()`` compiles ``csrc/model_ops.cpp`` and ``csrc/products.cpp`` into one extension
(``jit.py``: once per machine); until it has, or where it cannot, every function here answers None and
PyTorch's code runs.
"""
from __future__ import annotations

import torch

from . import jit

NAME = "cpu_model_kernels"  # the extension: these kernels and the products' (cpu_products.py)


def build() -> tuple[bool, str]:
    """Build the model's CPU kernels now, these and ``cpu_products.py``'s in one extension, or say why they
    cannot be (then PyTorch's code runs)."""
    module, why_not = jit.compile_extension(
        NAME, "the CPU model kernels (RoPE, norms, products)", ["model_ops.cpp", "products.cpp"],
        ["rope_qk", "rms_norm", "silu_mul", "thin_product", "panel_product", "vector_width"], ["-ffp-contract=off"])
    return module is not None, why_not


def extension():
    """The built extension of ``build()`` (these kernels and the products'), or None: not built (yet)."""
    return jit.built(NAME)


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
    apply; the CPU's twin of ``triton_ops.triton_silu_mul``."""
    module = extension()
    if module is None or gate_up.dim() != 2 or not _applies(gate_up):
        return None
    return module.silu_mul(gate_up.contiguous())
