"""Waiting on the thing itself rather than on the clock.

A test that sleeps a fixed time before it looks is either slow (the sleep is long enough for a loaded CI
machine) or flaky (it is not). ``wait_until`` looks again and again until the condition holds, so it returns
as soon as the event happened, and fails with the condition's last value only after ``timeout``: the bound is
for a machine under load, not a guess at how long the event takes.
"""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float = 20.0, interval: float = 0.02,
               message: str = "") -> T:
    """Call ``condition`` until it returns something truthy, and return that; fail after ``timeout`` seconds.

    Exceptions from ``condition`` propagate: a condition that cannot be evaluated is a failure, not a wait."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout} s: {message or condition} (last value {value!r})")
        time.sleep(interval)  # the poll's interval, not a guess at when the event happens


def healthy(url: str, proc=None) -> bool:
    """``GET url/health`` answered 200; False while nothing listens yet. ``proc``: the server's process, which
    must not have exited (a crash at start-up fails at once instead of after the timeout)."""
    import httpx
    if proc is not None:
        assert proc.poll() is None, f"the server at {url} exited while starting (exit code {proc.returncode})"
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def wait_healthy(url: str, timeout: float = 120.0, proc=None) -> None:
    """Until the server at ``url`` answers ``/health`` with 200 (a model load takes seconds on a loaded machine)."""
    wait_until(lambda: healthy(url, proc), timeout=timeout, interval=0.2, message=f"{url}/health answers 200")
