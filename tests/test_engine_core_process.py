"""The server with its engine core in a process of its own (``serve/engine_core.py``, ``core_client.py``), on a
real loopback port: the same tokens as the in-process engine, the text work (stop strings, logprobs) done by the
frontend, a stream whose first chunk carries its first token, aborts that free blocks, a core that dies turning
into 503s, a core that never outlives its parent, and prompts of megabytes that never freeze the other streams.
"""
import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from server_tools import assert_openai_error
from waiting import wait_healthy, wait_until

from labsupport.serve.api import create_app
from labsupport.serve.background import BackgroundServer
from labsupport.serve.core_client import EngineCoreClient, EngineCoreStartError
from labsupport.serve.request_stream import RequestStream

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
OPTIONS = dict(device="cpu", num_blocks=96, max_model_len=1024, max_num_seqs=16, enable_prefix_caching=True,
               enable_chunked_prefill=True, max_num_batched_tokens=256)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are"]
VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


@pytest.fixture(scope="module")
def core():
    client = EngineCoreClient(OPTIONS, "smol")
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def server(core):
    with BackgroundServer(create_app(core, "smol")) as srv:
        yield srv


@pytest.fixture(scope="module")
def in_process(llm):
    from labsupport import LLM
    ref = LLM(device="cpu", **{k: v for k, v in OPTIONS.items() if k != "device"})
    with BackgroundServer(create_app(ref, "smol")) as srv:
        yield srv
    ref.shutdown()


def stream_chunks(url: str, body: dict, path: str = CHAT) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def metric(url: str, name: str) -> float:
    from labsupport.serve.metrics import parse_metrics
    return parse_metrics(httpx.get(url + "/metrics", timeout=30).text)[name]


def wait_idle(url: str, timeout: float = 20):
    wait_until(lambda: metric(url, "labsupport:num_requests_running") == 0
               and metric(url, "labsupport:kv_cache_usage_perc") == 0, timeout=timeout, interval=0.1,
               message="the engine core goes idle with every block free")


def test_same_answers_as_the_engine_in_process(server, in_process):
    """Greedy text, token ids (logprobs), stop strings and usage are those of the in-process engine."""
    for prompt in PROMPTS:
        for extra in ({}, {"stop": [" the", "\n"]}, {"logprobs": 2}):
            body = {"model": "smol", "prompt": prompt, "max_tokens": 24, "temperature": 0, **extra}
            ours, ref = (httpx.post(s.url + TEXT, json=body, timeout=120).json() for s in (server, in_process))
            assert ours["choices"][0]["text"] == ref["choices"][0]["text"]
            assert ours["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"]
            assert ours["usage"] == ref["usage"]
            assert ours["choices"][0]["logprobs"] == ref["choices"][0]["logprobs"]
    chat = {"model": "smol", "messages": [{"role": "user", "content": "Name a yellow fruit."}], "max_tokens": 20,
            "temperature": 0}
    a, b = (stream_chunks(s.url, chat) for s in (server, in_process))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in a if c["choices"]) == \
           "".join(c["choices"][0]["delta"].get("content", "") for c in b if c["choices"])


@pytest.mark.parametrize("where", ["process", "thread"])
def test_first_chunk_carries_the_role_and_the_first_token(server, in_process, where):
    """No role-only chunk before a token exists: the first chunk has the role, the first token's text and its
    logprob, so a client that times TTFT at the first chunk times the prefill."""
    url = (server if where == "process" else in_process).url
    body = {"model": "smol", "messages": [{"role": "user", "content": "Name a yellow fruit."}], "max_tokens": 6,
            "temperature": 0, "logprobs": True, "stream_options": {"include_usage": True}}
    chunks = stream_chunks(url, body)
    first = chunks[0]["choices"][0]
    assert first["delta"]["role"] == "assistant"
    assert len(first["logprobs"]["content"]) == 1  # exactly one token in it: the first
    assert first["delta"]["content"] == first["logprobs"]["content"][0]["token"]
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:] if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_stop_string_ends_the_request_in_the_core(server):
    """The frontend finds the stop string; the core stops the request (its slot and blocks come back)."""
    body = {"model": "smol", "prompt": "1, 2, 3, 4, 5,", "max_tokens": 200, "temperature": 0, "stop": [" 9"],
            "ignore_eos": True}
    out = httpx.post(server.url + TEXT, json=body, timeout=120).json()
    assert out["choices"][0]["finish_reason"] == "stop" and " 9" not in out["choices"][0]["text"]
    assert out["usage"]["completion_tokens"] < 40
    wait_idle(server.url)


