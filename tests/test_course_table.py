"""``bench course-table``: the table the notebooks show, the server flags behind each row, and one real
quick measurement of two rows on loopback (prefix caching off and on)."""
import copy
import json
import math

import pytest

from labsupport.experiments import course_table as ct
from labsupport.viz import course_table_plot as view


@pytest.fixture(scope="module")
def saved():
    return view.load()


def test_saved_run_has_every_chapter_the_price_and_the_slos(saved):
    assert [r["chapter"] for r in saved["rows"]] == list(ct.ROW_IDS)
    assert saved["usd_per_hour"] > 0 and set(saved["slo_ms"]) == {"ttft", "tpot"}
    assert saved["machine"]["cores"] and saved["machine"]["torch"] and saved["machine"]["device"] == "cpu"
    assert saved["sizes"]["kv_bytes"] == saved["sizes"]["kv_blocks"] * saved["sizes"]["block_size"] * \
        saved["sizes"]["kv_bytes_per_token"]
    for r in saved["rows"]:
        if "capacity" in r:  # measured (vLLM may be skipped, with its reason)
            for key in ("capacity", "bursty", "poisson"):
                run = r[key]
                assert run["requests"] == saved["sizes"]["num_requests"]  # the same n sent to every row, row 00 too
                if run["completed"] == run["requests"]:
                    assert run["output_tokens"] == run["requested_tokens"]
                else:  # only the row without a KV cache may fall behind; the table's note then says how far
                    assert r["chapter"] == "00" and run["output_tokens"] < run["requested_tokens"]
                    assert f"{run['completed']} of {run['requests']}" in view._incomplete(r)
        else:
            assert r["skipped"] and "not measured" in r["note"]


def test_show_lists_rows_up_to_the_chapter_and_highlights_it(saved):
    table = view.show_course_table("03")
    assert [c[0] for c in table.cells] == ["00", "01", "02", "03"]  # later chapters left out
    md, html = table.markdown, table._repr_html_()
    assert "| **03** | **multi-level cache** |" in md and "**02**" not in md
    assert html.count("background:#fff3c4") == 1
    highlighted = html.split("background:#fff3c4")[1].split("</tr>")[0]
    assert "multi-level cache" in highlighted
    assert f"${saved['usd_per_hour']:.2f}/hour" in table.caption and saved["date"] in table.caption
    assert len(view.show_course_table(8).cells) == 9 and view.show_course_table(0).cells[0][1] == "from model to API"


def test_tails_are_called_max_below_100_samples(saved):
    assert ct.ttft_tail_of([float(i) for i in range(99)]) == ("max", 98.0)
    label, value = ct.ttft_tail_of([float(i) for i in range(100)])
    assert label == "P99" and value == pytest.approx(98.01)
    for r in saved["rows"]:
        for run in (r.get(k) for k in ("bursty", "poisson")):
            if run:
                assert run["ttft_tail_label"] == ("P99" if run["completed"] >= 100 else "max")
    small = copy.deepcopy(saved)
    small["rows"][0]["bursty"].update(ttft_tail_label="max", ttft_tail_ms=1234.0)
    assert "1234 (max)" in view.show_course_table("00", small).markdown


def test_plot_has_one_cost_bar_and_one_goodput_bar_per_chapter_shown(saved):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    fig = view.plot_course_table("04", path=schema1(saved))   # the first layout: one goodput bar each
    cost_ax, good_ax = fig.axes[0], fig.axes[1]
    assert [t.get_text().split("\n")[0] for t in cost_ax.get_xticklabels()] == ["00", "01", "02", "03", "04"]
    assert len(cost_ax.patches) == 5 and len(good_ax.patches) == 5
    heights = [p.get_height() for p in cost_ax.patches]
    assert heights == pytest.approx([r["capacity"]["usd_per_mtok"] for r in saved["rows"][:5]])
    colors = [p.get_facecolor() for p in cost_ax.patches]
    assert colors[-1] != colors[0]  # this chapter's bar stands out
    plt.close(fig)


