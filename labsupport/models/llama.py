"""The Llama-family transformer in plain PyTorch: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3.

One file you can read in a sitting, in the spirit of gpt-fast. Two choices shape it:

* The model works on a *flat* list of tokens from many sequences (no padding): shape [T, ...].
  Each token carries its own position, so one forward pass can mix a 900-token prompt with
  single-token decodes of other requests. Which token belongs to which sequence is only the
  attention's business.
* Attention over past tokens is a pluggable backend (``labsupport.engine.attention``): the
  model computes q, k, v for the new tokens and hands them over. Recompute-everything, a
  contiguous KV cache and paged KV blocks are different backends; the model never changes.

Weight names equal Hugging Face's, so a ``model.safetensors`` loads with ``load_state_dict``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_ops
from ..kernels.products import Linear, product


@dataclass
class ModelConfig:
    """The handful of numbers a Llama-family model is made of (read from a HF ``config.json``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": "llama3"|"yarn"|"linear", ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    model_type: str = "llama"

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from a ``config.json`` dict (transformers 4.x ``rope_scaling`` or 5.x ``rope_parameters``)."""
        model_type = hf.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2", "qwen3"):
            raise ValueError(f"model_type {model_type!r} is not a Llama/Mistral/Qwen2/Qwen3 model; "
                             "choose a checkpoint of one of those families")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            model_type=model_type,
        )


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of rotary embeddings and the attention scaling, for each RoPE variant.

    Long-context models stretch the low frequencies so positions beyond the training length
    still look familiar: Llama 3 scales by wavelength band, YaRN blends interpolation and
    extrapolation per dimension and rescales attention, "linear" divides all positions.
    """
    dim, base = cfg.head_dim, cfg.rope_theta
    # on the CPU whatever the default device: a model is built on "meta", where this arithmetic would import
    # torch's compiler (~900 modules, ~50 MB a process) for numbers nobody reads (load_model sets its own)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    s = cfg.rope_scaling
    kind = s.get("rope_type", s.get("type", "default"))
    scaling = 1.0
    if kind == "linear":
        inv_freq = inv_freq / s["factor"]
    elif kind == "llama3":
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
        inv_freq = torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind == "yarn":
        factor = s["factor"]
        old_len = s.get("original_max_position_embeddings") or cfg.max_position_embeddings
        beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

        def correction_dim(rotations):
            return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv_freq = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
        scaling = s.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    elif kind != "default":
        raise ValueError(f"RoPE type {kind!r} is not supported (default, linear, llama3, yarn are)")
    return inv_freq.float(), float(scaling)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of each head by the token's angle. x: [T, heads, d]; cos/sin: [T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``apply_rope`` to q and k; on a GPU one Triton kernel does both (``kernels/triton_ops.py``), on a CPU one C++
    loop once the engine has built it (``kernels/cpu_ops.py``: bit-identical, a millisecond off a decode step)."""
    if q.is_cuda and _gpu_kernels() is not None and q.shape[-1] in (16, 32, 64, 128, 256):
        return _gpu_kernels().triton_rope_qk(q, k, cos, sin)
    rotated = cpu_ops.cpu_rope_qk(q, k, cos, sin)  # None where it does not apply (a GPU, bf16, autograd)
    return rotated if rotated is not None else (apply_rope(q, cos, sin), apply_rope(k, cos, sin))


@functools.cache
def _gpu_kernels():
    from ..kernels import triton_ops as fused_kernels  # imports triton only on a GPU, and only if it is installed
    return fused_kernels if fused_kernels.triton is not None else None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused operator instead of six: on an H200 decode step of an 8B model 12 % faster; on the 2-core CPU
        # 10 instead of 20 us per call at one token (61 calls a step); in float32 its output is bit-identical to
        # the lines below. On the CPU in float32 a C++ pass is faster again (1-2 us; kernels/cpu_ops.py), equal to
        # them within 1e-6 relative; in bf16 the lines below round like the reference.
        if x.dtype == torch.float32 and not x.is_cuda:
            normed = cpu_ops.cpu_rms_norm(x, self.weight, self.eps)
            if normed is not None:
                return normed
        if x.is_cuda or x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in float32 like the reference, so bf16 runs round the same way.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
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
        self.qkv_packed = None  # its packed copy on the CPU (products.pack_cpu_weights)

    def forward(self, x, cos, sin, backend, batch):
        t, d = x.shape[0], self.cfg.head_dim
        if stacked_current(self.qkv, self.q_proj, self.k_proj, self.v_proj):  # one product reads all three
            q, k, v = product(x, *self.qkv, self.qkv_packed).split(
                [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.view(t, self.cfg.num_heads, d), k.view(t, self.cfg.num_kv_heads, d), v.view(t, self.cfg.num_kv_heads, d)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope_qk(q, k, cos, sin)
        out = backend.attend(self.layer, q, k, v, batch)  # [T, heads, d]
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up = None  # gate and up stacked, if fuse_projections made it
        self.gate_up_packed = None  # its packed copy on the CPU (products.pack_cpu_weights)

    def forward(self, x):
        if stacked_current((self.gate_up, None), self.gate_proj, self.up_proj):
            if x.is_cuda and _gpu_kernels() is not None:
                return self.down_proj(_gpu_kernels().triton_silu_mul(F.linear(x, self.gate_up)))
            gate_up = product(x, self.gate_up, None, self.gate_up_packed)
            activated = cpu_ops.cpu_silu_mul(gate_up)
            if activated is None:
                gate, up = gate_up.chunk(2, dim=-1)
                activated = F.silu(gate) * up
            return self.down_proj(activated)
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
    One stacked product reads them at full speed: on an H200, 6 % off an 8B decode step; on a 2-core
    EPYC, packed (``products.pack_cpu_weights``), 5-15 % off a layer's products at 1-32 rows. The separate
    parameters become *views* of the stacked matrix, so the memory is not doubled and the weight names
    stay Hugging Face's. Weights shared between engines (``loader.shared_weights``) stack once, in the
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
        # (or by random_model), and Embedding's random init on meta imports torch's compiler: ~900 modules, ~50 MB
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
