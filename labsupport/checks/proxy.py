"""Check for chapter 08: ``disagg_request``, vLLM's toy disaggregated proxy written by hand.

``fn(client, prefill_url, decode_url, body)`` gets an ``httpx.Client``, two base URLs and an OpenAI
completions body. The check serves two of our engines with TCP connectors on loopback, each behind a
recorder that keeps every request the server received and what it answered, so the protocol is
checked on the wire, one request at a time. The final text alone proves little: a proxy that skips
the hand-off still answers the right text, because the decode worker quietly recomputes the prompt.

Mistakes are reported where they start, in the order they happen: the caller's body changed, then
the prefill request, what the function raised, the decode request, what it returned. The engines'
own counters then confirm it (the decode worker computed one prompt token, the prefill worker
generated one), and neither worker may be left holding blocks.
"""
from __future__ import annotations

import copy
import json
import time
import uuid
import weakref

from ..engine.request import SamplingParams
from .base import CheckFailed, passed
from .pd import PROMPT, _idle, require_idle_pair

NEW_TOKENS = 4
PATH = "/v1/completions"
PREFILL_ONLY = ("max_tokens", "max_completion_tokens", "stream", "stream_options", "kv_transfer_params")
_colocated_answers = weakref.WeakKeyDictionary()  # greedy: one engine's answer never changes, compute it once


def _colocated(llm):
    if llm not in _colocated_answers:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        _colocated_answers[llm] = llm.generate(PROMPT, params, use_tqdm=False, use_result_cache=False)[0]
    return _colocated_answers[llm]


class _Recorder:
    """An ASGI wrapper that keeps each POST the server received and its answer, whichever client sent it."""

    def __init__(self, app):
        self.app, self.state, self.calls = app, app.state, []  # state: BackgroundServer.stop reaches the engine

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        call = {"path": scope["path"], "body": b"", "status": None, "answer": b""}
        self.calls.append(call)

        async def receive_recorded():
            message = await receive()
            if message["type"] == "http.request":
                call["body"] += message.get("body", b"")
            return message

        async def send_recorded(message):
            if message["type"] == "http.response.start":
                call["status"] = message["status"]
            elif message["type"] == "http.response.body":
                call["answer"] += message.get("body", b"")
            await send(message)

        await self.app(scope, receive_recorded, send_recorded)


