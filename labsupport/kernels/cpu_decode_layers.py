"""Decode steps of one to three sequences on the CPU with each layer in one C++ call: the CPU's ``DecodeGraphs``.

At batch 1 a decode step is mostly reading the weights (the thin products, ``kernels/cpu_products.py``), and
around them each layer makes about twenty Python calls: module calls, the norm, RoPE and SiLU kernels, the
K/V writes, splits and views, the attention. Each costs one to a few microseconds, and more in a real step
than alone, because the weights streaming through the caches evict the interpreter's state: together they
are a large share of a batch-1 step (``benchmarks/README.md``: the breakdown, and what this file bought).
A GPU removes the same overhead by replaying a CUDA graph (``cuda_graphs.py``); a CPU has no graphs, so
``decode_layer`` (``kernels/csrc/decode_layer.cpp``) calls the very kernels the Python layer calls, in the
same order, from C++: one call per layer instead of twenty, the same tokens and logprobs.

The Python model (``models/llama.py``) stays the one description of the layer; this is a faster way to run
it, for the steps where nothing else may need to see inside a layer, and it steps aside otherwise:

* only decode-only steps of at most ``thin_rows()`` tokens (the products' thin kernel), float32;
* only Llama/Qwen2 layers as loaded (stacked q/k/v and gate/up, plain ``Linear`` products; a Qwen3 q/k norm, a
  quantized module or a q/k/v or gate/up weight replaced apart from its stack runs the Python layer, and any
  other weight or module replaced is read again before the next step: ``held_by``);
* only with the engine's own pieces: the C++ decode kernel, no KV connector (chapter 07's per-layer hooks),
  no attention function plugged in by an exercise;
* ``enforce_eager=True`` turns it off, as it turns CUDA graphs off on a GPU.

Its output equals the Python layers' bit for bit (``tests/test_cpu_decode_layers.py``): the same kernels,
compiled with the same flags, in the same order.
"""
from __future__ import annotations

import torch

from . import cpu_attention, cpu_products
from .jit import compile_extension
from ..engine.runner import EagerStep
from ..models.llama import LlamaForCausalLM, Linear, stacked_current

_module = None
_why_not: str | None = None


def available() -> tuple[bool, str]:
    """Build (or load the cached build of) the layer once per process, with the kernels it calls: (True, "") or
    (False, why not). The model kernels' flags (``-ffp-contract=off``) for all of it, as ``cpu_ops.build``."""
    global _module, _why_not
    if _module is None and _why_not is None:
        files = ["model_ops.cpp", "products.cpp", "paged_decode.cpp", "decode_layer.cpp"]
        _module, why_not = compile_extension("cpu_decode_layer", "the CPU decode layer", files, ["decode_layer"],
                                             ["-ffp-contract=off"])
        _why_not = why_not or None
    return _module is not None, _why_not or ""


