"""Chapter 06's Prometheus metrics: vLLM's names, types, labels and buckets, with the engine's real counts.

The tests drive a real engine through its step loop and feed ``ServerMetrics`` as the server's
engine-loop thread does: ``on_step`` after every step, ``on_finished`` for every finished request.
"""
import ast
import importlib.util
import math
import re
import time
from pathlib import Path

import pytest

from labsupport import LLM, SamplingParams
from labsupport.serve.metrics import ServerMetrics, parse_metrics
from labsupport.serve.metrics_catalog import GAUGES, HISTOGRAMS, NOT_IMPLEMENTED, OWN, PREFIX, request_tokens_buckets

from conftest import PROMPTS

REPO = Path(__file__).resolve().parents[1]
MODEL = "smol-test"
LONG = "The quick brown fox jumps over the lazy dog. " * 5  # ~50 tokens: three full blocks of 16


def run(engine, metrics, prompts, params, after_step=None):
    """Add the prompts, step until all finished, feeding ``metrics`` as the server will."""
    reqs = [engine.add_request(p, params) for p in prompts]
    while not all(r.is_finished for r in reqs):
        got = engine.step()
        out = engine.last_step
        metrics.on_step(engine, got, out)
        for req in out.finished:
            metrics.on_finished(req)
        if after_step is not None:
            after_step(out, scrape(metrics))
    return reqs


def scrape(metrics) -> dict[str, float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return parse_metrics(body)


def counters(engine) -> dict:
    s = engine.stats()
    return {k: s.get(k, 0) for k in ("prompt_tokens_computed", "generation_tokens", "num_preemptions",
                                       "prefix_cache_queries", "prefix_cache_hits")}


def delta(before, after):
    return {k: after[k] - before[k] for k in before}


def token_ids(llm, texts):
    return [llm.tokenize(t)[0] for t in texts]


@pytest.fixture(scope="module")
def small_cached_llm():
    """Prefix caching on a pool of 5 blocks of 16 tokens: small enough to preempt."""
    return LLM(device="cpu", enable_prefix_caching=True, num_blocks=5, block_size=16)


def test_counters_histograms_and_gauges_equal_the_engines_counts(llm):
    engine = llm.engine
    metrics = ServerMetrics(MODEL, max_model_len=engine.max_model_len)
    prompts = token_ids(llm, PROMPTS[:3])
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    running, steps = [], []

    def after_step(out, m):
        running.append((m["labsupport:num_requests_running"], len(out.running) - len(out.finished)))
        assert m["labsupport:num_requests_waiting"] == len(out.waiting)
        steps.append(out.total_tokens)

    before = counters(engine)
    with engine.options(enable_chunked_prefill=True, max_num_batched_tokens=12):  # some prompts in chunks
        reqs = run(engine, metrics, prompts, params, after_step)
    done = delta(before, counters(engine))
    m = scrape(metrics)

    n_prompt = sum(len(p) for p in prompts)
    n_out = sum(len(r.output_token_ids) for r in reqs)
    assert n_out == 15
    assert m["labsupport:prompt_tokens_total"] == n_prompt
    assert m["labsupport:prompt_tokens_computed_total"] == n_prompt == done["prompt_tokens_computed"]
    assert m["labsupport:generation_tokens_total"] == n_out == done["generation_tokens"]
    assert m['labsupport:prompt_tokens_by_source_total{source="local_compute"}'] == n_prompt
    assert m["labsupport:prompt_tokens_cached_total"] == 0
    assert m["labsupport:prefix_cache_queries_total"] == 0  # prefix caching is off, as in vLLM: no queries
    assert m["labsupport:num_preemptions_total"] == 0
    assert m['labsupport:request_success_total{finished_reason="length"}'] == 3
    assert m["labsupport:request_success_total"] == 3

    # two requests shared a step, and the gauge said so
    assert max(g for g, _ in running) >= 2
    assert all(g == n for g, n in running)

    # every per-request histogram saw each request once
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "request_prefill_kv_computed_tokens", "request_num_preemptions", "request_params_max_tokens",
                 "time_to_first_token_seconds"):
        assert m[f"{PREFIX}{name}_count"] == 3, name
        assert m[f'{PREFIX}{name}_bucket{{le="+Inf"}}'] == 3, name
    assert m["labsupport:inter_token_latency_seconds_count"] == n_out - 3
    assert m["labsupport:request_params_n_count"] == m["labsupport:request_params_n_sum"] == 3  # n = 1, each once
    assert m["labsupport:request_max_num_generation_tokens_sum"] == n_out
    assert m["labsupport:request_prompt_tokens_sum"] == n_prompt
    assert m["labsupport:request_generation_tokens_sum"] == n_out
    assert m["labsupport:request_prefill_kv_computed_tokens_sum"] == n_prompt
    assert m["labsupport:iteration_tokens_total_count"] == len(steps)
    assert m["labsupport:iteration_tokens_total_sum"] == sum(steps) == n_prompt + n_out - 3
    assert len(steps) > 5  # chunked: more steps than tokens of the longest output

    # the timings are the requests' own
    assert m["labsupport:e2e_request_latency_seconds_sum"] == pytest.approx(sum(r.metrics.latency for r in reqs))
    assert m["labsupport:time_to_first_token_seconds_sum"] == pytest.approx(sum(r.metrics.ttft for r in reqs))
    assert m["labsupport:request_queue_time_seconds_sum"] == pytest.approx(
        sum(r.metrics.queueing_time for r in reqs))
    assert m["labsupport:request_time_per_output_token_seconds_sum"] == pytest.approx(
        sum(r.metrics.tpot for r in reqs))
    assert m["labsupport:inter_token_latency_seconds_sum"] == pytest.approx(
        sum(sum(r.metrics.itl) for r in reqs))
    phases = ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds")
    assert sum(m[f"{PREFIX}{p}_sum"] for p in phases) <= m["labsupport:e2e_request_latency_seconds_sum"] + 1e-9

    # all memory is back
    assert m["labsupport:num_requests_running"] == m["labsupport:num_requests_waiting"] == 0
    assert m["labsupport:kv_cache_usage_perc"] == 0
    assert m["labsupport:kv_cache_free_blocks"] == engine.kv.num_blocks

    # a stale step record (an idle step) and a second on_finished count nothing again
    metrics.on_step(engine, [], engine.last_step)
    for r in reqs:
        metrics.on_finished(r)
    assert {k: v for k, v in scrape(metrics).items() if k.startswith(PREFIX)} == \
        {k: v for k, v in m.items() if k.startswith(PREFIX)}  # the process's CPU time moves on


