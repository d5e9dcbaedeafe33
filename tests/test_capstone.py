"""The capstone: servers on loopback driven by the load generator, and the decision read from them."""
import math

import httpx
import pytest

from labsupport.bench import capstone
from labsupport.bench.serve_bench import benchmark, payload
from labsupport.bench.serve_datasets import SampleRequest
from labsupport.viz.capstone import format_decision, format_full, plot_capstone


def cell(tok_s, slo=1.0, tpot=50.0):
    return {"output_tok_s": tok_s, "slo_attainment": slo, "tpot_p50_ms": tpot, "usd_per_mtok": 0.1 / 3600 / tok_s * 1e6}


def synthetic():
    """all beats 'all - prefix caching' 2x on chat, 'all - speculative decoding' is 1.5x faster per token on
    reasoning (speculation costs there), nothing else moves."""
    ts = [{"name": "chat", "headline": "output_tok_s"}, {"name": "reasoning", "headline": "tpot_p50_ms"}]
    cols = [{"name": "all", "traffic": {"chat": cell(100), "reasoning": cell(100, tpot=60)}}]
    for tech in capstone.TECHNIQUES:
        chat = cell(50) if tech == "prefix caching" else cell(100)
        reasoning = cell(100, tpot=40) if tech == "speculative decoding" else cell(100, tpot=60)
        cols.append({"name": f"all - {tech}", "traffic": {"chat": chat, "reasoning": reasoning}})
    cols += [{"name": "transformers serve", "traffic": {"chat": cell(20), "reasoning": cell(20, tpot=120)}},
             {"name": "vllm serve", "skipped": "not installed"}]
    return {"traffics": ts, "columns": cols, "pays_above": capstone.PAYS}


def test_decision_reads_each_technique_against_all_but_it():
    chat, reasoning = capstone.decision(synthetic())
    assert chat["techniques"]["prefix caching"]["verdict"] == "pays"
    assert chat["techniques"]["prefix caching"]["x"] == pytest.approx(2.0)
    assert chat["techniques"]["int8 weights"]["verdict"] == "~"
    # a time per token is better when smaller: 60 ms with speculation, 40 ms without -> it costs
    assert reasoning["techniques"]["speculative decoding"]["verdict"] == "costs"
    assert reasoning["techniques"]["speculative decoding"]["x"] == pytest.approx(40 / 60)
    assert reasoning["best_ours"] == "all - speculative decoding"
    assert reasoning["best_vs_transformers"] == pytest.approx(120 / 40)
    assert chat["best_vs_transformers"] == pytest.approx(5.0) and math.isnan(chat["best_vs_vllm"])
    text = format_decision(synthetic() | {"decision": [chat, reasoning]})
    assert "pays 2.00x" in text and "costs 0.67x" in text


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
    from labsupport.side_by_side.servers import TransformersServer
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
