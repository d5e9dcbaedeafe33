"""Mechanism: moving a request's KV blocks from one engine's pool into another's, over TCP.

Two halves, the exercise of chapter 07 and the wire:

* ``pack_blocks`` reads one layer's K and V of some blocks into one contiguous tensor (blocks
  are scattered in the pool; the wire wants one run of bytes); ``unpack_blocks`` writes such a
  tensor into *other* block ids of *another* pool: the decode worker's freshly allocated blocks
  have nothing to do with the numbers the prefill worker used.
* ``KVServer`` (on the worker that prefilled) answers pulls: a client names a transfer and the
  blocks it wants, the server streams them **layer by layer** (one frame per layer) and waits
  for the client's acknowledgement before it reports the transfer done, so the blocks are freed
  only once they have landed. ``pull_blocks`` (on the decode worker) is that client: it writes
  each layer into its pool as it arrives, while the server packs the next one.

Why plain TCP: it is what every machine has, it runs on loopback in CI, and it is honest about
the cost: bytes are copied out of the pool, through the kernel, and into the other pool. The
production transports (NIXL over RDMA/NVLink, Mooncake's transfer engine) read GPU memory in
place without those copies; the protocol around them -- who holds the blocks, who pulls, when
they are freed -- is the same as here, and so are vLLM's field names.

Frames: a JSON header line, then per layer an 8-byte big-endian length and the raw bytes of a
``[2, num_kv_heads, n_blocks * block_size, head_dim]`` tensor (K then V).
"""
from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)
ACK = b"ok\n"


def pack_blocks(k_pool: torch.Tensor, v_pool: torch.Tensor, block_ids: list[int], block_size: int) -> torch.Tensor:
    """One layer's K and V of ``block_ids``, in that order: ``[2, Hkv, len(block_ids) * block_size, D]``.

    Pool layout (``PagedAttention``): ``[Hkv, slots, D]``, slot = block * block_size + offset."""
    hkv, _, d = k_pool.shape
    idx = torch.tensor(block_ids, dtype=torch.long, device=k_pool.device)
    k = k_pool.view(hkv, -1, block_size, d).index_select(1, idx)  # [Hkv, n, bs, D]
    v = v_pool.view(hkv, -1, block_size, d).index_select(1, idx)
    return torch.stack([k, v]).reshape(2, hkv, len(block_ids) * block_size, d)


def unpack_blocks(k_pool: torch.Tensor, v_pool: torch.Tensor, block_ids: list[int], block_size: int,
                  packed: torch.Tensor):
    """Write a ``pack_blocks`` tensor into ``block_ids`` of this pool (the i-th packed block into the
    i-th id), leaving every other slot untouched."""
    hkv, _, d = k_pool.shape
    n = len(block_ids)
    if tuple(packed.shape) != (2, hkv, n * block_size, d):
        raise ValueError(f"packed KV has shape {tuple(packed.shape)}; {n} blocks need {(2, hkv, n * block_size, d)}")
    idx = torch.tensor(block_ids, dtype=torch.long, device=k_pool.device)
    packed = packed.to(k_pool.device, k_pool.dtype).view(2, hkv, n, block_size, d)
    k_pool.view(hkv, -1, block_size, d).index_copy_(1, idx, packed[0])
    v_pool.view(hkv, -1, block_size, d).index_copy_(1, idx, packed[1])


# ---------------------------------------------------------------------------- the wire


def _send_json(sock: socket.socket, obj):
    sock.sendall(json.dumps(obj).encode() + b"\n")


def _recv_line(sock: socket.socket, limit: int = 1 << 20) -> bytes:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buf += chunk
        if len(buf) > limit:
            raise ConnectionError("header line too long")
    return bytes(buf)


