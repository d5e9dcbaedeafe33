"""The door: API keys and body size, checked before the app parses a byte of JSON.

A plain ASGI middleware, not a FastAPI dependency, because both checks must run *before* the
body is read and validated: a client without a key gets 401 whatever it sent, and a 1 GB body
is refused at its ``Content-Length`` (413), or, when it comes chunked without one, as soon as
the bytes counted so far pass the limit, instead of being buffered whole by the JSON parser.

With keys, ``/v1/...`` needs one, as in ``vllm serve``, and so do ``/tokenize`` and ``/detokenize``
(tokenizing megabytes costs a core for seconds: not for anyone who asks) and ``/pd/`` (chapter 07's
timeline lists every tenant's request ids); ``/health``, ``/metrics`` and ``/version`` stay open to
probes. Keys are compared in constant time. A body that trickles in slower than one chunk per
``BODY_READ_TIMEOUT_S`` is answered 408: a half-sent request must not hold a connection forever. With keys,
each key is a tenant: ``tenant_salt`` turns it into a cache salt, so two keys never share
cached KV blocks or cached results (a tenant could otherwise time another's prompts).

``cancel_on_disconnect`` stops a non-streamed answer whose client hung up. It lives here, with the other
HTTP-only pieces, because the PD router uses it too: importing it from ``api.py`` would bring the engine,
and torch, into the router's process (a large import in each, chapter 07 runs several).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac

from .protocol import error_response

DEFAULT_MAX_BODY_BYTES = 4 << 20
BODY_READ_TIMEOUT_S = 30.0
PROTECTED = ("/v1", "/tokenize", "/detokenize", "/pd/")


def bearer_token(headers) -> str | None:
    """The key of ``Authorization: Bearer <key>`` (Starlette headers or raw ASGI header pairs)."""
    if not hasattr(headers, "get"):
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}
    value = headers.get("authorization") or ""
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def tenant_salt(api_key: str | None, client_salt: str | None) -> str | None:
    """The cache salt of a request: the tenant's key (hashed: salts appear in logs and metrics), then the
    client's own salt, so a tenant may still split its own traffic further."""
    if api_key is None:
        return client_salt
    tenant = "tenant-" + hashlib.sha256(api_key.encode()).hexdigest()[:16]
    return tenant if client_salt is None else f"{tenant}/{client_salt}"


class Guard:
    def __init__(self, app, api_keys=(), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 body_read_timeout: float | None = None):
        self.app, self.api_keys, self.max_body_bytes = app, [k.encode() for k in api_keys], max_body_bytes
        self.body_read_timeout = BODY_READ_TIMEOUT_S if body_read_timeout is None else body_read_timeout

    def authorized(self, headers) -> bool:
        token = bearer_token(headers)
        if token is None:
            return False
        given = token.encode()
        matches = [hmac.compare_digest(given, key) for key in self.api_keys]  # every key, always: constant time
        return any(matches)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_keys and scope["path"].startswith(PROTECTED) and not self.authorized(scope["headers"]):
            return await error_response(401, "Unauthorized: send a valid API key as 'Authorization: Bearer <key>'",
                                        "authentication_error")(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k.lower() == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await self.too_large(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        body, more = bytearray(), True
        while more:  # count what arrives, whatever the headers said
            try:
                message = await asyncio.wait_for(receive(), self.body_read_timeout)
            except asyncio.TimeoutError:
                return await error_response(408, f"the request body did not arrive within {self.body_read_timeout:.0f} s "
                                                 "of its last part", "timeout_error")(scope, receive, send)
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await self.too_large(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: the client's disconnect, as the app expects

        await self.app(scope, replay, send)

    async def too_large(self, scope, receive, send):
        await error_response(413, f"the request body is over {self.max_body_bytes} bytes "
                                  "(the server's --max-request-body-bytes)")(scope, receive, send)


async def cancel_on_disconnect(request, work):
    """Await a non-streamed answer, but stop (aborting its engine requests) if the client hangs up:
    nobody would read it, and its tokens would take steps from clients who are still there."""
    task = asyncio.ensure_future(work)

    async def hung_up():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # its stream closes (aborting the engine requests) as the cancellation lands
    if task.done() and not task.cancelled():
        return task.result()  # the answer, or its exception for the error handlers
    return error_response(499, "the client closed the connection", "client_closed_request")
