"""The chapter 07 router (``labsupport.pd.router``) in front of real loopback servers.

Worker A is a ``python -m labsupport serve`` subprocess (it gets killed with SIGKILL near the end),
worker B an in-process server over the session's model. Only the PD wire-format test uses stand-ins.
"""
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from server_tools import QUESTION, assert_openai_error, server_metrics, stand_in_worker
from waiting import wait_healthy, wait_until

from labsupport.pd.router import PREFILL_KV_PARAMS
from labsupport.pd.router_app import create_router_app
from labsupport.pd.routing import LeastLoaded, PrefixAware, RoundRobin, prefix_key
from labsupport.serve.api import create_app
from labsupport.serve.background import BackgroundServer, free_port

SHORT = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
LONG_STREAM = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}


class ServeProcess:
    """``python -m labsupport serve`` in a subprocess; started at once, waited for when first needed."""

    def __init__(self, port=None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "labsupport", "serve", "--port", str(self.port), "--device", "cpu",
             "--served-model-name", "smol", "--max-num-batched-tokens", "2048", "--num-blocks", "256",
             "--max-model-len", "1024", "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def wait_ready(self, timeout=180):
        wait_healthy(self.url, timeout=timeout, proc=self.proc)
        return self

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module", autouse=True)
def worker_a():
    """Started by the first test of the module (the stand-in tests, which need no model), so it loads
    its model while the session's loads."""
    holder = {"a": ServeProcess()}
    yield holder
    holder["a"].kill()


@pytest.fixture(scope="module")
def a(worker_a):
    return worker_a["a"].wait_ready()


@pytest.fixture(scope="module")
def b(llm):
    with BackgroundServer(create_app(llm, "smol")) as srv:
        yield srv


def router(**kw):
    return BackgroundServer(create_router_app(**{"health_interval": 0.2, **kw}))


def routed(r: httpx.Response) -> str:
    return r.headers["x-pd-route"]


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


# ------------------------------------------------------------------ policies, no server


def test_policies_choose_and_count_in_flight():
    rr, ll = RoundRobin(), LeastLoaded()
    assert [rr.choose(["x", "y"], {}) for _ in range(4)] == ["x", "y", "x", "y"]
    assert ll.choose(["x", "y"], {}) == "x" and ll.choose(["x", "y"], {}) == "y"  # ties in turn
    assert ll.choose(["x", "y"], {}) == "x"  # x: 2 in flight, y: 1
    assert ll.choose(["x", "y"], {}) == "y" and ll.choose(["x", "y"], {}) == "x"
    ll.done("x"), ll.done("x")
    assert ll.choose(["x", "y"], {}) == "x"  # x 1, y 2
    p = PrefixAware(prefix_chars=16, max_imbalance=2)
    doc = {"prompt": "A long shared document. " + "tail one"}
    assert p.choose(["x", "y"], doc) == "x"
    assert p.choose(["x", "y"], {"prompt": "Something else entirely"}) == "y"  # new prefix: least loaded
    assert [p.choose(["x", "y"], {"prompt": "A long shared document. " + t}) for t in "abc"] == ["x"] * 3
    assert p.choose(["x", "y"], doc) == "y"  # x has 4 in flight, y 1: more than 2 apart, leave x
    assert p.choose(["y"], doc) == "y"  # x gone: the prefix moves
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prefix_key(chat, 256) == prefix_key({"messages": [{"role": "user", "content": "hi"}]}, 256)
    assert prefix_key({"prompt": [[1, 2, 3]]}, 256) == prefix_key({"prompt": [1, 2, 3]}, 256)


# ------------------------------------------------------------------ PD protocol, stand-in workers

KV_FROM_PREFILL = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1",
                   "remote_block_ids": [3, 4], "remote_host": "127.0.0.1", "remote_port": 5555,
                   "remote_request_id": "e1-r1", "tp_size": 1}
SSE = b'data: {"choices": [{"text": " decoded"}]}\n\ndata: [DONE]\n\n'


