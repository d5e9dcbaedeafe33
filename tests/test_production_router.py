"""The vLLM project's router (``vllm-router``, pd/production_router.py) in front of our workers, on loopback.

PD mode in front of ``serve --role prefill`` and ``--role decode``: the answer equals the decode
worker's own, KV moved, a streamed chat arrives chunk by chunk. Colocated: round robin alternates; a
fault drill (experiments/router_faults.py) kills a worker mid-stream, restarts it, freezes the other and bursts
a one-request router: every later request is answered and no block leaks. KV-aware:
with our KV-cache events, requests go to the worker that holds their prefix (a count of hits, against
round robin on the same workers). Skipped where ``make clients`` has not installed the router."""
import json
import time

import httpx
import pytest

from labsupport.pd.cluster import Worker, free_port, start_all, stop_all
from labsupport.pd.production_router import HOW_TO_INSTALL, ProductionRouter, router_binary
from labsupport.serve.metrics import parse_metrics

pytestmark = [pytest.mark.slow, pytest.mark.skipif(router_binary() is None, reason=HOW_TO_INSTALL)]

ARGS = ["--num-blocks", "256", "--max-model-len", "2048", "--served-model-name", "smol"]
BLOCK = 16


def metrics(worker) -> dict[str, float]:
    return parse_metrics(httpx.get(worker.url + "/metrics", timeout=10).text)


def complete(url: str, prompt, max_tokens: int = 8) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": "smol", "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def served_requests(worker) -> float:
    return sum(v for k, v in metrics(worker).items() if k.startswith("labsupport:request_success_total{engine"))


