"""The outputs of one HTTP request, as its handler reads them: ``RequestStream``; and the errors that end one.

Both engines of the server feed it: the engine-loop thread (``async_engine.py``) and the client of an
engine core in its own process (``core_client.py``). Either way it is fed on the event loop's thread
(the thread engine hands its outputs over with ``call_soon_threadsafe``), so it needs no lock.

It keeps only the *latest* output of each choice, never a queue of them. Outputs are cumulative (all
the text and tokens so far), so the latest is all a reader needs; and a queue would grow for a client
that stops reading — each entry a copy of everything so far, quadratic in the output's length (issue 41:
two never-read streams with 20 top logprobs each and 5,000 tokens held hundreds of megabytes). So a stream
holds at most one output per choice, however slowly its client reads.
"""
from __future__ import annotations

import asyncio
from typing import Callable


class EngineUnavailableError(RuntimeError):
    """The engine takes no requests: shut down, or its loop (or process) died (HTTP 503)."""


class QueueFullError(RuntimeError):
    """More requests wait than ``max_waiting_requests`` allows (HTTP 429)."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (a step raised) or aborted it (HTTP 500)."""


class RequestStream:
    """The outputs of the engine requests of one HTTP request (``n`` choices, several prompts).

    ``async for batch in stream`` gives ``{index: latest RequestOutput}`` for the requests that
    moved since the last batch and ends when all have finished. Closing it early (``close``,
    ``aclose``, or the consuming task being cancelled when a client disconnects) aborts the
    unfinished ones through ``abort`` (a request id -> None callable of the engine); the engine
    frees their blocks at its next iteration.
    """

    def __init__(self, abort: Callable[[str], None], request_ids: list[str]):
        self._abort, self.request_ids = abort, list(request_ids)
        self.unfinished = set(range(len(request_ids)))
        self._latest: dict[int, object] = {}
        self._ready = asyncio.Event()

    def put(self, index: int, item):
        """The newest output of choice ``index``, or an exception that ends the stream (event loop only)."""
        if isinstance(self._latest.get(index), BaseException):
            return  # an error already waits to be raised: nothing may hide it
        self._latest[index] = item
        self._ready.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        if not self.unfinished:
            raise StopAsyncIteration
        await self._ready.wait()
        self._ready.clear()
        items, self._latest = self._latest, {}
        batch = {}
        for index in sorted(items):
            item = items[index]
            if isinstance(item, BaseException):
                self.close()
                raise item
            batch[index] = item
            if item.finished:
                self.unfinished.discard(index)
        return batch

    def close(self):
        """Abort whatever has not finished (idempotent, never blocks: safe in a ``finally``)."""
        for index in self.unfinished:
            self._abort(self.request_ids[index])
        self.unfinished = set()

    async def aclose(self):
        self.close()

    def __del__(self):  # a stream dropped unread (its response never started) must not run on
        if getattr(self, "unfinished", None):
            self.close()