def recording_worker(seen: list, mode: dict) -> FastAPI:
    """A stand-in that records what it receives: prefill answers ``kv_transfer_params`` (or, per
    ``mode["prefill"]``, an error or nothing), decode answers JSON or a fixed SSE stream."""
    async def complete(body, request):
        seen.append({"headers": dict(request.headers), "body": body})
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):  # a prefill request
            if mode.get("prefill") == "error":
                return JSONResponse({"error": {"message": "busy", "type": "rate_limit_error", "param": None,
                                               "code": 429}}, 429)
            return {"choices": [{"text": "x"}], **({} if mode.get("prefill") == "no_kv" else
                                                   {"kv_transfer_params": KV_FROM_PREFILL})}
        if body.get("stream"):
            return StreamingResponse(iter([SSE]), media_type="text/event-stream")
        return {"choices": [{"text": " decoded"}]}

    return stand_in_worker(complete, paths=("/v1/completions", "/v1/chat/completions"))


def test_pd_wire_format_with_stand_ins():
    """The wire format only (what the router sends each side, what it passes back), against two
    recording stand-ins; the real servers' PD test is ``test_pd_mode_over_real_servers``."""
    pre, dec, mode = [], [], {}
    with BackgroundServer(recording_worker(pre, mode)) as p, BackgroundServer(recording_worker(dec, mode)) as d, \
            router(prefill=[p.url], decode=[d.url]) as r:
        body = {"model": "smol", "prompt": "Hello", "max_tokens": 50, "max_completion_tokens": 50, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0}
        with httpx.stream("POST", r.url + "/v1/completions", json=body, headers={"Authorization": "Bearer k1"}) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            assert routed(s) == f"prefill={p.url};decode={d.url}"
            assert s.read() == SSE  # the decode worker's bytes, unchanged
        sent = pre[-1]["body"]
        assert sent["max_tokens"] == sent["max_completion_tokens"] == 1 and sent["stream"] is False
        assert "stream_options" not in sent and sent["kv_transfer_params"] == PREFILL_KV_PARAMS
        assert {k: v for k, v in sent.items() if k not in ("max_tokens", "max_completion_tokens", "stream",
                                                           "kv_transfer_params")} == {"model": "smol",
                                                                                      "prompt": "Hello",
                                                                                      "temperature": 0}
        assert dec[-1]["body"] == {**body, "kv_transfer_params": KV_FROM_PREFILL}  # the original, plus the params
        assert pre[-1]["headers"]["authorization"] == dec[-1]["headers"]["authorization"] == "Bearer k1"
        assert pre[-1]["headers"]["x-request-id"] == dec[-1]["headers"]["x-request-id"]

        chat = {"model": "smol", "messages": QUESTION, "max_tokens": 5}
        reply = httpx.post(r.url + "/v1/chat/completions", json=chat)
        assert reply.json() == {"choices": [{"text": " decoded"}]}
        assert "max_completion_tokens" not in pre[-1]["body"] and pre[-1]["body"]["messages"] == QUESTION
        bad = httpx.post(r.url + "/v1/completions", json={**SHORT, "n": 2})
        assert_openai_error(bad.status_code, bad.json(), 400)
        mode["prefill"] = "error"  # the prefill worker's error goes back as it was
        busy = httpx.post(r.url + "/v1/completions", json=SHORT)
        assert busy.status_code == 429 and busy.json()["error"]["message"] == "busy"
        mode["prefill"] = "no_kv"
        no_kv = httpx.post(r.url + "/v1/completions", json=SHORT)
        assert_openai_error(no_kv.status_code, no_kv.json(), 502)
        assert len(dec) == 2  # neither failure reached the decode worker
    dead = f"http://127.0.0.1:{free_port()}"
    with BackgroundServer(recording_worker([], {})) as p, router(prefill=[p.url], decode=[dead]) as r:
        health = httpx.get(r.url + "/health")
        assert_openai_error(health.status_code, health.json(), 503)
        assert [w["healthy"] for w in health.json()["workers"].values()] == [True, False]
        assert httpx.post(r.url + "/v1/completions", json=SHORT).status_code == 503  # no decode worker: at once


def test_cli_router_starts_and_exits_0_on_sigterm(capsys):
    port = free_port()
    with BackgroundServer(recording_worker([], {})) as w:
        proc = subprocess.Popen([sys.executable, "-m", "labsupport", "router", "--instances", w.url,
                                 "--port", str(port), "--log-level", "warning"])
        try:
            wait_healthy(f"http://127.0.0.1:{port}", timeout=60, proc=proc)
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()
            assert health == {"status": "ok", "workers": {w.url: {"role": "instance", "healthy": True}}}
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    from labsupport.__main__ import main
    assert main(["router", "--prefill", w.url]) == 2 and "--decode" in capsys.readouterr().err


