"""``make gpu-check`` part 0: on the GPU, our engine's tokens equal ``transformers``' on tiny random models.

The CPU tests prove parity with the real checkpoint; a GPU adds its own code paths (the Triton
kernel, CUDA-graph decode, CUDA matmuls), so the check is repeated there. No checkpoint travels to a
bare GPU machine: the engine makes a tiny random Llama and Qwen3 (``random:tiny``,
``random:tiny-qwen3``), and transformers builds the same architecture from the same numbers and
loads the engine's own weights (the names are Hugging Face's). fp32, greedy, ``ignore_eos``.
"""
from __future__ import annotations

import torch

PROMPTS = [list(range(100, 140)), [7, 300, 42, 5, 5, 5, 99], list(range(1, 180, 3))]
NEW_TOKENS = 24


def hf_model(cfg, state: dict, device):
    """The transformers model of our ``ModelConfig`` holding our weights."""
    import transformers

    kind = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[cfg.model_type]
    config = kind[0](vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                     num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                     rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
                     tie_word_embeddings=cfg.tie_word_embeddings)
    model = kind[1](config).to(device=device, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"weights do not fit transformers' {cfg.model_type}: {missing[:3]} {unexpected[:3]}")
    return model


def check_parity(device, quick: bool) -> dict:
    from ... import LLM, SamplingParams
    from ...engine.runner import sequence_logits

    out, ok = {}, True
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for spec in ("random:tiny", "random:tiny-qwen3"):
        engines = {"graphs": LLM(model=spec, device=str(device), dtype="float32", num_blocks=256, block_size=16),
                   "eager": LLM(model=spec, device=str(device), dtype="float32", num_blocks=256, block_size=16,
                                enforce_eager=True)}
        ours = engines["graphs"].engine.model
        hf = hf_model(ours.config, ours.state_dict(), device)
        row = {"graphs_on": type(engines["graphs"].engine.runner.executor).__name__ == "DecodeGraphs",
               "decode_path": engines["graphs"].engine.backend.decode_attention.__name__}
        with torch.inference_mode():
            ids = PROMPTS[0]
            ref = hf(torch.tensor([ids], device=device)).logits[0].float()
            row["max_logit_diff"] = (sequence_logits(ours, ids) - ref).abs().max().item()
            want = [hf.generate(torch.tensor([p], device=device), max_new_tokens=NEW_TOKENS, do_sample=False,
                                attention_mask=torch.ones(1, len(p), dtype=torch.long, device=device),
                                eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
        for name, llm in engines.items():  # all prompts in one batch: decode steps of 3 rows
            got = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                     use_tqdm=False)]
            row[f"{name}_same_tokens"] = sum(a == b for x, y in zip(got, want) for a, b in zip(x, y)) / (
                len(PROMPTS) * NEW_TOKENS)
            row[f"{name}_blocks_free"] = llm.engine.kv.allocator.num_free == llm.engine.kv.num_blocks
            llm.shutdown()
        row["ok"] = (row["max_logit_diff"] < 1e-3 and row["graphs_same_tokens"] == 1.0
                     and row["eager_same_tokens"] == 1.0 and row["graphs_blocks_free"] and row["eager_blocks_free"])
        ok &= row["ok"]
        out[spec] = row
    out["ok"] = ok
    return out
