"""The capstone: servers on loopback driven by the load generator, and the decision read from them."""
import copy
import math
import re

import httpx
import numpy as np
import pytest

from labsupport.experiments import capstone
from labsupport.bench.serving.serve_bench import benchmark, payload
from labsupport.bench.serving.serve_datasets import SampleRequest
from labsupport.viz.capstone_plot import format_decision, format_full, plot_capstone, reading


def per_request(ms, slo=1.0, tokens=10):
    """Per-request figures whose time per output token (and TPOT) is ``ms``, request by request."""
    ms = list(ms)
    met = round(slo * len(ms))
    return {"e2el_ms": [m * tokens for m in ms], "output_tokens": [tokens] * len(ms), "tpot_ms": ms,
            "ttft_ms": [m for m in ms], "slo_met": [1] * met + [0] * (len(ms) - met)}


def jitter(seed, n=16, spread=0.02):
    """The same requests measured once more: each within a few percent of its first figure."""
    return 1 + np.random.default_rng(seed).uniform(-spread, spread, n)


def cell(tok_s, slo=1.0, tpot=50.0, hit=0.5, seed=None):
    """A cell; with ``seed``, per-request figures around its headline (chat: 1000 / tok_s ms per token)."""
    x = {"output_tok_s": tok_s, "slo_attainment": slo, "tpot_p50_ms": tpot, "prefix_cache_hit_rate": hit,
         "usd_per_mtok": 0.1 / 3600 / tok_s * 1e6}
    if seed is not None:
        x["per_request"] = per_request(1000 / tok_s * jitter(seed), slo) | {"tpot_ms": list(tpot * jitter(seed + 1))}
    return x


def synthetic(again=None, samples=True, again_tpot=60.0):
    """all beats 'all - prefix caching' 2x on chat, 'all - speculative decoding' is 1.5x faster per token on
    reasoning (speculation costs there), nothing else moves; every cell with per-request figures (``samples``).
    ``again``: an 'all (again)' column's chat tok/s (its reasoning TPOT ``again_tpot``)."""
    seeds = iter(range(0, 1000, 10))

    def c(*a, **k):
        return cell(*a, **k, seed=next(seeds) if samples else None)
    ts = [{"name": "chat", "headline": "output_tok_s"}, {"name": "reasoning", "headline": "tpot_p50_ms"}]
    cols = [{"name": "all", "traffic": {"chat": c(100), "reasoning": c(100, tpot=60)}}]
    for tech in capstone.TECHNIQUES:
        chat = c(50) if tech == "prefix caching" else c(100)
        reasoning = c(100, tpot=40) if tech == "speculative decoding" else c(100, tpot=60)
        cols.append({"name": f"all - {tech}", "traffic": {"chat": chat, "reasoning": reasoning}})
    cols += [{"name": "transformers serve", "traffic": {"chat": c(20), "reasoning": c(20, tpot=120)}},
             {"name": "vllm serve", "skipped": "not installed"}]
    if again is not None:
        cols.append({"name": capstone.AGAIN, "traffic": {"chat": c(again), "reasoning": c(100, tpot=again_tpot)}})
    return {"traffics": ts, "columns": cols}


def test_a_word_only_where_the_interval_lies_outside_the_aa_band():
    r = capstone.read(synthetic(again=100))
    chat, reasoning = r["decision"]
    assert all(b["band"] and b["band"]["low"] > 0.9 and b["band"]["high"] < 1.1 for b in r["bands"])
    assert chat["techniques"]["prefix caching"]["verdict"] == "pays"
    assert chat["techniques"]["prefix caching"]["x"] == pytest.approx(2.0)
    assert chat["techniques"]["prefix caching"]["interval"]["high"] < r["bands"][0]["band"]["low"]
    assert chat["techniques"]["int8 weights"]["verdict"] == "level"  # the same work, request by request
    # a time per token is better when smaller: 60 ms with speculation, 40 ms without -> it costs
    assert reasoning["techniques"]["speculative decoding"]["verdict"] == "costs"
    assert reasoning["techniques"]["speculative decoding"]["x"] == pytest.approx(40 / 60)
    # ours against the others is `all` against each: never the best of several of ours
    assert reasoning["ours_vs_transformers"]["verdict"] == "ahead"
    assert chat["ours_vs_transformers"]["x"] == pytest.approx(5.0) and math.isnan(chat["ours_vs_vllm"]["x"])
    assert chat["ours_vs_vllm"]["verdict"] is None
    text = format_decision(r)
    assert "pays 2.00x" in text and "costs 0.67x" in text and "level 1.00x" in text and "A/A band" in text
    assert capstone.read(synthetic(again=100)) == r  # a seeded bootstrap: the same file reads the same