def slow_worker(seen: dict) -> FastAPI:
    """A stand-in that streams an event every 50 ms for a minute, or answers JSON after a minute;
    ``seen`` counts plain requests and records each stream's end (a client hanging up ends it early)."""
    import asyncio

    async def complete(body, request):
        if not body.get("stream"):
            seen["plain"] += 1
            await asyncio.sleep(60)
            return {"choices": [{"text": "late"}]}

        async def events():
            try:
                for i in range(1200):
                    yield f'data: {{"choices": [{{"text": " {i}"}}]}}\n\n'.encode()
                    await asyncio.sleep(0.05)
            finally:
                seen["ended"].append(time.time())
        return StreamingResponse(events(), media_type="text/event-stream")

    return stand_in_worker(complete)


def test_shutdown_ends_streams_and_requests_in_flight_with_an_error():
    """As a worker does on SIGTERM: the router's streams in flight get an SSE error and [DONE] at once
    (and their worker streams are closed), a plain request in flight gets 503 JSON, new ones 503."""
    seen = {"plain": 0, "ended": []}
    with BackgroundServer(slow_worker(seen)) as w, router(instances=[w.url]) as r:
        with ThreadPoolExecutor(1) as pool:
            plain = pool.submit(httpx.post, r.url + "/v1/completions", json=SHORT, timeout=30)
            with httpx.stream("POST", r.url + "/v1/completions", json={**SHORT, "stream": True}, timeout=30) as s:
                lines = s.iter_lines()
                assert next(line for line in lines if line).startswith("data: {")
                wait_until(lambda: seen["plain"], 10, message="the plain request is on the worker")
                started = time.time()
                r.app.state.engine.shutdown()
                rest = [line for line in lines if line]
            assert time.time() - started < 5  # not the minute the worker would have taken
            assert rest[-1] == "data: [DONE]"
            error = json.loads(rest[-2].removeprefix("data: "))
            assert_openai_error(503, error)
            assert "shutting down" in error["error"]["message"]
            late = plain.result()
            assert_openai_error(late.status_code, late.json(), 503)
        assert httpx.post(r.url + "/v1/completions", json=SHORT).status_code == 503
        wait_until(lambda: seen["ended"], 5, message="the worker's stream was closed")
        assert seen["ended"][0] - started < 5  # the worker's stream was closed, not left running


# ------------------------------------------------------------------ instance mode, real servers


def successes(srv) -> float:
    return server_metrics(srv).get("labsupport:request_success_total", 0)


def test_round_robin_alternates_and_answers_as_direct(a, b):
    prompts = ["The capital of France is", "Water boils at"]
    with router(instances=[a.url, b.url]) as r:
        before = [successes(a), successes(b)]
        replies = [httpx.post(r.url + "/v1/completions", json={**SHORT, "prompt": p}, timeout=60) for p in prompts * 2]
        assert [routed(x) for x in replies] == [f"instance={a.url}", f"instance={b.url}"] * 2
        assert [successes(a), successes(b)] == [before[0] + 2, before[1] + 2]
        for reply, srv, prompt in zip(replies, (a, b), prompts):  # temperature 0: the text of a direct request
            assert text_of(reply) == text_of(httpx.post(srv.url + "/v1/completions", json={**SHORT, "prompt": prompt},
                                                        timeout=60))
        assert httpx.get(r.url + "/v1/models").json()["data"][0]["id"] == "smol"
        missing = httpx.post(r.url + "/v1/completions", json={**SHORT, "model": "nope"})
        assert_openai_error(missing.status_code, missing.json(), 404)  # the worker's own error, passed through
        bad = httpx.post(r.url + "/v1/completions", content=b"{not json")
        assert_openai_error(bad.status_code, bad.json(), 400)
        metrics = httpx.get(r.url + "/metrics").text
        assert 'labsupport_router:requests_total{route="/v1/completions"} 6.0' in metrics
        assert f'labsupport_router:in_flight{{role="instance",worker="{a.url}"}} 0.0' in metrics