def _json(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _differences(got: dict, want: dict, skip=()) -> str:
    out = []
    for key in sorted(set(got) | set(want), key=str):
        if key in skip:
            continue
        if key not in got:
            out.append(f"{key} is missing")
        elif key not in want:
            out.append(f"{key}={_short(got[key])} was added")
        elif got[key] != want[key]:
            out.append(f"{key} is {_short(got[key])} instead of {_short(want[key])}")
    return "; ".join(out)


def _error_message(answer: bytes) -> str:
    parsed = _json(answer)
    error = parsed.get("error") if isinstance(parsed, dict) else None
    return error.get("message", "") if isinstance(error, dict) else answer[:200].decode(errors="replace")


def _raised(exc: Exception) -> str:
    import httpx

    if isinstance(exc, httpx.HTTPStatusError):  # raise_for_status: the server's own message says more
        r = exc.response
        return f"HTTPStatusError ({r.status_code} from {r.request.url.path}: {_error_message(r.content)})"
    return f"{type(exc).__name__}: {exc}"


def _the_request(role: str, calls: list) -> tuple[dict, dict]:
    """The one request ``role``'s server received, as JSON, and its recorded call."""
    if not calls:
        raise CheckFailed(f"your function sent nothing to the {role} server: POST the request to {role}_url + "
                          f"'{PATH}'")
    if len(calls) > 1:
        raise CheckFailed(f"your function sent {len(calls)} requests to the {role} server, expected one: each request "
                          f"runs once on each worker (a second {role} run computes the prompt again)")
    call = calls[0]
    if call["path"] != PATH:
        raise CheckFailed(f"your function sent its {role} request to {call['path']}, expected {PATH}: the body is a "
                          "completions request, and both workers serve it on the same path")
    sent = _json(call["body"])
    if not isinstance(sent, dict):
        raise CheckFailed(f"the {role} request is not a JSON object: send the dict with client.post(url, json=...)")
    return sent, call


def _check_prefill(calls, body) -> tuple[dict, dict]:
    """Step 1: a copy of the body, capped at one token, not streamed, asking the worker to keep the KV."""
    sent, call = _the_request("prefill", calls)
    if sent.get("max_tokens") != 1:
        raise CheckFailed(f"the prefill request asked for max_tokens={sent.get('max_tokens')!r}, expected 1: the "
                          "prefill worker is there for the prompt's KV and one token; every further token it "
                          "generates is thrown away (the decode worker generates them again) and delays the hand-off")
    if sent.get("stream") is not False:
        raise CheckFailed("the prefill request has stream=True: its answer comes as SSE events, not the JSON object "
                          "that carries kv_transfer_params; set stream=False in the prefill copy" if sent.get("stream")
                          else "the prefill request does not set stream=False: a caller asking for a stream would get "
                          "the prefill answer as SSE events, with no JSON to read kv_transfer_params from; always set "
                          "stream=False in the prefill copy")
    kv = sent.get("kv_transfer_params")
    if not isinstance(kv, dict) or kv.get("do_remote_decode") is not True:
        raise CheckFailed(f"the prefill request's kv_transfer_params are {_short(kv)}: send "
                          "{'do_remote_decode': True}, or the prefill worker frees the prompt's KV as soon as it "
                          "answers and says nothing about where to fetch it")
    if diff := _differences(sent, body, skip=PREFILL_ONLY):
        raise CheckFailed(f"the prefill request is not a copy of the caller's body ({diff}): copy it and change only "
                          "max_tokens, stream and kv_transfer_params")
    if call["status"] != 200:
        raise CheckFailed(f"the prefill server answered {call['status']}: {_error_message(call['answer'])}")
    return sent, _json(call["answer"])


def _check_decode(calls, body, prefill_sent, prefill_answer, n, computed) -> dict:
    """Step 3: the caller's body unchanged, plus the prefill answer's kv_transfer_params."""
    sent, call = _the_request("decode", calls)
    kv, want_kv = sent.get("kv_transfer_params"), prefill_answer.get("kv_transfer_params")
    if kv is None:
        raise CheckFailed(f"the decode request has no kv_transfer_params: the decode worker computed {computed} of "
                          f"the prompt's {n} tokens instead of 1, and the prefill worker keeps their KV for a pull "
                          "that never comes, until its lease ends; send the prefill answer's kv_transfer_params")
    if kv != want_kv:
        what = ("the ones your prefill request sent, {'do_remote_decode': True}: send those of the prefill ANSWER, "
                "which say where the blocks are (remote_host, remote_port, remote_block_ids, ...)"
                if kv == prefill_sent.get("kv_transfer_params") else
                f"not the prefill answer's ({_differences(kv, want_kv)}): forward them unchanged"
                if isinstance(kv, dict) else f"{_short(kv)}: forward the prefill answer's dict unchanged")
        raise CheckFailed(f"the decode request's kv_transfer_params are {what}")
    if sent.get("max_tokens") != body.get("max_tokens"):
        raise CheckFailed(f"the decode request asked for max_tokens={sent.get('max_tokens')!r}, the caller for "
                          f"{body.get('max_tokens')!r}: the one-token cap is for the prefill copy only; build the "
                          "decode request from the caller's body, not from the prefill request")
    if diff := _differences(sent, body, skip=("kv_transfer_params",)):
        raise CheckFailed(f"the decode request is not the caller's body plus kv_transfer_params ({diff}): the decode "
                          "worker generates the answer the caller asked for")
    if call["status"] != 200:
        raise CheckFailed(f"the decode server answered {call['status']}: {_error_message(call['answer'])}")
    return _json(call["answer"])


def _asks_prefill(call) -> bool:
    sent = _json(call["body"])
    kv = sent.get("kv_transfer_params") if isinstance(sent, dict) else None
    return isinstance(kv, dict) and kv.get("do_remote_decode") is True


def _trace(given, body, prefill, decode, error, n, computed) -> tuple[dict, dict | None]:
    """What the function sent, step by step, against what it should have: (prefill answer, decode answer)."""
    if diff := _differences(given, body):
        sent = _json(decode[0]["body"]) if decode else None
        leak = given.get("max_tokens")
        effect = (f", so the decode request asked for max_tokens={leak!r} too and the caller got a {leak!r}-token "
                  "answer" if leak != body["max_tokens"] and isinstance(sent, dict) and sent.get("max_tokens") == leak
                  else "")
        raise CheckFailed(f"your function changed the caller's body ({diff}){effect}: build the prefill request as "
                          "a copy, {**body, 'max_tokens': 1, ...}; the caller's dict is theirs, and the decode request "
                          "must carry their max_tokens")
    if [any(_asks_prefill(c) for c in calls) for calls in (prefill, decode)] == [False, True]:
        raise CheckFailed("the request with do_remote_decode went to the decode server: prefill_url and decode_url "
                          "are swapped")
    prefill_sent, prefill_answer = _check_prefill(prefill, body)
    if error is not None and not decode:
        raise CheckFailed(f"your function raised {_raised(error)} after the prefill request, before the decode "
                          f"request; the prefill answer has the keys {sorted(prefill_answer)}: kv_transfer_params is "
                          "at its top level") from error
    return prefill_answer, _check_decode(decode, body, prefill_sent, prefill_answer, n, computed)


def check_disagg_request(fn, prefill_llm, decode_llm, colocated_llm):
    """``fn(client, prefill_url, decode_url, body) -> dict`` against ``prefill_llm`` and ``decode_llm`` served on
    loopback (engines with TCP connectors, not serving elsewhere): the decode worker's JSON answer must be returned,
    equal ``colocated_llm``'s, with one prompt token computed on the decode side and both workers left idle."""
    import httpx  # here, not at the top: every chapter imports checks, few need a server

    from ..serve.api import create_app
    from ..serve.background import BackgroundServer

    require_idle_pair(prefill_llm, decode_llm, "the check")
    body = {"model": prefill_llm.model_name, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True, "cache_salt": f"check_disagg_request-{uuid.uuid4().hex}"}  # no prefix cache helps
    n, engines = len(colocated_llm.tokenize(PROMPT)[0]), (prefill_llm, decode_llm)
    servers, client = [], httpx.Client(timeout=30)
    try:
        for llm in engines:
            servers.append(BackgroundServer(_Recorder(create_app(llm))).start())
        prefill, decode = (s.app.calls for s in servers)
        before = [llm.stats() for llm in engines]
        given, got, error = copy.deepcopy(body), None, None
        try:
            got = fn(client, servers[0].url, servers[1].url, given)
        except Exception as exc:  # diagnosed below: what was sent usually says why
            error = exc
        generated, computed = (after[key] - was[key] for after, was, key in
                               zip([llm.stats() for llm in engines], before, ("generation_tokens",
                                                                               "prompt_tokens_computed")))
        if error is not None and not prefill and not decode and given == body:
            raise CheckFailed(f"your function raised before sending any request: {_raised(error)}") from error
        try:
            prefill_answer, answer = _trace(given, body, prefill, decode, error, n, computed)
        except CheckFailed as failed:
            if error is None or "your function raised" in str(failed):
                raise
            raise CheckFailed(f"{failed}. Your function then raised {_raised(error)}") from error
        if error is not None:
            raise CheckFailed(f"your function raised {_raised(error)}") from error
        if isinstance(got, httpx.Response):
            raise CheckFailed("your function returned the httpx.Response: return its JSON, response.json()")
        if not isinstance(got, dict):
            raise CheckFailed(f"your function returned a {type(got).__name__}: return the decode server's JSON "
                              "answer as a dict")
        if got == prefill_answer and got != answer:
            raise CheckFailed("your function returned the prefill server's answer (one token, with "
                              "kv_transfer_params): return the decode server's")
        if got != answer:
            raise CheckFailed(f"your function's dict is not the decode server's answer ({_differences(got, answer)}): "
                              "return response.json() unchanged")
        text, want = answer["choices"][0]["text"], _colocated(colocated_llm)
        if text != want.text:
            raise CheckFailed(f"the decode worker answered {text!r}, the colocated engine {want.text!r} "
                              f"({answer['usage']['completion_tokens']} and {len(want.token_ids)} tokens)")
        if computed > 1:
            raise CheckFailed(f"the decode worker computed {computed} prompt tokens, expected 1 (the last, for its "
                              f"logits): the other {n - 1} tokens' KV must come from the prefill worker")
        if generated != 1:
            raise CheckFailed(f"the prefill worker generated {generated} tokens, expected 1 (max_tokens=1)")
        deadline = time.monotonic() + 5  # the server loops free held blocks on the step after the pull
        while not all(_idle(llm) for llm in engines) and time.monotonic() < deadline:
            time.sleep(0.05)
        for name, llm in zip(("prefill", "decode"), engines):
            if not _idle(llm):
                s = llm.stats()
                raise CheckFailed(f"after the request the {name} worker has {s['kv_blocks_free']} of "
                                  f"{s['kv_blocks_total']} blocks free, {s['kv_requests_held']} requests' KV held: "
                                  "every block must be freed")
    finally:
        client.close()
        for server in servers:
            server.stop()
    kv = prefill_answer["kv_transfer_params"]
    passed(f"disagg_request sent the prefill worker a one-token, non-streaming copy with do_remote_decode; the decode "
           f"worker got the caller's body with the answer's kv_transfer_params ({len(kv['remote_block_ids'])} blocks "
           f"at {kv['remote_host']}:{kv['remote_port']}), computed 1 of the {n} prompt tokens and answered what the "
           "colocated engine answers; you returned its JSON, the caller's body is unchanged, both workers are idle")
