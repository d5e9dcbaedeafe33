"""Structured output: a grammar decides which tokens may come next, and the others get -inf.

A request's ``SamplingParams.structured_outputs`` is plain data, vLLM's kinds with vLLM's names:
``{"json": schema}`` (a JSON Schema, as a dict or a string), ``{"json_object": True}`` (any JSON
object), ``{"regex": pattern}``, ``{"choice": [strings]}`` or ``{"grammar": ebnf}`` (xgrammar's
EBNF), plus ``"disable_any_whitespace": True`` to allow no whitespace between JSON tokens.
``normalize`` checks it when the parameters are made (without a tokenizer, as vLLM's frontend does):
a schema xgrammar cannot compile, or one with keywords it would silently ignore
(``json_schema_support``), is a ValueError naming them.

In the engine, ``StructuredOutputs`` (one per sampler) compiles each distinct grammar once against the
tokenizer (xgrammar's ``GrammarCompiler``, cached), keeps one ``GrammarMatcher`` per request (by id; a
preempted request keeps its own, since its tokens are kept), and per step fills one bitmask row per
constrained request (32 tokens per int32 word) and applies it to the logits, as vLLM's
``apply_grammar_bitmask`` does: before the logprobs are taken, so a logprob reports the distribution
the grammar left. After the draw, each matcher accepts its token. Once a matcher has accepted a stop
token the grammar is done and no longer masks (the request ends there unless ``ignore_eos``).
"""
from __future__ import annotations

import functools
import json
import threading

import torch

from .json_schema_support import unsupported_features

KINDS = ("json", "json_object", "regex", "choice", "grammar")
OPTIONS = ("disable_any_whitespace",)


def normalize(spec) -> dict | None:
    """The checked, normalized ``structured_outputs``: one kind, a JSON schema as a JSON string (its
    property order kept: it is the order the model writes). ValueError says what to change."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"structured_outputs must be a dict such as {{'json': schema}}, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(KINDS) - set(OPTIONS))
    if unknown:
        raise ValueError(f"structured_outputs has unsupported fields {unknown}: this engine takes one of "
                         f"{list(KINDS)} and the option 'disable_any_whitespace'")
    kinds = [k for k in KINDS if spec.get(k) is not None and spec.get(k) is not False]
    if len(kinds) != 1:
        raise ValueError(f"structured_outputs needs exactly one of {list(KINDS)}, got {kinds or 'none'}")
    kind, value = kinds[0], spec[kinds[0]]
    if not isinstance(spec.get("disable_any_whitespace", False), bool):
        raise ValueError("structured_outputs.disable_any_whitespace must be True or False")
    out = {kind: value, "disable_any_whitespace": spec.get("disable_any_whitespace", False)}
    if kind == "json":
        out["json"] = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    elif kind == "json_object":
        if value is not True:
            raise ValueError("structured_outputs.json_object must be True")
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
    elif not isinstance(value, str) or not value or "\x00" in value:
        raise ValueError(f"structured_outputs.{kind} must be a non-empty string without NUL characters")
    _check_compiles(_key(out))
    return out


def _key(spec: dict) -> tuple[str, str, bool]:
    kind = next(k for k in KINDS if k in spec)
    value = spec[kind]
    return kind, json.dumps(value) if kind == "choice" else str(value), spec.get("disable_any_whitespace", False)


@functools.lru_cache(maxsize=256)
def _check_compiles(key: tuple[str, str, bool]) -> None:
    """Tokenizer-free check (xgrammar's ``Grammar``, as vLLM's frontend validates); cached by spec."""
    import xgrammar as xgr
    kind, value, _ = key
    try:
        if kind == "json":
            schema = json.loads(value)
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON Schema (an object), got {type(schema).__name__}")
            problems = unsupported_features(schema)
            if problems:
                raise ValueError("the JSON schema uses what this server's grammar engine (xgrammar) would not "
                                 "enforce: " + "; ".join(problems[:10]))
            xgr.Grammar.from_json_schema(value)
        elif kind == "regex":
            xgr.Grammar.from_regex(value)
        elif kind in ("choice", "grammar"):
            xgr.Grammar.from_ebnf(_ebnf(kind, value))
    except json.JSONDecodeError as exc:
        raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
    except ValueError:
        raise
    except Exception as exc:  # xgrammar's parse errors (RuntimeError): keep the message, drop the C++ file and line
        raise ValueError(f"structured_outputs.{kind} cannot be compiled: {str(exc).split(': ', 1)[-1].strip()}") from None


def _ebnf(kind: str, value: str) -> str:
    if kind == "grammar":
        return value
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(value))  # JSON escapes = EBNF's


class StructuredOutputs:
    """The engine side: compiled grammars (cached), one matcher per request, the per-step bitmask."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()  # the compiler is made once, whichever thread asks first
        self.matchers: dict = {}

    @property
    def compiler(self):
        with self._lock:
            if self._compiler is None:  # costly for a large vocabulary: only when a request first needs it
                import xgrammar as xgr
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
            return self._compiler

    def compile(self, spec: dict):
        kind, value, tight = _key(spec)
        options = {"any_whitespace": not tight, "separators": (",", ":") if tight else None}
        if kind == "json":
            return self.compiler.compile_json_schema(value, **options)
        if kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', **options)
        if kind == "regex":
            return self.compiler.compile_regex(value)
        return self.compiler.compile_grammar(_ebnf(kind, value))

    def add(self, req):
        """Compile now (the engine calls this in ``add_request``, so a failure is that request's error)."""
        import xgrammar as xgr
        self.matchers[req.request_id] = xgr.GrammarMatcher(self.compile(req.params.structured_outputs))

    def mask(self, logits: torch.Tensor, requests, kept: list[bool]) -> torch.Tensor:
        """``logits`` with the grammar applied to each kept, constrained row (a copy; unchanged if none)."""
        rows = [i for i, req in enumerate(requests)
                if kept[i] and getattr(req.params, "structured_outputs", None) is not None]
        matchers = {}
        for i in rows:
            m = self.matchers.get(requests[i].request_id)
            if m is None:  # a sample forked from an n > 1 request: its own matcher, from the same grammar
                self.add(requests[i])
                m = self.matchers[requests[i].request_id]
            if not m.is_terminated():
                matchers[i] = m
        if not matchers:
            return logits
        import xgrammar as xgr
        bitmask = xgr.allocate_token_bitmask(len(requests), self.vocab_size)
        for i, m in matchers.items():
            m.fill_next_token_bitmask(bitmask, i)
        logits = logits.float().clone()
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size,
                                        indices=list(matchers))
        return logits

    def accept(self, requests, tokens: list[int], kept: list[bool]):
        for req, token, k in zip(requests, tokens, kept):
            m = self.matchers.get(req.request_id) if k else None
            if m is not None and not m.is_terminated() and not m.accept_token(int(token)):
                raise RuntimeError(f"request {req.request_id}: the grammar refused token {token} it allowed")

    def release(self, request_id: str):
        self.matchers.pop(request_id, None)
