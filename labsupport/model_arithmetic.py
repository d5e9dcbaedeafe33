"""Mixture-of-experts and MLA arithmetic from real published configurations ("compute less").

A mixture of experts (MoE) keeps many feed-forward "experts" per layer and sends each token to
only ``top_k`` of them. Every expert stays in memory, but each token pays compute for only a few:
DeepSeek-V3 holds 671B parameters yet spends about 37B per token. Multi-head latent attention
(MLA) shrinks the other big memory cost, the KV cache, by caching one small latent vector per
token and layer instead of a key and a value per head.

The numbers below are copied from each model's public Hugging Face ``config.json`` (the field
names in the comments are the config's). Nothing is downloaded and no model is loaded: parameter
counts are rebuilt from the shapes and checked against the published totals in the tests.
KV-cache and weight bytes, the memory budget, GPU and dtype sizes are chapter 01's
(:mod:`labsupport.kv_memory`, reached through :func:`to_facts`), so both chapters count a token
of cache the same way; this module adds only what a mixture of experts brings.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

import numpy as np

from . import data
from . import kv_memory as kvm
from .kv_memory import DTYPE_BYTES, GPUS, USABLE_FRACTION, KiB

H200_BYTES = GPUS["140 GiB (H200)"]  # the card this chapter sizes things on
# As usually quoted: NVLink 4 on an H200 900 GB/s (both directions), one InfiniBand NDR port 50 GB/s.
LINKS = {"NVLink (900 GB/s)": 900e9, "InfiniBand 400 Gb/s (50 GB/s)": 50e9}


@dataclass(frozen=True)
class ModelSpec:
    """The shapes that decide parameters, KV cache and expert traffic. Zero means "not used"."""

    name: str
    source: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # query/key width per head (MLA: qk_nope_head_dim + qk_rope_head_dim)
    intermediate_size: int  # width of a dense MLP layer
    published_total_b: float
    published_active_b: float
    v_head_dim: int = 0  # value width per head when it differs from head_dim
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm on each query and key head
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0  # experts every token goes through, beside the routed ones
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0  # leading layers that keep a dense MLP
    q_lora_rank: int = 0  # MLA: queries go through a low-rank bottleneck too
    kv_lora_rank: int = 0  # MLA: width of the cached latent
    qk_rope_head_dim: int = 0  # MLA: the decoupled RoPE key, cached beside the latent

    @property
    def attention(self) -> str:
        if self.kv_lora_rank:
            return "MLA"
        return {self.num_attention_heads: "MHA", 1: "MQA"}.get(self.num_key_value_heads, "GQA")

    @property
    def moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace if self.n_routed_experts else 0

    @property
    def value_dim(self) -> int:
        return self.v_head_dim or self.head_dim


MODELS: dict[str, ModelSpec] = {m.name: m for m in [
    # deepseek-ai/DeepSeek-V3 config.json: qk_nope_head_dim 128 + qk_rope_head_dim 64 = 192-wide keys,
    # v_head_dim 128, moe_layer_freq 1. The multi-token-prediction layer (num_nextn_predict_layers 1,
    # ~14B) is not part of the published 671B and is left out.
    ModelSpec("DeepSeek-V3", "deepseek-ai/DeepSeek-V3 config.json", vocab_size=129280, hidden_size=7168,
              num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, head_dim=192,
              v_head_dim=128, intermediate_size=18432, n_routed_experts=256, num_experts_per_tok=8,
              n_shared_experts=1, moe_intermediate_size=2048, first_k_dense_replace=3, q_lora_rank=1536,
              kv_lora_rank=512, qk_rope_head_dim=64, published_total_b=671, published_active_b=37),
    # Qwen/Qwen3-235B-A22B config.json: num_experts 128, num_experts_per_tok 8, decoder_sparse_step 1,
    # mlp_only_layers [] (every layer is MoE; intermediate_size 12288 is unused).
    ModelSpec("Qwen3-235B-A22B", "Qwen/Qwen3-235B-A22B config.json", vocab_size=151936, hidden_size=4096,
              num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
              intermediate_size=12288, qk_norm=True, n_routed_experts=128, num_experts_per_tok=8,
              moe_intermediate_size=1536, published_total_b=235, published_active_b=22),
    # Qwen/Qwen3-30B-A3B config.json (same layout, smaller).
    ModelSpec("Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B config.json", vocab_size=151936, hidden_size=2048,
              num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
              intermediate_size=6144, qk_norm=True, n_routed_experts=128, num_experts_per_tok=8,
              moe_intermediate_size=768, published_total_b=30.5, published_active_b=3.3),
    # mistralai/Mixtral-8x7B-v0.1 config.json: num_local_experts 8, num_experts_per_tok 2; each expert
    # is a full MLP of intermediate_size 14336.
    ModelSpec("Mixtral-8x7B", "mistralai/Mixtral-8x7B-v0.1 config.json", vocab_size=32000, hidden_size=4096,
              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
              intermediate_size=14336, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336,
              published_total_b=46.7, published_active_b=12.9),
    ModelSpec("Llama-3.1-70B", "meta-llama/Llama-3.1-70B config.json", vocab_size=128256, hidden_size=8192,
              num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
              intermediate_size=28672, published_total_b=70.6, published_active_b=70.6),
    ModelSpec("Llama-3.1-8B", "meta-llama/Llama-3.1-8B config.json", vocab_size=128256, hidden_size=4096,
              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
              intermediate_size=14336, published_total_b=8.03, published_active_b=8.03),
    ModelSpec("Llama-2-7B", "meta-llama/Llama-2-7b-hf config.json", vocab_size=32000, hidden_size=4096,
              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
              intermediate_size=11008, published_total_b=6.74, published_active_b=6.74),
]}


def _spec(cfg: ModelSpec | str) -> ModelSpec:
    return MODELS[cfg] if isinstance(cfg, str) else cfg


def attention_params_per_layer(cfg: ModelSpec | str) -> int:
    """Projection weights of one attention layer.

    Standard attention: q and o are ``hidden x heads x head_dim``, k and v ``hidden x kv_heads x dim``.
    MLA replaces them with low-rank pairs: queries via ``q_a`` (hidden -> q_lora_rank) and ``q_b``
    (-> heads x 192), keys and values via one down-projection to the 512-wide latent plus the 64-wide
    RoPE key (``kv_a_proj_with_mqa``) and one up-projection ``kv_b`` (latent -> heads x (128 + 128)).
    """
    c = _spec(cfg)
    h, n = c.hidden_size, c.num_attention_heads
    out = n * c.value_dim * h
    if c.attention == "MLA":
        nope = c.head_dim - c.qk_rope_head_dim
        q = h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * n * c.head_dim  # incl. q_a_layernorm
        kv = h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank + c.kv_lora_rank * n * (nope + c.value_dim)
        return q + kv + out
    q = h * n * c.head_dim
    kv = h * c.num_key_value_heads * (c.head_dim + c.value_dim)
    return q + kv + out + (2 * c.head_dim if c.qk_norm else 0)


def param_breakdown(cfg: ModelSpec | str) -> dict[str, tuple[int, int]]:
    """``{component: (total, active per token)}``. Only routed experts differ between the two:
    everything else (embeddings, attention, dense MLPs, shared experts, the router) runs for every token."""
    c = _spec(cfg)
    h, layers, moe = c.hidden_size, c.num_hidden_layers, c.moe_layers
    expert = 3 * h * c.moe_intermediate_size  # gate, up and down projections of one expert
    parts = {
        "embeddings": c.vocab_size * h * (1 if c.tie_word_embeddings else 2),
        "attention": layers * attention_params_per_layer(c),
        "dense MLP": (layers - moe) * 3 * h * c.intermediate_size,
        "shared experts": moe * c.n_shared_experts * expert,
        "router": moe * c.n_routed_experts * h,
        "norms": (2 * layers + 1) * h,
    }
    rows = {k: (v, v) for k, v in parts.items()}
    rows["routed experts"] = (moe * c.n_routed_experts * expert, moe * c.num_experts_per_tok * expert)
    return rows


def total_and_active_params(cfg: ModelSpec | str) -> tuple[int, int]:
    """All parameters (what must sit in GPU memory) and those one token uses (what it costs to compute)."""
    rows = param_breakdown(cfg).values()
    return sum(t for t, _ in rows), sum(a for _, a in rows)


def to_facts(cfg: ModelSpec | str, layout: str | None = None, gqa_kv_heads: int = 8) -> kvm.ModelFacts:
    """Chapter 01's :class:`~labsupport.kv_memory.ModelFacts` for this model, so its KV and weight bytes
    are counted there. ``params_b`` is our count of every expert (all stay resident). ``layout`` asks
    "what if it cached like X": MHA, GQA with ``gqa_kv_heads`` (its own count if it is GQA) or MQA.
    Only the cache changes, not the weights: the question is what the cache would cost."""
    c = _spec(cfg)
    facts = kvm.ModelFacts(c.name, total_and_active_params(c)[0] / 1e9, c.num_hidden_layers, c.attention,
                           c.num_attention_heads, c.num_key_value_heads, c.head_dim, kv_lora_rank=c.kv_lora_rank,
                           rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, source=c.source)
    if layout in (None, c.attention):
        return facts
    if layout == "MLA":  # a latent cannot be invented: its width is a trained shape
        raise ValueError(f"{c.name} has no latent (kv_lora_rank) to cache")
    heads = {"MHA": c.num_attention_heads, "GQA": gqa_kv_heads, "MQA": 1}[layout]
    return replace(facts, attention=layout, kv_heads=heads)


def kv_values_per_token_per_layer(cfg: ModelSpec | str, layout: str | None = None, gqa_kv_heads: int = 8) -> int:
    """Numbers cached per token and layer (own attention, or ``layout``): the count MLA is about.

    DeepSeek-V3 caches its 512-wide latent plus the 64-wide RoPE key, shared by all heads and by K
    and V: 576, against 128 x (192 + 128) = 40,960 for MHA with the same heads. Read off
    :func:`kv_memory.kv_bytes_per_token`, so the count and the bytes cannot disagree.
    """
    f = to_facts(cfg, layout, gqa_kv_heads)
    return kvm.kv_bytes_per_token(f, "bfloat16") // (f.layers * DTYPE_BYTES["bfloat16"])


def max_concurrent_tokens(cfg: ModelSpec | str, gpu_bytes: float = H200_BYTES, num_gpus: int = 1,
                          dtype: str = "bfloat16", weight_dtype: str | None = None, layout: str | None = None,
                          usable_fraction: float = USABLE_FRACTION) -> int:
    """Tokens of KV cache (all sequences together) that fit beside the weights on ``num_gpus`` GPUs:
    :func:`kv_memory.max_tokens_in_memory` on the usable share of all of them, since a big MoE only
    fits across several cards. 0 when the weights do not fit."""
    budget = usable_fraction * gpu_bytes * num_gpus
    return kvm.max_tokens_in_memory(to_facts(cfg, layout), budget, dtype, weight_dtype)


def decode_flops_per_token(cfg: ModelSpec | str, context_len: int = 0) -> float:
    """FLOPs to decode one token: 2 per active weight (a multiply and an add), plus attention.

    The input embedding is a table lookup, not a matmul, so it is left out. Attention reads every
    cached token: per layer ``2 x heads x (key + value width) x context``. MLA in its decode form
    ("absorbed" weights, as serving engines run it) scores against the 576-wide latent and sums
    512-wide latent values, so per cached token it does more work than MHA while reading 71x less.
    """
    c = _spec(cfg)
    matmul = 2 * (total_and_active_params(c)[1] - c.vocab_size * c.hidden_size)
    mla = c.attention == "MLA"
    width = 2 * c.kv_lora_rank + c.qk_rope_head_dim if mla else c.head_dim + c.value_dim
    return matmul + 2 * c.num_hidden_layers * c.num_attention_heads * width * context_len


def experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a batch of ``batch`` tokens uses in one layer, in expectation, under uniform routing.

    A token misses a given expert with probability ``1 - k/E``; ``batch`` independent tokens all miss
    it with ``(1 - k/E)^batch``. So ``E (1 - (1 - k/E)^B)``: k at B = 1, close to E once B >> E/k.
    """
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def weight_bytes_read_per_step(cfg: ModelSpec | str, batch: int, dtype: str = "bfloat16") -> float:
    """Weight bytes one decode step must stream from memory for ``batch`` tokens.

    Decode is memory-bound: each step reads every weight it uses once, whatever the batch. For a
    MoE that is all non-routed weights plus the experts the batch touches, which grows from the
    active count at B = 1 towards the total. (The input embedding is a lookup of B rows: left out.)
    """
    c = _spec(cfg)
    always = sum(t for k, (t, _) in param_breakdown(c).items() if k != "routed experts") - c.vocab_size * c.hidden_size
    touched = experts_touched(c.n_routed_experts, c.num_experts_per_tok, batch) if c.n_routed_experts else 0
    return (always + c.moe_layers * touched * 3 * c.hidden_size * c.moe_intermediate_size) * DTYPE_BYTES[dtype]


