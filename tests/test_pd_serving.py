"""1P+1D as chapter 07 runs it: two ``python -m labsupport serve --role`` processes and the router, all real,
all on loopback. Tokens through the router equal the colocated server's; the decode worker computes one
prompt token per request (its own ``/metrics``); killing the decode worker mid-stream gets the client an
error within 5 s, and so does freezing it (``kill -STOP``); the prefill worker frees the KV nobody pulled
when its lease expires, the router's ``/health`` says so, and a restarted worker is used again; a dead
prefill worker is a fast 503."""
import json
import os
import time

import httpx
import pytest
from server_tools import assert_openai_error
from waiting import wait_until

from labsupport.pd.cluster import Worker, start_all, stop_all
from labsupport.pd.router_app import create_router_app
from labsupport.serve.api import create_app
from labsupport.serve.background import BackgroundServer
from labsupport.serve.metrics import parse_metrics

ARGS = ["--num-blocks", "256", "--max-model-len", "2048", "--served-model-name", "smol", "--kv-lease-s", "2"]
PROMPTS = ["The capital of France is", "Explain why the sky is blue. " * 12, "def fibonacci(n):", "1, 2, 3, 4,"]


def metrics(url):
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


@pytest.fixture(scope="module")
def workers():
    ws = start_all([Worker("prefill", args=ARGS), Worker("decode", args=ARGS)])
    yield ws
    stop_all(ws)


@pytest.fixture(scope="module")
def router(workers):
    p, d = workers
    with BackgroundServer(create_router_app(prefill=[p.url], decode=[d.url], health_interval=0.2)) as r:
        yield r


@pytest.fixture(scope="module")
def colocated(llm):
    with BackgroundServer(create_app(llm, "smol")) as srv:
        yield srv


def wait_for(predicate, timeout=15.0):
    """True once ``predicate`` holds, False if it never did within ``timeout`` (callers assert on it)."""
    try:
        return bool(wait_until(predicate, timeout=timeout, interval=0.1))
    except AssertionError:
        return bool(predicate())


