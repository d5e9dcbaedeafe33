"""The Llama-family transformer in plain PyTorch: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3.

One file you can read in a sitting, in the spirit of gpt-fast. Two choices shape it:

* The model works on a *flat* list of tokens from many sequences (no padding): shape [T, ...].
  Each token carries its own position, so one forward pass can mix a 900-token prompt with
  single-token decodes of other requests. Which token belongs to which sequence is only the
  attention's business.
* Attention over past tokens is a pluggable backend (``labsupport.engine.attention``): the
  model computes q, k, v for the new tokens and hands them over. Recompute-everything, a
  contiguous KV cache and paged KV blocks are different backends; the model never changes.

The few operations a device runs faster (norms, RoPE, SiLU, the products) are called through a ``Kernels``
set whose default is the plain lines of this file; the engine picks a device's set once
(``kernels/select.py``), so no layer asks which device it is on.

Weight names equal Hugging Face's, so a ``model.safetensors`` loads with ``load_state_dict``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .model_config import ModelConfig
from .rope import rope_frequencies


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of each head by the token's angle. x: [T, heads, d]; cos/sin: [T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused operator, the lines below to the bit
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()  # normalise in float32 like the reference, so bf16 runs round the same way
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation on the stacked gate/up product [T, 2I]: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias, packed=None) -> torch.Tensor:
    """``x @ weight.T + bias``; ``packed`` is a device's own copy of the weight, which plain PyTorch ignores."""
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class Kernels:
    """The operations a device may run faster than the plain lines above, with the same results: the default is
    those lines; ``kernels/select.py`` picks a device's set once, when the engine is built (``use_kernels``)."""

    rms_norm: Callable = rms_norm
    rope_qk: Callable = rope_qk
    silu_mul: Callable = silu_mul
    linear: Callable = linear


def use_kernels(module: nn.Module, kernels: Kernels):
    """Every part of ``module`` that calls a kernel calls ``kernels``' from now on."""
    for m in module.modules():
        if isinstance(m, (Linear, RMSNorm, Attention, MLP)):
            m.kernels = kernels


class Linear(nn.Linear):
    """``nn.Linear`` (same weights, same names) whose product is the kernel set's (packed on a CPU)."""

    kernels = Kernels()
    packed = None  # a device's copy of the weight (kernels/products.pack_cpu_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.weight, self.bias, self.packed)


class RMSNorm(nn.Module):
    kernels = Kernels()

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    kernels = Kernels()

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(h, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * d, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv = None  # (weight, bias) of q, k, v stacked, if fuse_projections made them
        self.qkv_packed = None  # its packed copy on the CPU (kernels/products.pack_cpu_weights)

    def forward(self, x, cos, sin, backend, batch):
        t, d = x.shape[0], self.cfg.head_dim
        if stacked_current(self.qkv, self.q_proj, self.k_proj, self.v_proj):  # one product reads all three
            q, k, v = self.kernels.linear(x, *self.qkv, self.qkv_packed).split(
                [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.view(t, self.cfg.num_heads, d), k.view(t, self.cfg.num_kv_heads, d), v.view(t, self.cfg.num_kv_heads, d)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.kernels.rope_qk(q, k, cos, sin)
        out = backend.attend(self.layer, q, k, v, batch)  # [T, heads, d]
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    kernels = Kernels()

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up = None  # gate and up stacked, if fuse_projections made it
        self.gate_up_packed = None  # its packed copy on the CPU (kernels/products.pack_cpu_weights)

    def forward(self, x):
        if stacked_current((self.gate_up, None), self.gate_proj, self.up_proj):  # one product reads both
            gate_up = self.kernels.linear(x, self.gate_up, None, self.gate_up_packed)
            return self.down_proj(self.kernels.silu_mul(gate_up))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def stacked_current(stacked, *linears) -> bool:
    """Whether ``stacked`` (``fuse_projections``' (weight, bias)) still holds these modules' weights. A weight
    replaced since (a new Parameter) sends the modules back to their own products."""
    return stacked is not None and stacked[0] is not None and all(
        getattr(getattr(m, "weight", None), "_stacked", (None,))[0] is stacked[0] for m in linears)


def fuse_projections(model: nn.Module):
    """Stack q/k/v and gate/up into one matrix each, so a decode step makes 2 products instead of 5 per layer.

    A decode step's products are thin (a few rows against a wide matrix): each is bound by reading
    its weights, and small ones (k and v of a GQA model) read them far below the memory bandwidth.
    One stacked product reads them at full speed (what that saved on a GPU and a CPU: ``benchmarks/README.md``).
    The separate parameters become *views* of the stacked matrix, so the memory is not doubled and the weight
    names stay Hugging Face's. Weights shared between engines (``loader.shared_weights``) stack once, in the
    shared copy."""
    for attn, mlp in ((layer.self_attn, layer.mlp) for layer in model.model.layers):
        attn.qkv = _stack(attn.q_proj, attn.k_proj, attn.v_proj)
        mlp.gate_up = _stack(mlp.gate_proj, mlp.up_proj)[0]


def _stack(*linears: nn.Linear):
    """One matrix (and bias) of several ``nn.Linear``s, which become views of it."""
    weights = [m.weight for m in linears]
    # the shared copy already stacked: by another engine, or in the CPU's weights file (models/cpu_weights.py:
    # torch.save keeps a Parameter's attributes, so the views come back with their mark)
    base = getattr(weights[0], "_stacked", None)
    if base is None or any(getattr(w, "_stacked", None) is not base for w in weights):
        base = (torch.cat([w.detach() for w in weights]),
                torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None)
    rows = 0
    for m in linears:
        n = m.out_features
        m.weight = nn.Parameter(base[0][rows:rows + n], requires_grad=False)
        m.weight._stacked = base
        if base[1] is not None:
            m.bias = nn.Parameter(base[1][rows:rows + n], requires_grad=False)
        rows += n
    return base


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, backend, batch):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # made with an empty weight, not a random one: the model is built on "meta" and filled from the checkpoint
        # (or by random_model), and Embedding's random init on meta imports torch's compiler: a large import for nothing
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """``forward(token_ids, positions, backend, batch)`` -> hidden states of every token.

    ``logits(hidden)`` projects only the rows you ask for: during generation that is one row
    per sequence (its last token), which saves a [T, vocab] matmul on long prompts.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq, self.rope_scaling = rope_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def use_kernels(self, kernels: Kernels):
        """Run ``kernels`` (``kernels/select.py``'s choice for this device) instead of the plain lines."""
        use_kernels(self, kernels)

    def rope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        return (emb.cos() * self.rope_scaling).to(dtype), (emb.sin() * self.rope_scaling).to(dtype)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, backend, batch) -> torch.Tensor:
        x = self.model.embed_tokens(token_ids)
        cos, sin = self.rope_cos_sin(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, backend, batch)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
