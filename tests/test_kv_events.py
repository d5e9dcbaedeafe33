"""KV-cache events in vLLM's format (serve/kv_events.py): the flag, the wire, and vLLM's own classes reading it.

The model-free tests run the recorder and the publisher on loopback; the served ones start
``python -m labsupport serve --kv-events-config ...`` with a small pool, subscribe as a router would,
and hand the raw payloads to ``vllm.distributed.kv_events.KVEventBatch`` in ``.venv-vllm`` (skipped where
``make vllm`` has not run)."""
import json
import subprocess
import sys
import time

import httpx
import msgspec
import pytest
import zmq

from labsupport.pd.cluster import Worker, free_port, stop_all
from labsupport.serve.kv_events import (END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                        KVEventRecorder, ZmqEventPublisher, external_hash, parse_kv_events_config)

BLOCK = 16
DECODE = msgspec.msgpack.Decoder(KVEventBatch)


# ---------------------------------------------------------------------------- the flag


@pytest.mark.parametrize("text, needle", [
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher 'kafka'"),
    ('{"enable_kv_cache_events": true, "endpoints": "tcp://*:1"}', "unknown key(s) ['endpoints']"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events has the wrong type"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps must be at least 1"),
    ('{"enable_kv_cache_events": true, "endpoint": "127.0.0.1:5557"}', "not a ZMQ endpoint"),
    ('[1]', "must be a JSON object"),
    ("{enable", "is not JSON"),
])
def test_a_bad_kv_events_config_is_a_clear_error(text, needle):
    with pytest.raises(ValueError, match="--kv-events-config") as err:
        parse_kv_events_config(text)
    assert needle in str(err.value)


def test_kv_events_config_takes_vllms_defaults():
    assert parse_kv_events_config('{"enable_kv_cache_events": false}') is None
    assert parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    config = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert config.publisher == "zmq" and config.endpoint == "tcp://*:5557"
    assert config.replay_endpoint is None and config.topic == ""


def test_the_server_refuses_events_it_could_not_publish():
    cmd = [sys.executable, "-m", "labsupport", "serve", "--engine-in-process", "--kv-events-config",
           '{"enable_kv_cache_events": true}']
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "needs the engine core process" in out.stderr, out.stderr[-500:]


# ---------------------------------------------------------------------------- the wire, model-free


def subscriber(port: int, topic: bytes = b""):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


def receive(sub, timeout_ms: int = 5000) -> list[tuple[bytes, int, bytes]]:
    """Every (topic, seq, payload) until nothing came for ``timeout_ms`` after the last one."""
    got = []
    while sub.poll(timeout_ms):
        topic, seq, payload = sub.recv_multipart()
        got.append((topic, int.from_bytes(seq, "big"), payload))
        timeout_ms = 500
    return got


