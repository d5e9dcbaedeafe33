"""Tiny random-weight checkpoints cover what the embedded model does not: Qwen2's q/k/v bias,
Qwen3's q/k norm, and the RoPE scaling variants of Llama 3 and YaRN."""
import json
import shutil

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from labsupport import LLM, SamplingParams
from labsupport.models.llama import ModelConfig, rope_frequencies

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0)

VARIANTS = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=True)),
    "llama3-rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=512))),
    "qwen2-yarn": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=1024))),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny_checkpoint(request, tmp_path_factory, llm):
    config_cls, model_cls, extra = VARIANTS[request.param]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**TINY, **extra)).eval()
    if request.param == "qwen2":
        for layer in hf.model.layers:  # random biases, so a forgotten bias shows
            torch.nn.init.normal_(layer.self_attn.q_proj.bias, std=0.5)
            torch.nn.init.normal_(layer.self_attn.k_proj.bias, std=0.5)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (llm.engine.model_path / name).exists():
            shutil.copy(llm.engine.model_path / name, folder / name)
    return request.param, folder, hf


def test_tiny_variant_logits_and_greedy_tokens_match_transformers(tiny_checkpoint):
    name, folder, hf = tiny_checkpoint
    ours = LLM(model=str(folder), device="cpu")
    assert ours.engine.model.config.model_type == json.loads((folder / "config.json").read_text())["model_type"]
    ids = list(range(100, 140))
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long), eos_token_id=None)
    from test_parity import our_logits
    diff = (our_logits(ours, ids) - ref).abs().max().item()
    assert diff < 1e-4, f"{name}: max abs logit diff {diff:.2e}"
    out = ours.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0]
    assert out.token_ids == gen[0, len(ids):].tolist()


@pytest.mark.parametrize("rope", [
    dict(rope_type="linear", factor=4.0),
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768),
    dict(rope_type="yarn", factor=2.0, beta_fast=16, beta_slow=2, original_max_position_embeddings=2048),
])
def test_rope_scaling_frequencies_match_transformers(rope):
    hf_cfg = transformers.LlamaConfig(**{**TINY, "max_position_embeddings": 131072},
                                      rope_parameters=dict(rope, rope_theta=500000.0))
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, "cpu")
    inv, scale = rope_frequencies(ModelConfig.from_hf(hf_cfg.to_dict()))
    torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-5, atol=0)
    assert scale == pytest.approx(ref_scale)


def test_non_llama_model_type_is_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match="not a Llama"):
        ModelConfig.from_hf({"model_type": "gpt2"})