def test_client_hanging_up_frees_its_blocks_in_the_core(server):
    body = {"model": "smol", "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 500,
            "ignore_eos": True, "stream": True}
    for _ in range(3):
        with httpx.stream("POST", server.url + CHAT, json=body, timeout=60) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i > 6:
                    break
    wait_idle(server.url)


def test_n_samples_fork_in_the_core_and_answer_as_in_process(server, in_process):
    """n = 3 is one request to the core: the prompt is computed there once, each sample comes back under its own
    id as choice i, a stop string ends only the sample that wrote it (the frontend finds it, the core stops that
    sample), and the choices, usage and streams are the in-process engine's."""
    chat = {"model": "smol", "messages": [{"role": "user", "content": "List three animals, comma separated."}],
            "max_tokens": 24, "temperature": 1.0, "seed": 6, "n": 3, "stop": [","], "ignore_eos": True}
    computed, params_n = "labsupport:prompt_tokens_computed_total", "labsupport:request_params_n_sum"
    before = {name: metric(server.url, name) for name in (computed, params_n)}
    ours, ref = (httpx.post(s.url + CHAT, json=chat, timeout=120).json() for s in (server, in_process))
    assert [c["index"] for c in ours["choices"]] == [0, 1, 2]
    assert ours["choices"] == ref["choices"] and ours["usage"] == ref["usage"]
    assert len({c["message"]["content"] for c in ours["choices"]}) == 3  # seeds 6, 7, 8
    # with these seeds sample 0 (the request itself) meets its stop string first: the others go on to the end
    assert ours["choices"][0]["finish_reason"] == "stop" and ours["choices"][2]["finish_reason"] == "length", ours
    assert all("," not in c["message"]["content"] for c in ours["choices"])
    usage = ours["usage"]
    assert metric(server.url, computed) - before[computed] == \
        usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"] + 2
    assert metric(server.url, params_n) - before[params_n] == 3  # one request of n = 3, observed in the core
    assert joined(stream_chunks(server.url, chat)) == {i: c["message"]["content"] for i, c in enumerate(ref["choices"])}
    text = {k: v for k, v in chat.items() if k != "messages"} | {"prompt": ["Once upon", "1, 2"], "n": 2}
    a, b = (joined(stream_chunks(s.url, text, TEXT)) for s in (server, in_process))
    assert a == b and sorted(a) == [0, 1, 2, 3]  # two prompts x two samples, prompt-major
    wait_idle(server.url)


def joined(chunks: list[dict]) -> dict[int, str]:
    """A stream's text per choice index."""
    texts = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["text"] if "text" in c else c["delta"].get("content", ""))
    return texts