def test_a_loud_repeat_widens_the_band_and_the_same_ratio_reads_level():
    loud = capstone.read(synthetic(again=100, again_tpot=95))  # the same work read 1.6x apart on reasoning
    chat, reasoning = loud["decision"]
    assert loud["bands"][1]["band"]["high"] > 1.5  # all (again) / all: the band reaches past 60 / 40
    assert reasoning["techniques"]["speculative decoding"]["verdict"] == "level"
    assert chat["techniques"]["prefix caching"]["verdict"] == "pays"  # chat's own band stayed narrow
    assert "level (inside the A/A band) on reasoning" in reading(loud)


def test_one_run_each_gives_ratios_and_no_verdict_word():
    for r, why in ((capstone.read(synthetic(again=100, samples=False)), "no per-request figures"),
                   (capstone.read(synthetic(again=None)), "no all (again) column")):
        chat, reasoning = r["decision"]
        words = {v["verdict"] for row in r["decision"] for v in [*row["techniques"].values(),
                                                                   row["ours_vs_transformers"]]}
        assert words == {None}
        assert chat["techniques"]["prefix caching"]["x"] == pytest.approx(2.0)
        text = format_decision(r)
        assert why in text and "no verdict" in text and "pays" not in text and "costs" not in text
        assert " 2.00x" in text
        assert "one run each, no verdict: chat" in reading(r)


def test_an_idle_prefix_cache_says_idle_whatever_moved():
    r = synthetic(again=100)
    for c in r["columns"]:
        if "traffic" in c:
            c["traffic"]["reasoning"]["prefix_cache_hit_rate"] = 0.0
    assert capstone.decision(r)[1]["techniques"]["prefix caching"]["verdict"] == "idle"
    assert "idle (no prefix shared) on reasoning" in reading(capstone.read(r))


def planted(saved: dict, spread: float = 0.02) -> dict:
    """A copy of a saved run with per-request figures planted in every cell, around its own headline: the same
    requests, each within ``spread`` of its figure in every column, so the A/A band is narrow."""
    r = copy.deepcopy(saved)
    for k, c in enumerate(r["columns"]):
        for t in r["traffics"]:
            x = c.get("traffic", {}).get(t["name"])
            if x is None:
                continue
            n, j = t["requests"], jitter(k, t["requests"], spread)
            ms = {"output_tok_s": lambda: 1000 / x["output_tok_s"] * j, "e2el_p50_ms": lambda: x["e2el_p50_ms"] * j,
                  "slo_attainment": lambda: np.full(n, 100.0)}[t["headline"]]()
            x["per_request"] = per_request(ms, x["slo_attainment"])
    return capstone.read(r)


def test_saved_run_reads_through_its_own_bands_and_without_samples_as_ratios():
    saved = capstone.load()  # saved with each request's figures: an A/A band per traffic not sent at once
    at_once = {t["name"] for t in saved["traffics"] if math.isinf(t["rate"])}
    assert at_once == {"short chat", "shared system prompt", "long reasoning"}
    for b in saved["bands"]:
        if b["traffic"] in at_once:  # one burst a column: one sample, no band, whatever its requests say
            assert b["band"] is None and b["why_none"] == capstone.AT_ONCE
        else:
            assert b["band"] is not None and b["band"]["low"] <= 1.0 <= b["band"]["high"]
    for row in saved["decision"]:
        words = {v["verdict"] for v in [*row["techniques"].values(), row["ours_vs_transformers"], row["ours_vs_vllm"]]}
        assert words <= ({None, "idle"} if row["traffic"] in at_once else {"pays", "costs", "ahead", "behind", "level", "idle"})
    assert {v["verdict"] for row in saved["decision"] for v in row["techniques"].values()} & {"pays", "costs"}
    assert f"short chat, shared system prompt and long reasoning ({capstone.AT_ONCE})" in format_decision(saved)
    assert {t["name"] for t in saved["traffics"] if t["at_once"]} == at_once
    assert format_full(saved).count("rate all at once") == 3  # the table's caption reads the same flag
    assert capstone.read(saved)["decision"] == saved["decision"]  # the bootstrap is seeded: the same file, the same words
    bare = copy.deepcopy(saved)  # the same run without its per-request figures: ratios, no band, no word
    for c in bare["columns"]:
        for x in c.get("traffic", {}).values():
            x.pop("per_request", None)
    bare = capstone.read(bare)
    assert all(b["band"] is None for b in bare["bands"])
    assert {v["verdict"] for row in bare["decision"] for v in row["techniques"].values()} <= {None, "idle"}
    assert "ratios only, one run each, no verdict" in format_decision(bare)


