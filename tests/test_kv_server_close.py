"""KVServer.close (pd/kv_transfer.py): the port goes away with the server, also mid-transfer.

Closing a listening socket does not wake a thread blocked in ``accept()`` on Linux, so an engine's
KV port used to outlive ``LLM.shutdown()`` and accept one more connection. These run the real
server on loopback with small pools; no model is loaded."""
import json
import socket
import threading
import time

import pytest
import torch

from labsupport.pd.kv_transfer import KVServer, pull_blocks

BLOCK_SIZE, HKV, HEAD_DIM, LAYERS, BLOCKS = 16, 2, 64, 4, 64


class Held(list):
    """The connector's held blocks: the server calls ``release()`` when a pull ends, however it ends."""

    def __init__(self, blocks):
        super().__init__(blocks)
        self.released = threading.Event()

    def release(self):
        self.released.set()


def pools():
    slots = BLOCKS * BLOCK_SIZE
    return ([torch.randn(HKV, slots, HEAD_DIM) for _ in range(LAYERS)],
            [torch.randn(HKV, slots, HEAD_DIM) for _ in range(LAYERS)])


def refuses(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_closed_kv_server_refuses_connections_and_its_thread_ends():
    k, v = pools()
    server = KVServer(k, v, BLOCK_SIZE, lambda tid: None, lambda tid, record: None)
    assert not refuses(server.port)  # it listens
    time.sleep(0.1)  # its thread is now blocked in accept(): the case close() used to miss
    server.close()
    assert not server.alive
    assert refuses(server.port)


def test_a_pull_works_and_close_afterwards_leaves_nothing():
    k, v = pools()
    held, sent = Held(range(8)), []
    server = KVServer(k, v, BLOCK_SIZE, lambda tid: held if tid == "t1" else None,
                      lambda tid, record: sent.append(record))
    k2, v2 = pools()
    record = pull_blocks("127.0.0.1", server.port, "t1", list(range(8)), k2, v2, list(range(8, 16)), BLOCK_SIZE)
    assert record.num_blocks == 8 and held.released.wait(2)  # released once the server saw the ack
    assert torch.equal(k2[3][:, 8 * BLOCK_SIZE:16 * BLOCK_SIZE], k[3][:, :8 * BLOCK_SIZE])
    server.close()
    assert sent and sent[0].ok and not server.alive and refuses(server.port)


def test_close_cuts_a_pull_in_flight_and_still_releases_its_lease():
    k, v = pools()
    held = Held(range(BLOCKS))
    server = KVServer(k, v, BLOCK_SIZE, lambda tid: held, lambda tid, record: None)
    client = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        client.sendall(json.dumps({"transfer_id": "t", "block_ids": list(range(BLOCKS))}).encode() + b"\n")
        header = b""
        while not header.endswith(b"\n"):
            header += client.recv(1)
        assert json.loads(header)["ok"]
        client.recv(4096)  # the first frame has begun; the client now stalls, mid-transfer
        assert not held.released.is_set()
        start = time.monotonic()
        server.close()
        assert time.monotonic() - start < 5  # not the 30 s a stalled pull would otherwise hold it
        assert not server.alive
        assert held.released.wait(2)  # the blocks are not leaked to a pull that will never finish
        assert refuses(server.port)
        with pytest.raises(OSError):  # the client learns the transfer is over: EOF or reset, never a hang
            while client.recv(1 << 20):
                pass
            raise ConnectionError("the server closed the connection")
    finally:
        client.close()


def test_pull_from_a_closed_server_is_refused():
    k, v = pools()
    server = KVServer(k, v, BLOCK_SIZE, lambda tid: Held([0]), lambda tid, record: None)
    server.close()
    with pytest.raises(ConnectionRefusedError):
        pull_blocks("127.0.0.1", server.port, "t", [0], *pools(), [1], BLOCK_SIZE, timeout=2)
