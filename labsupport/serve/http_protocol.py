"""uvicorn's HTTP/1.1 protocol with one more deadline: a request's headers must arrive within ``HEADER_TIMEOUT_S``.

uvicorn closes a connection that sits idle *between* requests (its keep-alive timeout), but not one that
connects and then sends half a request line, or headers a byte at a time: such a client holds a
connection, and a slot of the server's, for as long as it likes. So the
connection gets a deadline whenever it waits for a request's headers — from the moment it opens, and
again after each response — and is closed if they are not complete by then. A request being served
(a stream that runs for minutes included) has no deadline here; its body has the ``Guard``'s.
"""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 20.0


class HeaderTimeoutProtocol(H11Protocol):
    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._header_deadline = None
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_headers()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _watch_headers(self):
        if self._waiting_for_headers():
            if self._header_deadline is None and not self.transport.is_closing():
                self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)
        else:
            self._disarm()

    def _disarm(self):
        if getattr(self, "_header_deadline", None) is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self):
        self._header_deadline = None
        if self._waiting_for_headers() and not self.transport.is_closing():
            self.transport.close()
