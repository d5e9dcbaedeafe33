"""Incremental detokenization: the new text of each new token, without decoding the whole output again.

Decoding the whole output every step costs O(length) per token, O(length²) per request. Instead,
as vLLM's detokenizer and TGI do, each request keeps two offsets into its tokens: text is only
emitted for tokens after ``read``, decoded together with a few tokens before it (from
``prefix``) so that the tokenizer sees the context it needs (a word-initial space, a merge).

Two cases make this subtle, and both are tested with non-ASCII text:

* one character can span several tokens (byte-level BPE splits a CJK character or an emoji into
  byte tokens): until the last byte arrives the decoded tail ends in U+FFFD, so nothing is
  emitted yet, and the character comes out whole one token later;
* special tokens decode to nothing (``skip_special_tokens``), so they emit nothing.

So every delta is whole characters, and the deltas join to exactly the request's text: a
streaming client never shows a half character ("KV\ufffd存") that the next chunk cannot repair.

Stop strings are searched for in the tail only (the new text plus the few characters before it
that a stop string could straddle), and the text is cut where the first one begins. As in vLLM,
they are looked for only once the output has more than ``min_tokens`` tokens (``stopping.py``).
"""
from __future__ import annotations

from .stopping import find_stop_string, may_stop

CONTEXT_TOKENS = 5  # prompt tokens decoded as context before the first output token (as vLLM does)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] = (), min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix = 0  # start of the tokens decoded as context ...
        self.read = len(self.context)  # ... up to here; text already emitted for everything before `read`
        self.stop = list(stop)
        self.min_tokens = min_tokens
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, output_token_ids: list[int], flush: bool = False) -> tuple[str, bool]:
        """Catch up with the request's output tokens. Returns ``(new text, stopped)``.

        ``flush``: the request has finished, so emit whatever is left even if it ends in an
        incomplete character (the full decode would show U+FFFD there too).
        """
        ids = self.context + output_token_ids
        before = self._decode(ids[self.prefix:self.read])
        after = self._decode(ids[self.prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not flush):
            return "", False  # nothing new yet: a special token, or a character still incomplete
        delta = after[len(before):]
        self.prefix, self.read = self.read, len(ids)
        return self._append(delta, may_stop(len(output_token_ids), self.min_tokens))

    def _append(self, delta: str, search: bool = True) -> tuple[str, bool]:
        start = len(self.text)
        self.text += delta
        cut = find_stop_string(self.text, start, self.stop) if search else None
        if cut is None:
            return delta, False
        self.text = self.text[:cut]
        return self.text[start:] if cut > start else "", True


def catch_up(detok: IncrementalDetokenizer, output_token_ids: list[int], num_new: int, finished: bool,
             finish_reason: str | None) -> int | None:
    """Feed ``detok`` a request's newest ``num_new`` tokens (several with speculative decoding), one at a
    time, so a stop string is found at the token that completed it. Returns how many output tokens to
    keep when a stop string ended the request (tokens past it were never meant to exist: plain decoding
    would have stopped there), else None. EOS or a stop token id (``finish_reason == "stop"`` on the
    last token) adds no text, as in vLLM. The engine calls this after each step; so does the server's
    frontend process, which detokenizes for an engine core that does not (``serve/core_client.py``)."""
    total = len(output_token_ids)
    for upto in range(total - max(1, num_new) + 1, total + 1):
        ids = output_token_ids[:upto]
        if upto == total and finish_reason == "stop":
            ids = ids[:-1]
        _, stopped = detok.update(ids, flush=finished and upto == total)
        if stopped:
            return upto
    return None

