"""Engine outputs in OpenAI's JSON shapes: usage, and log probabilities in both formats.

Chat completions use the newer format, one entry per output token:
``logprobs.content = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}, ...]}]``.
Text completions use the legacy one, parallel lists: ``tokens``, ``token_logprobs``,
``top_logprobs`` (a dict per token; the sampled token is always in it, so it may hold
``logprobs + 1`` entries, as OpenAI documents) and ``text_offset`` (where each token's text
begins in the choice's text). With ``echo`` the prompt's tokens come first; the first has no
logprob (nothing precedes it), so its entries are ``None``.

A token's ``bytes`` are its exact UTF-8 bytes. Byte-level BPE splits a CJK character or an
emoji over several tokens; each such token alone decodes to U+FFFD, which is useless to a
client reassembling text, so its raw bytes come from the tokenizer's byte alphabet instead.
JSON has no -inf: a logprob of -inf is sent as -9999.0, as vLLM does.
"""
from __future__ import annotations

from functools import lru_cache

LOGPROB_FLOOR = -9999.0


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable stand-in character -> the byte it encodes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenText:
    """Each token's text and bytes, computed once per token id (a stream asks again and again)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id])
            raw = text.encode()
            if "\ufffd" in text:  # part of a character: the raw bytes, if the tokenizer is byte-level
                piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
                decoder = _byte_decoder()
                if piece and all(c in decoder for c in piece):
                    raw = bytes(decoder[c] for c in piece)
            hit = self._cache[token_id] = (text, list(raw))
        return hit

    def text(self, token_id: int) -> str:
        return self(token_id)[0]


def _lp(value: float) -> float:
    return max(float(value), LOGPROB_FLOOR)


def top(logprobs: dict[int, float], n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens, most likely first."""
    return sorted(logprobs.items(), key=lambda kv: kv[1], reverse=True)[:n]


def chat_logprobs(token_text: TokenText, token_ids: list[int], logprobs: list[dict[int, float]],
                  num_top: int) -> list[dict]:
    """``choices[i].logprobs.content`` for these output tokens."""
    content = []
    for token, dist in zip(token_ids, logprobs):
        text, raw = token_text(token)
        tops = [{"token": token_text(t)[0], "logprob": _lp(lp), "bytes": token_text(t)[1]} for t, lp in top(dist, num_top)]
        content.append({"token": text, "logprob": _lp(dist[token]), "bytes": raw, "top_logprobs": tops})
    return content


def completion_logprobs(token_text: TokenText, token_ids: list[int], logprobs: list[dict[int, float] | None],
                        num_top: int, offset: int = 0) -> dict:
    """Legacy ``choices[i].logprobs`` for these tokens; ``offset``: where the first token's text begins."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, dist in zip(token_ids, logprobs):
        text = token_text.text(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if dist is None:  # the prompt's first token: nothing to predict it from
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_lp(dist[token]))
        tops = {token_text.text(t): _lp(lp) for t, lp in top(dist, num_top)}
        tops.setdefault(text, _lp(dist[token]))  # the sampled token is always listed
        out["top_logprobs"].append(tops)
    return out


def join_completion_logprobs(parts: list[dict]) -> dict:
    """One legacy logprobs object from consecutive pieces (the echoed prompt, then the output)."""
    return {key: [v for p in parts for v in p[key]] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def cached_tokens(out) -> int:
    """Prompt tokens the prefix cache supplied (``RequestOutput.num_cached_tokens``)."""
    return int(getattr(out, "num_cached_tokens", 0) or 0)