def test_planted_samples_give_words_both_ways():
    saved = capstone.load()
    rows = {row["traffic"]: row for row in planted(saved)["decision"]}
    rag, bursty = rows["long-document RAG"], rows["bursty load"]
    assert rag["techniques"]["chunked prefill"]["verdict"] == "pays"  # SLO met 100 % against 40 %
    assert bursty["ours_vs_transformers"]["verdict"] == "ahead"  # 100 % against 71 %
    assert bursty["techniques"]["chunked prefill"]["verdict"] == "level"  # every SLO met with and without it
    spread_out = planted(saved)
    for t in spread_out["traffics"]:
        t["rate"] = 1.0  # the same figures as if no traffic had been sent at once: chat's words come back
    rows = {row["traffic"]: row for row in capstone.read(spread_out)["decision"]}
    shared, chat = rows["shared system prompt"], rows["short chat"]
    assert shared["techniques"]["prefix caching"]["verdict"] == "pays"  # 3.35x beyond a 2 % band
    assert chat["techniques"]["int8 weights"]["verdict"] == "costs"  # 0.66x
    assert chat["ours_vs_vllm"]["verdict"] == "behind" and shared["ours_vs_transformers"]["verdict"] == "ahead"


def test_a_traffic_sent_at_once_gets_ratios_and_no_verdict_however_its_requests_read():
    r = synthetic(again=100)
    r["traffics"][0]["rate"] = math.inf  # chat all at once; reasoning keeps no rate (an older file)
    read = capstone.read(r)
    chat, reasoning = read["decision"]
    assert read["bands"][0] == {**read["bands"][0], "band": None, "why_none": capstone.AT_ONCE}
    assert chat["techniques"]["prefix caching"] == {"x": pytest.approx(2.0), "verdict": None}
    assert reasoning["techniques"]["speculative decoding"]["verdict"] == "costs"  # a band of its own still
    assert f"no band, so ratios only, on chat ({capstone.AT_ONCE})" in format_decision(read)
    assert "one run each, no verdict: chat" in reading(read)
    r["traffics"][0]["rate"] = "inf"  # as a hand-written file might say it
    assert capstone.read(r)["bands"][0]["why_none"] == capstone.AT_ONCE


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
    for x in (on, off):  # each request's figures, in request order: the samples a verdict needs
        assert len(x["per_request"]["e2el_ms"]) == 3 and sum(x["per_request"]["output_tokens"]) == x["output_tokens"]
    row = r["decision"][0]
    assert row["techniques"]["prefix caching"]["x"] == pytest.approx(on["output_tok_s"] / off["output_tok_s"])
    assert r["bands"][0]["why_none"] == capstone.AT_ONCE  # sent at once: no band, with or without all (again)
    assert r["traffics"][0]["at_once"] and "rate all at once" in format_full(r)
    assert row["techniques"]["prefix caching"]["verdict"] is None  # no A/A run: a ratio, no word
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
    white on the darkest green (prefix caching's 6.31x on the shared prompt, with planted samples)."""
    import matplotlib.colors as mcolors

    from labsupport.viz.capstone_plot import text_color

    def luminance(color):
        return sum(w * (c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4)
                   for w, c in zip((0.2126, 0.7152, 0.0722), mcolors.to_rgb(color)))

    fig = plot_capstone(planted(capstone.load()))  # with verdicts, so cells are coloured
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