def test_kv_usage_gauge_follows_the_pool(llm):
    engine = llm.engine
    metrics = ServerMetrics(MODEL)
    usage = []
    run(engine, metrics, token_ids(llm, [LONG]), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
        lambda out, m: usage.append((m["labsupport:kv_cache_usage_perc"], m["labsupport:kv_cache_free_blocks"])))
    total = engine.kv.num_blocks
    held = 4  # ~50 prompt tokens + 2 = 4 blocks of 16 while it ran
    assert usage[0][0] == pytest.approx(held / total, abs=1.5 / total)
    assert usage[-1] == (0, total)


def test_prefix_cache_hits_on_a_repeated_prompt(small_cached_llm):
    llm, metrics = small_cached_llm, ServerMetrics(MODEL)
    engine = llm.engine
    [prompt] = token_ids(llm, [LONG])
    hit = (len(prompt) - 1) // 16 * 16  # every full block but the one holding the last prompt token
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    before = counters(engine)
    first = run(engine, metrics, [prompt], params)
    second = run(engine, metrics, [prompt], params)
    done = delta(before, counters(engine))
    m = scrape(metrics)
    assert hit >= 32
    assert m["labsupport:prefix_cache_queries_total"] == 2 * len(prompt) == done["prefix_cache_queries"]
    assert m["labsupport:prefix_cache_hits_total"] == hit == done["prefix_cache_hits"]
    assert m["labsupport:prompt_tokens_total"] == 2 * len(prompt)  # cached tokens included, as vLLM counts
    assert m["labsupport:prompt_tokens_cached_total"] == hit == sum(r.metrics.num_cached_tokens for r in first + second)
    assert m["labsupport:prompt_tokens_computed_total"] == 2 * len(prompt) - hit == done["prompt_tokens_computed"]
    assert m['labsupport:prompt_tokens_by_source_total{source="local_cache_hit"}'] == hit
    assert m['labsupport:prompt_tokens_by_source_total{source="local_compute"}'] == 2 * len(prompt) - hit
    assert m["labsupport:request_prefill_kv_computed_tokens_sum"] == 2 * len(prompt) - hit
    assert m["labsupport:kv_cache_usage_perc"] == 0  # cached blocks nobody holds are free, as in vLLM
    assert m["labsupport:kv_cache_free_blocks"] == engine.kv.num_blocks