class _Captured(Exception):
    pass


def engine_options_of(monkeypatch, args: list[str]) -> dict:
    """What ``python -m labsupport serve ARGS`` hands the engine (the model is never loaded)."""
    import labsupport
    from labsupport.__main__ import main
    seen = {}

    def fake_llm(**kwargs):
        seen.update(kwargs)
        raise _Captured

    def fake_core(options, args):  # the default: the engine core in its own process
        seen.update(options, enable_result_cache=args.enable_result_cache)
        raise _Captured

    monkeypatch.setattr(labsupport, "LLM", fake_llm)
    monkeypatch.setattr("labsupport.serve.server.start_engine_core", fake_core)
    with pytest.raises(_Captured):
        main(["serve", *args])
    return seen


def test_each_row_runs_the_server_flags_it_claims_under_one_kv_budget(monkeypatch):
    s = ct.Sizes(kv_bytes_per_token=46080)
    for row in ct.rows():
        if row.kind == "vllm":
            args = ct.row_args(row, s)["server"]
            assert "--enable-prefix-caching" in args and "--enable-chunked-prefill" in args
            assert args[args.index("--num-gpu-blocks-override") + 1] == str(s.kv_blocks + 1)  # vLLM's null block
            assert args[args.index("--max-num-seqs") + 1] == str(s.max_num_seqs)
            continue
        kv_bytes, seqs = 0, 0
        for role, args in ct.row_args(row, s).items():  # every engine process of the row
            got = engine_options_of(monkeypatch, args)
            for key, value in row.engine.items():
                assert got[key] == value, (row.chapter, role, key)
            kv_bytes, seqs = kv_bytes + got["kv_cache_memory_bytes"], seqs + got["max_num_seqs"]
            assert got["kv_cache_memory_bytes"] % (s.block_size * s.kv_bytes_per_token) == 0  # whole blocks
            assert got["block_size"] == s.block_size and got["enable_result_cache"] is False
            assert got["max_num_batched_tokens"] == (s.chunk_tokens if row.engine.get("enable_chunked_prefill") else 8192)
        assert (kv_bytes, seqs) == (s.kv_bytes, s.max_num_seqs), row.chapter  # the row's processes together


def test_pd_row_splits_the_budget_with_the_larger_half_on_the_decode_worker():
    pd = next(r for r in ct.rows() if r.kind == "pd")
    for blocks, seqs in ((28, 8), (29, 7), (2, 2)):
        parts = ct.process_sizes(pd, ct.Sizes(kv_blocks=blocks, max_num_seqs=seqs))
        assert list(parts) == ["prefill", "decode"]
        assert parts["prefill"].kv_blocks + parts["decode"].kv_blocks == blocks
        assert parts["prefill"].max_num_seqs + parts["decode"].max_num_seqs == seqs
        assert parts["decode"].kv_blocks >= parts["prefill"].kv_blocks >= 1
        assert parts["decode"].max_num_seqs >= parts["prefill"].max_num_seqs >= 1


def test_each_row_adds_its_own_chapter_idea_to_the_one_before():
    ours = {r.chapter: r.engine for r in ct.rows() if r.kind != "vllm"}

    def diff(a, b):
        return {k: ours[b].get(k) for k in set(ours[a]) | set(ours[b]) if ours[a].get(k) != ours[b].get(k)}

    assert diff("00", "01") == {"kv_cache": "contiguous"} and diff("01", "02") == {"kv_cache": "paged"}
    assert diff("02", "03") == {"enable_prefix_caching": True}
    assert diff("03", "04") == {"scheduling_policy": "continuous"}
    assert diff("04", "05") == {"enable_chunked_prefill": True}
    assert diff("05", "06") == {} and diff("06", "07") == {}  # 06: the same server; 07: split across processes
    assert [r.kind for r in ct.rows()][-2:] == ["pd", "vllm"]


