"""Run an ASGI app with uvicorn in a background thread on a free loopback port.

Notebooks and tests need a real server they can call with the ``openai`` client and then stop,
without leaving a process behind: uvicorn in a daemon thread, bound to 127.0.0.1, port chosen
by the OS.
"""
from __future__ import annotations

import socket
import threading
import time

import uvicorn


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
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
