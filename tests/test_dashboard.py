"""The chapter 06 dashboard: it reads a real server's /metrics while a load runs, stops cleanly,
and its histogram arithmetic is Prometheus'."""
import math
import threading

import pytest

from labsupport.bench.serving.serve_bench import benchmark
from labsupport.bench.serving.serve_datasets import sample_requests
from labsupport.serve.api import create_app
from labsupport.serve.background import BackgroundServer, free_port
from labsupport.serve.metrics import parse_metrics
from labsupport.viz.dashboard import (ServerDashboard, bucket_counts, histogram_buckets, histogram_quantile,
                                      svg_bars, svg_lines, tail_quantile)

N, IN, OUT = 6, 16, 5

EXPOSITION = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="m"} 40.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.6
"""


def test_histogram_arithmetic_is_prometheus():
    values = parse_metrics(EXPOSITION)
    cumulative = histogram_buckets(values, "vllm:time_to_first_token_seconds")
    assert cumulative == [(0.1, 1.0), (0.5, 3.0), (1.0, 4.0), (math.inf, 4.0)]
    counts = bucket_counts(cumulative)
    assert counts == [(0.1, 1.0), (0.5, 2.0), (1.0, 1.0), (math.inf, 0.0)]
    # histogram_quantile(0.5): rank 2 falls in (0.1, 0.5], halfway through its 2 observations
    assert histogram_quantile(0.5, counts) == pytest.approx(0.3)
    assert histogram_quantile(1.0, counts) == pytest.approx(1.0)
    assert math.isnan(histogram_quantile(0.5, bucket_counts(cumulative, cumulative)))  # nothing new since
    assert histogram_quantile(0.99, [(0.1, 0.0), (math.inf, 5.0)]) == 0.1  # the highest finite bound


def test_a_tail_of_fewer_than_100_observations_is_called_the_max_to_its_bucket():
    from labsupport.viz.prom_histogram import quantiles_text
    few = [(0.1, 1.0), (0.5, 2.0), (1.0, 1.0), (2.5, 12.0), (math.inf, 0.0)]   # 16 requests
    assert quantiles_text(few) == "P50 ≈ 1.50 s, max ≤ 2.50 s (n = 16)"   # rank 8: 4 of the 12 in (1, 2.5]
    assert quantiles_text([(0.1, 3.0), (math.inf, 2.0)]) == "P50 ≈ 83 ms, max > 100 ms (n = 5)"
    many = [(0.1, 50.0), (0.5, 49.0), (1.0, 1.0), (math.inf, 0.0)]
    assert quantiles_text(many) == f"P50 ≈ 100 ms, P99 ≈ {1000 * histogram_quantile(0.99, many):.0f} ms (n = 100)"
    assert quantiles_text([(0.1, 0.0)]) == "no observations"


class Canned(ServerDashboard):
    """A dashboard whose scrapes are canned expositions (vLLM's names), one per poll."""

    def __init__(self, texts, **kw):
        super().__init__("http://unused:1/v1", **kw)
        self.texts = iter(texts)

    def scrape(self):
        return parse_metrics(next(self.texts))


def test_vllm_names_are_read_and_histograms_count_from_the_first_scrape():
    later = (EXPOSITION.replace(" 40.0", " 100.0").replace('le="1.0",model_name="m"} 4.0', 'le="1.0",model_name="m"} 6.0')
             .replace('le="+Inf",model_name="m"} 4.0', 'le="+Inf",model_name="m"} 6.0'))
    dash = Canned([EXPOSITION, later])
    assert dash.url == "http://unused:1"
    assert dash.poll_once()["running"] == 3.0 and dash.prefix == "vllm:"
    dash.samples[0]["t"] = 0.0
    dash.poll_once()
    dash.samples[1]["t"] = 2.0
    s = dash.summary()
    assert s["max_running"] == 3 and s["max_waiting"] == 2 and s["max_kv_usage"] == 0.25
    assert s["generation_tokens"] == 60 and s["tokens_per_s"] == 30
    assert dash.histogram("time_to_first_token_seconds") == [(0.1, 0.0), (0.5, 0.0), (1.0, 2.0), (math.inf, 0.0)]
    assert s["ttft_count"] == 2 and s["p50_ttft_s"] == pytest.approx(0.75)
    # two observations: no P99, the tail is the highest occupied bucket's bound
    assert "p99_ttft_s" not in s and s["max_bound_ttft_s"] == 1.0


def test_summary_gives_a_p99_only_from_100_observations():
    few = [(0.1, 0.0), (0.5, 98.0), (1.0, 1.0), (math.inf, 0.0)]
    assert tail_quantile(few) == ("max_bound", 1.0)
    assert tail_quantile([(0.1, 0.0), (0.5, 98.0), (math.inf, 1.0)]) == ("max_bound", math.inf)
    label, value = tail_quantile([(0.1, 0.0), (0.5, 99.0), (1.0, 1.0), (math.inf, 0.0)])
    assert label == "p99" and value == pytest.approx(0.5)
    assert math.isnan(tail_quantile([])[1])


def test_svg_panels_draw_lines_bars_and_an_empty_state():
    page = svg_lines("requests", [("running", "#1f77b4", [0, 1, 2], [1, 3, 2]),
                                  ("waiting", "#ff7f0e", [0, 1, 2], [0, 0, 1])], step=True)
    assert page.count("<polyline") == 2 and ">running<" in page and ">waiting<" in page
    bars = svg_bars("TTFT", [(0.1, 0.0), (0.5, 2.0), (1.0, 1.0), (math.inf, 0.0)], "#d62728")
    assert bars.count("<rect") == 4 and "≤ 500ms: 2" in bars
    assert "no observations yet" in svg_bars("ITL", [], "#17becf")


def test_dashboard_watches_a_real_load_and_stops_cleanly(llm):
    requests = sample_requests(llm.tokenizer, "random", N, input_len=IN, output_len=OUT, seed=0)
    with BackgroundServer(create_app(llm, "smol")) as server:
        with ServerDashboard(server.url + "/v1", interval_s=0.1) as dash:
            view = dash.widget
            assert dash.running
            run = benchmark(server.url, "smol", requests, rate=float("inf"), progress=False, test_request=False)
        assert not dash.running and not any(t.name == "dashboard-poller" for t in threading.enumerate())
    assert run.summary["completed"] == N
    s = dash.summary()
    assert s["samples"] >= 2 and dash.prefix == "labsupport:"
    assert s["requests"] == N and s["ttft_count"] == N and s["generation_tokens"] == N * OUT
    assert s["itl_count"] == N * (OUT - 1)
    assert 1 <= s["max_running"] <= N
    html = view.value  # the widget holds the last drawing, made after the last scrape
    assert "stopped" in html and html.count("<svg") == 5 and "since the dashboard started" in html
    fig = dash.plot()
    assert len(fig.axes) == 6 and "TTFT" in fig.axes[3].get_title()
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_poller_gives_up_when_the_server_is_gone():
    dash = ServerDashboard(f"http://127.0.0.1:{free_port()}", interval_s=0.01, max_failures=3).start()
    dash._thread.join(10)
    assert not dash.running and dash.samples == []
    assert dash.last_error.startswith("gave up after 3 failed scrapes")
    dash.stop()  # still safe: one more failed scrape, nothing drawn, no error
    assert "0 scrapes" in dash.render_html()


def test_stop_fills_the_place_show_made_with_the_last_drawing(monkeypatch):
    """show() puts the live widget and an empty place under it; stop() fills that place with the last drawing as
    plain HTML and SVG, which a saved notebook shows without the kernel the widget's view needs."""
    import IPython.display

    shown = []

    class Handle:
        def update(self, obj, raw=False):
            shown.append(("update", obj, raw))

    def fake_display(obj, raw=False, display_id=None):
        shown.append(("display", obj, raw))
        return Handle() if display_id else None

    monkeypatch.setattr(IPython.display, "display", fake_display)
    dash = Canned([EXPOSITION, EXPOSITION.replace(" 40.0", " 100.0")], title="canned load")
    assert dash.show() is dash
    assert shown[0][1] is dash and shown[1] == ("display", {"text/plain": ""}, True)   # the widget, then the place
    dash.poll_once()
    dash.stop()                                             # its last scrape, drawn in the widget and saved
    (what, saved, raw), = shown[2:]
    assert what == "update" and raw and set(saved) == {"text/html", "text/plain"}
    assert "application/vnd.jupyter.widget-view+json" not in saved
    assert saved["text/html"].count("<svg") == 5 and "stopped" in saved["text/html"] and "<polyline" in saved["text/html"]
    assert "peak running / waiting: 3 / 2" in saved["text/plain"] and "canned load" in saved["text/plain"]
    assert dash.widget.value in saved["text/html"]          # the same drawing as the widget's last one


def test_chapter_06_saves_the_dashboards_last_drawing_beside_the_widget():
    """The executed chapter keeps, next to the widget (blank once reopened without its kernel), a static copy."""
    from notebook_tools import chapter, read

    cell = next(c for c in read(chapter("06")).cells if c.cell_type == "code" and "dashboard.show()" in c.source)
    kinds = [set(o.get("data", {})) for o in cell.outputs if o.output_type == "display_data"]
    assert any("application/vnd.jupyter.widget-view+json" in k for k in kinds)
    static = [o.data["text/html"] for o in cell.outputs if "text/html" in o.get("data", {})]
    assert len(static) == 1 and static[0].count("<svg") == 5 and "<polyline" in static[0]
    assert "stopped" in static[0]
