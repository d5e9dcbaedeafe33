"""The capstone: servers on loopback driven by the load generator, and the decision read from them."""
import math
import re

import httpx
import pytest

from labsupport.experiments import capstone
from labsupport.bench.serving.serve_bench import benchmark, payload
from labsupport.bench.serving.serve_datasets import SampleRequest
from labsupport.viz.capstone_plot import format_decision, format_full, plot_capstone, reading


def cell(tok_s, slo=1.0, tpot=50.0, hit=0.5):
    return {"output_tok_s": tok_s, "slo_attainment": slo, "tpot_p50_ms": tpot, "prefix_cache_hit_rate": hit,
            "usd_per_mtok": 0.1 / 3600 / tok_s * 1e6}


def synthetic(again=None):
    """all beats 'all - prefix caching' 2x on chat, 'all - speculative decoding' is 1.5x faster per token on
    reasoning (speculation costs there), nothing else moves; ``again``: an 'all (again)' column's chat tok/s."""
    ts = [{"name": "chat", "headline": "output_tok_s"}, {"name": "reasoning", "headline": "tpot_p50_ms"}]
    cols = [{"name": "all", "traffic": {"chat": cell(100), "reasoning": cell(100, tpot=60)}}]
    for tech in capstone.TECHNIQUES:
        chat = cell(50) if tech == "prefix caching" else cell(100)
        reasoning = cell(100, tpot=40) if tech == "speculative decoding" else cell(100, tpot=60)
        cols.append({"name": f"all - {tech}", "traffic": {"chat": chat, "reasoning": reasoning}})
    cols += [{"name": "transformers serve", "traffic": {"chat": cell(20), "reasoning": cell(20, tpot=120)}},
             {"name": "vllm serve", "skipped": "not installed"}]
    if again is not None:
        cols.append({"name": capstone.AGAIN, "traffic": {"chat": cell(again), "reasoning": cell(100, tpot=60)}})
    return {"traffics": ts, "columns": cols, "floor": capstone.FLOOR}


def test_decision_reads_each_technique_against_all_but_it():
    chat, reasoning = capstone.decision(synthetic())
    assert chat["techniques"]["prefix caching"]["verdict"] == "pays"
    assert chat["techniques"]["prefix caching"]["x"] == pytest.approx(2.0)
    assert chat["techniques"]["int8 weights"]["verdict"] == "~"
    # a time per token is better when smaller: 60 ms with speculation, 40 ms without -> it costs
    assert reasoning["techniques"]["speculative decoding"]["verdict"] == "costs"
    assert reasoning["techniques"]["speculative decoding"]["x"] == pytest.approx(40 / 60)
    # ours against the others is `all` against each, one run each: never the best of several of ours
    assert reasoning["ours_vs_transformers"] == {"x": pytest.approx(120 / 60), "verdict": "ahead"}
    assert chat["ours_vs_transformers"]["x"] == pytest.approx(5.0) and math.isnan(chat["ours_vs_vllm"]["x"])
    r = capstone.read(synthetic())
    text = format_decision(r)
    assert "pays 2.00x" in text and "costs 0.67x" in text and "1.15x" in text


def test_a_difference_is_called_only_beyond_the_runs_own_repeat():
    quiet = capstone.noise(synthetic(again=95))  # all measured again: 5 % apart, under the floor
    assert quiet["largest"] == pytest.approx(100 / 95) and quiet["threshold"] == pytest.approx(1 + capstone.FLOOR)
    loud = capstone.read(synthetic(again=60))  # the same work read 1.67x apart: 1.5x is no longer a difference
    assert loud["noise"]["threshold"] == pytest.approx(100 / 60)
    chat, reasoning = loud["decision"]
    assert reasoning["techniques"]["speculative decoding"]["verdict"] == "~"
    assert chat["techniques"]["prefix caching"]["verdict"] == "pays"  # 2x is still beyond 1.67x
    assert "1.67x on chat, all measured twice" in format_decision(loud)