def test_streaming_through_the_openai_client(a, b):
    with router(instances=[a.url, b.url]) as r:
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="unused")
        expected = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=10, temperature=0)
        chunks = list(client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=10, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            expected.choices[0].message.content  # a on one, b on the other: same model, same greedy text
        assert chunks[-1].usage.completion_tokens == expected.usage.completion_tokens


def test_prefix_aware_keeps_a_prefix_on_one_instance(a, b):
    doc = "Here is a long document that every question in this test shares. " * 6  # > 256 characters
    with router(instances=[a.url, b.url], policy="prefix_aware") as r:
        hits = server_metrics(a)["labsupport:prefix_cache_hits_total"]
        first, second = [httpx.post(r.url + "/v1/completions", json={**SHORT, "prompt": doc + q, "max_tokens": 2},
                                    timeout=60) for q in ("Question one?", "And another?")]
        other = httpx.post(r.url + "/v1/completions", json={**SHORT, "max_tokens": 2}, timeout=60)
        assert routed(first) == routed(second) == f"instance={a.url}" != routed(other)
        # the second found the document's KV in a's prefix cache (serve enables it)
        assert server_metrics(a)["labsupport:prefix_cache_hits_total"] - hits >= 64


def test_least_loaded_avoids_the_busy_instance_and_hangups_abort_upstream(a, b):
    aborted = 'labsupport:request_success_total{finished_reason="abort"}'

    def aborts():  # the plain request may go to either (both idle by then)
        return sum(server_metrics(srv).get(aborted, 0) for srv in (a, b))

    before = aborts()
    with router(instances=[a.url, b.url], policy="least_loaded") as r:
        with httpx.stream("POST", r.url + "/v1/completions", json=LONG_STREAM, timeout=60) as s:
            assert routed(s) == f"instance={a.url}"
            lines = s.iter_lines()  # kept: a dropped iterator closes the connection (a hang-up)
            assert next(lines).startswith("data:")
            assert {routed(httpx.post(r.url + "/v1/completions", json={**SHORT, "max_tokens": 1}, timeout=60))
                    for _ in range(2)} == {f"instance={b.url}"}  # a has the long one in flight
        # we hung up on the stream; now on a plain request too: the router closes its upstream, a aborts both
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(r.url + "/v1/completions", json={**LONG_STREAM, "stream": False}, timeout=1.5)
        wait_until(lambda: aborts() >= before + 2, 10, message="the worker aborted both requests")
        assert aborts() == before + 2
        assert f'in_flight{{role="instance",worker="{a.url}"}} 0.0' in httpx.get(r.url + "/metrics").text


def test_a_dead_worker_is_skipped_and_listed_unhealthy(b):
    dead = f"http://127.0.0.1:{free_port()}"
    with router(instances=[dead, b.url]) as r:
        assert all(routed(httpx.post(r.url + "/v1/completions", json=SHORT, timeout=60)) == f"instance={b.url}"
                   for _ in range(3))
        assert httpx.get(r.url + "/health").json() == {"status": "ok", "workers": {
            dead: {"role": "instance", "healthy": False}, b.url: {"role": "instance", "healthy": True}}}


# ------------------------------------------------------------------ PD mode, real servers


def test_pd_mode_over_real_servers():
    pytest.importorskip("labsupport.pd.connector")
    from labsupport import LLM

    def engine(role):
        return LLM(device="cpu", num_blocks=128, kv_transfer_config={"kv_connector": "TcpConnector", "kv_role": role})

    prefill_llm, decode_llm = engine("kv_producer"), engine("kv_consumer")
    try:
        with BackgroundServer(create_app(prefill_llm, "smol")) as p, \
                BackgroundServer(create_app(decode_llm, "smol")) as d, router(prefill=[p.url], decode=[d.url]) as r:
            body = {"model": "smol", "prompt": "The three primary colors are", "max_tokens": 12, "temperature": 0}
            reply = httpx.post(r.url + "/v1/completions", json=body, timeout=60)
            assert routed(reply) == f"prefill={p.url};decode={d.url}"
            client = openai.OpenAI(base_url=r.url + "/v1", api_key="unused")
            streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices)
            m = server_metrics(d)  # the decode worker pulled the prompt's KV instead of computing it
            assert sum(v for k, v in m.items() if k.startswith("labsupport:kv_transfer_bytes_received")) > 0
            assert sum(v for k, v in m.items() if "external_kv_transfer" in k) > 0
            colocated = text_of(httpx.post(d.url + "/v1/completions", json=body, timeout=60))
            assert text_of(reply) == streamed == colocated
    finally:
        prefill_llm.shutdown(), decode_llm.shutdown()