def test_workload_shares_the_system_prompt_and_never_repeats_a_question(llm):
    s = ct.Sizes(num_requests=12)
    a, b = ct.workload(llm.tokenizer, s, 0), ct.workload(llm.tokenizer, s, 1)
    assert len({r.prompt for r in a + b}) == 24  # no exact repeats: a result cache could only miss
    system = a[0].prompt.split("\nEmployee question")[0]
    assert all(r.prompt.startswith(system) for r in a + b)
    assert s.system_tokens <= len(llm.tokenizer.encode(system)) <= s.system_tokens + 80
    assert {r.output_len for r in a} <= set(s.output_lens)
    assert [r.prompt for r in ct.workload(llm.tokenizer, s, 0)] == [r.prompt for r in a]  # seeded


@pytest.mark.slow
def test_quick_run_of_two_rows_on_loopback(tmp_path):
    """Rows 02 (paged) and 03 (+ prefix caching) measured for real through the command line."""
    from labsupport.__main__ import main
    out = tmp_path / "t.json"
    argv = ["bench", "course-table", "--quick", "--rows", "02,03", "--json", str(out)]
    assert main(argv) == 0
    t = json.loads(out.read_text())
    rows = {r["chapter"]: r for r in t["rows"]}
    assert list(rows) == ["02", "03"] and t["usd_per_hour"] == 0.10 and t["schema"] == ct.SCHEMA == 3
    assert t["workload"]["poisson"]["burstiness"] == 1.0 and t["workload"]["bursty"]["burstiness"] == 0.5
    assert all(r["kv_blocks"] == ct.QUICK.kv_blocks for r in rows.values())
    for r in rows.values():
        for name in ("capacity", "bursty", "poisson"):  # both arrival processes by default
            run = r[name]
            assert run["completed"] == run["requests"] == ct.QUICK.num_requests and not run["errors"]
            assert run["output_tokens"] == run["requested_tokens"]  # ignore_eos: every token asked for
            assert 0 <= run["slo_attainment"] <= 1 and run["ttft_tail_label"] == "max"
            assert run["ttft_p50_ms"] <= run["ttft_tail_ms"]
        assert r["bursty"]["goodput_req_s"] <= ct.QUICK.rate + 1e-9
        cap = r["capacity"]
        assert cap["usd_per_mtok"] == pytest.approx(0.10 / 3600 / cap["output_tok_s"] * 1e6)
    assert rows["02"]["bursty"]["prefix_cache_hit_rate"] == 0.0
    assert rows["03"]["bursty"]["prefix_cache_hit_rate"] > 0.3  # the shared system prompt
    assert "capacity_vs_00" not in rows["02"] and not math.isnan(rows["03"]["capacity"]["output_tok_s"])
    table = view.show_course_table("03", t)
    assert [c[0] for c in table.cells] == ["02", "03"]
    assert "gamma / Poisson" in table.head[5] and table.cells[1][8].count("(max)") == 2  # 4 requests: maxima
    assert "Poisson" in table.caption and "one KV budget" in table.caption


def schema1(saved):
    """The saved run in the first layout: gamma arrivals only, no schema key."""
    t = copy.deepcopy(saved)
    t.pop("schema", None)
    t["workload"].pop("poisson", None)
    for r in t["rows"]:
        r.pop("poisson", None)
    return t


def schema2(saved, n=100):
    """The saved run as a schema-2 run would look: a Poisson run beside every bursty one, n requests each."""
    t = copy.deepcopy(saved)
    t.update(schema=2)
    t["workload"]["poisson"] = {**t["workload"]["bursty"], "burstiness": 1.0}
    for r in t["rows"]:
        if "bursty" in r:
            r["bursty"].update(completed=n, requests=n, ttft_tail_label="P99" if n >= 100 else "max")
            r["poisson"] = {**r["bursty"], "goodput_req_s": r["bursty"]["goodput_req_s"] + 0.5, "ttft_tail_ms": 4321.0}
    return t


