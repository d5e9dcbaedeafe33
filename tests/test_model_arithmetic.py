"""MoE and MLA arithmetic from real configs: parameter counts match the published totals, MLA caches
576 numbers per token and layer, a batch touches k..E experts, all-to-all bytes follow top_k x hidden,
and hot experts unbalance devices more as routing gets skewed. KV and weight bytes are chapter 01's
(kv_memory), so these tests also check that the two chapters describe shared models identically."""
import math
from dataclasses import replace

import matplotlib
import pytest

matplotlib.use("Agg")

from labsupport import kv_memory as kvm  # noqa: E402
from labsupport import model_arithmetic as ma  # noqa: E402

PUBLISHED = {  # billions: (total, active per token), as the model cards state them
    "DeepSeek-V3": (671, 37), "Mixtral-8x7B": (46.7, 12.9), "Qwen3-30B-A3B": (30.5, 3.3),
    "Qwen3-235B-A22B": (235, 22), "Llama-3.1-8B": (8.03, 8.03), "Llama-3.1-70B": (70.6, 70.6),
    "Llama-2-7B": (6.74, 6.74),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_total_and_active_parameters_match_the_published_counts(name):
    total, active = ma.total_and_active_params(name)
    published_total, published_active = PUBLISHED[name]
    assert total / 1e9 == pytest.approx(published_total, rel=0.02)
    assert active / 1e9 == pytest.approx(published_active, rel=0.02)


def test_only_routed_experts_differ_between_total_and_active():
    rows = ma.param_breakdown("DeepSeek-V3")
    assert all(t == a for k, (t, a) in rows.items() if k != "routed experts")
    routed_total, routed_active = rows["routed experts"]
    assert routed_total == 58 * 256 * 3 * 7168 * 2048 and routed_active == routed_total * 8 // 256
    assert rows["dense MLP"][0] == 3 * 3 * 7168 * 18432  # first_k_dense_replace = 3 dense layers
    assert rows["shared experts"][0] == 58 * 3 * 7168 * 2048


def test_mla_caches_the_576_wide_latent_far_less_than_mha_or_gqa():
    ds = ma.MODELS["DeepSeek-V3"]
    mla = ma.kv_values_per_token_per_layer(ds)
    assert mla == 512 + 64 == 576
    mha = ma.kv_values_per_token_per_layer(ds, "MHA")
    assert mha == 128 * ((128 + 64) + 128)  # 128 heads, keys 192 wide, values 128 wide
    assert mha / mla == pytest.approx(71.1, abs=0.1)
    assert ma.kv_values_per_token_per_layer(ds, "GQA", gqa_kv_heads=8) / mla == pytest.approx(2560 / 576)
    # against a real GQA model: Llama-3.1-70B caches 2 x 8 heads x 128 = 2048 per layer
    assert ma.kv_values_per_token_per_layer("Llama-3.1-70B") == 2048
    assert kvm.kv_bytes_per_token(ma.to_facts(ds), "bfloat16") == 61 * 576 * 2 == 61 * 1152
    assert kvm.kv_bytes_per_token(ma.to_facts("Llama-2-7B")) == 32 * 2 * 32 * 128 * 2  # MHA: 512 KiB per token
    with pytest.raises(ValueError):
        ma.kv_values_per_token_per_layer("Llama-3.1-8B", "MLA")


def test_what_if_layouts_only_change_the_cache():
    ds = ma.to_facts("DeepSeek-V3")
    assert kvm.kv_bytes_per_token(ma.to_facts(ds.name, "MHA")) == kvm.mha_equivalent_bytes_per_token(ds)
    assert ma.to_facts(ds.name, "GQA").kv_heads == 8 and ma.to_facts(ds.name, "MQA").kv_heads == 1
    assert ma.to_facts(ds.name, "GQA", gqa_kv_heads=16).kv_heads == 16
    assert ma.to_facts("Qwen3-235B-A22B", "GQA").kv_heads == 4  # a GQA model keeps its own count
    assert ma.to_facts(ds.name, "MHA").params_b == ds.params_b  # weights are not re-sized


@pytest.mark.parametrize("ours, chapter01", [("DeepSeek-V3", "DeepSeek-V3"), ("Llama-2-7B", "Llama-2-7B"),
                                             ("Llama-3.1-8B", "Llama-3-8B"), ("Llama-3.1-70B", "Llama-3-70B")])
def test_models_shared_with_chapter01_agree(ours, chapter01):
    """Same shapes in both tables (Llama 3.1 keeps Llama 3's attention); parameters agree to 0.2%."""
    mine, theirs = ma.to_facts(ours), kvm.MODELS[chapter01]
    assert mine.params_b == pytest.approx(theirs.params_b, rel=2e-3)
    assert replace(mine, name=theirs.name, params_b=theirs.params_b, source=theirs.source) == theirs


def test_constants_are_chapter01s():
    assert ma.DTYPE_BYTES is kvm.DTYPE_BYTES and ma.KiB == kvm.KiB
    assert ma.H200_BYTES == kvm.GPUS["140 GiB (H200)"] == 143771 * 1024**2
    assert ma.USABLE_FRACTION == kvm.USABLE_FRACTION


def test_max_concurrent_tokens_follows_the_kv_layout():
    ds = "DeepSeek-V3"
    by_layout = {lay: ma.max_concurrent_tokens(ds, num_gpus=8, dtype="bfloat16", weight_dtype="fp8", layout=lay)
                 for lay in ("MHA", "GQA", "MLA")}
    assert by_layout["MLA"] / by_layout["MHA"] == pytest.approx(40960 / 576, rel=1e-4)
    assert by_layout["GQA"] < by_layout["MLA"]
    assert ma.max_concurrent_tokens(ds, num_gpus=1) == 0  # 1.3 TB of bf16 weights on one H200
    free = kvm.USABLE_FRACTION * ma.H200_BYTES - 2 * ma.total_and_active_params("Llama-3.1-8B")[0]
    assert ma.max_concurrent_tokens("Llama-3.1-8B") == int(free // (128 * 1024))
    fp8 = ma.max_concurrent_tokens("Llama-3.1-8B", dtype="fp8", weight_dtype="bfloat16")
    assert fp8 == int(free // (64 * 1024))  # an fp8 cache: twice the tokens beside the same weights


def test_decode_flops_are_twice_the_active_weights_plus_attention():
    ds = ma.MODELS["DeepSeek-V3"]
    matmul = 2 * (ma.total_and_active_params(ds)[1] - ds.vocab_size * ds.hidden_size)
    assert ma.decode_flops_per_token(ds, 0) == matmul
    assert ma.decode_flops_per_token(ds, 1000) - matmul == 2 * 61 * 128 * (512 + 64 + 512) * 1000
    llama = ma.MODELS["Llama-3.1-8B"]
    assert ma.decode_flops_per_token(llama, 10) - ma.decode_flops_per_token(llama, 0) == 2 * 32 * 32 * 256 * 10


def test_experts_touched_goes_from_k_to_e_monotonically():
    assert ma.experts_touched(256, 8, 1) == pytest.approx(8)
    assert ma.experts_touched(256, 8, 100_000) == pytest.approx(256)
    touched = [ma.experts_touched(256, 8, b) for b in (1, 8, 64, 256, 1024)]
    assert touched == sorted(touched) and len(set(touched)) == 5
    assert ma.experts_touched(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))


def test_weights_read_per_step_grow_from_active_to_total():
    ds = "DeepSeek-V3"
    total, active = ma.total_and_active_params(ds)
    embed = 129280 * 7168  # the input embedding is a row lookup, not read whole
    assert ma.weight_bytes_read_per_step(ds, 1, "fp8") == pytest.approx(active - embed)
    assert ma.weight_bytes_read_per_step(ds, 10_000, "fp8") == pytest.approx(total - embed)
    assert ma.weight_bytes_read_per_step("Llama-3.1-8B", 64) == 2 * (ma.total_and_active_params("Llama-3.1-8B")[0]
                                                                        - 128256 * 4096)


def test_all_to_all_bytes_by_hand():
    # DeepSeek-V3: 8 copies of a 7168-wide vector out (fp8, 1 byte) and back (bf16, 2 bytes), per MoE layer
    per_token_layer = 8 * 7168 * (1 + 2)
    assert ma.all_to_all_bytes("DeepSeek-V3", 1, "fp8", "bfloat16", per_layer=True) == per_token_layer == 172_032
    assert ma.all_to_all_bytes("DeepSeek-V3", 64, "fp8", "bfloat16") == 64 * 58 * per_token_layer
    assert ma.all_to_all_bytes("Mixtral-8x7B", 10, "bfloat16") == 10 * 32 * 2 * 4096 * (2 + 2)
    # 256 tokens over 8 devices: each sends its 32 tokens' copies, 7/8 of them off-device, at 50 GB/s
    sent = 32 * 58 * per_token_layer * 7 / 8
    assert ma.all_to_all_seconds("DeepSeek-V3", 256, 8, 50e9, "fp8", "bfloat16") == pytest.approx(sent / 50e9)
    assert ma.all_to_all_seconds("DeepSeek-V3", 256, 1, 50e9) == 0.0


def test_load_is_balanced_without_skew_and_unbalanced_with_it():
    assert ma.expert_load_imbalance(256, 8, 8, 0.0, 32_768, seed=1) == pytest.approx(1.0, abs=0.03)
    ratios = [ma.expert_load_imbalance(256, 32, 8, s, 8192, seed=1) for s in (0.0, 0.5, 1.0, 1.5)]
    assert ratios == sorted(ratios) and ratios[-1] > 2 * ratios[0]
    # fewer experts per device (more devices) averages less: worse at the same skew
    assert ma.expert_load_imbalance(256, 64, 8, 1.0, 8192) > ma.expert_load_imbalance(256, 8, 8, 1.0, 8192)
    # seeded: the same call gives the same answer; every token gives top_k assignments
    loads = ma.sample_expert_loads(256, 8, 1.0, 1000, seed=3)
    assert loads.sum() == 8000 and (loads == ma.sample_expert_loads(256, 8, 1.0, 1000, seed=3)).all()
    assert loads.max() <= 1000  # experts are distinct within a token
    # a given popularity vector: one expert gets all traffic it can
    hot = [100.0] + [1.0] * 7
    assert ma.sample_expert_loads(8, 1, 0, 2000, popularity=hot)[0] > 1500


def test_published_routing_is_cited_and_consistent():
    pub = ma.published_routing()
    assert pub["url"].startswith("https://") and pub["source"] and pub["model"] and pub["hardware"] and pub["workload"]
    assert pub["num_experts"] == 256 and pub["top_k"] == 8
    for row in pub["rows"]:
        # every GPU holds slots_per_device expert slots, so the mean per GPU is slots x the mean per slot
        assert row["by_rank"]["mean"] == pytest.approx(row["slots_per_device"] * row["by_expert_slot"]["mean"], rel=0.02)
        assert row["by_rank"]["imbalance_ratio"] < row["by_expert_slot"]["imbalance_ratio"]  # a GPU averages its slots
    no_eplb, *eplb = pub["rows"]
    assert all(r["by_rank"]["imbalance_ratio"] < no_eplb["by_rank"]["imbalance_ratio"] / 10 for r in eplb)
    per_layer = list(pub["per_layer_no_eplb"].values())
    assert min(per_layer) < no_eplb["by_rank"]["imbalance_ratio"] < max(per_layer)


def test_skew_matching_finds_the_skew_that_gives_an_imbalance():
    seeds = range(4)
    assert ma.mean_imbalance(256, 32, 8, 0.0, 4096, seeds) < 0.2  # uniform routing: only sampling noise
    for target in (0.5, 1.5):
        s = ma.skew_matching(target, 256, 32, 8, 4096, seeds=seeds)
        assert ma.mean_imbalance(256, 32, 8, s, 4096, seeds) == pytest.approx(target, rel=0.05)
    assert ma.skew_matching(0.5, 256, 32, 8, 4096, seeds=seeds) < ma.skew_matching(1.5, 256, 32, 8, 4096, seeds=seeds)
    # an imbalance no skew in range reaches: the bisection ends at the bound, not somewhere arbitrary
    assert ma.skew_matching(1e6, 256, 32, 8, 4096, seeds=seeds, high=2.0) == pytest.approx(2.0, abs=1e-3)


def test_summary_table_lists_every_model():
    rows = ma.summary_table()
    assert [r["model"] for r in rows] == list(ma.MODELS)
    text = ma.format_table(rows)
    assert "DeepSeek-V3" in text and "576" in text
    assert all(math.isfinite(r["decode_gflop_per_token"]) for r in rows)


def test_plots_and_explorer_build():
    from labsupport.viz import moe_mla
    figs = [moe_mla.plot_kv_by_attention(), moe_mla.plot_kv_by_attention("Llama-2-7B", num_gpus=1),
            moe_mla.plot_experts_touched(batch=64),
            moe_mla.plot_imbalance_vs_skew(skews=(0, 0.5, 1.0), tokens=2048),
            moe_mla.plot_moe_overview("Llama-3.1-8B", devices=1, dtype="bfloat16")]
    assert all(len(f.axes) >= 1 for f in figs)
    kv_axes = figs[0].axes[1]
    assert [t.get_text() for t in kv_axes.get_xticklabels()] == ["MHA (128 heads)", "GQA (8 KV heads)", "MLA (latent)"]
    box = moe_mla.explore_moe(batch=8, devices=8)
    import ipywidgets
    assert isinstance(box, ipywidgets.VBox) and len(box.last_figure.axes) == 3
    assert "experts touched per layer at batch 8" in box.children[1].value
    model = box.children[0].children[0].children[0]
    model.value = "Mixtral-8x7B"  # redraws for another model
    assert "Mixtral" in box.last_figure.axes[0].get_title()
