"""The probes of ``bench soak`` (``soak.py`` says what each one is for): each takes URLs, talks HTTP, and
returns its figures as a dict. Two things only a process owner can do are done here too: reading the
server's RSS (``psutil``) and freezing a worker (SIGSTOP), each on a pid ``soak.py`` hands over."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import time

import httpx
import psutil

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
FUZZ_MAX_TOKENS = 16  # a generated request's answer: enough to exercise streaming, cheap on 2 cores
FUZZ_MAX_CHOICES = 2


def bound_cost(body):
    """Keep a generated request cheap without making an invalid one valid: positive ``max_tokens`` (or none)
    become at most ``FUZZ_MAX_TOKENS``, ``n`` and lists of prompts at most ``FUZZ_MAX_CHOICES``."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        if type(body.get(key)) is int and body[key] > FUZZ_MAX_TOKENS:
            body[key] = FUZZ_MAX_TOKENS
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = FUZZ_MAX_TOKENS
    n = body.get("n")
    if type(n) in (int, float) and FUZZ_MAX_CHOICES < n <= 128 and n == int(n):
        body["n"] = 1 + int(n) % FUZZ_MAX_CHOICES
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > FUZZ_MAX_CHOICES and not any(type(x) is int for x in prompt):
        body["prompt"] = prompt[:FUZZ_MAX_CHOICES]


