"""``bench serve``: the HTTP load generator, against a real loopback server of ours.

The server is built only with ``create_app(llm)`` and driven only through the standard OpenAI
endpoints, as the generator drives ``vllm serve``. The pure parts (goodput, arrivals, the
/metrics diff, the summary) are checked on hand-made numbers.
"""
import asyncio
import importlib.util
import json
import math

import numpy as np
import pytest

from labsupport.bench.serving.serve_bench import BenchResult, RequestResult, benchmark, goodput, summarize
from labsupport.bench.serving.serve_datasets import SampleRequest, arrival_gaps, arrival_times, sample_requests
from labsupport.bench.serving.serve_metrics import parse_metrics, server_metrics_delta
from labsupport.percentiles import tail
from labsupport.serve.api import create_app
from labsupport.serve.background import BackgroundServer

N, IN, OUT = 6, 16, 8


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(create_app(llm)) as srv:
        yield srv


@pytest.fixture(scope="module")
def sweep(server, llm, tmp_path_factory):
    """The command line once, at rate 4 (Poisson) then inf: its saved JSON files and its exit status."""
    from labsupport.__main__ import main
    out = tmp_path_factory.mktemp("bench")
    argv = ["bench", "serve", "--base-url", server.url, "--model", llm.model_name, "--num-prompts", str(N),
            "--random-input-len", str(IN), "--random-output-len", str(OUT), "--request-rate", "4", "inf",
            "--goodput", "ttft:60000", "tpot:60000", "--usd-per-hour", "2", "--save-result", "--result-dir", str(out),
            "--result-filename", "run.json", "--disable-tqdm"]
    if importlib.util.find_spec("matplotlib"):  # the course extra
        argv += ["--plot", str(out / "knee.png")]
    rc = main(argv)
    return rc, out


@pytest.mark.parametrize("rate", ["4", "inf"])
def test_cli_sweep_saves_one_json_per_rate_with_every_request_complete(sweep, rate):
    rc, out = sweep
    assert rc == 0
    run = json.loads((out / f"run-{rate}qps.json").read_text())
    assert run["request_rate"] == (4.0 if rate == "4" else "inf") and run["burstiness"] == 1.0
    assert run["completed"] == N and run["failed"] == 0 and run["first_errors"] == []
    assert run["output_lens"] == [OUT] * N and run["total_output_tokens"] == N * OUT  # ignore_eos
    assert all(n >= IN for n in run["input_lens"])  # the server's count: the text plus the chat template
    assert all(0 < t <= e for t, e in zip(run["ttfts"], run["e2els"]))
    assert all(len(gaps) <= OUT - 1 for gaps in run["itls"])
    assert run["median_ttft_ms"] <= run["p90_ttft_ms"] <= run["p99_ttft_ms"]
    assert run["request_goodput"] == pytest.approx(run["request_throughput"])  # SLOs of a minute: all good
    expected_cost = 2 / 3600 / run["output_throughput"] * 1e6
    assert run["usd_per_million_output_tokens"] == pytest.approx(expected_cost)
    if run.get("server_metrics_prefix"):  # our /metrics (labsupport:): each request waited >= 0 in the queue
        assert run["server_metrics_prefix"] == "labsupport:" and run["mean_queue_time_ms"] >= 0


def test_cli_plot_when_matplotlib_is_there(sweep):
    pytest.importorskip("matplotlib")
    assert (sweep[1] / "knee.png").stat().st_size > 10_000


def test_python_api_with_max_concurrency(server, llm):
    requests = sample_requests(llm.tokenizer, "random", 3, IN, 4, seed=1)
    assert [r.prompt_len for r in requests] == [IN] * 3

    async def in_a_notebook():  # a Jupyter kernel's loop is running: benchmark() must still work
        return benchmark(server.url, llm.model_name, requests, rate=math.inf, max_concurrency=2, progress=False,
                         endpoint="/v1/completions", test_request=False)

    result = asyncio.run(in_a_notebook())
    assert result["completed"] == 3 and result["failed"] == 0
    for r in result.requests:
        assert r.success and r.output_tokens == 4 and r.prompt_len == IN and r.generated_text
        assert 0 < r.ttft <= r.latency and r.tpot > 0


