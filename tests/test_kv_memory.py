"""KV-cache memory arithmetic (chapter 01): exact bytes per token, savings, budgets and plots."""
import json

import matplotlib

matplotlib.use("Agg")

import pytest

from labsupport import kv_memory as kvm
from labsupport.kv_memory import MODELS


@pytest.mark.parametrize("name, dtype, expected", [
    ("Llama-3-8B", "bfloat16", 131072),  # 2*32*8*128*2 = 128 KiB
    ("Llama-2-7B", "bfloat16", 524288),  # 2*32*32*128*2 = 512 KiB (MHA)
    ("SmolLM2-135M", "float32", 46080),  # 2*30*3*64*4
    ("DeepSeek-V3", "bfloat16", 70272),  # 61*(512+64)*2: one latent per layer
    ("Falcon-7B", "bfloat16", 8192),  # 2*32*1*64*2 (MQA)
    ("Qwen2.5-7B", "fp8", 28672),  # 2*28*4*128*1
])
def test_kv_bytes_per_token_exact(name, dtype, expected):
    assert kvm.kv_bytes_per_token(MODELS[name], dtype) == expected
    assert kvm.kv_bytes_per_token(name, dtype) == expected


def test_llama3_8b_is_128_kib_per_token():
    assert kvm.kv_bytes_per_token(MODELS["Llama-3-8B"]) / kvm.KiB == 128


@pytest.mark.parametrize("name, saving", [
    ("Llama-2-7B", 1), ("Llama-3-8B", 4), ("Llama-3-70B", 8), ("Qwen2.5-7B", 7),
    ("Mistral-7B", 4), ("Falcon-7B", 71), ("SmolLM2-135M", 3),
])
def test_gqa_mqa_saving_is_the_head_ratio(name, saving):
    f = MODELS[name]
    mha = kvm.mha_equivalent_bytes_per_token(f)
    assert mha == 2 * f.layers * f.q_heads * f.head_dim * 2
    assert mha / kvm.kv_bytes_per_token(f) == saving


def test_mla_saving_against_mha():
    mha = kvm.mha_equivalent_bytes_per_token("DeepSeek-V3")
    assert mha == 61 * 128 * (192 + 128) * 2          # keys 192 wide (128 + 64 RoPE), values 128
    assert mha / kvm.kv_bytes_per_token("DeepSeek-V3") == pytest.approx(71.1, abs=0.05)


def test_kv_bytes_scales_with_context_and_batch():
    assert kvm.kv_bytes("Llama-3-8B", 8192, 1, "bfloat16") == 8192 * 131072 == 2**30
    assert kvm.kv_bytes("Llama-3-8B", 8192, 32, "fp8") == 16 * 2**30


def test_weight_bytes():
    assert kvm.weight_bytes("Llama-3-8B", "bfloat16") == round(8.03e9 * 2)
    assert kvm.weight_bytes("SmolLM2-135M", "float32") == round(0.135e9 * 4)


