"""Step-cost profiles: a model shape, a KV budget and fitted (or derived) coefficients, saved as JSON.

A profile says what it was made from (``source``): ``"fitted"`` to step records timed on the machine at hand
(``cpu``, see ``calibrate.py``), ``"measured"`` from a GPU's step records, or ``"roofline"``: arithmetic on
the GPU's bandwidth and FLOP/s at the efficiencies a real H200 step reached (``H200_CHECK``), until a
measured profile replaces it. ``python -m labsupport.sim.profiles --roofline`` writes the roofline ones.

    {"name", "source", "device", "machine", "date", "model": {ModelConfig fields}, "dtype",
     "kv_cache_bytes", "coefficients": {feature: seconds per unit}, "fit": {...}, "notes"}
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ..models.model_config import ModelConfig
from .cost_model import StepCostModel

PROFILE_DIR = Path(__file__).resolve().parent.parent / "data" / "sim_profiles"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GiB = 2**30

# The 2026-11-30 H200 check (benchmarks/gpu-check-h200-2026-11-30.json): what a real step reached there.
H200_CHECK = "benchmarks/gpu-check-h200-2026-11-30.json"
CHECK_BW = 2688e9  # Llama-3.1-8B shape, B=64, contexts 512-1024, CUDA graph: 7.98 ms for 15.01 GB + 6.44 GB
CHECK_135M_GRAPH = (64, 767.5, 3.40e-3)  # SmolLM2 shape, same check: rows, mean context, graph step seconds
CHECK_135M_EAGER = 18.18e-3  # the same step eager (Triton attention): launch-bound, ~5x the graph's
CHECK_135M_W1 = (32, 264.0, 2.37e-3)  # W1 (32 x 200 in, 128 out) through the engine: TPOT P50; mean context

# What a GPU is sold as (dense bf16, HBM); usable memory as the brief's devices report it.
GPUS = {
    "h100": {"device": "NVIDIA H100 80GB HBM3", "hbm_bytes_s": 3.35e12, "bf16_flops": 989e12, "memory": 78 * GiB},
    "h200": {"device": "NVIDIA H200 141GB HBM3e", "hbm_bytes_s": 4.8e12, "bf16_flops": 989e12, "memory": 139 * GiB},
}
H200_BW_SHARE = CHECK_BW / GPUS["h200"]["hbm_bytes_s"]  # 0.56 of the sold bandwidth, reached by a whole step
PRODUCT_EFFICIENCY = 0.6  # assumed: large bf16 GEMMs' share of peak (not measured by the check)
ATTENTION_EFFICIENCY = 0.4  # assumed: prefill attention's share of peak (not measured by the check)

LLAMA_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=131072)


def default_model_config() -> ModelConfig:
    """SmolLM2-135M-Instruct's shape, read from the prepared model folder."""
    from ..models.loader import resolve_model_path
    return ModelConfig.from_hf(json.loads((resolve_model_path(None) / "config.json").read_text()))


MODELS = {"smollm2-135m": default_model_config, "llama-3.1-8b": lambda: LLAMA_8B}


def model_config(profile: dict) -> ModelConfig:
    return ModelConfig(**profile["model"])


def kv_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
    """One token's K and V in every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * DTYPE_BYTES[dtype]


def block_bytes(profile: dict, block_size: int) -> int:
    return kv_bytes_per_token(model_config(profile), profile["dtype"]) * block_size


def layer_params(cfg: ModelConfig) -> int:
    """Weights of one layer's products: q, k, v, o and the gated MLP (norms are negligible)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return cfg.hidden_size * (2 * q + 2 * kv) + 3 * cfg.hidden_size * cfg.intermediate_size


def weight_bytes_per_step(cfg: ModelConfig, dtype: str) -> int:
    """Weights one step reads: every layer's and the LM head's (the embedding reads only its rows)."""
    return (cfg.num_layers * layer_params(cfg) + cfg.vocab_size * cfg.hidden_size) * DTYPE_BYTES[dtype]


def gpu_kv_budget(cfg: ModelConfig, dtype: str, memory: int, utilization: float = 0.9) -> int:
    """The engine's own rule (``config.gpu_kv_cache_bytes``) for one engine owning the GPU at vLLM's 0.9."""
    from ..engine.config import EngineConfig, gpu_kv_cache_bytes
    c = EngineConfig(gpu_memory_utilization=utilization, max_model_len=8192)
    weights = (cfg.num_layers * layer_params(cfg) + cfg.vocab_size * cfg.hidden_size
               * (1 if cfg.tie_word_embeddings else 2)) * DTYPE_BYTES[dtype]
    per_block = kv_bytes_per_token(cfg, dtype) * c.block_size
    return gpu_kv_cache_bytes(c, cfg, weights, per_block, memory, memory)


