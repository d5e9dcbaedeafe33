"""The server under abuse, on a real loopback port: many streaming clients at once, half of them hanging up
mid-stream, malformed requests among them; more requests than the server may queue; requests generated from
its own OpenAPI schema (schemathesis). Never a 5xx, nothing hangs, every error is OpenAI's JSON, every KV
block comes back, and the clients that stayed get exactly the tokens they get on a quiet server.

Bounded: greedy and short (``max_tokens`` 6-8), a fixed number of clients, a timeout on every request."""
import asyncio
import json
import time

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from server_tools import QUESTION, assert_openai_error, server_metrics, wait_metrics_free

from labsupport import LLM
from labsupport.serve.api import create_app
from labsupport.serve.background import BackgroundServer

CLIENT_TIMEOUT_S = 60  # per client: far above what any request here needs, far below a hung test
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at", "To make a cup of tea, first",
           "The largest planet in our solar system is", "In machine learning, overfitting means"]
MAX_TOKENS = 8
GREEDY = {"model": "smol", "temperature": 0, "ignore_eos": True, "max_tokens": MAX_TOKENS, "stream": True,
          "stream_options": {"include_usage": True}}


def survivor(i: int) -> tuple[str, dict]:
    """The i-th client that reads its stream to the end, with its tokens: chat for even ``i``, text completions for
    odd; clients ``i`` and ``i + 8`` send the same request (twins in one batch must agree too)."""
    prompt = PROMPTS[i % len(PROMPTS)]
    if i % 2 == 0:
        return CHAT, {**GREEDY, "messages": [{"role": "user", "content": prompt}], "logprobs": True, "top_logprobs": 0}
    return TEXT, {**GREEDY, "prompt": prompt, "logprobs": 0}


def dropper(i: int) -> tuple[str, dict]:
    """The i-th client that hangs up: a long, sampled answer it stops reading after a few chunks."""
    body = {"model": "smol", "max_tokens": 300, "ignore_eos": True, "temperature": 0.8, "seed": i, "stream": True}
    if i % 2:
        return CHAT, {**body, "messages": [{"role": "user", "content": f"Tell me story number {i}."}]}
    return TEXT, {**body, "prompt": f"Story number {i}: once upon a time"}


NAN_BODY = b'{"model": "smol", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
MALFORMED = [  # (path, raw body or JSON, the status OpenAI's API gives)
    (CHAT, b'{"model": "smol", "messages": [', 400),  # bad JSON
    (CHAT, b"\xff\xfe\x00", 400),  # not even text
    (CHAT, {"model": "smol", "messages": "hello"}, 400),  # wrong types
    (CHAT, {"model": "smol", "messages": QUESTION, "max_tokens": "lots"}, 400),
    (TEXT, {"model": "smol", "prompt": {"text": "hi"}}, 400),
    (CHAT, {"model": "smol"}, 400),  # missing fields
    (TEXT, {"model": "smol", "max_tokens": 4}, 400),
    (CHAT, {"model": "gpt-9", "messages": QUESTION, "max_tokens": 4}, 404),  # unknown model
    (TEXT, {"model": "gpt-9", "prompt": "hi", "max_tokens": 4}, 404),
    (CHAT, NAN_BODY, 400),  # NaN temperature
    (CHAT, {"model": "smol", "messages": [{"role": "user", "content": "x" * 100_000}]}, 413),  # oversize body
    (TEXT, "chunked", 413),  # oversize, sent chunked: no Content-Length to refuse it by
]
MAX_BODY = 64 << 10


async def read_stream(client: httpx.AsyncClient, path: str, body: dict, drop_after: int | None = None):
    """A streamed answer as ``(text, token strings, usage)``; with ``drop_after``, hang up after that many
    chunks (leaving the ``async with`` closes the connection) and return None. Fails on any error event."""
    text, tokens, usage, chunks = "", [], None, 0
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise AssertionError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, ": ping" comments
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return text, tokens, usage
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                lp = choice.get("logprobs")
                if path == CHAT:
                    text += choice["delta"].get("content") or ""
                    tokens += [e["token"] for e in (lp or {}).get("content") or []]
                else:
                    text += choice["text"]
                    tokens += (lp or {}).get("tokens") or []
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                return None
    raise AssertionError(f"the stream of {body} ended without [DONE]")