def test_max_tokens_in_memory():
    assert kvm.max_tokens_in_memory("Llama-3-70B", 24e9, "bfloat16") == 0
    tokens = kvm.max_tokens_in_memory("Llama-3-8B", 80e9, "bfloat16")
    assert tokens == int((80e9 - 8.03e9 * 2) // 131072) > 0
    # fp8 cache with bf16 weights: exactly twice the tokens of a bf16 cache... up to rounding
    fp8 = kvm.max_tokens_in_memory("Llama-3-8B", 80e9, "fp8", weight_dtype="bfloat16")
    assert fp8 in (2 * tokens, 2 * tokens + 1)


def test_comparison_table():
    rows = kvm.comparison_table("bfloat16", 8192)
    assert [r["model"] for r in rows] == list(MODELS)
    llama3 = next(r for r in rows if r["model"] == "Llama-3-8B")
    assert llama3["kib_per_token"] == 128 and llama3["mha_kib_per_token"] == 512
    assert llama3["saving"] == 4 and llama3["gib_per_sequence"] == 1.0
    assert llama3["attention"] == "GQA" and llama3["kv_heads"] == 8
    text = kvm.format_table(rows)
    assert "DeepSeek-V3" in text and len(text.splitlines()) == len(rows) + 2


def test_models_are_consistent():
    for f in MODELS.values():
        assert f.source and f.q_heads % f.kv_heads == 0
        kind = {f.q_heads: "MHA", 1: "MQA"}.get(f.kv_heads, "GQA")
        assert f.attention == ("MLA" if f.kv_lora_rank else kind), f.name


def test_from_config_matches_the_embedded_model():
    from labsupport.models.llama import ModelConfig
    from labsupport.models.loader import prepare_default_model

    folder = prepare_default_model()
    with open(folder / "config.json") as fh:
        cfg = ModelConfig.from_hf(json.load(fh))
    got, ref = kvm.from_config(cfg), MODELS["SmolLM2-135M"]
    assert (got.layers, got.q_heads, got.kv_heads, got.head_dim, got.attention) == \
        (ref.layers, ref.q_heads, ref.kv_heads, ref.head_dim, ref.attention)
    assert got.params_b == pytest.approx(ref.params_b, rel=0.01)  # 134.5M derived from shapes
    for dtype in kvm.DTYPE_BYTES:
        assert kvm.kv_bytes_per_token(got, dtype) == kvm.kv_bytes_per_token(ref, dtype)
    assert kvm.from_config(cfg, params_b=0.5).params_b == 0.5


def test_plot_kv_vs_weights():
    fig = kvm_viz().plot_kv_vs_weights("Llama-3-8B", 32768, 16, "bfloat16", "80 GiB (A100 / H100)")
    ax = fig.axes[0]
    title = ax.get_title()
    # 68.7e9 bytes of KV = 64.0 GiB; with 16 GB of weights, past the usable 72 GiB of an 80 GiB card
    assert "KV cache 64.0 GiB" in title and "does NOT fit in 72.0 GiB usable of 80.0 GiB" in title
    assert "GiB" in ax.get_xlabel()
    lines = sorted(line.get_xdata()[0] for line in ax.get_lines())
    assert lines == pytest.approx([72.0, 80.0])                   # the usable share, then the card
    fig.canvas.draw()
    small = kvm_viz().plot_kv_vs_weights("SmolLM2-135M", 512, 1, "float32", 24 * kvm.GiB)
    assert "fits in 21.6 GiB usable of 24.0 GiB" in small.axes[0].get_title()
    too_big = kvm_viz().plot_kv_vs_weights("Llama-3-70B", 8192, 4, "bfloat16", 24e9)
    assert "does NOT fit" in too_big.axes[0].get_title()


def test_plot_kv_per_token_comparison():
    fig = kvm_viz().plot_kv_per_token_comparison("bfloat16")
    ax = fig.axes[0]
    assert ax.get_title() and "KiB" in ax.get_ylabel()
    assert [t.get_text() for t in ax.get_xticklabels()] == list(MODELS)
    fig.canvas.draw()


def test_plots_leave_no_open_pyplot_figures():
    import matplotlib.pyplot as plt

    before = len(plt.get_fignums())
    kvm_viz().plot_kv_vs_weights()
    kvm_viz().plot_kv_per_token_comparison()
    assert len(plt.get_fignums()) == before


def test_widget_builds_and_redraws():
    import ipywidgets as W

    box = kvm_viz().kv_memory_widget()
    assert isinstance(box, W.VBox)
    model_w, ctx_w, batch_w, dtype_w, gpu_w, summary, out = box.children
    assert summary.value.startswith("at this context, ")
    first = box.last_figure
    ctx_w.value = 131072
    assert box.last_figure is not first and "128K" in box.last_figure.axes[0].get_title()
    model_w.value = "Llama-3-70B"
    gpu_w.value = "24 GiB (RTX 4090 / L4)"
    assert "do not fit" in summary.value
    # nbval compares the text/plain repr: equal settings must give an equal, address-free text
    again = kvm_viz().kv_memory_widget(model="Llama-3-70B", context_len=131072,
                                       gpu="24 GiB (RTX 4090 / L4)")
    assert repr(box) == repr(again) and "0x" not in repr(box)


def kvm_viz():
    from labsupport.viz import kv_charts
    return kv_charts