def replay(port: int, start: int, timeout_ms: int = 5000) -> list[tuple[bytes, int, bytes]]:
    """Ask the replay ROUTER for every batch from ``start``, as a DEALER (one request, many replies)."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        got = []
        while dealer.poll(timeout_ms):
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return got
            got.append((topic, int.from_bytes(seq, "big"), payload))
        raise AssertionError(f"no end-of-replay marker after {len(got)} batches")
    finally:
        dealer.close(linger=0)


def test_batches_go_out_in_sequence_and_replay_from_the_buffer():
    pub_port, replay_port = free_port(), free_port()
    config = parse_kv_events_config(json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub_port}",
                                                "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv",
                                                "buffer_steps": 3}))
    publisher = ZmqEventPublisher(config)
    sub = subscriber(pub_port, b"kv")
    try:
        time.sleep(0.5)  # ZMQ's slow joiner: a PUB drops what it sends before the SUB's subscription arrived
        recorder = KVEventRecorder(BLOCK)
        for step in range(5):
            recorder.stored([bytes([step]) * 32], list(range(step, step + BLOCK)), "GPU", parent=None)
            publisher.publish(KVEventBatch(ts=float(step), events=recorder.take()))
        got = receive(sub)
        assert [seq for _, seq, _ in got] == [0, 1, 2, 3, 4] and {t for t, _, _ in got} == {b"kv"}
        batches = [DECODE.decode(p) for _, _, p in got]
        assert batches[2].events[0].token_ids == list(range(2, 2 + BLOCK)) and batches[2].data_parallel_rank == 0
        assert batches[2].events[0].block_hashes == [external_hash(bytes([2]) * 32)]
        again = replay(replay_port, 1)  # the buffer keeps the last 3 batches only
        assert [seq for _, seq, _ in again] == [2, 3, 4]
        assert [p for _, _, p in again] == [p for _, _, p in got[2:]]
    finally:
        sub.close(linger=0)
        publisher.close()
    assert not publisher._thread.is_alive()
    again = ZmqEventPublisher(config)  # the ports are free again: a restarted worker binds the same endpoints
    again.close()


def test_a_block_moving_to_the_cpu_tier_keeps_its_parent():
    recorder = KVEventRecorder(BLOCK)
    a, b = b"a" * 32, b"b" * 32
    recorder.stored([a, b], list(range(2 * BLOCK)), "GPU", parent=None)
    recorder.stored([b], list(range(BLOCK, 2 * BLOCK)), "CPU")  # evicted from the device, copied to host memory
    recorder.removed([b], "GPU")
    gpu, cpu, removed = recorder.take()
    assert gpu.parent_block_hash is None and gpu.block_hashes == [external_hash(a), external_hash(b)]
    assert cpu.medium == "CPU" and cpu.parent_block_hash == external_hash(a)
    assert isinstance(removed, BlockRemoved) and removed.medium == "GPU"
    recorder.removed([b], "CPU")
    assert external_hash(b) not in recorder.parent_of  # held nowhere: forgotten, the memory stays bounded
    recorder.cleared()
    assert isinstance(recorder.take()[-1], AllBlocksCleared)


def test_hashes_are_unsigned_64_bit_as_vllm_publishes_them():
    digest = bytes(range(32))
    assert external_hash(digest) == int.from_bytes(digest[-8:], "big")  # vLLM's maybe_convert_block_hash
    assert 0 <= external_hash(("an attendee's", "hash")) < 2 ** 64
    assert 0 <= external_hash(-1) < 2 ** 64


# ---------------------------------------------------------------------------- served, decoded by vLLM


def vllm_python():
    from labsupport.servers import vllm_bin
    python = vllm_bin("python")
    if not python.exists():
        pytest.skip(f"vLLM is not installed ({python} missing): `make vllm` makes .venv-vllm")
    return python


VLLM_DECODE = """
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
out = []
for hexed in json.load(sys.stdin):
    batch = decoder.decode(bytes.fromhex(hexed))
    out.append({"ts": batch.ts, "rank": batch.data_parallel_rank,
                "events": [{"type": type(e).__name__, **msgspec.to_builtins(e)} for e in batch.events]})