async def send_malformed(client: httpx.AsyncClient, path: str, body, expected: int):
    if body == "chunked":
        async def pieces():  # a generator body goes out with Transfer-Encoding: chunked
            for _ in range(8):
                yield b'{"prompt": "' + b"y" * (MAX_BODY // 4) + b'",'
        r = await client.post(path, content=pieces(), headers={"content-type": "application/json"})
    elif isinstance(body, bytes):
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = await client.post(path, json=body)
    assert_openai_error(r.status_code, r.json(), expected)
    return r.status_code


async def bounded(coro):
    """Every client gets an answer in time, or the test fails saying which did not."""
    return await asyncio.wait_for(coro, CLIENT_TIMEOUT_S)


def abort_and_length_counts(srv) -> tuple[float, float]:
    m = server_metrics(srv)
    return (m.get('labsupport:request_success_total{finished_reason="abort"}', 0.0),
            m.get('labsupport:request_success_total{finished_reason="length"}', 0.0))


def test_32_streams_half_hanging_up_with_malformed_requests_mixed_in(llm):
    n_survivors = n_droppers = 16
    with BackgroundServer(create_app(llm, "smol", max_request_body_bytes=MAX_BODY)) as srv:
        async def quiet():
            async with httpx.AsyncClient(base_url=srv.url, timeout=CLIENT_TIMEOUT_S) as client:
                return [await bounded(read_stream(client, *survivor(i))) for i in range(len(PROMPTS))]

        async def storm():
            clients = [httpx.AsyncClient(base_url=srv.url, timeout=CLIENT_TIMEOUT_S)
                       for _ in range(n_survivors + n_droppers + len(MALFORMED))]
            try:
                jobs = [read_stream(clients[i], *survivor(i)) for i in range(n_survivors)]
                jobs += [read_stream(clients[n_survivors + i], *dropper(i), drop_after=3) for i in range(n_droppers)]
                jobs += [send_malformed(clients[n_survivors + n_droppers + i], *bad) for i, bad in enumerate(MALFORMED)]
                order = list(range(len(jobs)))
                order = order[::3] + order[1::3] + order[2::3]  # interleave the three kinds of client
                results = await asyncio.gather(*(bounded(jobs[k]) for k in order))
                return dict(zip(order, results))
            finally:
                await asyncio.gather(*(c.aclose() for c in clients))

        alone = asyncio.run(quiet())
        aborts_before, lengths_before = abort_and_length_counts(srv)
        results = asyncio.run(storm())

        for i in range(n_survivors):
            text, tokens, usage = results[i]
            assert usage["completion_tokens"] == MAX_TOKENS and len(tokens) == MAX_TOKENS, (i, usage, tokens)
            assert (text, tokens) == alone[i % len(PROMPTS)][:2], f"client {i}: the answer differs from the quiet one"
        assert all(results[n_survivors + i] is None for i in range(n_droppers))
        assert [results[n_survivors + n_droppers + i] for i in range(len(MALFORMED))] == [e for *_, e in MALFORMED]

        wait_metrics_free(srv, llm)  # every block back, as /metrics says and as the engine says
        aborts, lengths = abort_and_length_counts(srv)
        assert aborts - aborts_before == n_droppers and lengths - lengths_before == n_survivors
        assert srv.app.state.engine.peak_batch_size > 1  # the clients really shared steps
        assert httpx.get(srv.url + "/health").status_code == 200


def test_overload_answers_429_then_recovers(llm):
    """Two running, two waiting, twenty-four arriving at once: the rest are told to retry (429), never a 5xx."""
    n, max_tokens = 24, 6

    async def one(client: httpx.AsyncClient, i: int):
        body = {"model": "smol", "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        if i % 2:  # a streamed request is refused before its stream starts, so it has a status too
            async with client.stream("POST", CHAT, json={**body, "stream": True,
                                                          "stream_options": {"include_usage": True}}) as r:
                if r.status_code != 200:
                    return r.status_code, json.loads(await r.aread())
                lines = [line async for line in r.aiter_lines() if line.startswith("data:")]
            assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines), lines
            return 200, json.loads(lines[-2][len("data:"):])["usage"]
        r = await client.post(CHAT, json=body)
        return r.status_code, r.json() if r.status_code != 200 else r.json()["usage"]

    async def burst(srv):
        async with httpx.AsyncClient(base_url=srv.url, timeout=CLIENT_TIMEOUT_S,
                                     limits=httpx.Limits(max_connections=n)) as client:
            return await asyncio.gather(*(bounded(one(client, i)) for i in range(n)))

    with llm.engine.options(max_num_seqs=2), \
            BackgroundServer(create_app(llm, "smol", max_waiting_requests=2)) as srv:
        results = asyncio.run(burst(srv))
        statuses = [s for s, _ in results]
        assert set(statuses) <= {200, 429}, statuses
        assert statuses.count(429) >= 1 and statuses.count(200) >= 2, statuses
        for status, body in results:
            if status == 429:
                assert_openai_error(status, body)
                assert body["error"]["type"] == "rate_limit_error"
            else:  # accepted: completed in full
                assert body["completion_tokens"] == max_tokens, body
        wait_metrics_free(srv, llm)
        assert httpx.get(srv.url + "/health").status_code == 200
        again = httpx.post(srv.url + CHAT, json={"model": "smol", "messages": QUESTION, "max_tokens": 2}, timeout=30)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 2
        wait_metrics_free(srv, llm)


# ---------------------------------------------------------------------- schema-driven fuzzing

FUZZ_MAX_MODEL_LEN = 48  # every choice is short: the chat template of an empty message takes 30 of these
FUZZ_REQUEST_TIMEOUT_S = 30
FUZZ_EXAMPLES = 25
FUZZ_MAX_CHOICES = 2  # per prompt, and prompts per request: see bound_cost
FUZZED = [("POST", CHAT), ("POST", TEXT), ("POST", "/tokenize"), ("POST", "/detokenize"),
          ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/version"), ("GET", "/metrics"), ("GET", "/pd/timeline")]


@pytest.fixture(scope="module")
def fuzz_llm():
    """Both caches on (``vllm serve`` has prefix caching on), a short context, a small pool."""
    return LLM(device="cpu", max_model_len=FUZZ_MAX_MODEL_LEN, num_blocks=256, enable_prefix_caching=True,
               enable_result_cache=True)


@pytest.fixture(scope="module")
def fuzz_server(fuzz_llm):
    with BackgroundServer(create_app(fuzz_llm, "smol")) as srv:
        yield srv


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json", timeout=30)


def test_the_fuzz_covers_every_route(fuzz_schema):
    routes = {(op.ok().method.upper(), op.ok().path) for op in fuzz_schema.get_all_operations()}
    assert routes == set(FUZZED), "a route was added or removed: fuzz it (FUZZED)"


def bound_cost(body):
    """Keep one generated request's work small: an ``n`` the server accepts (1-128) becomes at most 2, and a list
    of prompts keeps its first 2 (so at most 4 choices, each under ``FUZZ_MAX_MODEL_LEN``). On 2 CPU cores 128
    choices take minutes. Values the server must refuse (``n`` 0 or over 128, a string, ...) stay as generated."""
    if not isinstance(body, dict):
        return
    n = body.get("n")  # 124.0 counts: JSON has one number type, and pydantic takes a whole float as an int
    if type(n) in (int, float) and FUZZ_MAX_CHOICES < n <= 128 and n == int(n):
        body["n"] = 1 + int(n) % FUZZ_MAX_CHOICES
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > FUZZ_MAX_CHOICES and not any(type(x) is int for x in prompt):
        body["prompt"] = prompt[:FUZZ_MAX_CHOICES]  # a list of prompts (a list of ints is one prompt)


@pytest.mark.parametrize("method, path", FUZZED, ids=[f"{m} {p}" for m, p in FUZZED])
def test_schema_fuzz_never_a_5xx(fuzz_llm, fuzz_server, fuzz_schema, method, path):
    """Valid and invalid requests generated from ``/openapi.json``: each gets an answer in time, never a 5xx;
    an error is OpenAI's JSON; a stream (read up to schemathesis's 20 events, then dropped) has no error event."""
    operation = fuzz_schema[path][method]
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def fuzz(case):
        bound_cost(case.body)
        start = time.perf_counter()
        try:
            response = case.call(base_url=fuzz_server.url, timeout=FUZZ_REQUEST_TIMEOUT_S)
        except requests.Timeout:
            pytest.fail(f"no answer in {FUZZ_REQUEST_TIMEOUT_S} s: {case.as_curl_command()}")
        took = time.perf_counter() - start
        assert took < FUZZ_REQUEST_TIMEOUT_S, f"a stream hung ({took:.0f} s): {case.as_curl_command()}"
        case.validate_response(response, checks=[not_a_server_error])
        if response.status_code >= 400:
            assert_openai_error(response.status_code, json.loads(response.content))
        elif "text/event-stream" in response.headers.get("content-type", [""])[0]:
            assert b'"error"' not in response.content, response.content[-500:]

    fuzz()
    wait_metrics_free(fuzz_server, fuzz_llm)
    assert requests.get(fuzz_server.url + "/health", timeout=10).status_code == 200
