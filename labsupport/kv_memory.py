"""KV-cache memory arithmetic: how many bytes every token of context costs, for real models.

Serving is bounded by memory before it is bounded by compute. During decoding each sequence
keeps the keys and values of all its past tokens in every layer, so a GPU holds
``weights + batch x context x bytes_per_token``. These few functions turn a model's published
``config.json`` numbers into that budget, which is the whole case for GQA, MQA, MLA, fp8 KV
caches and paged allocation (later chapters).

Nothing is downloaded: the numbers below are copied from each model's public config.json
(``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` or
``hidden_size / num_attention_heads``). Parameter counts are the usual published totals.
"""
from __future__ import annotations

from dataclasses import dataclass

KiB, GiB = 1024, 1024**3

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}

# A card sold as "80 GB" has 80 GiB (nvidia-smi: 81920 MiB); the H200's "141 GB" reads 143771 MiB.
GPUS = {"24 GiB (RTX 4090 / L4)": 24 * GiB, "80 GiB (A100 / H100)": 80 * GiB, "140 GiB (H200)": 143771 * 1024**2}
# The share of a GPU an engine may plan for: the rest is the CUDA context, activations and allocator
# slack (vLLM's --gpu-memory-utilization, 0.92 by default; 0.9 is a round, common setting).
USABLE_FRACTION = 0.9


@dataclass(frozen=True)
class ModelFacts:
    """The handful of numbers that decide a model's KV-cache size (and its weights' size).

    ``attention`` names how keys and values are shared: MHA gives every query head its own
    K/V head, GQA lets a group of query heads share one, MQA has one K/V head for all, and MLA
    (DeepSeek) caches one compressed latent per layer from which K and V are re-expanded.
    """

    name: str
    params_b: float  # billions of parameters (all of them, for a mixture of experts)
    layers: int
    attention: str  # "MHA" | "GQA" | "MQA" | "MLA"
    q_heads: int
    kv_heads: int
    head_dim: int
    kv_lora_rank: int = 0  # MLA only: width of the cached latent c_KV
    rope_head_dim: int = 0  # MLA only: the decoupled RoPE key, cached beside the latent
    v_head_dim: int = 0  # when values are narrower than keys (DeepSeek: keys 192, values 128); 0 = head_dim
    source: str = ""


MODELS: dict[str, ModelFacts] = {f.name: f for f in [
    ModelFacts("SmolLM2-135M", 0.135, 30, "GQA", 9, 3, 64,
               source="HuggingFaceTB/SmolLM2-135M-Instruct config.json"),
    ModelFacts("Llama-2-7B", 6.74, 32, "MHA", 32, 32, 128,
               source="meta-llama/Llama-2-7b-hf config.json (hidden_size 4096 / 32 heads)"),
    ModelFacts("Llama-3-8B", 8.03, 32, "GQA", 32, 8, 128,
               source="meta-llama/Meta-Llama-3-8B config.json (hidden_size 4096 / 32 heads)"),
    ModelFacts("Llama-3-70B", 70.6, 80, "GQA", 64, 8, 128,
               source="meta-llama/Meta-Llama-3-70B config.json (hidden_size 8192 / 64 heads)"),
    ModelFacts("Qwen2.5-7B", 7.62, 28, "GQA", 28, 4, 128,
               source="Qwen/Qwen2.5-7B config.json (hidden_size 3584 / 28 heads)"),
    ModelFacts("Qwen2.5-72B", 72.7, 80, "GQA", 64, 8, 128,
               source="Qwen/Qwen2.5-72B config.json (hidden_size 8192 / 64 heads)"),
    ModelFacts("Mistral-7B", 7.25, 32, "GQA", 32, 8, 128,
               source="mistralai/Mistral-7B-v0.3 config.json (head_dim 128)"),
    ModelFacts("Falcon-7B", 6.92, 32, "MQA", 71, 1, 64,
               source="tiiuae/falcon-7b config.json (hidden_size 4544 / 71 heads, multi_query)"),
    # num_key_value_heads is 128 in the config, but what is cached is the shared latent. For the MHA
    # comparison a key is qk_nope_head_dim 128 + qk_rope_head_dim 64 = 192 wide, a value v_head_dim 128.
    ModelFacts("DeepSeek-V3", 671.0, 61, "MLA", 128, 128, 192, kv_lora_rank=512, rope_head_dim=64, v_head_dim=128,
               source="deepseek-ai/DeepSeek-V3 config.json (kv_lora_rank 512, qk_nope_head_dim 128, "
                      "qk_rope_head_dim 64, v_head_dim 128)"),
]}


def _facts(model: ModelFacts | str) -> ModelFacts:
    return MODELS[model] if isinstance(model, str) else model