def test_router_answers_equal_colocated_and_decode_computes_one_token_each(workers, router, colocated):
    _, d = workers
    before = metrics(d.url)
    body = {"model": "smol", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    lengths = []
    for prompt in PROMPTS:
        got = httpx.post(router.url + "/v1/completions", json={**body, "prompt": prompt}, timeout=60)
        want = httpx.post(colocated.url + "/v1/completions", json={**body, "prompt": prompt}, timeout=60)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
        assert got.headers["x-pd-route"].startswith("prefill=")
        lengths.append(got.json()["usage"]["prompt_tokens"])
    with httpx.stream("POST", router.url + "/v1/completions", json={**body, "prompt": PROMPTS[1], "stream": True},
                      timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
    assert events[-1] == "[DONE]"
    assert streamed == httpx.post(colocated.url + "/v1/completions", json={**body, "prompt": PROMPTS[1]},
                                  timeout=60).json()["choices"][0]["text"]
    after = metrics(d.url)
    computed = after["labsupport:prompt_tokens_computed_total"] - before["labsupport:prompt_tokens_computed_total"]
    external = (after['labsupport:prompt_tokens_by_source_total{source="external_kv_transfer"}']
                - before['labsupport:prompt_tokens_by_source_total{source="external_kv_transfer"}'])
    assert computed == len(PROMPTS) + 1  # one token per request: the prompts came as KV, not recomputed
    hits = (after['labsupport:prompt_tokens_by_source_total{source="local_cache_hit"}']
            - before['labsupport:prompt_tokens_by_source_total{source="local_cache_hit"}'])
    # every prompt token but the last came as KV or, for the repeated prompt, from the decode worker's own prefix cache
    assert external + hits == sum(lengths) - len(lengths) + lengths[1] - 1 and external >= sum(lengths) - len(lengths)
    p = workers[0]
    assert wait_for(lambda: metrics(p.url)["labsupport:kv_requests_held"] == 0)
    assert metrics(p.url)["labsupport:kv_transfer_bytes_sent_total"] == after["labsupport:kv_transfer_bytes_received_total"]


def smaps(pid: int) -> dict[str, int]:
    """``/proc/PID/smaps_rollup`` in bytes: Rss, Pss, Anonymous (memory no other process could share), ..."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0]) * 1024
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="Linux's smaps_rollup")
def test_a_worker_holds_its_kv_pool_and_little_more_of_its_own(workers):
    """Chapter 07 runs four workers: each once held ~1.5 GB of its own (stacked and packed copies of the
    weights besides a 512-block pool) and 2.3 GB resident. Now the weights are one file every process maps
    (``models/cpu_weights.py``): what is a worker's own is its KV pool, torch and the server, ~0.3 GB."""
    p, d = workers
    for w in workers:  # some work first: a long prefill, a batch of decodes
        body = {"model": "smol", "prompt": PROMPTS[1] * 8, "max_tokens": 8, "ignore_eos": True}
        assert httpx.post(w.url + "/v1/completions", json=body, timeout=120).status_code == 200
    pool = 256 * 16 * 30 * 2 * 3 * 64 * 4  # ARGS' blocks x tokens per block x the default model's KV bytes per token
    for w in workers:
        m = smaps(w.proc.pid)
        own = m["Anonymous"] - pool
        assert own < 450e6, f"{w.name}: {own / 1e6:.0f} MB of its own besides its {pool / 1e6:.0f} MB KV pool"
        assert m["Rss"] < 1.9e9 and m["Anonymous"] < 0.7e9, {k: f"{v / 1e6:.0f} MB" for k, v in m.items()}


def test_frozen_decode_worker_ends_streams_within_5_s_and_new_requests_get_503_at_once(workers, router):
    """``kill -STOP`` the decode worker: its socket still accepts, nothing comes back. The stream in flight
    ends with an SSE error within 5 s (the probe marks the worker down), a new request is a 503 at once
    (no prefill for nothing), and once resumed the worker serves again."""
    import os
    import signal
    p, d = workers
    body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        seen = [next(lines) for _ in range(6)]  # the stream has begun
        os.kill(d.proc.pid, signal.SIGSTOP)
        t0 = time.time()
        try:
            rest = [line for line in lines if line]
            elapsed = time.time() - t0
            assert elapsed < 5, f"the client waited {elapsed:.1f} s"
            assert any('"error"' in line for line in rest) and rest[-1] == "data: [DONE]", (seen, rest[-3:])
            prefilled = metrics(p.url)["labsupport:request_success_total"]
            t0 = time.time()
            late = httpx.post(router.url + "/v1/completions", json={**body, "stream": False}, timeout=30)
            assert_openai_error(late.status_code, late.json(), 503)
            assert time.time() - t0 < 0.5 and metrics(p.url)["labsupport:request_success_total"] == prefilled
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
    assert wait_for(lambda: httpx.get(router.url + "/health", timeout=5).status_code == 200, 20)
    r = httpx.post(router.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_decode_killed_mid_stream_errors_fast_frees_prefill_blocks_and_comes_back(workers, router):
    p, d = workers
    body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        seen = [next(lines) for _ in range(6)]  # the stream has begun
        d.kill()
        t0 = time.time()
        rest = [line for line in lines if line]
    elapsed = time.time() - t0
    assert elapsed < 5, f"the client waited {elapsed:.1f} s"
    assert any('"error"' in line for line in rest) and rest[-1] == "data: [DONE]", (seen, rest[-3:])
    health = httpx.get(router.url + "/health", timeout=5)
    assert health.status_code == 503
    prefilled = metrics(p.url)["labsupport:request_success_total"]
    t0 = time.time()
    r = httpx.post(router.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=30)
    assert_openai_error(r.status_code, r.json(), 503)
    assert time.time() - t0 < 5
    assert metrics(p.url)["labsupport:request_success_total"] == prefilled  # no prefill for a decode nobody runs
    # a prefill whose decode worker died right after it (the router's first leg, sent by hand): the prefill
    # worker holds its KV for a pull that never comes, and its 2 s lease frees it
    total = metrics(p.url)["labsupport:kv_cache_free_blocks"]
    leg = httpx.post(p.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 1,
                                                      "kv_transfer_params": {"do_remote_decode": True}}, timeout=30)
    assert leg.status_code == 200 and leg.json()["kv_transfer_params"]["remote_block_ids"]
    assert wait_for(lambda: metrics(p.url)["labsupport:kv_requests_held"] == 0, 10)
    m = metrics(p.url)
    assert m["labsupport:kv_leases_expired_total"] >= 1 and m["labsupport:kv_cache_free_blocks"] >= total
    d.start()  # same port
    assert wait_for(lambda: httpx.get(router.url + "/health", timeout=5).status_code == 200, 20)
    r = httpx.post(router.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_dead_prefill_worker_is_a_fast_503(workers, router):
    p, _ = workers
    p.kill()
    try:
        t0 = time.time()
        r = httpx.post(router.url + "/v1/completions", json={"model": "smol", "prompt": "Hi", "max_tokens": 4},
                       timeout=30)
        assert_openai_error(r.status_code, r.json(), 503)
        assert time.time() - t0 < 5
        assert wait_for(lambda: httpx.get(router.url + "/health", timeout=5).status_code == 503, 5)
    finally:
        p.start()
    assert wait_for(lambda: httpx.get(router.url + "/health", timeout=5).status_code == 200, 20)
