"""The server's life under stress, on a real loopback port: clients that hang up, a full queue, a step
that raises, an engine loop that dies, shutdown with requests in flight (in-process and by SIGTERM to
``python -m labsupport serve``), and concurrent clients sharing the engine's steps. After each, every
request is gone and every KV block is back."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from server_tools import LONG, QUESTION, post, server_metrics, wait_idle_and_free
from waiting import wait_healthy

from labsupport import SamplingParams
from labsupport.serve.api import create_app
from labsupport.serve.async_engine import AsyncEngine
from labsupport.serve.background import BackgroundServer, free_port


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(create_app(llm, "smol")) as srv:
        yield srv


def test_client_disconnecting_mid_stream_frees_all_its_blocks(llm, server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**LONG, "stream": True}, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # hang up after a few tokens
    wait_idle_and_free(llm)
    assert post(server, {"model": "smol", "messages": QUESTION, "max_tokens": 2}).status_code == 200


def test_client_giving_up_on_a_non_streamed_answer_aborts_it(llm, server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=LONG, timeout=1.5)
    wait_idle_and_free(llm)


def test_hanging_up_on_n_forked_samples_aborts_every_sample_and_frees_their_blocks(llm, server):
    """Past the fork, each sample is a sequence of its own holding its own blocks: a hang-up aborts them all."""
    body = {**LONG, "n": 4, "temperature": 1.0, "seed": 1, "stream": True}
    aborted = 'labsupport:request_success_total{finished_reason="abort"}'
    before = server_metrics(server)[aborted]
    seen = set()
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen |= {c["index"] for c in json.loads(line[len("data: "):])["choices"]}
            if len(seen) == 4 and llm.stats()["num_requests_running"] == 4:
                break  # hang up while all four samples run
    assert seen == {0, 1, 2, 3}
    wait_idle_and_free(llm)
    assert server_metrics(server)[aborted] == before + 4  # each sample aborted, none left to run its 400 tokens
    with pytest.raises(httpx.ReadTimeout):  # and a client giving up on the whole answer
        httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=1.5)
    wait_idle_and_free(llm)


def test_a_full_waiting_queue_answers_429(llm):
    with llm.engine.options(max_num_seqs=1), \
            BackgroundServer(create_app(llm, "smol", max_waiting_requests=1)) as srv:
        url, stream = srv.url + "/v1/chat/completions", {**LONG, "stream": True}
        with httpx.stream("POST", url, json=stream, timeout=30) as running:
            lines = running.iter_lines()  # keep the iterator: dropping it would close the connection
            next(lines)  # running: the one slot is taken
            with httpx.stream("POST", url, json=stream, timeout=30) as waiting:
                assert waiting.status_code == 200  # accepted: it waits for the slot
                r = post(srv, LONG)
                assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    wait_idle_and_free(llm)


def test_a_failing_step_fails_only_its_requests(llm, server, monkeypatch):
    execute = llm.engine.runner.execute

    def broken_once(out):
        monkeypatch.setattr(llm.engine.runner, "execute", execute)
        raise RuntimeError("a bug in the forward pass")

    monkeypatch.setattr(llm.engine.runner, "execute", broken_once)
    r = post(server, {"model": "smol", "messages": QUESTION, "max_tokens": 2})
    assert r.status_code == 500 and "step failed" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert post(server, {"model": "smol", "messages": QUESTION, "max_tokens": 2}).status_code == 200
    wait_idle_and_free(llm)


def test_a_dead_engine_loop_answers_503_and_health_says_so(llm, monkeypatch):
    with BackgroundServer(create_app(llm, "smol")) as srv:
        monkeypatch.setattr(llm.engine, "step", lambda: (_ for _ in ()).throw(SystemExit("the loop's end")))
        r = post(srv, {"model": "smol", "messages": QUESTION, "max_tokens": 2})
        assert r.status_code == 503 and "engine loop died" in r.json()["error"]["message"]
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "SystemExit" in health.json()["error"]["message"]
        assert post(srv, {"model": "smol", "messages": QUESTION, "max_tokens": 2}).status_code == 503
    monkeypatch.undo()
    wait_idle_and_free(llm)


def test_shutdown_fails_streams_in_flight_then_refuses(llm):
    with BackgroundServer(create_app(llm, "smol")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        stream = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=400, stream=True,
                                                extra_body={"ignore_eos": True})
        next(iter(stream))
        srv.app.state.engine.shutdown()
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in stream:
                pass
        assert httpx.get(srv.url + "/health").status_code == 503
        assert post(srv, {"model": "smol", "messages": QUESTION, "max_tokens": 2}).status_code == 503
    wait_idle_and_free(llm)


def test_python_m_labsupport_serve_exits_0_on_sigterm(tmp_path):
    port = free_port()
    keys = tmp_path / "keys"
    keys.write_text("key-a\n# a comment\nkey-b\n")
    proc = subprocess.Popen([sys.executable, "-m", "labsupport", "serve", "--port", str(port), "--num-blocks", "64",
                             "--served-model-name", "smol", "--api-key-file", str(keys), "--max-model-len", "1024"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=120, proc=proc)
        headers = {"Authorization": "Bearer key-b"}
        with httpx.stream("POST", url + "/v1/chat/completions", json={**LONG, "stream": True}, headers=headers,
                          timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert any('"error"' in line for line in rest) and rest[-1] == "data: [DONE]"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_four_streaming_clients_share_steps(llm):
    """Continuous batching across HTTP clients: their requests run in the same forward passes."""
    class StepRecorder:  # the metrics hooks, recording what each step ran
        def __init__(self):
            self.batch_sizes, self.finished = [], []

        def on_step(self, engine, got_token, scheduler_output):
            self.batch_sizes.append(len(scheduler_output.requests))

        def on_finished(self, request):
            self.finished.append(request.request_id)

    recorder = StepRecorder()
    with BackgroundServer(create_app(llm, "smol", metrics=recorder)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        texts = [None] * 4

        def ask(i):
            chunks = client.completions.create(model="smol", prompt=f"Story number {i}:", max_tokens=12,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
            texts[i] = "".join(c.choices[0].text for c in chunks if c.choices)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert all(texts) and max(recorder.batch_sizes) > 1 and srv.app.state.engine.peak_batch_size > 1
    assert len(recorder.finished) == 4
    wait_idle_and_free(llm)


def test_async_engine_streams_cumulative_outputs_and_closing_aborts(llm):
    """The interface without HTTP: ``generate`` yields growing outputs, the last one finished; closing the
    iterator early (what a disconnect does) aborts the request and its blocks come back."""
    engine = AsyncEngine(llm).start()
    greedy = SamplingParams(max_tokens=4, temperature=0)

    async def run():
        outs = [out async for out in engine.generate(llm.frontend.prepare("The capital of France is", greedy), "a")]
        long = engine.generate(llm.frontend.prepare("Tell me a story.", SamplingParams(max_tokens=400, ignore_eos=True)),
                               "b")
        first = await long.__anext__()
        await long.aclose()
        return outs, first

    try:
        outs, first = asyncio.run(run())
    finally:
        engine.shutdown()
    lengths = [len(o.token_ids) for o in outs]
    assert lengths == sorted(lengths) and outs[-1].finished and not first.finished
    assert outs[-1].token_ids == llm.generate("The capital of France is", greedy, use_tqdm=False)[0].token_ids
    wait_idle_and_free(llm)
