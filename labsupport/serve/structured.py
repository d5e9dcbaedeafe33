"""The API's ways to ask for structured output, turned into the engine's one ``structured_outputs`` dict.

Clients ask in three dialects, and all end in ``SamplingParams.structured_outputs`` (vLLM's kinds,
``engine/structured_output.py``), which the sampler enforces with a grammar:

- OpenAI's ``response_format``: ``{"type": "json_object"}`` (any JSON object) or ``{"type":
  "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`` (LangChain's
  ``with_structured_output`` sends this by default; ``"text"`` asks for nothing);
- vLLM's ``structured_outputs``: ``{"json": ...}``, ``{"regex": ...}``, ``{"choice": [...]}``,
  ``{"grammar": ...}``, ``{"json_object": true}``;
- vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``. vLLM 0.32
  dropped these and ignores them with a log line, so old clients there get unconstrained text; here
  they keep working, since a silently ignored constraint is the one thing a client cannot detect.

More than one of them at once is a 400 (vLLM: "You can only use one kind of structured outputs
constraint"), as is a kind this engine does not have (``structural_tag``, a ``guided_whitespace_pattern``).
"""
from __future__ import annotations

from .protocol import APIError

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
BACKENDS = (None, "auto", "xgrammar")


def structured_outputs(body) -> dict | None:
    """The request's constraint as ``structured_outputs`` (not yet checked: ``SamplingParams`` does that)."""
    asked = []
    response_format = from_response_format(getattr(body, "response_format", None))
    if response_format is not None:
        asked.append(("response_format", response_format))
    if getattr(body, "structured_outputs", None) is not None:
        asked.append(("structured_outputs", dict(body.structured_outputs)))
    for field, kind in GUIDED.items():
        if getattr(body, field, None) is not None:
            asked.append((field, {kind: getattr(body, field)}))
    if getattr(body, "guided_decoding_backend", None) not in BACKENDS:
        raise APIError(400, f"guided_decoding_backend {body.guided_decoding_backend!r} is not available: this server "
                            "enforces structured output with xgrammar only", param="guided_decoding_backend")
    if len(asked) > 1:
        raise APIError(400, f"only one kind of structured output may be asked for, got {[a for a, _ in asked]}",
                       param=asked[1][0])
    if asked and getattr(body, "tools", None) and getattr(body, "tool_choice", None) not in (None, "none", "auto"):
        raise APIError(400, "structured output and a forced tool choice cannot be combined", param="tool_choice")
    return asked[0][1] if asked else None


def from_response_format(response_format: dict | None) -> dict | None:
    """OpenAI's ``response_format`` -> ``structured_outputs`` (None for ``{"type": "text"}``)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", spec.get("json_schema")), (dict, bool)):
            raise APIError(400, "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                           param="response_format")
        return {"json": spec.get("schema", spec.get("json_schema"))}
    raise APIError(400, f"response_format type {kind!r} is not supported: use 'text', 'json_object' or 'json_schema'",
                   param="response_format")