def test_schema2_table_shows_poisson_beside_gamma_with_each_tail_labelled(saved):
    t = schema2(saved)
    table = view.show_course_table("04", t)
    assert table.head[5] == "goodput req/s gamma / Poisson" and len(table.head) == 12
    r = t["rows"][4]
    assert table.cells[4][5] == f"{r['bursty']['goodput_req_s']:.2f} / {r['poisson']['goodput_req_s']:.2f}"
    assert table.cells[4][8].endswith("(P99) / 4321 (P99)")
    assert "max" in view.show_course_table("04", schema2(saved, n=24)).cells[4][8]
    assert f"Poisson {t['sizes']['num_requests']} requests" in table.caption
    assert f"{t['sizes']['kv_blocks']} blocks" in table.caption
    old = schema1(saved)
    assert "Poisson" not in view.show_course_table("04", old).caption.split("load:")[-1]  # the first layout: gamma only
    moved = view.what_moved("04", t)
    assert "goodput under Poisson arrivals" in moved and "Poisson" not in view.what_moved("04", old)


def test_every_row_after_00_states_its_factor_against_row_00(saved):
    by = {r["chapter"]: r for r in saved["rows"]}
    for chapter in ("01", "03", "08"):  # 01 too, whose row before it is row 00 itself
        factor = by["00"]["capacity"]["usd_per_mtok"] / by[chapter]["capacity"]["usd_per_mtok"]
        assert f"a million output tokens costs {factor:.1f}x less" in view.what_it_bought(chapter)
    assert "the starting line" in view.what_it_bought("00") and "Against row 00" not in view.what_it_bought("00")


def test_schema2_plot_draws_poisson_goodput_beside_bursty(saved):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    t = schema2(saved)
    fig = view.plot_course_table("04", path=t)
    good_ax = fig.axes[1]
    assert len(fig.axes[0].patches) == 5 and len(good_ax.patches) == 10  # bursty and Poisson bar per chapter
    heights = [p.get_height() for p in good_ax.patches[5:]]
    assert heights == pytest.approx([r["poisson"]["goodput_req_s"] for r in t["rows"][:5]])
    assert "Poisson" in " ".join(x.get_text() for x in fig.legends[0].get_texts())
    plt.close(fig)


def test_what_moved_gives_figures_and_ratios_but_no_verdict_word_from_one_run(saved):
    t = copy.deepcopy(saved)
    by = {r["chapter"]: r for r in t["rows"]}
    by["03"]["capacity"]["output_tok_s"], by["04"]["capacity"]["output_tok_s"] = 100.0, 112.0     # +12 %
    by["03"]["bursty"]["ttft_p50_ms"], by["04"]["bursty"]["ttft_p50_ms"] = 900.0, 150.0         # 6x lower
    text = view.what_moved("04", t)
    assert "TTFT P50 900 → 150 ms (0.17×)" in text and "output 100.0 → 112.0 tok/s (1.12×)" in text
    assert "one run each" in text
    for word in ("higher", "lower", "beyond", "faster", "slower"):  # one run per row: no verdict words
        assert word not in text.split("saved run of")[1], word
    for run in ("capacity", "bursty"):
        by["04"][run] = copy.deepcopy(by["03"][run])
    assert "no figure changed" in view.what_moved("04", t) and "the same:" in view.what_moved("04", t)
    assert "no measured row before it" in view.what_moved("00", t)


def test_wait_idle_waits_for_a_server_to_drain_what_a_run_left_queued():
    """A loopback /metrics that reports requests running for its first reads, then none: the next run waits."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    reads = []

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            reads.append(self.path)
            busy = 1 if len(reads) <= 2 else 0
            body = f"labsupport:num_requests_running {busy}\nlabsupport:num_requests_waiting 0\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert ct.wait_idle(url, timeout_s=10) and len(reads) == 3   # busy, busy, idle
        assert not ct.wait_idle("http://127.0.0.1:9", timeout_s=1)   # nothing answers: cannot tell, no wait
    finally:
        server.shutdown()
