"""Weight-only quantization: int8 per output channel, int4 per group of 32 inputs (chapter 09).

Why it can speed anything up: a decode step multiplies a few rows of activations by *every* weight
matrix, so its time is mostly the time to read the weights. In 8 or 4 bits they are 4x or 8x fewer
bytes than in float32; the activations stay in floating point ("weight-only").

* int8, symmetric per output row: ``w ~ q * scale[row]``, ``q`` in [-127, 127]; 255 levels cover a row.
* int4, per group of ``group_size`` inputs: ``w ~ (q - 8) * scale + zero``, ``q`` in [0, 15]. 16 levels
  are coarse, so each group gets its own range: asymmetric fits the group's min..max, symmetric
  (zero = 0) fits -absmax..absmax and wastes levels on one side.

The defaults, asymmetric groups of 32, are what ``python -m labsupport.bench.lab.quant`` and
``quantization_error`` found best on SmolLM2-135M-Instruct (128 does not divide its 576-wide rows; the
errors: ``benchmarks/README.md``). Part of that lead is particular to this model: its weights were
dequantized from a Q4_1 GGUF file (blocks of 32 inputs with a scale and a minimum), a grid that group 32
re-finds almost exactly; on the embedding (it is ``lm_head``), not on such a grid, group 32's lead is small.

The products run in torch's own kernels (``aten._weight_int8pack_mm``; ``_weight_int4pack_mm_for_cpu``
on the CPU, ``_weight_int4pack_mm`` on CUDA: gpt-fast's). Their fast paths take bfloat16 activations
(float32 ones take a scalar loop on the CPU, many times slower), so activations are rounded to
bfloat16 at each product and the result comes back in the model's dtype. Each module checks its kernel
on one row against the dequantized weights when built; a kernel missing or disagreeing falls back to
dequantize-then-matmul, and ``module.path`` (and ``quantize_model``'s report) says which path runs.

Weights are shared between engines of one model (``loader.shared_weights``): nothing here writes a
weight tensor; new tensors are built and modules are swapped, in this model only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SCALE_DTYPE = torch.bfloat16  # scales, zeros and kernel activations: the dtype the kernels take
# Rows above which a float32 int8 product dequantizes and uses float32 BLAS instead of the kernel. The
# CPU kernel costs the same per row at any batch, BLAS gets cheaper per row: the kernel wins at one row and
# loses by 32 (benchmarks/README.md has the figures).
KERNEL_MAX_ROWS = 16
METHODS = ("int8", "int4")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes int8 [N, K], scales [N])`` with ``weight ~ codes * scales[:, None]`` (symmetric, per row).
    Codes are rounded with the stored (bfloat16) scales, so dequantizing reproduces what was fitted."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-8).to(SCALE_DTYPE)
    codes = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales.float()[:, None]


def quantize_int4(weight: torch.Tensor, group_size: int = 32, symmetric: bool = False):
    """``(codes uint8 [N, K] in 0..15, scales [N, K/g], zeros [N, K/g])`` with, per group of ``group_size``
    inputs, ``weight ~ (codes - 8) * scale + zero`` (the kernels' form). Symmetric: zero = 0."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide the {k} inputs of a {n}x{k} matrix; "
                         f"choose one of {[g for g in (32, 64, 128, 256) if k % g == 0]}")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    if symmetric:  # levels -8..7 around 0; absmax / 7.5 keeps every weight within half a step
        scales = (w.abs().amax(dim=-1) / 7.5).clamp(min=1e-8).to(SCALE_DTYPE)
        zeros = torch.zeros_like(scales)
    else:  # levels spread over the group's own min..max
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=1e-8).to(SCALE_DTYPE)
        zeros = (low + 8 * scales.float()).to(SCALE_DTYPE)
    codes = torch.round((w - zeros.float()[..., None]) / scales.float()[..., None]) + 8
    return codes.clamp(0, 15).to(torch.uint8).reshape(n, k), scales, zeros


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = codes.shape
    groups = (codes.float().reshape(n, k // group_size, group_size) - 8) * scales.float()[..., None]
    return (groups + zeros.float()[..., None]).reshape(n, k)


def relative_error(weight: torch.Tensor, approx: torch.Tensor) -> float:
    """||W - Q(W)|| / ||W|| (Frobenius): one number per matrix, comparable across shapes."""
    w = weight.detach().float()
    return float((w - approx).norm() / w.norm().clamp(min=1e-12))


class _QuantizedLinear(nn.Module):
    """What both formats share: shape, bias, the choice of path and the one-row check of the kernel."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.uses_kernel, self.path = False, "dequantize + matmul"

    def _try_kernel(self, reference: torch.Tensor) -> bool:
        """Run the kernel on one row and compare with ``row @ reference.T``: False if it is missing here
        (a build without it, a shape it refuses) or disagrees."""
        seeded = torch.Generator(reference.device).manual_seed(0)  # leaves the global RNG (sampling) alone
        row = torch.randn(1, self.in_features, generator=seeded, device=reference.device).to(SCALE_DTYPE)
        try:
            got = self._kernel(row).float()
        except (RuntimeError, NotImplementedError):
            return False
        want = row.float() @ reference.T
        return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()) + 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not self.uses_kernel or (x.dtype == torch.float32 and rows.shape[0] > KERNEL_MAX_ROWS
                                    and self._can_dequantize_fast):
            out = F.linear(rows, self.dequantized_weight().to(x.dtype))
        else:
            out = self._kernel(rows.to(SCALE_DTYPE).contiguous()).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for name, t in self.named_buffers() if name != "bias")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, path={self.path!r}"


class Int8Linear(_QuantizedLinear):
    """int8 codes [N, K] and one scale per output row; ``aten._weight_int8pack_mm`` computes
    ``x @ (codes * scales).T`` straight from the codes."""

    _can_dequantize_fast = True  # the codes are a plain [N, K] matrix: one multiply gives the weight

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(codes.shape[1], codes.shape[0], bias)
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.to(SCALE_DTYPE).contiguous())
        if self._try_kernel(self.dequantized_weight()):
            self.uses_kernel, self.path = True, f"aten._weight_int8pack_mm ({codes.device.type}, bf16 activations)"

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scales)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_int8(self.codes, self.scales)


class Int4Linear(_QuantizedLinear):
    """int4 codes, two per byte, and a scale and zero per group of inputs. On the kernel path the bytes
    are in the kernel's own tiled layout (``_convert_weight_to_int4pack*``), readable only by it;
    otherwise they are plain nibbles (even column high) that ``dequantized_weight`` unpacks."""

    _can_dequantize_fast = False  # the tiled layout is the kernel's: every product goes through it

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None):
        super().__init__(codes.shape[1], codes.shape[0], bias)
        self.group_size = group_size
        # the kernels' scale-and-zero table: [K / group_size, N, 2]
        table = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(SCALE_DTYPE)
        self.register_buffer("scales_and_zeros", table)
        nibbles = ((codes[:, ::2] << 4) | codes[:, 1::2]).contiguous()  # uint8 [N, K / 2]
        self.register_buffer("packed", nibbles)
        try:
            self.packed = self._pack_for_kernel(codes, nibbles)
            kernel_ok = self._try_kernel(dequantize_int4(codes, scales, zeros, group_size))
        except (RuntimeError, NotImplementedError):  # a shape the packing refuses (N not a multiple of 16, ...)
            kernel_ok = False
        if kernel_ok:
            device = codes.device.type
            op = "_weight_int4pack_mm_for_cpu" if device == "cpu" else "_weight_int4pack_mm"
            self.uses_kernel, self.path = True, f"aten.{op} ({device}, bf16 activations)"
        else:
            self.packed = nibbles

    def _pack_for_kernel(self, codes: torch.Tensor, nibbles: torch.Tensor) -> torch.Tensor:
        if codes.device.type == "cpu":
            return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        inner_k_tiles = next((t for t in (8, 4, 2) if self.in_features % (t * 16) == 0), 2)
        return torch.ops.aten._convert_weight_to_int4pack(nibbles, inner_k_tiles)

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        op = (torch.ops.aten._weight_int4pack_mm_for_cpu if rows.device.type == "cpu"
              else torch.ops.aten._weight_int4pack_mm)
        return op(rows, self.packed, self.group_size, self.scales_and_zeros)

    def dequantized_weight(self) -> torch.Tensor:
        if self.uses_kernel:
            raise ValueError("the int4 weights are in the kernel's tiled layout; dequantize the codes "
                             "(quantize_int4 -> dequantize_int4) instead")
        codes = torch.stack([self.packed >> 4, self.packed & 15], dim=-1).reshape(self.out_features, -1)
        scales, zeros = self.scales_and_zeros.transpose(0, 1).unbind(-1)
        return dequantize_int4(codes, scales, zeros, self.group_size)


def _targets(model: nn.Module, include_lm_head: bool):
    """``(parent, attribute, name, linear)`` of every ``nn.Linear`` to replace, found before any swap."""
    found = []
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            name = f"{parent_name}.{attr}" if parent_name else attr
            if isinstance(child, nn.Linear) and (include_lm_head or name != "lm_head"):
                found.append((parent, attr, name, child))
    return found


def _quantize_linear(linear: nn.Linear, method: str, group_size: int, symmetric: bool, build: bool = True):
    """``(module or None, dequantized weight)``: the codes are fitted once and serve both."""
    if method == "int8":
        codes, scales = quantize_int8(linear.weight)
        module = Int8Linear(codes, scales, linear.bias) if build else None
        return module, dequantize_int8(codes, scales)
    codes, scales, zeros = quantize_int4(linear.weight, group_size, symmetric)
    module = Int4Linear(codes, scales, zeros, group_size, linear.bias) if build else None
    return module, dequantize_int4(codes, scales, zeros, group_size)


def quantization_error(model: nn.Module, method: str = "int8", group_size: int = 32, symmetric: bool = False,
                       include_lm_head: bool = True) -> dict[str, float]:
    """Relative error ``||W - Q(W)|| / ||W||`` of each matrix ``quantize_model`` would replace; changes nothing."""
    _check_method(method)
    return {name: relative_error(lin.weight, _quantize_linear(lin, method, group_size, symmetric, build=False)[1])
            for _, _, name, lin in _targets(model, include_lm_head)}


def _check_method(method: str):
    if method not in METHODS:
        raise ValueError(f"quantization method {method!r} is not one of {', '.join(METHODS)}")


@torch.no_grad()
def quantize_model(model: nn.Module, method: str = "int8", group_size: int = 32, symmetric: bool = False,
                   include_lm_head: bool = True) -> dict:
    """Replace the ``nn.Linear`` modules of ``model`` (q/k/v/o, gate/up/down, and ``lm_head`` unless
    ``include_lm_head=False``) by ``Int8Linear`` or ``Int4Linear``, in place; return a report.

    ``lm_head`` is included by default: it is a fifth of SmolLM2's weights, read at every decode step.
    Measured, int4 with a float ``lm_head`` is barely faster than float32; with it quantized, much
    faster, for a few task points. Tied to ``embed_tokens``, the quantized copy is new memory (the lookup
    keeps the float table), so the model holds more bytes but *reads* fewer per step.
    Projections stacked by ``fuse_projections`` are unstacked (``qkv``/``gate_up`` set to None):
    the quantized per-matrix modules then run. The model stops holding the checkpoint's shared float
    copy (``model.shared_weights``), so its float matrices are freed once no other engine uses them.
    Call this before the engine captures CUDA graphs (they would replay the float products)."""
    _check_method(method)
    targets = _targets(model, include_lm_head)
    if not targets:
        raise ValueError("the model has no float nn.Linear left to quantize (quantized already?)")
    if method == "int4":  # refuse before swapping anything: a half-quantized model helps nobody
        for _, _, name, linear in targets:
            if linear.in_features % group_size:
                raise ValueError(f"group_size {group_size} does not divide the {linear.in_features} inputs of "
                                 f"{name}; choose a divisor such as 32")
    for layer in getattr(getattr(model, "model", None), "layers", []):
        layer.self_attn.qkv, layer.mlp.gate_up = None, None
        layer.self_attn.qkv_packed, layer.mlp.gate_up_packed = None, None
    if getattr(model, "shared_weights", None) is not None:
        model.shared_weights = None  # let the float matrices go once no other engine of this model holds them
    bytes_before = bytes_after = 0
    errors, paths = [], {}
    for parent, attr, _, linear in targets:
        new, approx = _quantize_linear(linear, method, group_size, symmetric)
        bytes_before += linear.weight.numel() * linear.weight.element_size()
        bytes_after += new.weight_bytes()
        errors.append(relative_error(linear.weight, approx))
        paths[new.path] = paths.get(new.path, 0) + 1
        setattr(parent, attr, new)
    return {"method": method, "group_size": group_size if method == "int4" else None,
            "symmetric": symmetric if method == "int4" else True, "layers": len(targets),
            "lm_head": include_lm_head, "bytes_before": bytes_before, "bytes_after": bytes_after,
            "ratio": bytes_after / bytes_before, "paths": paths,
            "mean_relative_error": sum(errors) / len(errors), "max_relative_error": max(errors)}