def all_to_all_bytes(cfg: ModelSpec | str, tokens: int = 1, dtype: str = "bfloat16",
                     combine_dtype: str | None = None, per_layer: bool = False) -> int:
    """Bytes expert parallelism moves for ``tokens`` tokens (every MoE layer, or one).

    With experts spread over devices, each token's hidden vector is sent to each of its ``top_k``
    experts (dispatch) and every expert's output is sent back to be summed (combine): ``top_k x
    hidden`` numbers each way, per MoE layer. Dispatch is often fp8 while combine stays bf16, hence
    the two dtypes. This counts every copy; copies whose expert sits on the sender's device never
    touch a link (see :func:`all_to_all_seconds`).
    """
    c = _spec(cfg)
    per_token_layer = c.num_experts_per_tok * c.hidden_size * (DTYPE_BYTES[dtype] + DTYPE_BYTES[combine_dtype or dtype])
    return tokens * per_token_layer * (1 if per_layer else c.moe_layers)


def all_to_all_seconds(cfg: ModelSpec | str, tokens: int, num_devices: int, link_bytes_per_s: float,
                       dtype: str = "bfloat16", combine_dtype: str | None = None) -> float:
    """Time one decode step spends in all-to-all, every device sending over its own link at once.

    Each device holds ``tokens / D`` of the batch; under uniform routing a share ``(D - 1) / D`` of
    their expert copies leave the device. Latency and overlap with compute are ignored.
    """
    if num_devices <= 1:
        return 0.0
    sent = all_to_all_bytes(cfg, tokens, dtype, combine_dtype) / num_devices
    return sent * (num_devices - 1) / num_devices / link_bytes_per_s


