"""Chapter 09's roofline lab: step cost arithmetic, the report's roofs, the engine measurement, the plots."""
import json

import matplotlib

matplotlib.use("Agg")

import pytest

from labsupport.bench.lab import roofline, roofline_lab as rl
from labsupport.models.loader import RANDOM_MODELS, prepare_default_model

TINY = RANDOM_MODELS["tiny"]  # V 512, d 64, I 128, 2 layers, 4 heads of 16, 2 KV heads, tied embeddings
SMOL, LLAMA8B = RANDOM_MODELS["smollm2-135m"], RANDOM_MODELS["llama-3.1-8b"]

# Worked by hand for TINY. One layer's matmuls (in x out): q 64x64, k 64x32, v 64x32, o 64x64,
# gate 64x128, up 64x128, down 128x64 = 36864 params; 2 layers 73728; LM head 64x512 = 32768;
# norms (2 * 2 + 1) * 64 = 320. KV per token (fp32): 2 (K, V) * 2 layers * 2 heads * 16 * 4 = 512 bytes.
# Activations per token: one layer's sum of (in + out) = 1024 numbers, 2 layers, + 64 embedding row;
# per sequence: the LM head's 64 in + 512 out.
WEIGHT_BYTES = 4 * (73728 + 32768 + 320)


def test_decode_step_costs_by_hand():
    c = rl.step_costs(TINY, [1], [10], dtype_bytes=4)  # one sequence, 9 cached tokens + the new one
    assert c["matmul_flops"] == 2 * 73728 + 2 * 32768
    assert c["attention_flops"] == 4 * 2 * 4 * 16 * 10  # QK^T and PV: 2 layers, 4 heads, 16 wide, 10 keys
    assert c["flops"] == 218112
    assert c["weight_bytes"] == WEIGHT_BYTES
    assert c["kv_bytes"] == 512 * (10 + 1)  # read the context, write the new token
    assert c["activation_bytes"] == 4 * (2 * 1024 + 64 + 64 + 512)
    assert c["bytes"] == 427264 + 5632 + 10752


def test_prefill_step_costs_by_hand():
    c = rl.step_costs(TINY, [4], [4], dtype_bytes=2)
    assert c["matmul_flops"] == 2 * 4 * 73728 + 2 * 32768  # the LM head for the last token only
    assert c["attention_flops"] == 4 * 2 * 4 * 16 * (1 + 2 + 3 + 4)  # causal: query i sees i keys
    assert c["weight_bytes"] == WEIGHT_BYTES // 2
    assert c["kv_bytes"] == 256 * (4 + 4)  # bf16: 256 bytes a token
    assert c["activation_bytes"] == 2 * (4 * (2 * 1024 + 64) + 64 + 512)


def test_weights_agree_with_roofline_model_facts():
    facts = roofline.model_facts(prepare_default_model())
    c = rl.step_costs(SMOL, [1], [1], 4)
    assert c["weight_bytes"] == facts["weight_bytes"]
    assert c["kv_bytes"] == 2 * facts["kv_bytes_per_token"]  # one token read, one written


def test_decode_intensity_rises_with_batch_and_prefill_sits_right():
    def intensity(cost):
        return cost["flops"] / cost["bytes"]

    for cfg, ctx in ((SMOL, 64), (LLAMA8B, 1024)):
        series = [intensity(rl.step_costs(cfg, [1] * b, [ctx] * b, 2)) for b in (1, 2, 4, 8, 16, 32, 64, 256)]
        assert series == sorted(series) and series[-1] > 10 * series[0]
        assert 0.9 < series[0] < 1.1  # B = 1 in bf16: about 2 FLOPs per 2-byte weight
        assert intensity(rl.step_costs(cfg, [512], [512], 2)) > 100 * series[0]