class CpuDecodeLayers(EagerStep):
    """A CPU's step executor (``ModelRunner(executor=...)``): ``forward`` runs a decode-only step of at most
    ``thin_rows()`` tokens one C++ call per layer, any other step through the Python layers. Built only where
    the layer applies to the model and its pools at all (``applies``, asked once by ``engine/build.py``)."""

    def __init__(self, model: LlamaForCausalLM, backend):
        super().__init__(model, backend)
        self.num_steps = 0  # steps run here (the rest ran the Python layers)
        # Reading every layer's weights through their modules costs time each step, so they are kept, with where
        # they were read from (``held_by``), and read again only once one of those places holds something else.
        self._layers, self._held = None, None

    @staticmethod
    def applies(model: LlamaForCausalLM, backend) -> bool:
        """What does not change while an engine lives: the layer is built, the pools float32, the widths whole
        vectors, no Qwen3 q/k norm."""
        cfg = model.config
        return (available()[0] and bool(backend.k_pool) and backend.k_pool[0].dtype == torch.float32
                and cfg.head_dim % 16 == 0 and cfg.hidden_size % 16 == 0 and cfg.intermediate_size % 16 == 0
                and not cfg.qk_norm)

    def can_run(self, token_ids: torch.Tensor, batch) -> bool:
        """What a step or a chapter may change: a small decode-only step, the engine's own C++ decode attention
        (not an exercise's), no KV connector (chapter 07's per-layer hooks)."""
        be = self.backend
        return (0 < token_ids.shape[0] <= cpu_products.thin_rows() and batch.attn_metadata.decodes_only
                and be.decode_attention is cpu_attention.cpu_decode_attention and be.connector is None)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        hidden = self.run_layers(token_ids, positions, batch) if self.can_run(token_ids, batch) else None
        return hidden if hidden is not None else self.model(token_ids, positions, self.backend, batch)

    def layer_weights(self, layer) -> tuple | None:
        """What ``decode_layer`` reads of one layer, or None where the layer is not as loaded (a weight replaced,
        quantized or not float32, a product that is not a plain ``Linear``)."""
        a, mlp = layer.self_attn, layer.mlp
        if not (stacked_current(a.qkv, a.q_proj, a.k_proj, a.v_proj) and mlp.gate_up is not None
                and stacked_current((mlp.gate_up, None), mlp.gate_proj, mlp.up_proj)
                and type(a.o_proj) is Linear and type(mlp.down_proj) is Linear and a.o_proj.bias is None):
            return None
        weights = (layer.input_layernorm.weight, a.qkv[0], a.o_proj.weight, layer.post_attention_layernorm.weight,
                   mlp.gate_up, mlp.down_proj.weight)
        if any(w.dtype != torch.float32 or not w.is_contiguous() for w in weights):
            return None
        ln1, qkv, o, ln2, gate_up, down = weights
        return ln1, qkv, a.qkv[1], o, ln2, gate_up, down, layer.input_layernorm.eps, self.model.config.num_heads

    def run_layers(self, token_ids: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor | None:
        """The hidden states of the step, as ``LlamaForCausalLM.forward`` gives them, or None (nothing run,
        nothing written) where a layer is not as loaded: the caller runs the Python layers."""
        if self._held is None or any(place.get(name) is not obj for place, name, obj in self._held):
            self._held = held_by(self.model.model.layers)  # a weight or a module replaced (quantized, say): look again
            layers = [(layer.self_attn.layer, self.layer_weights(layer)) for layer in self.model.model.layers]
            self._layers = None if any(w is None for _, w in layers) else layers  # its pools' index, its weights
        if self._layers is None:
            return None
        x = self.model.model.embed_tokens(token_ids)
        cos, sin = self.model.rope_cos_sin(positions, x.dtype)
        meta, be = batch.attn_metadata, self.backend
        rows = meta.decode
        for i, weights in self._layers:  # (a draft model's layers have pools after the target's)
            x = _module.decode_layer(x, *weights, cos, sin, be.k_pool[i], be.v_pool[i], meta.slot_mapping,
                                     rows.block_tables, rows.context_lens, be.block_size)
        self.num_steps += 1
        return self.model.model.norm(x)


def held_by(layers: torch.nn.ModuleList) -> tuple[tuple[dict, str, object], ...]:
    """Where the layers' weights are held, as ``(dict, name, object)``: every parameter and submodule entry of every
    module of the layers (and the list's own entries), and the stacked q/k/v and gate/up matrices.

    Replacing a weight or a module (``linear.weight = Parameter(...)``, ``quantize_model``, an exercise's piece)
    puts something else in one of these entries, which a step sees by identity in one pass over them, without
    reading a weight. Scoped to this model: nothing is registered with PyTorch. A change in place
    (``weight.mul_(2)``) changes no entry and needs none: the C++ reads the same tensor."""
    held = [(layers._modules, name, layer) for name, layer in layers._modules.items()]
    for layer in layers:
        for module in layer.modules():
            held += [(entries, name, obj) for entries in (module._parameters, module._modules)
                     for name, obj in entries.items()]
        attn, mlp = layer.self_attn, layer.mlp
        held += [(attn.__dict__, "qkv", attn.qkv), (mlp.__dict__, "gate_up", mlp.gate_up)]
    return tuple(held)
