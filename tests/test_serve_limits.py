"""What a server owes the clients that behave when others do not: deadlines for half-sent requests, a stream
dropped (and its KV freed) when its client stops reading, the key on every route that costs or tells,
429s only for requests that would really wait, and defaults under which a long prompt never stalls the
decoders for a whole prefill. An in-process engine on a real loopback port, except where a stalled client
is simulated at the ASGI level (a socket that takes no bytes needs megabytes of kernel buffer to fill first).
"""
import asyncio
import socket
import time

import httpx
import pytest
from server_tools import assert_openai_error, wait_idle_and_free

from labsupport.serve import guard, http_protocol
from labsupport.serve.api import create_app
from labsupport.serve.background import BackgroundServer

TEXT = "/v1/completions"


@pytest.fixture(scope="module")
def engine_llm():
    from labsupport import LLM
    llm = LLM(device="cpu", num_blocks=128, max_model_len=1024, max_num_seqs=16)
    yield llm
    llm.shutdown()


def test_half_sent_headers_are_closed_after_the_header_deadline(engine_llm, monkeypatch):
    monkeypatch.setattr(http_protocol.HeaderTimeoutProtocol, "header_timeout_s", 1.0)
    with BackgroundServer(create_app(engine_llm, "smol")) as srv:
        for partial in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty"):
            with socket.create_connection((srv.host, srv.port), timeout=10) as s:
                s.sendall(partial)
                start = time.monotonic()
                assert s.recv(100) == b""  # closed by the server, not by our 10 s timeout
                assert time.monotonic() - start < 5
        # a request that completes in time is served as ever, on the same kind of connection
        r = httpx.post(srv.url + TEXT, json={"model": "smol", "prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200


def test_a_body_that_stops_arriving_gets_408(engine_llm, monkeypatch):
    monkeypatch.setattr(guard, "BODY_READ_TIMEOUT_S", 1.0)
    with BackgroundServer(create_app(engine_llm, "smol")) as srv:
        with socket.create_connection((srv.host, srv.port), timeout=20) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\": ")
            reply = s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


def test_the_key_guards_every_route_that_costs_or_tells(engine_llm):
    with BackgroundServer(create_app(engine_llm, "smol", api_keys=["k"])) as srv:
        for method, path, body in [("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
                                   ("GET", "/pd/timeline", None), ("POST", TEXT, {"prompt": "hi", "max_tokens": 1})]:
            r = httpx.request(method, srv.url + path, json=body, timeout=30)
            assert_openai_error(r.status_code, r.json(), 401)
            ok = httpx.request(method, srv.url + path, json=body, timeout=30, headers={"Authorization": "Bearer k"})
            assert ok.status_code == 200, (path, ok.text)
        for path in ("/health", "/metrics", "/version"):  # probes stay open
            assert httpx.get(srv.url + path, timeout=30).status_code == 200


def test_a_client_that_reads_nothing_is_dropped_and_its_blocks_freed(engine_llm):
    """The app behind a transport that stops taking bytes after the first chunk: past ``stream_send_timeout`` the
    stream ends, its engine request is aborted, and every block comes back."""
    app = create_app(engine_llm, "smol", stream_send_timeout=1.0)
    body = b'{"model": "smol", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": true, "stream": true}'
    sent = []

    async def run():
        async with app.router.lifespan_context(app):
            stalled = asyncio.Event()

            async def receive():
                if not sent:
                    return {"type": "http.request", "body": body, "more_body": False}
                await asyncio.sleep(3600)  # the client never hangs up: it only stops reading

            async def send(message):
                sent.append(message)
                if message["type"] == "http.response.body" and len(sent) > 2:
                    stalled.set()
                    await asyncio.sleep(3600)  # its socket is full: this write never completes

            scope = {"type": "http", "method": "POST", "path": TEXT, "raw_path": TEXT.encode(), "query_string": b"",
                     "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                     "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
                     "root_path": "", "app": app}
            start = time.monotonic()
            with pytest.raises(Exception):  # sse-starlette's SendTimeoutError ends the response
                await asyncio.wait_for(app(scope, receive, send), 30)
            assert stalled.is_set() and time.monotonic() - start < 20
    asyncio.run(run())
    wait_idle_and_free(engine_llm)


def test_a_burst_within_the_free_slots_is_not_refused_in_process(engine_llm):
    with BackgroundServer(create_app(engine_llm, "smol", max_waiting_requests=2)) as srv:
        async def burst(n):
            async with httpx.AsyncClient(timeout=120) as http:
                body = {"model": "smol", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
                return await asyncio.gather(*(http.post(srv.url + TEXT, json=body) for _ in range(n)))
        assert [r.status_code for r in asyncio.run(burst(12))] == [200] * 12  # 16 slots free: nobody waits
        replies = asyncio.run(burst(40))
        refused = [r for r in replies if r.status_code == 429]
        assert refused and refused[0].headers["retry-after"] == "1"


def test_serve_defaults_feed_a_long_prompt_in_chunks_beside_the_decoders():
    """``python -m labsupport serve``'s defaults: chunked prefill on, a step budget sized for the device (512 on
    the CPU), so an 8,000-token prompt never takes a step alone: every step that carries a chunk of it also gives
    each decoding request its next token. Its tokens are priced by the context they attend to (``chunk_cost_context``
    from the model: 3,072 for SmolLM2), so its late chunks are smaller and no step costs more than the budget
    (``bench soak`` times the longest wait this leaves a stream)."""
    from labsupport import LLM, SamplingParams
    from labsupport.__main__ import build_parser
    from labsupport.serve.server import CPU_BATCHED_TOKENS, engine_options
    args = build_parser().parse_args(["serve", "--device", "cpu", "--num-blocks", "640", "--max-model-len", "8192"])
    options = engine_options(args)
    assert options["enable_chunked_prefill"] and options["max_num_batched_tokens"] == CPU_BATCHED_TOKENS
    llm = LLM(device="cpu", num_blocks=640, max_model_len=8192, **options)
    try:
        engine = llm.engine
        decoders = [engine.add_request(list(range(100, 116)), SamplingParams(max_tokens=64, ignore_eos=True))
                    for _ in range(4)]
        for _ in range(3):
            engine.step()
        assert options["chunk_cost_context"] == "auto" and engine.config.chunk_cost_context == 3072
        long = engine.add_request(list(range(200, 8200)), SamplingParams(max_tokens=1))
        chunk_steps, chunks = 0, []
        while not long.is_finished:
            before = [len(d.output_token_ids) for d in decoders]
            done = long.num_computed_tokens
            engine.step()
            out = engine.last_step
            assert out.total_tokens <= CPU_BATCHED_TOKENS
            if long in out.requests and long.num_computed_tokens < 8000:
                n = out.scheduled[long.request_id][0]
                chunks.append(n)
                cost = n * (1 + (done + n / 2) / 3072) + sum(1 for r in out.requests if r is not long)
                assert cost <= CPU_BATCHED_TOKENS
            if long in out.requests and any(not d.is_finished for d in decoders):
                chunk_steps += 1
                assert all(len(d.output_token_ids) == b + 1 for d, b in zip(decoders, before) if not d.is_finished)
        assert chunk_steps >= 8000 // CPU_BATCHED_TOKENS - 1
        assert chunks[0] > 400  # early: most of the budget (471 of the 508 the four decodes leave)
        assert chunks[-2] < chunks[0] / 2.5  # late in the prompt: its attention is most of a token's cost
    finally:
        llm.shutdown()