print(json.dumps(out))
"""


def decode_with_vllm(payloads: list[bytes]) -> list[dict]:
    from labsupport.servers import client_env
    out = subprocess.run([str(vllm_python()), "-c", VLLM_DECODE], input=json.dumps([p.hex() for p in payloads]),
                         capture_output=True, text=True, timeout=120, env=client_env())
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def served():
    """Our server with events on, a 24-block pool and an 8-block CPU tier, so a few prompts evict."""
    vllm_python()
    pub_port, replay_port = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub_port}",
              "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv-events"}
    worker = Worker(args=["--kv-events-config", json.dumps(config), "--num-blocks", "24", "--cpu-offload-blocks", "8",
                          "--max-num-seqs", "2", "--served-model-name", "smol"])
    sub = subscriber(pub_port)  # before the server binds: ZMQ connects when it does, and misses nothing after
    worker.start(timeout=120)
    yield worker, sub, pub_port, replay_port
    sub.close(linger=0)
    stop_all([worker])


def complete(worker, prompt: list[int]) -> dict:
    r = httpx.post(worker.url + "/v1/completions", json={"model": "smol", "prompt": prompt, "max_tokens": 1,
                                                        "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_served_events_decode_with_vllms_classes_and_report_storing_and_eviction(served):
    worker, sub, _, replay_port = served
    first = [1000 + i for i in range(5 * BLOCK + 3)]  # 5 full blocks
    complete(worker, first)
    others = [[2000 + 100 * k + i for i in range(6 * BLOCK + 1)] for k in range(5)]  # 30 more blocks: evictions
    for prompt in others:
        complete(worker, prompt)
    got = receive(sub)
    assert [seq for _, seq, _ in got] == list(range(got[0][1], got[0][1] + len(got))), "a gap in the sequence"
    assert {topic for topic, _, _ in got} == {b"kv-events"}
    batches = decode_with_vllm([payload for _, _, payload in got])
    events = [e for b in batches for e in b["events"]]
    assert all(b["rank"] == 0 for b in batches)

    stored = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "GPU"]
    first_run = next(e for e in stored if e["token_ids"][:BLOCK] == first[:BLOCK])
    # the prompt's full blocks, as vLLM reports a request's: chained hashes, its tokens, the parent of the first
    assert first_run["token_ids"] == first[:len(first_run["block_hashes"]) * BLOCK]
    assert first_run["parent_block_hash"] is None and first_run["block_size"] == BLOCK
    chain = [h for e in stored if e["token_ids"][:1] and 1000 <= e["token_ids"][0] < 1100 for h in e["block_hashes"]]
    assert len(chain) == 5 and len(set(chain)) == 5
    for e in stored:  # every later run names the block before it as parent
        if e["parent_block_hash"] is not None:
            assert any(e["parent_block_hash"] in s["block_hashes"] for s in stored)

    removed = [h for e in events if e["type"] == "BlockRemoved" and e["medium"] == "GPU" for h in e["block_hashes"]]
    assert set(chain) & set(removed), "the pool is 24 blocks: the first prompt's blocks were evicted"
    to_cpu = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "CPU"]
    assert to_cpu and all(e["block_hashes"][0] in removed for e in to_cpu)
    moved = next(e for e in to_cpu if e["block_hashes"][0] == chain[1])  # the 2nd block, copied to host memory
    assert moved["parent_block_hash"] == chain[0] and moved["token_ids"] == first[BLOCK:2 * BLOCK]
    assert any(e["type"] == "BlockRemoved" and e["medium"] == "CPU" for e in events), "an 8-block tier overflows"

    replayed = replay(replay_port, 0)
    assert replayed[0][1] == 0 and DECODE.decode(replayed[0][2]).events == [AllBlocksCleared()]  # a fresh engine
    by_seq = {seq: payload for _, seq, payload in replayed}
    assert all(by_seq[seq] == payload for _, seq, payload in got)


@pytest.mark.slow
def test_a_cpu_tier_hit_is_reported_back_on_the_device(served):
    worker, sub, _, _ = served
    receive(sub, 200)
    prompt = [3000 + i for i in range(4 * BLOCK + 1)]
    complete(worker, prompt)
    for k in range(3):  # push it out of the 24-block pool into the CPU tier
        complete(worker, [4000 + 100 * k + i for i in range(7 * BLOCK + 1)])
    receive(sub, 300)
    r = complete(worker, prompt)
    assert r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) > 0, r["usage"]
    events = [e for _, _, p in receive(sub) for e in DECODE.decode(p).events]
    back = [e for e in events if isinstance(e, BlockStored) and e.medium == "GPU" and e.token_ids[:1] == [prompt[0]]]
    assert back, "blocks loaded back from the CPU tier are stored on the device again"