def kv_bytes_per_token(facts: ModelFacts | str, dtype: str = "bfloat16") -> int:
    """Bytes the cache grows by for each token of each sequence.

    MHA/GQA/MQA: every layer stores one key and one value vector per K/V head, so
    ``2 x layers x kv_heads x head_dim x bytes``. The query-head count does not appear: that
    is exactly what GQA and MQA exploit.

    MLA: every layer stores a single compressed vector of width ``kv_lora_rank`` plus the small
    RoPE key of width ``rope_head_dim``, shared by all heads and by K and V alike, so
    ``layers x (kv_lora_rank + rope_head_dim) x bytes``.
    """
    f, nbytes = _facts(facts), DTYPE_BYTES[dtype]
    if f.attention == "MLA":
        return f.layers * (f.kv_lora_rank + f.rope_head_dim) * nbytes
    return f.layers * f.kv_heads * (f.head_dim + (f.v_head_dim or f.head_dim)) * nbytes


def mha_equivalent_bytes_per_token(facts: ModelFacts | str, dtype: str = "bfloat16") -> int:
    """What the same model would cache with plain MHA (one K/V head per query head).

    The ratio to :func:`kv_bytes_per_token` is the memory the attention variant saves, and
    therefore how many more sequences (or how much longer ones) fit beside the weights.
    """
    f = _facts(facts)
    return f.layers * f.q_heads * (f.head_dim + (f.v_head_dim or f.head_dim)) * DTYPE_BYTES[dtype]


def kv_bytes(facts: ModelFacts | str, context_len: int, batch_size: int = 1,
             dtype: str = "bfloat16") -> int:
    """Bytes of KV cache for ``batch_size`` sequences each ``context_len`` tokens long."""
    return kv_bytes_per_token(facts, dtype) * context_len * batch_size


def weight_bytes(facts: ModelFacts | str, dtype: str = "bfloat16") -> int:
    """Bytes the weights take: parameters x bytes per parameter (a mixture of experts keeps
    every expert resident, so the total count matters, not the active one)."""
    return round(_facts(facts).params_b * 1e9 * DTYPE_BYTES[dtype])


def max_tokens_in_memory(facts: ModelFacts | str, gpu_bytes: float, dtype: str = "bfloat16",
                         weight_dtype: str | None = None) -> int:
    """Tokens of KV cache (summed over all sequences) that fit after the weights are loaded.

    ``weight_dtype`` defaults to ``dtype``. Returns 0 when the weights alone do not fit. This
    ignores activations and allocator slack, which real servers reserve (vLLM's
    ``gpu_memory_utilization``), so it is an upper bound.
    """
    free = gpu_bytes - weight_bytes(facts, weight_dtype or dtype)
    return max(0, int(free // kv_bytes_per_token(facts, dtype)))


def comparison_table(dtype: str = "bfloat16", context_len: int = 8192) -> list[dict]:
    """One row per model in :data:`MODELS`: per-token cache, the MHA equivalent, the saving,
    and the GiB one sequence of ``context_len`` tokens needs."""
    rows = []
    for f in MODELS.values():
        per_token = kv_bytes_per_token(f, dtype)
        mha = mha_equivalent_bytes_per_token(f, dtype)
        rows.append({
            "model": f.name,
            "attention": f.attention,
            "kv_heads": "latent" if f.attention == "MLA" else f.kv_heads,
            "kib_per_token": per_token / KiB,
            "mha_kib_per_token": mha / KiB,
            "saving": mha / per_token,
            "gib_per_sequence": per_token * context_len / GiB,
            "context_len": context_len,
        })
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows of :func:`comparison_table` as aligned text, for ``print``."""
    ctx = rows[0]["context_len"] if rows else 0
    head = (f"{'model':<14}{'attn':<6}{'KV heads':>9}{'KiB/token':>11}{'MHA KiB/token':>15}"
            f"{'saving':>9}{f'GiB @ {ctx} tok':>17}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:<14}{r['attention']:<6}{r['kv_heads']!s:>9}"
                     f"{r['kib_per_token']:>11.1f}{r['mha_kib_per_token']:>15.1f}"
                     f"{r['saving']:>8.1f}×{r['gib_per_sequence']:>17.2f}")
    return "\n".join(lines)


def from_config(config, params_b: float | None = None, name: str = "loaded model") -> ModelFacts:
    """ModelFacts for a model this engine loaded (a ``labsupport.models.llama.ModelConfig``).

    ``params_b`` is best measured by the caller (``sum(p.numel() for p in model.parameters())
    / 1e9``); without it the Llama-family count is derived from the config's shapes.
    """
    c = config
    if params_b is None:
        h, kv = c.hidden_size, c.num_kv_heads * c.head_dim
        attn = 2 * h * c.num_heads * c.head_dim + 2 * h * kv  # q, o and k, v projections
        layer = attn + 3 * h * c.intermediate_size + 2 * h  # gate/up/down MLP + two RMSNorms
        embed = c.vocab_size * h * (1 if c.tie_word_embeddings else 2)
        params_b = (c.num_layers * layer + embed + h) / 1e9
    kind = ("MHA" if c.num_kv_heads == c.num_heads else "MQA" if c.num_kv_heads == 1 else "GQA")
    return ModelFacts(name, params_b, c.num_layers, kind, c.num_heads, c.num_kv_heads, c.head_dim,
                      source=f"{getattr(c, 'model_type', 'llama')} ModelConfig of the loaded model")