def _recv_exact(sock: socket.socket, n: int, into: bytearray | memoryview | None = None) -> memoryview:
    view = memoryview(into if into is not None else bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return view


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass
class TransferRecord:
    """One finished (or failed) transfer, for metrics and the timeline widget."""

    transfer_id: str
    role: str  # "send" (the prefill worker) or "recv" (the decode worker)
    start: float  # time.time(): comparable across the workers of one machine
    end: float
    num_bytes: int
    num_blocks: int
    ok: bool = True
    error: str | None = None

    @property
    def gbps(self) -> float:
        return self.num_bytes / max(self.end - self.start, 1e-9) / 1e9


class KVServer:
    """Answers pulls of held blocks. ``lookup(transfer_id) -> block ids or None`` says what may be read
    (the connector's held transfers; if the answer has a ``release()``, it is called when the pull
    ends, so a lease cannot expire under a transfer); ``on_sent(transfer_id, record)`` is called once
    the client has acknowledged, from the server's threads."""

    def __init__(self, k_pool: list[torch.Tensor], v_pool: list[torch.Tensor], block_size: int, lookup, on_sent,
                 host: str = "127.0.0.1", port: int = 0):
        self.k_pool, self.v_pool, self.block_size = k_pool, v_pool, block_size
        self.lookup, self.on_sent = lookup, on_sent
        self.pack_blocks = pack_blocks  # chapter 07's exercise plugs the attendee's own in (TcpConnector.PLUG_POINTS)
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.host, self.port = host, self.sock.getsockname()[1]
        self._closed = False
        self._lock = threading.Lock()
        self._answering: dict[socket.socket, threading.Thread] = {}  # connections being answered, for close()
        self._thread = threading.Thread(target=self._serve, name="kv-server", daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # shut down by close()
            with self._lock:
                if self._closed:  # accepted in the instant close() ran: refuse it rather than answer
                    conn.close()
                    return
                thread = threading.Thread(target=self._answer, args=(conn,), name="kv-send", daemon=True)
                self._answering[conn] = thread
            thread.start()

    def _answer(self, conn: socket.socket):
        try:
            self._answer_pull(conn)
        finally:
            with self._lock:
                self._answering.pop(conn, None)

    def _answer_pull(self, conn: socket.socket):
        start, tid, sent, held = time.time(), None, 0, None
        with conn:
            try:
                conn.settimeout(30)
                ask = json.loads(_recv_line(conn))
                tid = str(ask["transfer_id"])
                held = self.lookup(tid)
                blocks = [int(b) for b in ask["block_ids"]]
                if held is None:
                    return _send_json(conn, {"ok": False, "error": f"no KV held for transfer {tid} (expired or unknown)"})
                if not set(blocks) <= set(held):
                    return _send_json(conn, {"ok": False, "error": f"blocks {blocks} are not those held for {tid}"})
                k0 = self.k_pool[0]
                _send_json(conn, {"ok": True, "num_layers": len(self.k_pool), "dtype": str(k0.dtype),
                                  "shape": [2, k0.shape[0], len(blocks) * self.block_size, k0.shape[2]]})
                for layer in range(len(self.k_pool)):  # one frame per layer: the client unpacks it meanwhile
                    data = self.pack_blocks(self.k_pool[layer], self.v_pool[layer], blocks, self.block_size)
                    raw = memoryview(data.cpu().contiguous().view(torch.uint8).numpy()).cast("B")  # any dtype, no copy
                    conn.sendall(struct.pack(">Q", raw.nbytes))
                    conn.sendall(raw)
                    sent += raw.nbytes
                if _recv_exact(conn, len(ACK)).tobytes() != ACK:
                    raise ConnectionError("bad acknowledgement")
                self.on_sent(tid, TransferRecord(tid, "send", start, time.time(), sent, len(blocks)))
            except Exception as exc:  # the client went away or asked nonsense: the lease still frees the blocks
                log.warning("KV send %s failed: %s", tid, exc)
            finally:
                if hasattr(held, "release"):
                    held.release()  # this pull no longer reads the blocks

    def close(self, timeout: float = 5.0):
        """Stop listening and end the pulls in flight; returns once the threads have ended (or ``timeout``).

        Closing a listening socket does not wake a thread blocked in ``accept()`` on Linux: the port
        kept listening, with no owner in ``ss -ltnp``, until one more client came. ``shutdown`` wakes
        it. Pulls in flight are cut the same way: their clients get a ConnectionError, and each
        answer's ``finally`` still releases its lease."""
        with self._lock:
            self._closed = True
            answering = dict(self._answering)
        for sock in (self.sock, *answering):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # never connected, or the peer is gone already
        self.sock.close()
        deadline = time.monotonic() + timeout
        for thread in (self._thread, *answering.values()):
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def alive(self) -> bool:
        """Whether any of its threads still runs (false once ``close()`` returned in time)."""
        with self._lock:
            answering = list(self._answering.values())
        return self._thread.is_alive() or any(t.is_alive() for t in answering)


def pull_blocks(host: str, port: int, transfer_id: str, remote_block_ids: list[int], k_pool: list[torch.Tensor],
                v_pool: list[torch.Tensor], local_block_ids: list[int], block_size: int,
                timeout: float = 30.0, unpack=unpack_blocks) -> TransferRecord:
    """Fetch ``remote_block_ids`` of a held transfer into ``local_block_ids`` of this pool, layer by layer;
    raises ConnectionError (or ValueError) if anything is wrong, having written only into the local blocks."""
    if len(remote_block_ids) != len(local_block_ids):
        raise ValueError(f"{len(remote_block_ids)} remote blocks for {len(local_block_ids)} local ones")
    start, got = time.time(), 0
    with socket.create_connection((host, port), timeout=timeout) as sock:
        _send_json(sock, {"transfer_id": transfer_id, "block_ids": list(remote_block_ids)})
        head = json.loads(_recv_line(sock))
        if not head.get("ok"):
            raise ConnectionError(head.get("error", "the KV server refused"))
        shape, dtype = head["shape"], _dtype(head["dtype"])
        if head["num_layers"] != len(k_pool) or shape[1] != k_pool[0].shape[0] or shape[3] != k_pool[0].shape[2]:
            raise ValueError(f"the remote KV ({head['num_layers']} layers, shape {shape}) does not fit this model's pool")
        for layer in range(len(k_pool)):
            (size,) = struct.unpack(">Q", _recv_exact(sock, 8).tobytes())
            buf = bytearray(size)
            _recv_exact(sock, size, buf)
            packed = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
            unpack(k_pool[layer], v_pool[layer], local_block_ids, block_size, packed)
            got += size
        sock.sendall(ACK)
    return TransferRecord(transfer_id, "recv", start, time.time(), got, len(local_block_ids))