def roofline_profile(gpu: str, model: str, eager: bool = False, date: str = "2026-12-06") -> dict:
    """A GPU profile from arithmetic: bytes over the bandwidth the H200 check reached, FLOPs at an assumed
    efficiency. ``eager``: the SmolLM2 shape without CUDA graphs (every step pays the eager launch floor)."""
    g, cfg, dtype = GPUS[gpu], MODELS[model](), "bfloat16"
    bw = H200_BW_SHARE * g["hbm_bytes_s"]
    per_token_s = 2 * cfg.num_layers * layer_params(cfg) / (PRODUCT_EFFICIENCY * g["bf16_flops"])
    per_pair_s = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim / (ATTENTION_EFFICIENCY * g["bf16_flops"])
    context_s = kv_bytes_per_token(cfg, dtype) / bw
    step_s, rows_s = weight_bytes_per_step(cfg, dtype) / bw, 0.0
    how_step = f"weights read once per step ({weight_bytes_per_step(cfg, dtype) / 1e9:.2f} GB) over {bw / 1e9:.0f} GB/s"
    how_rows = ("0: a decode row's products hide under the weight read below the ridge (about "
                f"{PRODUCT_EFFICIENCY * g['bf16_flops'] / bw:.0f} rows); above it this profile is optimistic")
    if model == "smollm2-135m":  # launch-bound: the step is a floor of launches, fitted to the check's steps
        (b1, c1, t1), (b2, c2, t2) = CHECK_135M_GRAPH, CHECK_135M_W1
        rows_s = max(0.0, ((t1 - b1 * c1 * context_s) - (t2 - b2 * c2 * context_s)) / (b1 - b2))
        step_s = t1 - b1 * c1 * context_s - b1 * rows_s
        how_rows = (f"from two H200 decode points through CUDA graphs: {b1} rows at context {c1:.0f} in "
                    f"{t1 * 1e3:.2f} ms (bare step) and {b2} rows at {c2:.0f} in {t2 * 1e3:.2f} ms (W1's TPOT P50)")
        how_step = "the launch floor those two points leave (the model is launch-bound: its bytes hide under it)"
        if eager:
            step_s += CHECK_135M_EAGER - t1
            how_step += f", raised by the eager step's {(CHECK_135M_EAGER - t1) * 1e3:.1f} ms more (18.18 - 3.40 ms)"
        if gpu != "h200":
            how_step += "; launches cost the same on an H100 (assumed: the host and driver set them, not HBM)"
    coefficients = {"step": step_s, "prefill_tokens": per_token_s, "attention_pairs": per_pair_s,
                    "decode_rows": rows_s, "context_tokens": context_s}
    name = f"{gpu}-{model}" + ("-eager" if eager else "")
    notes = {
        "bandwidth": f"{bw / 1e9:.0f} GB/s = {H200_BW_SHARE:.2f} x the sold {g['hbm_bytes_s'] / 1e12:.2f} TB/s: the "
                     f"share a whole CUDA-graph decode step of the Llama-3.1-8B shape reached on the H200 "
                     f"({CHECK_BW / 1e9:.0f} GB/s, {H200_CHECK})" + ("" if gpu == "h200" else ", carried to the H100"),
        "step": how_step,
        "prefill_tokens": f"2 x {cfg.num_layers * layer_params(cfg) / 1e6:.0f}M product weights FLOPs a token at "
                          f"{PRODUCT_EFFICIENCY:.0%} of {g['bf16_flops'] / 1e12:.0f} TFLOP/s bf16 (efficiency assumed)",
        "attention_pairs": f"4 x {cfg.num_layers} layers x {cfg.num_heads} heads x {cfg.head_dim} FLOPs a pair at "
                           f"{ATTENTION_EFFICIENCY:.0%} of peak (efficiency assumed)",
        "decode_rows": how_rows,
        "context_tokens": f"{kv_bytes_per_token(cfg, dtype)} KV bytes a context token over the same bandwidth",
        "kv_cache_bytes": f"the engine's gpu_kv_cache_bytes at gpu_memory_utilization 0.9 of {g['memory'] / GiB:.0f} "
                          "GiB, max_num_batched_tokens 8192",
        "not_modelled": "prefill and decode overlapping in one step (costs add, a real step takes the larger); on "
                        "the launch-bound SmolLM2 shape a step with a prompt chunk runs eager on the real engine "
                        "(~18 ms on the H200), which the graph profile does not see: its TTFTs are optimistic; "
                        "the -eager profile bounds them from above",
    }
    return {"name": name, "source": "roofline", "device": g["device"], "machine": None, "date": date,
            "model": dataclasses.asdict(cfg), "model_name": model, "dtype": dtype,
            "kv_cache_bytes": gpu_kv_budget(cfg, dtype, g["memory"]), "coefficients": coefficients,
            "fit": None, "notes": notes}


def roofline_profiles() -> list[dict]:
    out = [roofline_profile(gpu, model) for gpu in GPUS for model in MODELS]
    return out + [roofline_profile(gpu, "smollm2-135m", eager=True) for gpu in GPUS]


def save_profile(profile: dict, path) -> Path:
    """Write ``profile`` as JSON (its coefficients checked first)."""
    StepCostModel.from_dict(profile["coefficients"])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2) + "\n")
    return path


def profile_names() -> list[str]:
    return ["cpu", *sorted(p.stem for p in PROFILE_DIR.glob("*.json"))]


def load_profile(name_or_path, recalibrate: bool = False) -> dict:
    """A profile by name (``cpu``: this machine's, calibrated once and cached; else a shipped one) or file."""
    if isinstance(name_or_path, dict):
        return name_or_path
    if name_or_path == "cpu":
        from .calibrate import cpu_profile
        return cpu_profile(recalibrate=recalibrate)
    shipped = PROFILE_DIR / f"{name_or_path}.json"
    path = shipped if shipped.exists() else Path(name_or_path)
    if not path.exists():
        raise ValueError(f"no profile {name_or_path!r}: give a file or one of {', '.join(profile_names())}")
    profile = json.loads(path.read_text())
    StepCostModel.from_dict(profile["coefficients"])
    return profile


def cost_model(profile: dict) -> StepCostModel:
    return StepCostModel.from_dict(profile["coefficients"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m labsupport.sim.profiles", description=__doc__.split("\n")[0])
    p.add_argument("--roofline", action="store_true", help="write the roofline GPU profiles")
    p.add_argument("--out", default=str(PROFILE_DIR), help="folder to write them to")
    args = p.parse_args(argv)
    if not args.roofline:
        print("\n".join(profile_names()))
        return 0
    for profile in roofline_profiles():
        print(f"wrote {save_profile(profile, Path(args.out) / (profile['name'] + '.json'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
