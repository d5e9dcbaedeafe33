"""How late the server's event loop wakes up: the delay every stream shares when something blocks the loop.

Everything the frontend does for every client — parsing requests, tokenizing, turning tokens into SSE,
noticing disconnects — runs on one event loop. A task that asks to sleep 50 ms and wakes up later than
that measures how long the loop was busy elsewhere (or waiting for the GIL): the lag one chunk of every
stream waits, on top of the engine's own step. Chapter 06 reads it to compare the engine in a thread of
this process with the engine in a process of its own. Not a vLLM metric; ours, under ``labsupport:``.
"""
from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

INTERVAL_S = 0.05
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LoopLag:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.histogram = Histogram("labsupport:api_server_event_loop_lag_seconds",
                                   f"How much later than asked ({INTERVAL_S * 1000:.0f} ms) the API server's event loop "
                                   "woke a sleeping task.", buckets=BUCKETS, registry=self.registry)
        self.max = Gauge("labsupport:api_server_event_loop_lag_max_seconds",
                         "The largest event-loop lag seen since the server started.", registry=self.registry)
        self.largest = 0.0

    async def run(self):
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(INTERVAL_S)
            lag = max(0.0, loop.time() - asked - INTERVAL_S)
            self.histogram.observe(lag)
            if lag > self.largest:
                self.largest = lag
                self.max.set(lag)

    def render(self) -> bytes:
        return generate_latest(self.registry)