def zipf_popularity(num_experts: int, skew: float) -> np.ndarray:
    """Routing probabilities proportional to ``1 / rank^skew``: uniform at 0, a few hot experts when large."""
    p = 1.0 / np.arange(1, num_experts + 1) ** skew
    return p / p.sum()


def sample_expert_loads(num_experts: int, top_k: int, skew: float, tokens: int, seed: int = 0,
                        popularity: np.ndarray | None = None) -> np.ndarray:
    """Tokens routed to each expert when ``tokens`` tokens each pick ``top_k`` distinct experts.

    Experts are drawn without replacement in proportion to ``popularity`` (Zipf with ``skew`` by
    default) by a race: expert i arrives after an exponential time with rate p_i, and the token takes
    the first ``top_k`` to arrive (the same as Gumbel top-k). The Zipf ranks are shuffled over expert
    ids (which expert is hot has nothing to do with its number); a given ``popularity`` is per expert id.
    """
    rng = np.random.default_rng(seed)
    if popularity is None:
        rate = rng.permutation(zipf_popularity(num_experts, skew)).astype(np.float32)
    else:
        rate = (np.asarray(popularity, float) / np.sum(popularity)).astype(np.float32)
    loads = np.zeros(num_experts, dtype=np.int64)
    for start in range(0, tokens, 4096):  # in chunks: a tokens x experts array at once could be large
        n = min(4096, tokens - start)
        arrival = rng.standard_exponential((n, num_experts), dtype=np.float32) / rate
        chosen = np.argpartition(arrival, top_k - 1, axis=1)[:, :top_k]
        loads += np.bincount(chosen.ravel(), minlength=num_experts)
    return loads