@pytest.mark.parametrize("cfg, ctx", [(SMOL, 1), (SMOL, 1024), (LLAMA8B, 1), (LLAMA8B, 1024), (LLAMA8B, 8192)])
@pytest.mark.parametrize("peak_flops, peak_bw, dtype_bytes", [(60e9, 15e9, 4), (989e12, 4.8e12, 2)])
def test_compute_bound_batch_is_where_intensity_crosses_the_ridge(cfg, ctx, peak_flops, peak_bw, dtype_bytes):
    got = rl.compute_bound_batch(cfg, peak_flops, peak_bw, dtype_bytes, ctx)
    ridge = peak_flops / peak_bw
    assert got["ridge"] == ridge

    def intensity(b):
        c = rl.step_costs(cfg, [1] * b, [ctx] * b, dtype_bytes)
        return c["flops"] / c["bytes"]

    if got["batch"] is None:  # even a huge batch stays below: the per-sequence KV caps the intensity
        assert got["limit_intensity"] < ridge and intensity(1 << 16) < ridge
    else:
        assert intensity(got["batch"]) >= ridge
        assert got["batch"] == 1 or intensity(got["batch"] - 1) < ridge


def test_h200_figures_are_the_textbook_ones():
    ridge = 989e12 / 4.8e12
    weights_only = rl.compute_bound_batch(LLAMA8B, 989e12, 4.8e12, 2, context_len=1)["batch"]
    assert weights_only == pytest.approx(ridge, rel=0.15)  # ~ ridge * 2 bytes / 2 FLOPs per weight
    assert rl.compute_bound_batch(LLAMA8B, 989e12, 4.8e12, 2, context_len=8192)["batch"] is None


def _synthetic_points(peak_flops, peak_bw, slowdown=2.0):
    """Points whose times are ``slowdown`` x the roofs' floor: MFU or MBU must come out as 1/slowdown."""
    pts = []
    for kind, b, n, ctx in [("prefill", 1, [256], [256])] + [("decode", b, [1] * b, [64] * b) for b in (1, 4, 16, 64)]:
        c = rl.step_costs(SMOL, n, ctx, 4)
        t = slowdown * max(c["flops"] / peak_flops, c["bytes"] / peak_bw)
        pts.append({"kind": kind, "batch": b, "label": f"{kind} {b}", "seconds": t, "num_tokens": n,
                    "context_lens": ctx, "tokens_per_s": sum(n) / t, "dtype_bytes": 4, **c})
    return pts


def test_report_roofs_ridge_and_utilisation():
    peak_flops, peak_bw = 60e9, 15e9
    rep = rl.roofline_report(_synthetic_points(peak_flops, peak_bw), peak_flops, peak_bw, SMOL)
    assert rep["ridge"] == 4.0
    for p in rep["points"]:
        assert p["bound"] == ("compute" if p["intensity"] >= 4.0 else "memory")
        assert (p["mfu"] if p["bound"] == "compute" else p["mbu"]) == pytest.approx(0.5)
        assert 0 < p["mfu"] <= 0.5 + 1e-9 and 0 < p["mbu"] <= 0.5 + 1e-9
        assert p["what_if"]["floor_seconds"] < p["seconds"] / 1000  # an H200 is more than 1000x faster
    decode = rep["decode"]
    cb = rep["compute_bound_batch_measured"]
    assert all((d["batch"] >= cb) == (d["intensity"] >= 4.0) for d in decode)
    table = {(t["model"], t["machine"]): t for t in rep["compute_bound_table"]}
    assert table[("this model", "this machine (measured)")]["by_context"][1]["batch"] == \
        rl.compute_bound_batch(SMOL, peak_flops, peak_bw, 4, 1)["batch"]
    assert "decode 64" in rl.format_report(rep)