def test_each_request_records_the_prompt_tokens_the_server_found_cached():
    """usage.prompt_tokens_details.cached_tokens, per request: the same prompt sent twice, one after the other, finds
    its full blocks cached the second time; a prompt nobody sent before finds none."""
    from labsupport import LLM
    cached_llm = LLM(device="cpu", enable_prefix_caching=True, num_blocks=64)
    first, other = sample_requests(cached_llm.tokenizer, "random", 2, 64, 2, seed=41)
    with BackgroundServer(create_app(cached_llm)) as srv:
        result = benchmark(srv.url, cached_llm.model_name, [first, first, other], rate=math.inf, max_concurrency=1,
                           progress=False, test_request=False, endpoint="/v1/completions")   # no chat template
    cached = [r.cached_tokens for r in result.requests]
    assert all(r.success for r in result.requests) and cached[0] == 0 and cached[2] == 0, cached
    assert 0 < cached[1] < 64 and cached[1] % cached_llm.engine.config.block_size == 0, cached


def test_interrupting_a_benchmark_in_a_notebook_returns_at_once_and_the_server_aborts_its_requests(server, llm):
    """The stop button during a sweep: KeyboardInterrupt in the kernel's thread while the load runs in its
    own. It must come back within a second (it took 5-9 s), and the requests must not run on."""
    import signal
    import threading
    import time

    from server_tools import wait_idle_and_free
    requests = sample_requests(llm.tokenizer, "random", 4, IN, 400, seed=2)  # ~10 s of decoding here
    sent = {}

    def interrupt_once_running():
        from waiting import wait_until
        wait_until(lambda: llm.stats()["num_requests_running"], 60, message="a request is running")
        sent["at"] = time.perf_counter()
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    async def cell():  # inside a running event loop, as a notebook cell is
        return benchmark(server.url, llm.model_name, requests, rate=math.inf, progress=False, test_request=False)

    # The kernel's own precondition, stated rather than inherited: the signal goes to the thread running the cell,
    # and SIGINT raises KeyboardInterrupt there (as ipykernel's handler does). Started as a background job of a
    # non-interactive shell, pytest inherits SIGINT ignored, and Python then installs no handler at all.
    assert threading.current_thread() is threading.main_thread(), "the interrupt must reach this test's thread"
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    loop = asyncio.new_event_loop()  # run_until_complete, not asyncio.run: no SIGINT handler of asyncio's
    threading.Thread(target=interrupt_once_running, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(cell())
    finally:
        loop.close()
        signal.signal(signal.SIGINT, previous)
    assert time.perf_counter() - sent["at"] < 1.0
    wait_idle_and_free(llm, timeout=5)  # the server saw the hang-ups and aborted every request
    assert llm.stats()["num_requests_running"] == 0


def test_a_plot_after_an_interrupted_sweep_says_so_instead_of_drawing(capsys):
    pytest.importorskip("matplotlib")
    from labsupport.bench.serving.serve_plots import plot_results
    run = BenchResult({"request_rate": 1.0}, summarize([made(10, 50, 4)], 1.0), [made(10, 50, 4)])
    assert plot_results([], title="x") is None
    assert "incomplete: 0 of its rates ran" in capsys.readouterr().out
    assert plot_results([run], expected=3) is None
    assert "incomplete: 1 of 3 rates ran" in capsys.readouterr().out
    assert plot_results([run, run, run], expected=3) is not None


def test_a_wrong_model_is_one_clear_error_not_n_failures(server):
    requests = [SampleRequest("Hi", 1, 2)]
    with pytest.raises(RuntimeError, match="404"):
        benchmark(server.url, "no-such-model", requests, progress=False)


def made(ttft_ms, e2e_ms, tokens, start=0.0, success=True):
    return RequestResult(prompt_len=4, output_len=tokens, success=success, start_time=start, ttft=ttft_ms / 1000,
                         latency=e2e_ms / 1000, output_tokens=tokens)


def test_goodput_counts_requests_meeting_every_slo_per_second():
    results = [made(100, 1000, 10, start=0.0),   # TPOT 100 ms
               made(300, 1200, 10, start=1.0),   # TTFT too slow
               made(100, 2800, 10, start=2.0),   # TPOT 300 ms: too slow
               made(50, 900, 10, start=3.0, success=False),  # failed: never good
               made(80, 80, 1, start=3.0)]       # one token: TPOT counts as 0 (as vLLM)
    slo = {"ttft": 200, "tpot": 150}
    assert goodput(results, slo, duration_s=2.0) == 1.0      # 2 good requests in 2 s
    assert goodput(results, slo) == pytest.approx(2 / 4.8)   # default span: first send 0 s, last answer 4.8 s
    assert goodput(results, {"e2el": 1000}, duration_s=1.0) == 2.0
    assert goodput(results, {}, duration_s=1.0) == 4.0       # no SLO: every success
    with pytest.raises(ValueError, match="itl"):
        goodput(results, {"itl": 10})


def test_summary_percentiles_and_throughput():
    results = [made(100 * (i + 1), 1000 + 100 * i, 11) for i in range(10)]
    s = summarize(results, duration_s=2.0)
    assert s["completed"] == 10 and s["failed"] == 0 and s["total_output_tokens"] == 110
    assert s["output_throughput"] == 55.0 and s["request_throughput"] == 5.0
    assert s["mean_ttft_ms"] == pytest.approx(550) and s["median_ttft_ms"] == pytest.approx(550)
    assert s["p90_ttft_ms"] == pytest.approx(910) and s["p99_ttft_ms"] == pytest.approx(991)
    assert s["mean_tpot_ms"] == pytest.approx(90)  # (E2E - TTFT) / 10 = 90 ms for every one
    assert s["max_ttft_ms"] == pytest.approx(1000) and s["n_ttft"] == 10
    assert tail(s, "ttft") == ("max", pytest.approx(1000))   # ten samples: the tail is called the max


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_arrivals_have_mean_gap_one_over_rate(burstiness):
    rate = 5.0
    gaps = arrival_gaps(200_000, rate, burstiness, np.random.default_rng(0))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.01)
    cv = gaps.std() / gaps.mean()  # burstiness sets the spread: CV = 1/sqrt(shape); 1 for Poisson
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.02)
    times = arrival_times(50, rate, burstiness, seed=3)
    assert times == sorted(times) and times[-1] == pytest.approx(50 / rate)  # vLLM's rescaling
    assert times == arrival_times(50, rate, burstiness, seed=3)
    assert arrival_times(5, math.inf) == [0.0] * 5