def device_loads(expert_loads: np.ndarray, num_devices: int) -> np.ndarray:
    """Per-device work when the experts are split into ``num_devices`` equal contiguous groups."""
    return np.asarray(expert_loads).reshape(num_devices, -1).sum(axis=1)


def max_over_mean(loads: np.ndarray) -> float:
    """Busiest device over the average: the step's slowdown against perfect balance."""
    return float(np.max(loads) / np.mean(loads))


def expert_load_imbalance(num_experts: int, num_devices: int, top_k: int, skew: float, tokens: int,
                          seed: int = 0, popularity: np.ndarray | None = None) -> float:
    """Max over mean device load. A step ends when the busiest device does, so this is the slowdown
    against perfect balance: it grows with skew and with fewer experts per device (less averaging)."""
    return max_over_mean(device_loads(sample_expert_loads(num_experts, top_k, skew, tokens, seed, popularity),
                                      num_devices))


def published_routing() -> dict:
    """Expert-load statistics measured on a served model, as published (``data/moe_routing_published.json``
    names the source, model, hardware and workload): the figures a Zipf skew is calibrated against, so the
    explorer's slider starts from something a serving team saw rather than from a guess."""
    return json.loads(data.text("moe_routing_published.json"))


def mean_imbalance(num_experts: int, num_devices: int, top_k: int, skew: float, tokens: int,
                   seeds=range(8)) -> float:
    """(max - mean) / mean device load averaged over draws: each seed puts the hot experts elsewhere, as
    another layer would. This is the published "imbalance ratio" (0 when balanced); 1 + it is the slowdown."""
    return float(np.mean([expert_load_imbalance(num_experts, num_devices, top_k, skew, tokens, seed) - 1
                          for seed in seeds]))