# ------------------------------------------------------------------ bodies no worker would take


@pytest.mark.parametrize("raw, where", [
    (b'{"model": "smol", "prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    (b'{"model": "smol", "prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt.1"),
    (b'{"model": "\\ud800", "prompt": "hi"}', "model"),
    (b'{"model": "smol", "messages": [{"role": "user", "content": [{"type": "text", "text": "a\\ud800"}]}]}',
     "messages.0.content.0.text"),
    (b'{"\\ud800": 1, "model": "smol", "prompt": "hi"}', "\\ud800"),
    (b"[" * 100_000 + b"]" * 100_000, None),  # Python's parser: RecursionError
    (b'{"model": "smol", "prompt": "hi", "x": ' + b"[" * 150 + b"]" * 150 + b"}", None),  # parses; too deep to send
])
def test_bodies_that_cannot_be_sent_on_are_clear_400s(b, raw, where):
    with router(instances=[b.url]) as r:
        reply = httpx.post(r.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert_openai_error(reply.status_code, reply.json(), 400)
        message = reply.json()["error"]["message"]
        assert ("lone surrogate" in message and message.startswith(where)) if where else \
            "nests deeper than 100" in message, message
        assert httpx.post(r.url + "/v1/completions", json=SHORT, timeout=60).status_code == 200  # still serving


def test_router_bodies_over_the_limit_are_413_by_header_or_by_count(b):
    import socket
    with router(instances=[b.url], max_request_body_bytes=10_000) as r:
        big = {**SHORT, "prompt": "x" * 20_000}
        reply = httpx.post(r.url + "/v1/completions", json=big)
        assert_openai_error(reply.status_code, reply.json(), 413)
        assert "10000" in reply.json()["error"]["message"]

        def chunked():  # no Content-Length: refused once 10 kB have been counted, not after the whole body
            yield b'{"model": "smol", "prompt": "'
            for _ in range(1000):
                yield b"x" * 1000
            yield b'"}'
        reply = httpx.post(r.url + "/v1/chat/completions", content=chunked())
        assert_openai_error(reply.status_code, reply.json(), 413)
        with socket.create_connection(("127.0.0.1", r.port), timeout=5) as s:  # 200 MB announced, none sent
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 200000000\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 413")
        assert httpx.post(r.url + "/v1/completions", json=SHORT, timeout=60).status_code == 200


# ------------------------------------------------------------------ a frozen worker (SIGSTOP: accepts, never answers)


def test_a_frozen_worker_ends_its_streams_fast_and_new_requests_get_503_at_once(a):
    """Streams and plain requests in flight end with an error within 5 s of the freeze (the probe marks it
    down), new ones get 503 at once; with the probe too slow to notice, ``read_timeout`` ends the stream."""
    os.kill(a.proc.pid, signal.SIGSTOP)
    os.kill(a.proc.pid, signal.SIGCONT)  # (a stopped-then-resumed worker is fine: the probe finds it again)
    with router(instances=[a.url]) as r, ThreadPoolExecutor(1) as pool:
        with httpx.stream("POST", r.url + "/v1/completions", json=LONG_STREAM, timeout=60) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data:")
            plain = pool.submit(httpx.post, r.url + "/v1/completions", json={**LONG_STREAM, "stream": False},
                                timeout=60)
            wait_until(lambda: server_metrics(a)["labsupport:num_requests_running"] >= 2, 10,
                       message="the plain request reached the worker")  # both in flight when it freezes
            os.kill(a.proc.pid, signal.SIGSTOP)
            frozen = time.time()
            try:
                rest = [line for line in lines if line.startswith("data:")]
                assert time.time() - frozen < 5
                error = json.loads(rest[-2][5:])
                assert_openai_error(503, error)
                assert "stopped answering" in error["error"]["message"] and rest[-1] == "data: [DONE]"
                answer = plain.result(timeout=5)
                assert_openai_error(answer.status_code, answer.json(), 503)
                t0 = time.time()
                late = httpx.post(r.url + "/v1/completions", json=SHORT, timeout=30)
                assert_openai_error(late.status_code, late.json(), 503)
                assert time.time() - t0 < 0.5 and "no healthy" in late.json()["error"]["message"]
            finally:
                os.kill(a.proc.pid, signal.SIGCONT)
        wait_until(lambda: httpx.get(r.url + "/health").status_code == 200, 10, message="the router is healthy again")
        assert text_of(httpx.post(r.url + "/v1/completions", json=SHORT, timeout=60))
    with router(instances=[a.url], health_interval=3600, read_timeout=1.5) as r:  # no probe after the first
        with httpx.stream("POST", r.url + "/v1/completions", json=LONG_STREAM, timeout=60) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data:")
            os.kill(a.proc.pid, signal.SIGSTOP)
            frozen = time.time()
            try:
                rest = [line for line in lines if line.startswith("data:")]
                assert time.time() - frozen < 4
            finally:
                os.kill(a.proc.pid, signal.SIGCONT)
        error = json.loads(rest[-2][5:])
        assert_openai_error(504, error)
        assert "sent nothing for 1.5 s" in error["error"]["message"] and rest[-1] == "data: [DONE]"


# ------------------------------------------------------------------ faults (last: kills worker a)


def test_worker_killed_mid_request_then_restarted(worker_a, a, b, llm):
    with router(instances=[a.url, b.url]) as r, ThreadPoolExecutor(2) as pool:
        with httpx.stream("POST", r.url + "/v1/completions", json=LONG_STREAM, timeout=60) as s:
            assert routed(s) == f"instance={a.url}"  # round robin starts with the first
            lines = s.iter_lines()
            assert next(lines).startswith("data:")
            assert routed(httpx.post(r.url + "/v1/completions", json=SHORT, timeout=60)) == f"instance={b.url}"
            plain = pool.submit(httpx.post, r.url + "/v1/completions",  # to a again, not streamed
                                json={**LONG_STREAM, "stream": False}, timeout=60)
            wait_until(lambda: server_metrics(a)["labsupport:num_requests_running"] >= 2, 10,
                       message="both requests are running on a")
            killed = time.time()
            worker_a["a"].kill()
            rest = [line for line in lines if line.startswith("data:")]
            assert time.time() - killed < 5
        assert json.loads(rest[-2][5:])["error"]["type"] == "service_unavailable" and rest[-1] == "data: [DONE]"
        answer = plain.result(timeout=5)
        assert time.time() - killed < 5 and routed(answer) == f"instance={a.url}"
        assert_openai_error(answer.status_code, answer.json(), 503)
        assert answer.json()["error"]["type"] == "service_unavailable"
        # the others keep being served, by b
        assert {routed(httpx.post(r.url + "/v1/completions", json=SHORT, timeout=60)) for _ in range(3)} == \
            {f"instance={b.url}"}
        assert httpx.get(r.url + "/health").json()["workers"][a.url]["healthy"] is False
        # a comes back on the same port (in this process, over the session's model, which b gives up: a
        # second subprocess would load the model again): the router sends it requests again
        b.stop()
        with BackgroundServer(create_app(llm, "smol"), port=a.port):
            wait_until(lambda: httpx.get(r.url + "/health").json()["workers"][a.url]["healthy"], 10,
                       message="the router finds a healthy again")
            assert routed(httpx.post(r.url + "/v1/completions", json=SHORT, timeout=60)) == f"instance={a.url}"


def test_the_router_process_never_imports_torch():
    """``python -m labsupport router`` needs no model: chapter 07 runs several routers beside its workers, and
    torch would add ~200 MB to each (it came in through the server's app module before)."""
    code = "import sys; from labsupport.pd import router_app; sys.exit(int('torch' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
    help_run = subprocess.run([sys.executable, "-X", "importtime", "-m", "labsupport", "router", "--help"],
                              capture_output=True, text=True, timeout=60)
    assert help_run.returncode == 0 and "--prefill" in help_run.stdout
    assert not [line for line in help_run.stderr.splitlines() if line.rstrip().endswith("| torch")]
