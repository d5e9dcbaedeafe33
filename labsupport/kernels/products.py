"""How the model's products ``x @ weight.T + bias`` run on a CPU in float32: which path for which rows and layout.

Almost all of a forward pass is these products (121 of them in a SmolLM2 step), and on a CPU in float32
the fastest path depends on how many rows ``x`` has (measured, the model's products one after another
and whole decode steps: ``benchmarks/README.md``):

* **1-3 rows** (a decode step of one to three sequences): the C++ kernel that streams each weight row
  once (``kernels/cpu_products.thin_product``), reading the plain weight.
* **4-128 rows** (decode steps of a batch, short chunks): the C++ panel kernel (``cpu_products.panel_product``)
  on a copy of the weight re-laid as panels, made once when the model loads (``pack_cpu_weights``). It
  keeps a 12 x 32 block of sums in registers, and beats oneDNN's own packed copy, which packs for 32
  rows and at 33-64 does the work of 64.
* **More rows** (prefill): oneDNN on the plain weight, faster than ``F.linear`` with this torch build.
  Its packed copy is a little faster in the products alone, but whole runs with that copy kept beside the
  panels did not move beyond the machine's noise, so the panels take its place rather than the memory twice.

Where the C++ kernels are not built (no compiler) or a weight's rows are not a whole number of panels,
the copy is oneDNN's packed layout instead, used at every size, as before the panels. Autograd, GPUs and
other dtypes take ``F.linear``. Every path sums in its own order: tokens are checked against transformers
as for any product (``tests/test_cpu_kernels.py``, ``tests/test_parity.py``).
"""
from __future__ import annotations

import platform

import torch
import torch.nn.functional as F
from torch import nn

from ..models.llama import Linear
from . import cpu_products

# oneDNN's fp32 matmul, where this torch build has it (x86 CPUs): faster than the default BLAS path,
# the 49152-wide LM head of a decode step most (benchmarks/README.md has the figures). Only where it
# was measured: x86 (an Arm laptop keeps F.linear).
_onednn_linear = (getattr(torch.ops.mkldnn, "_linear_pointwise", None)
                  if torch.backends.mkldnn.is_available() and platform.machine().lower() in ("x86_64", "amd64") else None)


def product(x: torch.Tensor, weight: torch.Tensor, bias, packed=None) -> torch.Tensor:
    """``x @ weight.T + bias`` by the path above for its rows; ``packed`` is ``pack_weight``'s copy, used
    while it is still the weight's (not written or replaced since)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return F.linear(x, weight, bias)  # autograd watching: oneDNN's product and ours have no backward
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    streamed = cpu_products.thin_product(x, weight, bias)  # 1-3 rows: the C++ kernel, if built
    if streamed is not None:
        return streamed
    if packed is not None:
        copy, ptr, version = packed
        if weight.data_ptr() == ptr and weight._version == version:
            if copy.is_mkldnn:  # oneDNN's packed layout
                return _onednn_linear(x, copy, bias, "none", [], "")
            blocked = cpu_products.panel_product(x, copy, bias)  # None past PANEL_ROWS rows, or not built
            if blocked is not None:
                return blocked
    if _onednn_linear is not None and x.dim() == 2:
        return _onednn_linear(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def packed_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """A float32 CPU weight's copy for ``product``: panels where the C++ kernels are built and the rows fill
    whole panels, else oneDNN's packed layout on x86 (an opaque ``is_mkldnn`` tensor); None elsewhere."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    panels = cpu_products.pack_panels(weight)
    if panels is not None or _onednn_linear is None:
        return panels
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)


def pack_weight(weight: torch.Tensor, copy: torch.Tensor | None):
    """``product``'s ``packed`` argument: ``copy`` (``packed_copy(weight)``) and what identifies the weight it
    was made from, so a weight written or replaced since is noticed."""
    return None if copy is None else (copy, weight.data_ptr(), weight._version)


def pack_cpu_weights(model: nn.Module, cache: dict):
    """Give every fp32 product on the CPU a copy of its weight in the layout its fast path reads.

    A plain [out, in] matrix makes a blocked product re-lay the weight as it goes; packed once, a product
    streams it in the order its kernel reads (the figures: ``benchmarks/README.md``). The copy costs the
    matrices' size again, once per process: ``cache`` is kept by the shared weights (``loader.shared_weights``), so
    every engine of the model uses the same copies. Matrices stacked by ``fuse_projections`` are packed as
    the stack. A weight written or replaced afterwards is noticed (its version or address changes) and its
    product goes back to the plain path. The layout is chosen by what is built now: the engine builds the
    C++ kernels before it loads the model. The model's stacks are found by their attributes (``llama.Attention``'s
    ``qkv``, ``llama.MLP``'s ``gate_up``)."""

    def packed(key, w):
        if key not in cache:
            cache[key] = packed_copy(w)
        return pack_weight(w, cache[key])

    for name, m in model.named_modules():
        if isinstance(m, Linear) and getattr(m.weight, "_stacked", None) is None:  # a stacked one: read as the stack
            m.packed = packed(name, m.weight)
        elif getattr(m, "qkv", None) is not None:
            m.qkv_packed = packed(name + ".qkv", m.qkv[0])
        elif getattr(m, "gate_up", None) is not None:
            m.gate_up_packed = packed(name + ".gate_up", m.gate_up)