def test_preemptions_are_counted_once_and_recompute_is_computed_work(small_cached_llm):
    llm, metrics = small_cached_llm, ServerMetrics(MODEL)
    engine = llm.engine
    # 3 x (~28 + 8) tokens need 9 blocks of 16, the pool has 5: one waits, and as the others grow, one is preempted
    prompts = [ids[:28] for ids in token_ids(llm, [p * 4 for p in PROMPTS[3:6]])]
    before = counters(engine)
    reqs = run(engine, metrics, prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    done = delta(before, counters(engine))
    m = scrape(metrics)
    n_prompt = sum(len(p) for p in prompts)
    assert done["num_preemptions"] > 0
    assert m["labsupport:num_preemptions_total"] == done["num_preemptions"] == sum(r.num_preemptions for r in reqs)
    assert m["labsupport:request_num_preemptions_sum"] == done["num_preemptions"]
    assert m["labsupport:prompt_tokens_total"] == n_prompt  # once per request, recomputes not counted
    assert m["labsupport:prompt_tokens_computed_total"] == done["prompt_tokens_computed"]
    assert m["labsupport:generation_tokens_total"] == 24 == done["generation_tokens"]
    assert m["labsupport:prefix_cache_queries_total"] == done["prefix_cache_queries"] == n_prompt
    assert m["labsupport:prefix_cache_hits_total"] == done["prefix_cache_hits"]
    assert m["labsupport:time_to_first_token_seconds_count"] == 3
    assert m["labsupport:inter_token_latency_seconds_count"] == 21
    assert m['labsupport:request_success_total{finished_reason="length"}'] == 3
    assert m["labsupport:kv_cache_free_blocks"] == engine.kv.num_blocks


def test_aborted_and_failed_requests(llm):
    engine, metrics = llm.engine, ServerMetrics(MODEL)
    assert not engine.has_unfinished_requests()
    [prompt] = token_ids(llm, PROMPTS[:1])
    waiting = engine.add_request(prompt, SamplingParams(max_tokens=4))
    engine.abort(waiting)  # a client that went away before its request ran
    metrics.on_finished(waiting)

    failing = engine.add_request(prompt, SamplingParams(max_tokens=4))

    def broken_policy(scheduler):
        raise RuntimeError("an exercise's bug")

    with engine.plugged(schedule_fn=broken_policy), pytest.raises(RuntimeError):
        engine.step()
    assert failing.finish_reason == "error"
    metrics.on_finished(failing)
    m = scrape(metrics)
    assert m["labsupport:request_prefill_time_seconds_sum"] == 0  # never scheduled: no prefill, no decode
    assert m["labsupport:request_decode_time_seconds_sum"] == 0
    assert m["labsupport:request_queue_time_seconds_sum"] == pytest.approx(
        m["labsupport:e2e_request_latency_seconds_sum"])

    running = engine.add_request(prompt, SamplingParams(max_tokens=4))
    metrics.on_step(engine, engine.step(), engine.last_step)
    assert scrape(metrics)["labsupport:num_requests_running"] == 1
    engine.abort(running)  # between steps, and no step follows: on_finished refreshes the gauges
    metrics.on_finished(running)
    metrics.on_step(engine, [], engine.last_step)  # a stale step record: not counted again

    m = scrape(metrics)
    assert m['labsupport:request_success_total{finished_reason="abort"}'] == 2
    assert m['labsupport:request_success_total{finished_reason="error"}'] == 1
    assert m["labsupport:request_success_total"] == 3
    assert m["labsupport:e2e_request_latency_seconds_count"] == 3
    assert m["labsupport:request_prefill_time_seconds_sum"] > 0  # the one that ran, until its first token
    assert m["labsupport:request_decode_time_seconds_sum"] == 0  # one token: no decode
    assert m["labsupport:generation_tokens_total"] == 1
    assert m["labsupport:prompt_tokens_total"] == len(prompt)
    assert m["labsupport:num_requests_waiting"] == m["labsupport:num_requests_running"] == 0
    assert m["labsupport:kv_cache_usage_perc"] == 0


def test_every_metric_is_exposed_with_its_labels_from_the_start():
    metrics = ServerMetrics("my-model")
    body = metrics.render()[0].decode()
    exposed = {line.split()[2] for line in body.splitlines() if line.startswith("# TYPE")}
    wanted = {PREFIX + n for n in [*GAUGES, *HISTOGRAMS]} | {
        f"{PREFIX}{n}_total" for n in ("prompt_tokens", "generation_tokens", "prefix_cache_queries",
                                       "prefix_cache_hits", "num_preemptions", "request_success",
                                       "prompt_tokens_computed", "prompt_tokens_cached", "prompt_tokens_by_source")}
    assert wanted <= exposed
    samples = [line for line in body.splitlines() if line.startswith(PREFIX)]  # process_* and python_* aside
    assert samples and all('model_name="my-model"' in s and 'engine="0"' in s for s in samples)
    assert "process_resident_memory_bytes" in body and "python_gc_objects_collected_total" in body  # as vLLM's
    for reason in ("stop", "length", "abort", "error"):
        assert f'labsupport:request_success_total{{engine="0",finished_reason="{reason}",model_name="my-model"}} 0.0' \
            in body


def test_a_fresh_server_reports_its_whole_pool_free_before_any_request(llm):
    """The gauges are set when the engine loop starts, not at the first step: an idle pool is all free, not 0."""
    from labsupport.serve.api import create_app
    from labsupport.serve.background import BackgroundServer
    from server_tools import server_metrics
    with BackgroundServer(create_app(llm, "smol")) as srv:
        from waiting import wait_until
        m = wait_until(lambda: (m := server_metrics(srv))["labsupport:kv_cache_free_blocks"] and m, 10,
                       message="the server reports its free blocks")
        assert m["labsupport:kv_cache_free_blocks"] == llm.stats()["kv_blocks_total"] > 0
        assert m["labsupport:kv_cache_usage_perc"] == 0


def test_n_is_observed_once_per_request_when_its_last_sample_finishes(llm):
    """``request_params_n`` and ``request_max_num_generation_tokens`` (vLLM's parallel-sampling histograms), read
    from a real server's ``/metrics``: one observation per HTTP request, its n samples' other histograms each."""
    from labsupport.serve.api import create_app
    from labsupport.serve.background import BackgroundServer
    from server_tools import QUESTION, post, server_metrics
    with BackgroundServer(create_app(llm, "smol")) as srv:
        for n, max_tokens in ((3, 5), (1, 2)):
            r = post(srv, {"model": "smol", "messages": QUESTION, "n": n, "max_tokens": max_tokens, "seed": 1,
                           "ignore_eos": True})
            assert r.status_code == 200 and len(r.json()["choices"]) == n, r.text
        m = server_metrics(srv)
    assert m["labsupport:request_params_n_count"] == 2 and m["labsupport:request_params_n_sum"] == 3 + 1
    assert m['labsupport:request_params_n_bucket{le="2.0"}'] == 1  # the n = 1 request; n = 3 lies above 2
    assert m["labsupport:request_max_num_generation_tokens_sum"] == 5 + 2
    assert m["labsupport:request_success_total"] == 4  # each sample is a request, as vLLM's child requests are
    assert m["labsupport:request_generation_tokens_sum"] == 3 * 5 + 2


def test_an_n_sample_request_computes_its_prompt_once_and_its_samples_reuse_it(llm):
    """n > 1 forks once the prompt is computed: samples 1 .. n-1 share its blocks and recompute only its last token
    (``lifecycle.fork_samples``). ``/metrics`` says so as vLLM's child requests with prefix caching would: every
    sample's prompt counts in ``prompt_tokens`` (vLLM counts per child), ``local_compute`` is what was computed
    (``prompt_tokens_computed``), the rest ``local_cache_hit``, and the sources add up to the prompt tokens.
    (It counted every sample's whole prompt as computed.)"""
    from labsupport.serve.api import create_app
    from labsupport.serve.background import BackgroundServer
    from server_tools import post, server_metrics
    messages = [{"role": "user", "content": "Name three birds that cannot fly, one per line."}]
    with BackgroundServer(create_app(llm, "smol")) as srv:
        r = post(srv, {"model": "smol", "messages": messages, "n": 3, "max_tokens": 4, "seed": 1, "ignore_eos": True})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
        m = server_metrics(srv)
    usage = r.json()["usage"]
    p, c = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]  # the prompt once; its own hit
    source = {s: m[f'labsupport:prompt_tokens_by_source_total{{source="{s}"}}']
              for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    assert m["labsupport:prompt_tokens_total"] == 3 * p
    assert source["local_compute"] == m["labsupport:prompt_tokens_computed_total"] == (p - c) + 2
    assert source["local_cache_hit"] == m["labsupport:prompt_tokens_cached_total"] == c + 2 * (p - 1)
    assert sum(source.values()) == m["labsupport:prompt_tokens_total"]


def test_servers_in_one_process_have_their_own_registries():
    a, b = ServerMetrics("a"), ServerMetrics("b")  # would raise "Duplicated timeseries" on a shared registry
    a.counters["generation_tokens"].inc(3)
    assert parse_metrics(a.render()[0])["labsupport:generation_tokens_total"] == 3
    assert parse_metrics(b.render()[0])["labsupport:generation_tokens_total"] == 0


def test_parse_metrics_sums_over_label_sets():
    text = """# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 2.0
vllm:request_success_total{engine="1",finished_reason="stop",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0
vllm:request_success_created{engine="0",finished_reason="stop",model_name="m"} 1.7e9
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
"""
    m = parse_metrics(text)
    assert m["vllm:request_success_total"] == 6
    assert m['vllm:request_success_total{finished_reason="stop"}'] == 5
    assert m['vllm:request_success_total{engine="1",finished_reason="stop",model_name="m"}'] == 3
    assert m["vllm:num_requests_running"] == 4
    assert m['vllm:num_requests_running{engine="0",model_name="m"}'] == 4
    assert not any("created" in k for k in m)


def test_request_token_buckets_follow_max_model_len():
    assert request_tokens_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert request_tokens_buckets(8192)[-1] == 5000
    m = parse_metrics(ServerMetrics("x", max_model_len=2048).render()[0])
    les = [k for k in m if k.startswith("labsupport:request_prompt_tokens_bucket{le=")]
    assert len(les) == len(request_tokens_buckets(2048)) + 1  # and +Inf


# ------------------------------------------------------------------ the same names, types, help and buckets as vLLM


def vllm_metrics_dir() -> Path | None:
    found = sorted(REPO.glob(".venv-vllm/lib/python*/site-packages/vllm/v1/metrics"))
    if not found and (spec := importlib.util.find_spec("vllm")) is not None and spec.origin:
        found = [Path(spec.origin).parent / "v1" / "metrics"]
    return found[0] if found and (found[0] / "loggers.py").exists() else None


def vllm_definitions(loggers: Path) -> tuple[set[str], dict[str, dict]]:
    """Every ``vllm:`` metric name in vLLM's Prometheus logger (and its speculative-decoding metrics,
    ``v1/spec_decode/metrics.py``, diffusion names aside), and for those made with a literal name:
    type, help, label names and bucket family."""
    names, defs = _definitions(ast.parse(loggers.read_text()))
    spec = loggers.parents[1] / "spec_decode" / "metrics.py"
    if spec.exists():
        tree = ast.parse(spec.read_text())
        spec_names, spec_defs = _definitions(tree)
        names |= {n for n in spec_names if n.startswith("spec_decode_")}
        defs |= spec_defs
        for node in ast.walk(tree):  # the three made in a loop from (name, help) pairs
            if (isinstance(node, ast.Tuple) and len(node.elts) == 2
                    and all(isinstance(e, ast.Constant) for e in node.elts)
                    and str(node.elts[0].value).startswith("vllm:spec_decode_")):
                defs[node.elts[0].value[len("vllm:"):]] = {"type": "counter", "help": node.elts[1].value,
                                                           "labels": {"model_name", "engine"}, "family": None}
    return names, defs


def _definitions(tree) -> tuple[set[str], dict[str, dict]]:
    names = {node.value[len("vllm:"):] for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and re.fullmatch(r"vllm:\w+", node.value)}
    defs = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("_gauge_cls", "_counter_cls", "_histogram_cls")):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        if not isinstance(kw.get("name"), ast.Constant):
            continue
        labels = kw.get("labelnames")
        if isinstance(labels, ast.Name):
            labelnames = ["model_name", "engine"]
        elif isinstance(labels, ast.BinOp):
            labelnames = ["model_name", "engine"] + [e.value for e in labels.right.elts]
        else:
            labelnames = [e.value for e in labels.elts]
        buckets = kw.get("buckets")
        defs[kw["name"].value[len("vllm:"):]] = {
            "type": node.func.attr[1:-len("_cls")],
            "help": kw["documentation"].value if isinstance(kw.get("documentation"), ast.Constant) else None,
            "labels": set(labelnames),
            "family": buckets.id[:-len("_buckets")] if isinstance(buckets, ast.Name) else None,
        }
    return names, defs


