"""Run an ASGI app with uvicorn in a background thread on a free loopback port.

Notebooks and tests need a real server they can call with the ``openai`` client and then stop,
without leaving a process behind: uvicorn in a daemon thread, bound to 127.0.0.1, port chosen
by the OS.
"""
from __future__ import annotations

import random
import socket
import threading
import time

import uvicorn


_handed_out: set[int] = set()  # ports this process chose already: two servers started together never share one


def _ephemeral_low() -> int:
    """The lowest port the OS hands to a socket bound to port 0 (Linux: 32768 unless configured)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A free port *below* the OS's ephemeral range, for a server started a moment later. A port the OS picked
    for a bind to port 0 is free again once that probe socket closes, so the OS may give it to the next bind to
    port 0 — a KV server's, a client's — before our server binds it (seen: chapter 07's decode worker, 'address
    already in use'). Ports under the ephemeral range are never handed out that way."""
    low = max(1024, min(_ephemeral_low(), 32768) - 12000)
    for port in random.Random().sample(range(low, low + 12000), 200):
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # a crowded range: fall back to the OS's choice
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None):
        self.host, self.port = host, port or free_port(host)
        self.app = app
        from .http_protocol import HeaderTimeoutProtocol
        self.server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port, log_level="warning",
                                                    http=HeaderTimeoutProtocol, timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30) -> "BackgroundServer":
        self.thread.start()
        deadline = time.time() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.05)
        return self

    def stop(self):
        engine = getattr(getattr(self.app, "state", None), "engine", None)
        if engine is not None:  # our app: requests in flight end now (with an error), so nothing holds the stop up
            engine.shutdown(wait=False)
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