def test_datasets_shared_prefix_and_long_short(llm):
    tok = llm.tokenizer
    shared = sample_requests(tok, "shared-prefix", 4, 8, 4, prefix_len=32)
    ids = [tok.encode(r.prompt, add_special_tokens=False) for r in shared]
    assert all(len(i) == 40 == r.prompt_len for i, r in zip(ids, shared))
    assert all(i[:30] == ids[0][:30] for i in ids)  # (the boundary token may merge differently)
    mixed = sample_requests(tok, "long-short", 16, 8, 4, long_input_len=200)
    assert sorted(r.prompt_len for r in mixed)[-2:] == [200, 200] and mixed[0].prompt_len == 8


METRICS_BEFORE = """# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 20.0
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 2.0
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 2.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.5
"""


def test_server_metrics_delta_reads_hit_rate_and_queue_time():
    after = (METRICS_BEFORE.replace("} 100.0", "} 500.0").replace("} 20.0", "} 320.0")
             .replace("_count{engine=\"0\",model_name=\"m\"} 2.0", "_count{engine=\"0\",model_name=\"m\"} 6.0")
             .replace("} 0.5", "} 1.3"))
    delta = server_metrics_delta(parse_metrics(METRICS_BEFORE), parse_metrics(after))
    assert delta["prefix_cache_hit_rate"] == pytest.approx(300 / 400)
    assert delta["mean_queue_time_ms"] == pytest.approx(800 / 4)
    assert delta["server_metrics_prefix"] == "vllm:"
    assert server_metrics_delta(None, parse_metrics(after)) == {}
    ours = parse_metrics(METRICS_BEFORE.replace("vllm:", "labsupport:"))
    assert server_metrics_delta({}, ours)["server_metrics_prefix"] == "labsupport:"