def test_names_types_help_labels_and_buckets_equal_vllms():
    where = vllm_metrics_dir()
    if where is None:
        pytest.skip("vLLM is not installed (.venv-vllm): nothing to compare with")
    vllm_names, defs = vllm_definitions(where / "loggers.py")
    spec = importlib.util.spec_from_file_location("vllm_buckets", where / "buckets.py")
    vllm_buckets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vllm_buckets)  # plain Python: no vLLM import needed

    metrics = ServerMetrics(MODEL, max_model_len=2048)
    ours = {name[len(PREFIX):]: kind for name, kind in metrics.names().items()}
    theirs = set(ours) - set(OWN)
    assert set(NOT_IMPLEMENTED) <= vllm_names, set(NOT_IMPLEMENTED) - vllm_names  # the skip list stays true
    assert not set(NOT_IMPLEMENTED) & theirs
    assert theirs | set(NOT_IMPLEMENTED) == vllm_names, (vllm_names - theirs - set(NOT_IMPLEMENTED),
                                                        theirs - vllm_names)

    # the exposed names, _total and all: ours with the prefix swapped are vLLM's
    body = metrics.render()[0].decode()
    exposed = {line.split()[2] for line in body.splitlines() if line.startswith("# TYPE")
               and not line.split()[2].endswith("_created") and line.split()[2].startswith(PREFIX)}
    exposed -= {PREFIX + n for n in OWN} | {f"{PREFIX}{n}_total" for n in OWN}

    def exposition_name(name, kind):
        return name if kind != "counter" or name.endswith("_total") else name + "_total"

    vllm_exposed = {exposition_name("vllm:" + n, defs[n]["type"] if n in defs else ours[n]) for n in theirs}
    assert {n.replace(PREFIX, "vllm:", 1) for n in exposed} == vllm_exposed

    values = parse_metrics(body)
    assert set(theirs) - set(defs) == {"cache_config_info"}  # vLLM makes its info gauge from a computed name
    for name in sorted(set(theirs) & set(defs)):
        d = defs[name]
        assert ours[name] == d["type"], name
        if d["help"] is not None:
            family = next(f for f in metrics.registry.collect() if f.name == PREFIX + name)
            assert family.documentation == d["help"], name
        if name == "spec_decode_num_accepted_tokens_per_pos":  # its children appear once a position counts
            family = next(f for f in metrics.registry.collect() if f.name == PREFIX + name)
            assert not family.samples or set(family.samples[0].labels) == d["labels"]
            continue
        sample = next(line for line in body.splitlines()
                      if re.match(rf"{re.escape(PREFIX + name)}(_total|_bucket)?{{", line))
        assert set(re.findall(r'(\w+)="', sample.split("{", 1)[1])) - {"le"} == d["labels"], name
        if d["type"] == "histogram":
            want = vllm_buckets.histogram_buckets(d["family"], max_model_len=2048)
            got = sorted(float(k.split('"')[1]) for k in values
                         if k.startswith(f"{PREFIX}{name}_bucket{{le=") and "+Inf" not in k)
            assert got == [float(b) for b in want], name
            assert all(math.isfinite(b) for b in got)


