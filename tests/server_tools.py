"""Helpers for the server tests (``test_server.py``, ``test_api_*.py``): a real loopback server, real HTTP."""
import time

import httpx

QUESTION = [{"role": "user", "content": "Name a fruit that is yellow."}]
LONG = {"model": "smol", "messages": QUESTION, "max_tokens": 400, "ignore_eos": True}  # outlives any test step


def post(srv, body, path="/v1/chat/completions", **kw):
    return httpx.post(srv.url + path, json=body, timeout=60, **kw)


def wait_idle_and_free(llm, timeout=20):
    """Every request gone and every KV block back (cached blocks count as free: they are reclaimable),
    nothing left in the engine's per-request tables."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = llm.stats()
        if not (s["num_requests_running"] or s["num_requests_waiting"]) and s["kv_blocks_free"] == s["kv_blocks_total"]:
            break
        time.sleep(0.05)
    s = llm.stats()
    assert s["num_requests_running"] == s["num_requests_waiting"] == 0
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
    assert not llm.engine.detokenizers and not llm.engine.runner.sampler.generators
