"""Helpers for the server tests (``test_server.py``, ``test_api_*.py``): a real loopback server, real HTTP; and
the model-free stand-in workers the router tests put behind chapter 07's router (``stand_in_worker``)."""
import httpx
from fastapi import FastAPI, Request
from waiting import wait_until

QUESTION = [{"role": "user", "content": "Name a fruit that is yellow."}]
LONG = {"model": "smol", "messages": QUESTION, "max_tokens": 400, "ignore_eos": True}  # outlives any test step


def post(srv, body, path="/v1/chat/completions", **kw):
    return httpx.post(srv.url + path, json=body, timeout=60, **kw)


def wait_idle_and_free(llm, timeout=20):
    """Every request gone and every KV block back (cached blocks count as free: they are reclaimable),
    nothing left in the engine's per-request tables."""
    def idle_and_free():
        s = llm.stats()
        return not (s["num_requests_running"] or s["num_requests_waiting"]) and s["kv_blocks_free"] == s["kv_blocks_total"]
    try:
        wait_until(idle_and_free, timeout=timeout, interval=0.05)
    except AssertionError:
        pass  # the assertions below say which figure is off
    s = llm.stats()
    assert s["num_requests_running"] == s["num_requests_waiting"] == 0
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
    assert not llm.engine.detokenizers and not llm.engine.runner.sampler.generators


OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


def assert_openai_error(status: int, body: dict, expected: int | range | None = None):
    """``body`` is OpenAI's error JSON for this status: ``{"error": {message, type, param, code}}``, code == status."""
    if expected is not None:
        assert status == expected if isinstance(expected, int) else status in expected, (status, body)
    assert isinstance(body, dict) and set(body.get("error") or ()) == OPENAI_ERROR_KEYS, body
    assert body["error"]["code"] == status and body["error"]["message"], body


def server_metrics(srv) -> dict[str, float]:
    """``GET /metrics``, parsed (``labsupport.serve.metrics.parse_metrics``)."""
    from labsupport.serve.metrics import parse_metrics
    r = httpx.get(srv.url + "/metrics", timeout=10)
    assert r.status_code == 200, r.text
    return parse_metrics(r.text)


def wait_metrics_free(srv, llm, timeout=20) -> dict[str, float]:
    """Poll ``/metrics`` until no request runs or waits and ``labsupport:kv_cache_free_blocks`` is the whole pool
    (the engine loop handles aborts at its next iteration); then check the engine itself agrees."""
    total = llm.stats()["kv_blocks_total"]
    def idle_and_free():
        m = server_metrics(srv)
        idle = m["labsupport:num_requests_running"] == m["labsupport:num_requests_waiting"] == 0
        return m if idle and m["labsupport:kv_cache_free_blocks"] == total else None
    try:
        m = wait_until(idle_and_free, timeout=timeout, interval=0.05)
    except AssertionError:
        m = server_metrics(srv)  # the assertions below say which figure is off
    assert m["labsupport:kv_cache_free_blocks"] == total, (m["labsupport:kv_cache_free_blocks"], total)
    assert m["labsupport:num_requests_running"] == m["labsupport:num_requests_waiting"] == 0
    wait_idle_and_free(llm, timeout=5)
    return m


def stand_in_worker(complete, paths=("/v1/completions",)) -> FastAPI:
    """A worker as the router sees one, without a model: ``GET /health`` answers ok, and a ``POST`` to each of
    ``paths`` answers ``await complete(body, request)`` (a dict for JSON, or a response: a stream, an error).
    What a test's worker does differently (record what it was sent, answer late, prefill by the clock) is
    ``complete``'s alone."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    async def answer(request: Request):
        return await complete(await request.json(), request)

    for path in paths:
        app.post(path)(answer)
    return app