def test_reading_says_what_the_report_shows_and_when_no_batch_turns():
    peak_flops, peak_bw = 60e9, 15e9
    rep = rl.roofline_report(_synthetic_points(peak_flops, peak_bw), peak_flops, peak_bw, SMOL)
    text = rl.reading(rep, SMOL, verify=[(1, 4), (64, 4)])
    assert "60.0 GFLOP/s and 15.0 GB/s, so the ridge is 4.0 FLOP/byte" in text
    long_ctx = {ctx: v for t in rep["compute_bound_table"] if t["machine"] == "H200 (published)"
                for ctx, v in t["by_context"].items()}
    assert long_ctx[8192]["batch"] is None and "never with 1024 and 8192 cached tokens" in text
    one, many = (rl.step_costs(SMOL, [5] * u, [205] * u, 4) for u in (1, 64))
    assert f"{one['flops'] / one['bytes']:.1f} FLOP/byte, below" in text
    assert f"{many['flops'] / many['bytes']:.1f} FLOP/byte, above" in text
    for d in rep["decode"]:
        assert f"{d['intensity']:.1f}" in text and f"{d['mbu']:.0%}" in text


@pytest.fixture(scope="module")
def roofs(tmp_path_factory):
    """This machine's peak matmul rate and read bandwidth from ``roofline.measure``. Its model folder
    only sets the decode shapes it also times, which the lab does not use: a TINY config keeps them quick."""
    folder = tmp_path_factory.mktemp("tiny")
    c = TINY
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "tie_word_embeddings": True}))
    roof = roofline.measure(folder, quick=True, dtypes=("fp32",))
    return roof["matmul"]["fp32"]["prefill_gflops"] * 1e9, roof["read_gbps"] * 1e9


@pytest.fixture(scope="module")
def measured(llm, roofs):
    """Real steps of the real model at tiny sizes, against this machine's measured roofs."""
    points = rl.measure_engine_points(llm, [1, 2], prompt_len=16, decode_prompt_len=4, decode_steps=2,
                                      prefill_repeats=1, use_tqdm=False)
    return rl.roofline_report(points, *roofs, llm.engine.model.config), llm


def test_engine_points(measured):
    rep, llm = measured
    assert not llm.engine.has_unfinished_requests()  # every request made for the measurement is gone
    assert [p["label"] for p in rep["points"]] == ["prefill P=16", "decode B=1", "decode B=2"]
    for p in rep["points"]:
        assert {"kind", "batch", "seconds", "best_seconds", "flops", "bytes", "num_tokens", "context_lens",
                "tokens_per_s", "intensity", "mfu", "mbu"} <= set(p)
        assert 0 < p["best_seconds"] <= p["seconds"] < 30
        assert 0 < p["mfu"] <= 1.5 and 0 < p["mbu"] <= 1.5
    prefill, one, two = rep["points"]
    assert prefill["num_tokens"] == [16] and one["num_tokens"] == [1] and two["num_tokens"] == [1, 1]
    assert min(two["context_lens"]) >= 5  # 4 prompt tokens and at least one generated
    assert one["intensity"] < two["intensity"] < prefill["intensity"]


def test_plots_build(measured):
    from labsupport.viz.roofline_plot import plot_decode_scaling, plot_roofline

    rep, _ = measured
    fig = plot_roofline(rep, footnote="test")
    ax = fig.axes[0]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    texts = " ".join(t.get_text() for t in ax.texts)
    assert "prefill P=16" in texts and "decode B=2" in texts and "ridge" in texts
    fig = plot_decode_scaling(rep)
    assert len(fig.axes) == 2 and "tokens/s" in fig.axes[0].get_ylabel()


def test_main_prints_the_table(tmp_path, capsys):
    out = tmp_path / "lab.json"
    assert rl.main(["--model", "random:tiny", "--batches", "1,2", "--prompt-len", "8", "--decode-prompt-len", "4",
                    "--steps", "2", "--peak-gflops", "50", "--peak-gbps", "10", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "decode B=2" in text and "ridge 5.0" in text and "Llama-3.1-8B" in text
    saved = json.loads(out.read_text())
    assert saved["ridge"] == 5.0 and len(saved["points"]) == 3
