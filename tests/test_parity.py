"""Our model and engine against Hugging Face transformers, on the embedded model.

Tolerance: float32 logits may differ by summation order only (different matmul/attention
kernels), so we require max |diff| < 1e-3 on logits whose scale is ~10-30; greedy tokens must be
identical.
"""
import torch

from labsupport import SamplingParams
from labsupport.engine.attention import AttentionBatch, RecomputeAttention

from conftest import PROMPTS

LOGIT_TOLERANCE = 1e-3


def our_logits(llm, ids):
    model = llm.engine.model
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), RecomputeAttention(),
                       AttentionBatch([len(ids)], [len(ids)]))
        return model.logits(hidden)


def test_logits_match_transformers_on_embedded_model(llm, hf_model):
    worst = 0.0
    for prompt in PROMPTS:
        ids = llm.tokenizer(prompt).input_ids
        with torch.inference_mode():
            ref = hf_model(torch.tensor([ids])).logits[0].float()
        diff = (our_logits(llm, ids) - ref).abs().max().item()
        worst = max(worst, diff)
    print(f"max abs logit difference vs transformers over {len(PROMPTS)} prompts: {worst:.2e}")
    assert worst < LOGIT_TOLERANCE


def test_greedy_tokens_equal_transformers_for_ten_prompts(llm, hf_model):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer(prompt).input_ids
        with torch.inference_mode():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert out.token_ids == ref[0, len(ids):].tolist(), prompt


def test_batch_of_different_lengths_equals_each_prompt_alone(llm):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    together = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS[:4], together):
        alone = llm.generate(prompt, params, use_tqdm=False)[0]
        assert alone.token_ids == out.token_ids