def schema_fuzz(schema_url: str, targets: dict[str, str], examples: int, seconds: float, timeout: float = 30) -> dict:
    """schemathesis's valid and invalid requests for every ``/v1`` route of the schema at ``schema_url``, each sent
    to every target (name -> base URL): per target, responses, 5xx answers and requests left unanswered."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(schema_url, timeout=30)
    seen = {name: {"responses": 0, "5xx": 0, "unanswered": 0, "first_5xx": None} for name in targets}
    deadline = time.monotonic() + seconds
    for result in schema.get_all_operations():
        operation = result.ok()
        if not operation.path.startswith("/v1"):
            continue
        cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))

        @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=cases)
        def fuzz(case):
            if time.monotonic() > deadline:
                return
            bound_cost(case.body)
            for name, base in targets.items():
                try:
                    response = case.call(base_url=base, timeout=timeout)
                except requests.RequestException:
                    seen[name]["unanswered"] += 1
                    continue
                seen[name]["responses"] += 1
                if response.status_code >= 500:
                    seen[name]["5xx"] += 1
                    seen[name]["first_5xx"] = seen[name]["first_5xx"] or \
                        f"{response.status_code} for {case.as_curl_command()[:300]}"

        fuzz()
    return seen


# ------------------------------------------------------------------ HTTP streams


async def stream(client: httpx.AsyncClient, url: str, body: dict, hang_up_after: int | None = None,
                 stamps: list | None = None) -> dict:
    """POST a streamed request; read it to the end, or hang up after ``hang_up_after`` events. ``stamps`` gets
    the arrival time of every event. Returns ``{"events", "error"}`` (``error``: an SSE error event's message)."""
    out = {"events": 0, "error": None}
    async with client.stream("POST", url, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            out["error"] = f"HTTP {r.status_code}"
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if stamps is not None:
                stamps.append(time.perf_counter())
            out["events"] += 1
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"].get("message", "error")
            if hang_up_after is not None and out["events"] >= hang_up_after:
                break
    return out


def metrics(url: str) -> dict[str, float]:
    from ...serve.metrics import parse_metrics
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


def wait_idle(url: str, timeout: float = 30) -> float:
    """Seconds until the server runs and waits for nothing (``/metrics``), at most ``timeout``."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        m = metrics(url)
        if m.get("labsupport:num_requests_running", 0) == m.get("labsupport:num_requests_waiting", 0) == 0:
            break
        time.sleep(0.1)
    return time.perf_counter() - start


def disconnect_storm(url: str, model: str, num_blocks: int, streams: int) -> dict:
    """``streams`` streams at once, half hanging up after their first token; then as many that all hang up.
    Leaked blocks: the pool's blocks not free once the server is idle."""
    body = {"model": model, "prompt": "Tell me a long story about a lighthouse.", "max_tokens": 64, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=2 * streams)) as client:
            half = await asyncio.gather(*(stream(client, url + COMPLETIONS, body, 1 if i % 2 else None)
                                          for i in range(streams)), return_exceptions=True)
            everyone = await asyncio.gather(*(stream(client, url + COMPLETIONS, body, 1) for _ in range(streams)),
                                            return_exceptions=True)
            return half + everyone

    results = asyncio.run(run())
    drained_s = wait_idle(url)
    free = metrics(url).get("labsupport:kv_cache_free_blocks", 0)
    failed = [r for r in results if isinstance(r, BaseException) or r["error"]]
    return {"streams": len(results), "failed": len(failed), "drained_s": drained_s,
            "leaked_blocks": int(num_blocks - free)}


def tree_rss(pid: int) -> int:
    """RSS of a process and its children (an engine core in a child process counts too)."""
    p = psutil.Process(pid)
    total = 0
    for q in [p, *p.children(recursive=True)]:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total


def never_read_streams(url: str, model: str, pid: int, streams: int, seconds: float) -> dict:
    """``streams`` chat streams with 20 top logprobs per token whose client never reads a byte (raw sockets with a
    small receive buffer), for ``seconds``; then closed. The server's RSS before, at its peak, after."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Count to ten thousand."}],
                       "max_tokens": 4000, "ignore_eos": True, "stream": True, "logprobs": True,
                       "top_logprobs": 20}).encode()
    host, port = url.removeprefix("http://").split(":")
    wait_idle(url)
    before = peak = tree_rss(pid)
    tokens_before = metrics(url).get("labsupport:generation_tokens_total", 0)
    socks = []
    try:
        for _ in range(streams):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((host, int(port)))
            s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            socks.append(s)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            peak = max(peak, tree_rss(pid))
            time.sleep(0.5)
        generated = metrics(url).get("labsupport:generation_tokens_total", 0) - tokens_before
    finally:
        for s in socks:
            s.close()
    drained_s = wait_idle(url)
    time.sleep(1.0)
    after = tree_rss(pid)
    return {"rss_before_mb": before / 1e6, "rss_peak_growth_mb": (peak - before) / 1e6,
            "rss_growth_after_close_mb": (after - before) / 1e6, "tokens_generated": int(generated),
            "drained_s": drained_s}


def beside_streams(url: str, live: int, body: dict, request, settle: float, timeout: float = 300):
    """``live`` streams of ``body`` decoding while ``request(client)`` (a coroutine function) runs once every
    stream is producing: returns its result, when it started and ended, and the gaps between consecutive events of
    any stream as ``(gap, earlier event, later event)``. The streams go on ``settle`` seconds after it."""
    stamps = [[] for _ in range(live)]

    async def run():
        async with httpx.AsyncClient(timeout=timeout) as client:
            tasks = [asyncio.create_task(stream(client, url + COMPLETIONS, body, None, s)) for s in stamps]
            while min(len(s) for s in stamps) < 5:  # every stream is producing
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)
            t0 = time.perf_counter()
            result = await request(client)
            t1 = time.perf_counter()
            await asyncio.sleep(settle)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return result, t0, t1

    result, t0, t1 = asyncio.run(run())
    return result, t0, t1, [(b - a, a, b) for s in stamps for a, b in zip(s, s[1:])]


def tokenize_stall(url: str, model: str, live: int, body_bytes: int) -> dict:
    """``live`` streams decoding while a ``/tokenize`` of ``body_bytes`` arrives: the longest gap between two
    events of any stream around it (the stall), beside the streams' median gap and the tokenize's own time."""
    words = (body_bytes - 100) // 6
    big = json.dumps({"model": model, "prompt": "hello " * words}).encode()
    body = {"model": model, "prompt": "Write a poem about the sea.", "max_tokens": 2000, "ignore_eos": True}

    async def tokenize(client):
        r = await client.post(url + "/tokenize", content=big, headers={"content-type": "application/json"})
        return r.status_code

    status, t0, t1, gaps = beside_streams(url, live, body, tokenize, settle=1.5)
    around = [g for g, a, b in gaps if b >= t0 and a <= t1 + 0.5]
    wait_idle(url)
    return {"tokenize_status": status, "tokenize_s": t1 - t0, "body_mb": len(big) / 1e6,
            "max_stall_s": max(around, default=0.0), "median_gap_s": statistics.median(g for g, _, _ in gaps)}


def long_prompt_stall(url: str, model: str, live: int, prompt_tokens: int) -> dict:
    """``live`` streams decoding while one prompt of ``prompt_tokens`` token ids arrives (head-of-line blocking,
    issue 41): the longest gap between two events of any stream while it is prefilled, beside the streams'
    median gap and the long request's time to its one token."""
    body = {"model": model, "prompt": "Write a poem about the sea.", "max_tokens": 4000, "ignore_eos": True}
    long = {"model": model, "prompt": [(i * 7919) % 20000 + 100 for i in range(prompt_tokens)], "max_tokens": 1}

    async def send_long(client):
        return (await client.post(url + COMPLETIONS, json=long)).status_code

    status, t0, t1, gaps = beside_streams(url, live, body, send_long, settle=0.5, timeout=600)
    around = [g for g, a, b in gaps if b >= t0 and a <= t1]
    before = [g for g, a, b in gaps if b < t0]
    wait_idle(url)
    return {"long_status": status, "long_prompt_tokens": prompt_tokens, "long_request_s": t1 - t0,
            "max_stall_s": max(around, default=0.0), "median_gap_during_s": statistics.median(around or [0.0]),
            "median_gap_before_s": statistics.median(before or [0.0])}


def frozen_worker(router_url: str, model: str, pid: int) -> dict:
    """``kill -STOP`` a PD worker under a stream through the router: seconds until the client learns (an SSE
    error or the end of the stream), whether it was an error, and how fast a new request is answered."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}
    out = {}
    try:
        with httpx.stream("POST", router_url + COMPLETIONS, json={**body, "stream": True}, timeout=120) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            os.kill(pid, signal.SIGSTOP)
            t0 = time.perf_counter()
            try:
                rest = [line for line in lines if line.startswith("data: ")]
            except httpx.HTTPError as exc:
                rest = [f'data: {{"error": "{type(exc).__name__}"}}']
            out["time_to_error_s"] = time.perf_counter() - t0
            out["got_error"] = any('"error"' in line for line in rest)
        t0 = time.perf_counter()
        try:
            late = httpx.post(router_url + COMPLETIONS, json={**body, "max_tokens": 4}, timeout=60)
            out["new_request_status"] = late.status_code
        except httpx.HTTPError as exc:
            out["new_request_status"] = type(exc).__name__
        out["new_request_s"] = time.perf_counter() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    return out
