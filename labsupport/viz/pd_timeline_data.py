"""The PD timeline as data: what the workers answer on ``GET /pd/timeline``, and its transfers paired up.

Separate from the drawing (``pd_timeline_draw``) and the live widget (``pd_timeline``) because the
numbers are the lesson's evidence on their own: which lane goes where, what a step fed the model,
and each KV hand-off matched across workers by its ``transfer_id`` into one row of bytes, time and
GB/s. Nothing here draws or keeps a thread, so it is read and tested without matplotlib or widgets.
"""
from __future__ import annotations

ROLE_RANK = {"kv_producer": 0, "kv_both": 1, None: 2, "kv_consumer": 3}  # prefill lanes first


def fetch_timelines(workers: dict[str, str], since: float = 0.0, timeout: float = 2.0) -> dict[str, dict]:
    """``{name: the worker's /pd/timeline answer}``; ``{"error": "..."}`` for one that fails to answer."""
    import httpx

    out = {}
    for name, url in workers.items():
        try:
            resp = httpx.get(url.rstrip("/").removesuffix("/v1") + "/pd/timeline", params={"since": since},
                             timeout=timeout)
            resp.raise_for_status()
            out[name] = resp.json()
        except Exception as exc:  # refused, timed out, 404 from a server without PD: say so, keep the others
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def lane_order(timelines: dict[str, dict]) -> list[str]:
    """Worker names, prefill workers first, then colocated/unknown, then decode (stable otherwise)."""
    return sorted(timelines, key=lambda n: ROLE_RANK.get(timelines[n].get("role"), 2))


def step_kind(step: dict) -> str:
    p, d = bool(step.get("prefill")), bool(step.get("decode"))
    return "mixed" if p and d else "prefill" if p else "decode"


def step_tokens(step: dict) -> int:
    """Tokens the step fed the model: prompt tokens plus one per decoding request."""
    return sum(step.get("prefill", {}).values()) + len(step.get("decode", []))


def _pairs(timelines: dict[str, dict]) -> list[tuple[str, tuple | None, tuple | None]]:
    """``[(transfer_id, (sender, record) or None, (receiver, record) or None), ...]`` by start time."""
    found: dict[str, dict] = {}
    for name, tl in timelines.items():
        for rec in tl.get("transfers") or []:
            found.setdefault(rec["transfer_id"], {})[rec["role"]] = (name, rec)
    pairs = [(tid, ends.get("send"), ends.get("recv")) for tid, ends in found.items()]
    return sorted(pairs, key=lambda p: min(e[1]["start"] for e in p[1:] if e))


def _row(tid: str, send, recv) -> dict:
    """One transfer in numbers. Its time is the receiver's (connect to unpacked: what the decode
    request waits for), or the sender's when only that end answered."""
    main = (recv or send)[1]
    ms = 1e3 * (main["end"] - main["start"])
    row = {"transfer_id": tid, "from": send and send[0], "to": recv and recv[0], "bytes": main["num_bytes"],
           "blocks": main["num_blocks"], "ms": ms, "GB/s": main["num_bytes"] / max(ms, 1e-6) / 1e6,
           "send_ms": send and 1e3 * (send[1]["end"] - send[1]["start"]),
           "recv_ms": recv and 1e3 * (recv[1]["end"] - recv[1]["start"]), "overlap_ms": None, "overlap": None,
           "ok": all(e[1]["ok"] for e in (send, recv) if e),
           "error": next((e[1]["error"] for e in (send, recv) if e and e[1].get("error")), None)}
    if send and recv:  # the same pull seen from both ends: the send should sit inside the recv
        s, r = send[1], recv[1]
        row["overlap_ms"] = 1e3 * max(0.0, min(s["end"], r["end"]) - max(s["start"], r["start"]))
        row["overlap"] = row["overlap_ms"] / max(1e3 * min(s["end"] - s["start"], r["end"] - r["start"]), 1e-6)
    return row


def transfer_table(timelines: dict[str, dict]) -> list[dict]:
    """One row per transfer_id: from, to, bytes, blocks, ms, GB/s, send_ms, recv_ms, overlap_ms,
    overlap (fraction of the shorter end), ok, error."""
    return [_row(*p) for p in _pairs(timelines)]


def _span(timelines: dict[str, dict]) -> tuple[float, float] | None:
    times = [t for tl in timelines.values() for ev in (tl.get("steps") or []) + (tl.get("transfers") or [])
             for t in (ev["start"], ev["end"])]
    return (min(times), max(times)) if times else None