# ------------------------------------------------------------------ vLLM's cache-source, waiting-reason and info families


def test_cached_prompt_tokens_by_tier_waiting_by_reason_and_cache_config_info():
    """A pool of 8 blocks with a CPU tier: a prompt's blocks, evicted by two others, come back from host
    memory (``source="host"``); asked again at once, from the pool (``"device"``). The sources sum to
    ``prefix_cache_hits``, the waiting reasons to ``num_requests_waiting``, at every step."""
    llm = LLM(device="cpu", enable_prefix_caching=True, num_blocks=8, block_size=16, cpu_offload_blocks=32,
              max_num_seqs=1)
    engine, metrics = llm.engine, ServerMetrics(MODEL)
    a, b, c = token_ids(llm, [LONG, LONG.upper(), LONG.replace(" ", "_")])
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def waiting_adds_up(out, m):
        assert m['labsupport:num_requests_waiting_by_reason{reason="capacity"}'] == m["labsupport:num_requests_waiting"]
        assert m['labsupport:num_requests_waiting_by_reason{reason="deferred"}'] == 0

    run(engine, metrics, [a, b, c], params, waiting_adds_up)  # one at a time (max_num_seqs=1): two wait
    run(engine, metrics, [a], params)  # its blocks went to the CPU tier
    run(engine, metrics, [a], params)  # now in the pool again
    m = scrape(metrics)
    full = (len(a) - 1) // 16 * 16
    src = "labsupport:prompt_tokens_cached_by_source_total"
    assert m[f'{src}{{source="host"}}'] == full and m[f'{src}{{source="device"}}'] == full
    assert m[src] == m["labsupport:prefix_cache_hits_total"] == 2 * full
    assert m[f'{src}{{source="p2p"}}'] == m[f'{src}{{source="disk"}}'] == 0
    info = m['labsupport:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
             'engine="0",gpu_memory_utilization="0.2",kv_cache_memory_bytes="None",num_cpu_blocks="32",'
             'num_gpu_blocks="8",num_gpu_blocks_override="8"}']
    assert info == 1
    llm.shutdown()


def test_a_prompt_only_request_counts_its_prompt_and_no_token(llm):
    metrics = ServerMetrics(MODEL)
    [prompt] = token_ids(llm, [PROMPTS[0]])
    run(llm.engine, metrics, [prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))
    m = scrape(metrics)
    assert m["labsupport:prompt_tokens_total"] == len(prompt) and m["labsupport:generation_tokens_total"] == 0
    assert m["labsupport:time_to_first_token_seconds_count"] == 0
    assert m['labsupport:request_success_total{finished_reason="length"}'] == 1
