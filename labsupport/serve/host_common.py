"""What the two engine hosts share: the in-process ``AsyncEngine`` (a thread beside the event loop) and the engine
core in its own process (``engine_core.EngineCore``, reached through ``core_client.EngineCoreClient``).

Each rule lives here once, so the two hosts cannot drift apart: when a request is refused with 429, how a
broken metric is kept from stopping the serving, and what a step and ``/pd/timeline`` look like to chapter 07's
timeline. Neither host imports the other.
"""
from __future__ import annotations

import logging

from .request_stream import QueueFullError

log = logging.getLogger(__name__)


def waiting_after(in_flight: int, new: int, max_num_seqs: int, reported_waiting: int = 0) -> int:
    """Requests that would wait for a sequence slot once ``new`` more are accepted.

    ``in_flight``: the sequences the host has accepted and not finished (each sample of ``n`` counts). Those past
    ``max_num_seqs`` wait: a burst that fits the free slots waits for nobody. ``reported_waiting``: the queue the
    engine reported after its last step, when it has one (the engine core's): requests it could not admit for
    want of KV memory wait although slots are free, and new ones would wait behind them. The in-process host
    passes none: it sees the live queue, where a burst that arrived a moment ago has not met a step yet."""
    behind = reported_waiting + new if reported_waiting else 0
    return max(in_flight + new - max_num_seqs, behind, 0)


def refuse_when_full(limit: int | None, waiting_with, new: int):
    """The 429 rule, applied before anything is queued: refuse when the requests waiting with the ``new`` ones
    (``waiting_with(new)``, the host's ``waiting_after``) would pass ``max_waiting_requests`` (``limit``; None: no
    limit). The message gives those waiting now, ``waiting_with(0)``."""
    if limit is not None and waiting_with(new) > limit:
        raise QueueFullError(f"the server is at capacity: {waiting_with(0)} requests are waiting "
                             f"(max_waiting_requests={limit}); retry later")


def call_hook(metrics, name: str, *args):
    """Call ``metrics.<name>(*args)`` where the host has metrics: a broken metric is logged, it never stops the
    serving."""
    if metrics is not None:
        try:
            getattr(metrics, name)(*args)
        except Exception:
            log.exception("metrics.%s failed", name)


def step_record(out, wall: float) -> dict:
    """One step as the PD timeline draws it: when (wall clock: ``perf_counter`` + ``wall``), which requests,
    prefill tokens or decodes."""
    prefill = {r.request_id: n for r, n, p in zip(out.requests, out.num_new_tokens, out.is_prefill) if p}
    return {"start": out.start + wall, "end": out.end + wall, "prefill": prefill,
            "decode": [r.request_id for r, p in zip(out.requests, out.is_prefill) if not p]}


def timeline(connector, steps: list[dict], since: float) -> dict:
    """``/pd/timeline``'s answer from a step log and a connector (None: no PD), after ``since``."""
    records = [] if connector is None else [vars(r) for r in list(connector.records) if r.end > since]
    return {"role": getattr(connector, "role", None), "engine_id": getattr(connector, "engine_id", None),
            "steps": [s for s in steps if s["end"] > since], "transfers": records}
