"""The products' compiled C++ kernels on the CPU (``csrc/products.cpp``): ``x @ weight.T + bias`` for the few
rows of a decode step.

``kernels/products.py`` routes each product to these or to oneDNN, by the number of rows, where each was
measured to be faster (``benchmarks/README.md``: the figures, Zen 5 with AVX-512, default model, float32):

**Thin products** (``thin_product``): ``x @ weight.T`` for one to three rows of ``x``, a decode step of
one to three sequences. Such a product only streams its weight from memory (SmolLM2's 538 MB over the
model's 121 products), so the rate it reads the weight is its speed. Eight weight rows at a time, each
read once and dotted with every row of ``x`` from registers, read it faster than oneDNN's packed path;
from four rows on, oneDNN's blocking wins (AVX2 builds: up to two rows). The sum runs in a
different order from oneDNN's, as oneDNN's differs from the default BLAS: tokens are checked
against transformers as for every product.

**Panel products** (``panel_product``): four to 128 rows, a decode step of a batch or a short chunk. The
weight is re-laid once as panels of 32 columns (``pack_panels``: [N / 32, K, 32]), so for each ``k`` a
tile of 12 rows of ``x`` multiplies two vector loads of the panel by 12 broadcast numbers, 24
multiply-adds into sums kept in registers (AVX2: 6 rows x 16 columns). Against oneDNN on its own packed
copy it is faster up to about 64 rows; at 128 it is slower than that copy but still a little faster than
oneDNN on the plain weight, and slower beyond: hence ``PANEL_ROWS`` below.

They are compiled into the same extension as ``cpu_ops.py``'s (one build: ``cpu_ops.build``).
"""
from __future__ import annotations

import torch

from . import cpu_ops

PANEL_ROWS = 128  # rows up to which panel_product beats oneDNN on the plain weight (measured, see above)
# Rows up to which thin_product beats oneDNN, by vector width: 3 with AVX-512, 2 with AVX2 (measured, see above);
# none with the portable vectors (unmeasured: an Arm laptop keeps PyTorch's products).
_THIN_ROWS = {16: 3, 8: 2}
_X86 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def thin_rows() -> int:
    """Rows up to which ``thin_product`` beats oneDNN: 3 with AVX-512, 2 with AVX2, none elsewhere or unbuilt."""
    module = cpu_ops.extension()
    return _THIN_ROWS.get(module.vector_width(), 0) if module is not None and _X86 else 0


def thin_product(x: torch.Tensor, weight: torch.Tensor, bias):
    """``x @ weight.T + bias`` streamed by the C++ kernel, or None where it does not apply: not built, more
    rows than ``thin_rows()``, not float32 on the CPU, shapes off its vector width, or autograd watching."""
    module = cpu_ops.extension()
    if (module is None or x.dim() != 2 or not 0 < x.shape[0] <= thin_rows()
            or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
            or x.shape[1] % 16 or weight.shape[0] % 8 or not x.is_contiguous() or not weight.is_contiguous()
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return None
    return module.thin_product(x, weight, bias)


def panel_width() -> int:
    """Columns of a panel in this build (``2 * vector width``: 32 with AVX-512, 16 with AVX2), 0 where the
    kernels are not built or not measured (products then keep oneDNN's packed copies)."""
    module = cpu_ops.extension()
    return 2 * module.vector_width() if module is not None and thin_rows() else 0


def pack_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [N, K] as panels [N / width, K, width] for ``panel_product``, or None where it cannot be."""
    width = panel_width()
    if not width or weight.dim() != 2 or weight.shape[0] % width or weight.dtype != torch.float32:
        return None
    n, k = weight.shape
    return weight.detach().reshape(n // width, width, k).transpose(1, 2).contiguous()


def panel_product(x: torch.Tensor, panels: torch.Tensor, bias):
    """``x @ weight.T + bias`` from the weight's panels, or None where this kernel does not apply: not built,
    more rows than ``PANEL_ROWS``, not float32, or autograd watching."""
    module = cpu_ops.extension()
    if (module is None or x.dim() != 2 or not 0 < x.shape[0] <= PANEL_ROWS or x.dtype != torch.float32
            or x.device.type != "cpu" or x.shape[1] != panels.shape[1] or panels.shape[2] != panel_width()
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))
            or (torch.is_grad_enabled() and x.requires_grad)):
        return None
    return module.panel_product(x.contiguous(), panels, bias)