def skew_matching(imbalance_ratio: float, num_experts: int, num_devices: int, top_k: int, tokens: int,
                  seeds=range(8), low: float = 0.0, high: float = 3.0, steps: int = 14) -> float:
    """The Zipf skew whose mean imbalance ratio equals ``imbalance_ratio`` (bisection; the ratio grows
    with skew). The same seeds at every skew keep the comparison from chasing sampling noise."""
    for _ in range(steps):
        mid = (low + high) / 2
        if mean_imbalance(num_experts, num_devices, top_k, mid, tokens, seeds) < imbalance_ratio:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def summary_table(dtype: str = "bfloat16", context_len: int = 4096) -> list[dict]:
    """One row per model: parameters (ours vs published), KV cache per token, decode GFLOPs per token."""
    rows = []
    for c in MODELS.values():
        total, active = total_and_active_params(c)
        rows.append({"model": c.name, "attention": c.attention, "total_b": total / 1e9, "active_b": active / 1e9,
                     "published_total_b": c.published_total_b, "published_active_b": c.published_active_b,
                     "kv_values_per_layer": kv_values_per_token_per_layer(c),
                     "kv_kib_per_token": kvm.kv_bytes_per_token(to_facts(c), dtype) / KiB,
                     "decode_gflop_per_token": decode_flops_per_token(c, context_len) / 1e9,
                     "context_len": context_len})
    return rows


def format_table(rows: list[dict]) -> str:
    """:func:`summary_table` as aligned text for ``print``."""
    ctx = rows[0]["context_len"] if rows else 0
    head = (f"{'model':<16}{'attn':<5}{'total B':>9}{'(pub.)':>8}{'active B':>10}{'(pub.)':>8}"
            f"{'KV vals/layer':>14}{'KV KiB/tok':>12}{f'GFLOP/tok @{ctx}':>17}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:<16}{r['attention']:<5}{r['total_b']:>9.2f}{r['published_total_b']:>8g}"
                     f"{r['active_b']:>10.2f}{r['published_active_b']:>8g}{r['kv_values_per_layer']:>14,}"
                     f"{r['kv_kib_per_token']:>12.1f}{r['decode_gflop_per_token']:>17.1f}")
    return "\n".join(lines)
