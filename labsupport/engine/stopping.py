"""When a request stops: every rule in one file, so the sampler, the scheduler, the detokenizer and a stream agree.

A request ends on a token (EOS unless ``ignore_eos``, one of its ``stop_token_ids``), on text (a stop string), or
on length (``max_tokens``, the context). One rule covers ``min_tokens`` for all of them: the n-th output token
may end the request only if n > ``min_tokens`` (``may_stop``). The sampler uses it to keep EOS and the stop token
ids from being drawn too early, ``update_from_output`` to read a token's finish reason (``token_stop_reason``),
the detokenizer to search for stop strings (``find_stop_string``); a stream holds back the last characters that
may still begin a stop string (``streamable``). As in vLLM, a stop string is cut from the text and the tokens
after the one that completed it never were.
"""
from __future__ import annotations


def may_stop(num_output_tokens: int, min_tokens: int) -> bool:
    """Whether the request's ``num_output_tokens``-th output token may end it: ``min_tokens`` came before it."""
    return num_output_tokens > min_tokens


def token_stop_reason(req, token: int, eos_token_ids: set[int], longest: int) -> str | None:
    """The finish reason ``token``, just appended to ``req``'s output, gives: "stop" for EOS or a stop token id
    once ``min_tokens`` tokens came before it, "length" at ``max_tokens`` or ``longest`` tokens (the context, or
    the pool), else None. A structured-output request draws one earlier only when its grammar has ended and
    allows nothing else (``Sampler._hold_back_stop_tokens``): then it ends there, as the grammar says."""
    params = req.params
    if may_stop(len(req.output_token_ids), params.min_tokens) or getattr(params, "structured_outputs", None):
        if token in eos_token_ids and not params.ignore_eos:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
    if len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= longest:
        return "length"
    return None


def find_stop_string(text: str, start: int, stop: list[str]) -> int | None:
    """Where the first stop string in ``text`` begins, looking only where one could end in ``text[start:]`` (the
    new text and the characters before it a stop string could straddle); None if there is none."""
    if not stop:
        return None
    tail = max(0, start - max(map(len, stop)) + 1)
    found = [i for i in (text.find(s, tail) for s in stop) if i >= 0]
    return min(found) if found else None


def streamable(text: str, stop: list[str], finished: bool) -> str:
    """The text a client may be sent already: while a request runs, the last characters that could still
    turn out to begin a stop string are held back (they may yet be cut)."""
    hold = max((len(s) for s in stop), default=1) - 1
    return text if finished or hold == 0 else text[:max(0, len(text) - hold)]