def test_an_idle_prefix_cache_counts_as_the_same_work():
    r = synthetic()
    for c in r["columns"]:
        if "traffic" in c:
            c["traffic"]["reasoning"]["prefix_cache_hit_rate"] = 0.0
    next(c for c in r["columns"] if c["name"] == "all - prefix caching")["traffic"]["reasoning"]["tpot_p50_ms"] = 75
    n = capstone.noise(r)
    assert [(p["traffic"], p["against"]) for p in n["pairs"]] == [("reasoning", "all - prefix caching")]
    assert n["threshold"] == pytest.approx(75 / 60)
    assert capstone.decision(r)[1]["techniques"]["prefix caching"]["verdict"] == "idle"
    assert "no difference beyond noise on" in reading(capstone.read(r))


def test_payload_sends_vllm_extensions_only_when_asked():
    req = SampleRequest("hi", 1, 7)
    strict = payload("/v1/chat/completions", "m", req, ignore_eos=False, temperature=0.0)
    assert "ignore_eos" not in strict and strict["max_tokens"] == strict["max_completion_tokens"] == 7
    assert payload("/v1/chat/completions", "m", req, ignore_eos=True, temperature=0.0)["ignore_eos"] is True


def test_capstone_run_on_loopback_shared_prompt_hits_only_with_prefix_caching(tmp_path):
    r = capstone.run(scale=0.2, which=("all", "all - prefix caching"), only=("shared system prompt",),
                     progress=False)
    on, off = (c["traffic"]["shared system prompt"] for c in r["columns"])
    for x in (on, off):
        assert x["completed"] == x["requests"] == 3 and x["output_tokens"] == x["requested_tokens"]
    assert on["prefix_cache_hit_rate"] > 0.5 and off["prefix_cache_hit_rate"] == 0
    row = r["decision"][0]
    assert row["techniques"]["prefix caching"]["x"] == pytest.approx(on["output_tok_s"] / off["output_tok_s"])
    assert "shared system prompt" in format_full(r)
    plot_capstone(r).savefig(tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_transformers_serve_answers_the_load_generator():
    from labsupport.models.loader import resolve_model_path
    from labsupport.pd.cluster import start_all, stop_all
    from labsupport.servers import TransformersServer
    folder = str(resolve_model_path(None))
    w = TransformersServer(folder)
    start_all([w], 300)
    try:
        assert httpx.get(w.url + "/v1/models", timeout=10).status_code == 200
        r = benchmark(w.url, folder, [SampleRequest("Name three colors.", 4, 6)] * 2, ignore_eos=False,
                      progress=False, test_request=False)
        assert r.summary["completed"] == 2 and 2 <= r.summary["total_output_tokens"] <= 12
    finally:
        stop_all([w])
    assert not w.alive


def test_decision_table_prints_every_header_whole():
    r = capstone.load()  # the saved run the chapter shows
    header = re.split(r"\s{2,}", format_decision(r).splitlines()[1])  # columns stand two spaces apart
    assert header == ["traffic", "headline", *r["decision"][0]["techniques"], "all vs transformers", "all vs vLLM"]


def test_heatmap_labels_contrast_with_their_cells():
    """Each cell's text is black or white, whichever contrasts more: WCAG 2's ratio at least 4.5 on every cell,
    white on the darkest green (the saved run's 6.67x)."""
    import matplotlib.colors as mcolors

    from labsupport.viz.capstone_plot import text_color

    def luminance(color):
        return sum(w * (c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4)
                   for w, c in zip((0.2126, 0.7152, 0.0722), mcolors.to_rgb(color)))

    fig = plot_capstone(capstone.load())
    heat = fig.axes[0]
    image = heat.images[0]
    cells = [t for t in heat.texts if t.get_gid() == "capstone-cell"]
    assert len(cells) == image.get_array().size
    for t in cells:
        j, i = (round(v) for v in t.get_position())
        face = image.cmap(image.norm(image.get_array()[i, j]))
        lo, hi = sorted((luminance(t.get_color()), luminance(face)))
        assert (hi + 0.05) / (lo + 0.05) >= 4.5, t.get_text()
    darkest = min(cells, key=lambda t: luminance(image.cmap(image.norm(image.get_array()[
        round(t.get_position()[1]), round(t.get_position()[0])]))))
    assert darkest.get_color() == "white" and text_color((0.0, 0.4, 0.2)) == "white" and text_color((1, 1, 0.7)) == "black"
