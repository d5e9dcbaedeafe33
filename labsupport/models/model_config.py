"""The handful of numbers a Llama-family model is made of, read from a Hugging Face ``config.json``."""
from __future__ import annotations

from dataclasses import dataclass, field


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