def test_router_refuses_a_half_pd_deployment():
    with pytest.raises(ValueError, match="both prefill and decode"):
        ProductionRouter(prefill=["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="kv_aware"):
        ProductionRouter(workers=["http://127.0.0.1:1"], kv_events={"http://127.0.0.1:1": "tcp://127.0.0.1:2"})


# ---------------------------------------------------------------------------- PD mode


@pytest.fixture(scope="class")  # class scope: the two workers stop before the next class starts its two
def pd():
    ws = start_all([Worker("prefill", cpus="0", args=ARGS), Worker("decode", cpus="1", args=ARGS)], timeout=120)
    router = ProductionRouter(prefill=[ws[0]], decode=[ws[1]])
    try:
        router.start(timeout=30)
        yield ws, router
    finally:
        router.stop()
        stop_all(ws)


class TestPD:
    def test_answer_through_the_router_equals_the_decode_workers_own_and_kv_moved(self, pd):
        (prefill, decode), router = pd
        prompt = "Explain why the sky is blue. " * 8
        before = metrics(decode)
        routed = complete(router.url, prompt, 16)
        after = metrics(decode)
        own = complete(decode.url, prompt, 16)  # the decode worker alone: it computes the prompt itself
        assert routed["choices"][0]["text"] == own["choices"][0]["text"]
        received = "labsupport:kv_transfer_bytes_received_total"
        moved = after[received] - before[received]
        assert moved > 0, "the decode worker pulled the prompt's KV from the prefill worker"
        key = 'labsupport:prompt_tokens_by_source_total{source="external_kv_transfer"}'
        assert after[key] - before[key] >= routed["usage"]["prompt_tokens"] - BLOCK  # all but the last partial block
        print(f"PD via vllm-router: {moved:,.0f} KV bytes received by the decode worker, "
              f"{after[key] - before[key]:.0f} of {routed['usage']['prompt_tokens']} prompt tokens transferred")

    def test_a_streamed_chat_comes_through_chunk_by_chunk(self, pd):
        _, router = pd
        body = {"model": "smol", "messages": [{"role": "user", "content": "Count from one to ten."}],
                "max_tokens": 24, "temperature": 0, "stream": True}
        chunks, arrivals = [], []
        with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"]
                    if delta and delta[0]["delta"].get("content"):
                        chunks.append(delta[0]["delta"]["content"])
                        arrivals.append(time.perf_counter())
        assert len(chunks) >= 10, chunks
        assert arrivals[-1] - arrivals[0] > 0.05, "chunks arrived as they were generated, not all at once"


# ---------------------------------------------------------------------------- colocated


def events_config(port: int, replay_port: int) -> str:
    """Topic "" (vLLM's default): vllm-router 0.1.17's --kv-event-source takes no topic and reads only topic "";
    with "kv-events" it indexed nothing and credited no prefix (measured)."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                       "replay_endpoint": f"tcp://*:{replay_port}", "topic": ""})


@pytest.fixture(scope="class")
def pair():
    """Two colocated workers, one core each, publishing KV-cache events."""
    ports = [(free_port(), free_port()) for _ in range(2)]
    ws = [Worker(cpus=str(i), args=[*ARGS, "--kv-events-config", events_config(*p)]) for i, p in enumerate(ports)]
    start_all(ws, timeout=120)
    try:
        yield ws, [{w: f"tcp://127.0.0.1:{p[k]}" for w, p in zip(ws, ports)} for k in range(2)]
    finally:
        stop_all(ws)


class TestColocated:
    def test_round_robin_alternates_and_answers_equal_a_workers_own(self, pair):
        ws, _ = pair
        with ProductionRouter(workers=ws, policy="round_robin") as router:
            before = [served_requests(w) for w in ws]
            answers = [complete(router.url, "The capital of France is")["choices"][0]["text"] for _ in range(4)]
            after = [served_requests(w) for w in ws]
        assert [a - b for a, b in zip(after, before)] == [2, 2]
        assert set(answers) == {complete(ws[0].url, "The capital of France is")["choices"][0]["text"]}

    def test_kv_aware_sends_a_shared_prefix_to_the_worker_holding_it(self, pair):
        """Each worker first holds one document (sent to it directly, past the router); then questions on
        both documents go through the router. Only the events tell the router which worker holds which."""
        ws, endpoints = pair
        from labsupport.data import __file__ as data_init
        from labsupport.models.loader import resolve_model_path
        text = open(data_init.replace("__init__.py", "northwind_handbook.txt")).read()
        results = {}
        for policy, offset in (("kv_aware", 0), ("round_robin", 2000)):  # fresh documents for each policy
            docs = [text[offset + 1000 * i: offset + 1000 * (i + 1)] for i in range(2)]  # ~14 blocks each
            kv, replay = endpoints if policy == "kv_aware" else (None, None)
            with ProductionRouter(workers=ws, policy=policy, kv_events=kv, kv_replay=replay, block_size=BLOCK,
                                  model=str(resolve_model_path(None)) if kv else None) as router:
                for w, doc in zip(ws, docs):
                    complete(w.url, doc + "\nQuestion: what is this about?", 1)  # the worker now holds the document
                time.sleep(1.0)  # the events reach the router (one batch per step, sent at once)
                before = [metrics(w) for w in ws]
                hits = 0
                for k, d in enumerate((0, 0, 1, 1, 0, 1)):  # twice in a row: round robin sends one of each pair
                    doc = docs[d]  # to the worker without the document, whichever worker it starts on
                    usage = complete(router.url, doc + f"\nQuestion {k}: what does item {k} say?", 1)["usage"]
                    hits += usage["prompt_tokens_details"]["cached_tokens"] >= len(doc) // 8  # found its document
                after = [metrics(w) for w in ws]
            q = sum(a["labsupport:prefix_cache_queries_total"] - b["labsupport:prefix_cache_queries_total"]
                    for a, b in zip(after, before))
            h = sum(a["labsupport:prefix_cache_hits_total"] - b["labsupport:prefix_cache_hits_total"]
                    for a, b in zip(after, before))
            results[policy] = (hits, h / q)
        print("requests that found their document's blocks, of 6; prefix-cache hit rate over both workers: "
              + ", ".join(f"{p}: {n}/6, {rate:.0%}" for p, (n, rate) in results.items()))
        assert results["kv_aware"][0] == 6
        assert results["round_robin"][0] < 6
        assert results["kv_aware"][1] > results["round_robin"][1]

    def test_the_fault_drill_survives_four_faults_and_leaks_nothing(self, pair):
        """experiments/router_faults.py, which chapter 07 runs: after a kill mid-stream, a restart, a frozen worker
        and a burst at a one-request router, every later request is answered, the restarted worker serves again,
        the burst gets status codes instead of a wait (429 with no queue, 408 past the queue's timeout), and neither worker holds a block or a request."""
        from labsupport.experiments.router_faults import fault_drill
        ws, _ = pair
        lines = []
        drill = fault_drill(ws, "smol", progress=lines.append)
        print("\n".join(lines))
        assert drill["killed"]["chunks"] < drill["killed"]["of"] and drill["killed"]["then"] == [200] * 4
        assert drill["killed"]["survivor_served"] == 4  # each probe counted once, all by the survivor
        assert drill["recovered"]["then"] == [200] * 4 and all(n > 0 for n in drill["recovered"]["served_by"])
        assert drill["frozen"]["codes"] == [200] * 4  # the timeout and a retry, then the health check, saved each
        refused, timed_out = drill["overload"]["no queue"]["codes"], drill["overload"]["queue, 1 s timeout"]["codes"]
        # no queue: a request that finds the one token taken is refused at once; a queue: it waits, then 408
        assert sum(refused.values()) == 6 and refused.get(429, 0) > 0 and refused.get(200, 0) > 0, refused
        assert set(refused) <= {200, 429}, refused
        assert sum(timed_out.values()) == 6 and timed_out.get(408, 0) > 0 and timed_out.get(200, 0) > 0, timed_out
        assert set(timed_out) <= {200, 408}, timed_out
        assert not any(drill["leaked"].values())
        assert all(w.alive for w in ws)