def test_hanging_up_on_n_samples_aborts_each_in_the_core(server):
    aborted = 'labsupport:request_success_total{finished_reason="abort"}'
    before = metric(server.url, aborted)
    body = {"model": "smol", "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 500,
            "ignore_eos": True, "stream": True, "n": 4, "temperature": 1.0}
    seen = set()
    with httpx.stream("POST", server.url + CHAT, json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen |= {c["index"] for c in json.loads(line[len("data: "):])["choices"]}
            if seen == {0, 1, 2, 3}:
                break
    wait_idle(server.url)
    assert metric(server.url, aborted) - before == 4


def test_burst_that_fits_the_free_slots_is_not_refused():
    """``max_waiting_requests`` counts requests that will wait for a slot, not a burst the free slots take at once."""
    client = EngineCoreClient({**OPTIONS, "max_num_seqs": 16}, "smol", max_waiting_requests=2)
    try:
        with BackgroundServer(create_app(client, "smol")) as srv:
            async def burst(n):
                async with httpx.AsyncClient(timeout=120) as http:
                    body = {"model": "smol", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
                    return await asyncio.gather(*(http.post(srv.url + TEXT, json=body) for _ in range(n)))
            assert [r.status_code for r in asyncio.run(burst(12))] == [200] * 12  # 12 < 16 free slots
            codes = [r for r in asyncio.run(burst(40))]
            refused = [r for r in codes if r.status_code == 429]
            assert refused and all(r.headers["retry-after"] == "1" for r in refused)  # 40 > 16 + 2: some wait too long
            assert sum(r.status_code == 200 for r in codes) >= 18
            assert_openai_error(429, refused[0].json(), 429)
    finally:
        client.shutdown()


def test_a_dead_core_answers_503_within_seconds():
    client = EngineCoreClient(OPTIONS, "smol")
    try:
        with BackgroundServer(create_app(client, "smol")) as srv:
            body = {"model": "smol", "prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.url + TEXT, json=body, timeout=60) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                killed = time.monotonic()
                os.kill(client.process.pid, signal.SIGKILL)
                rest = [line for line in lines if line.startswith("data: ")]
            assert time.monotonic() - killed < 5
            assert '"error"' in rest[-2] and rest[-1] == "data: [DONE]"
            health = httpx.get(srv.url + "/health", timeout=5)
            assert health.status_code == 503 and "died" in health.json()["error"]["message"]
            r = httpx.post(srv.url + TEXT, json={"model": "smol", "prompt": "Hi", "max_tokens": 2}, timeout=10)
            assert_openai_error(r.status_code, r.json(), 503)
    finally:
        client.shutdown()


def test_bad_engine_options_fail_at_start_with_the_reason():
    with pytest.raises(EngineCoreStartError) as info:
        EngineCoreClient({**OPTIONS, "max_num_seqs": 0})
    assert info.value.bad_option and "max_num_seqs" in str(info.value)


def test_the_core_dies_with_its_parent(tmp_path):
    """A frontend killed with SIGKILL (or a notebook kernel restarted) leaves no engine core behind."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from labsupport.serve.core_client import EngineCoreClient
        if __name__ == "__main__":
            c = EngineCoreClient({{"device": "cpu", "num_blocks": 16, "max_model_len": 256}})
            print(c.process.pid, flush=True)
            time.sleep(600)  # the parent lives until the test kills it: that is the behaviour under test
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        core_pid = int(parent.stdout.readline())
        os.kill(core_pid, 0)  # alive
        parent.kill()
        parent.wait()
        from waiting import wait_until
        wait_until(lambda: not _alive(core_pid), 10, message="the engine core ended with its parent")
    finally:
        if parent.poll() is None:
            parent.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def cli_server():
    """``python -m labsupport serve`` as users start it: its own process (and its core's), nothing shared with
    the test's interpreter."""
    from labsupport.serve.background import free_port
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "labsupport", "serve", "--port", str(port), "--num-blocks", "96",
                             "--max-model-len", "1024", "--served-model-name", "smol"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, timeout=180, proc=proc)

    class Srv:
        pass
    srv = Srv()
    srv.url = url
    yield srv
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


@pytest.mark.parametrize("route", ["/tokenize", TEXT])
def test_four_megabytes_of_prompt_never_freeze_the_other_streams(cli_server, route):
    """A 4 MB prompt beside a live stream delays the stream's next token by less than 0.5 s, and the prompt gets a
    clear answer: one that cannot fit the context is refused untokenized, by /tokenize as by /v1, and a long one
    that may fit is tokenized off the event loop."""
    body = {"model": "smol", "prompt": "Count slowly:", "max_tokens": 300, "ignore_eos": True, "stream": True}
    huge = "word " * 800_000  # 4 MB
    gaps, answer = [], {}

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            async def streamer():
                async with http.stream("POST", cli_server.url + TEXT, json=body) as r:
                    last = None
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            now = time.perf_counter()
                            if last is not None:
                                gaps.append(now - last)
                            last = now

            async def big():
                await asyncio.sleep(0.5)
                payload = {"model": "smol", "prompt": huge, "max_tokens": 1} if route == TEXT else {"prompt": huge}
                answer["r"] = await http.post(cli_server.url + route, json=payload)
                long = {"prompt": "a" * 60_000}  # 60k characters may still be under 1,024 tokens: counted
                answer["long"] = await http.post(cli_server.url + "/tokenize", json=long)
            await asyncio.gather(streamer(), big())

    asyncio.run(run())
    r = answer["r"]
    assert_openai_error(r.status_code, r.json(), 400)
    assert "maximum context length" in r.json()["error"]["message"]
    assert answer["long"].status_code == 200 and answer["long"].json()["count"] > 0
    typical = sorted(gaps)[len(gaps) // 2]  # the engine's own step on this (possibly busy) machine
    assert max(gaps) - typical < 0.5, (max(gaps), typical)  # tokenized on the loop, it stalled 3-8 s


def test_a_stream_keeps_only_the_latest_output_however_slowly_it_is_read():
    """Unread outputs are not queued: a stream holds one (the latest, cumulative) per choice."""
    async def run():
        stream = RequestStream(lambda rid: None, ["a"])

        class Out:
            def __init__(self, n):
                self.n, self.finished = n, False
        for n in range(1000):
            stream.put(0, Out(n))
        assert len(stream._latest) == 1
        batch = await stream.__anext__()
        assert batch[0].n == 999
    asyncio.run(run())


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM is not installed (make vllm)")
def test_vllm_bench_serves_parser_reads_every_token_of_our_streams(server):
    """Replay our raw streams, read by read and also cut at random points, through ``vllm bench serve``'s own
    SSE parser: every chunk we sent is parsed (no keep-alive comment can glue events onto itself)."""
    recordings = []
    for i, prompt in enumerate(PROMPTS):
        body = {"model": "smol", "messages": [{"role": "user", "content": prompt}], "max_tokens": 48 + 16 * i,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.url + CHAT, json=body, timeout=120) as r:
            reads = [chunk.decode("latin-1") for chunk in r.iter_raw()]
        recordings.append(reads)
    script = textwrap.dedent("""
        import json, random, sys
        from vllm.benchmarks.lib.endpoint_request_func import StreamedResponseHandler
        out = []
        for reads in json.load(sys.stdin):
            raw = "".join(reads).encode("latin-1")
            cuts = sorted(random.Random(len(raw)).sample(range(1, len(raw)), min(40, len(raw) - 1)))
            for pieces in ([r.encode("latin-1") for r in reads], [raw[a:b] for a, b in zip([0] + cuts, cuts + [len(raw)])]):
                handler, contents, usage = StreamedResponseHandler(), 0, None
                for piece in pieces:
                    for message in handler.add_chunk(piece):
                        data = message.removeprefix("data: ")
                        if data == "[DONE]":
                            continue
                        chunk = json.loads(data)
                        if chunk["choices"] and chunk["choices"][0]["delta"].get("content") is not None:
                            contents += 1
                        usage = chunk.get("usage") or usage
                out.append([contents, usage["completion_tokens"]])
        print(json.dumps(out))
    """)
    result = subprocess.run([str(VLLM_PYTHON), "-c", script], input=json.dumps(recordings), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    counted = json.loads(result.stdout.strip().splitlines()[-1])
    for reads, (contents_by_read, contents_by_cut) in zip(recordings, zip(counted[::2], counted[1::2])):
        sent = sum(1 for event in "".join(reads).split("\n\n") if '"content"' in event)
        assert contents_by_read[0] == contents_by_cut[0] == sent
        assert not any(line.startswith(":") for line in "".join(reads).splitlines())


def test_tenants_share_no_cached_blocks_through_the_core(core):
    """Each API key is a tenant: its cache salt crosses to the core with the request, so one tenant's prompt is a
    prefix-cache hit for itself and a miss for another."""
    with BackgroundServer(create_app(core, "smol", api_keys=["alice", "bob"])) as srv:
        prompt = "The support policy of the shop: " + "returns within thirty days, receipts required. " * 8

        def cached(key):
            r = httpx.post(srv.url + TEXT, json={"model": "smol", "prompt": prompt, "max_tokens": 2},
                           headers={"Authorization": f"Bearer {key}"}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached("alice") == 0
        assert cached("alice") > 0
        assert cached("bob") == 0
