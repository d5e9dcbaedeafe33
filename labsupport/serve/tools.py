"""Tool calling: what this server does with ``tools``, ``tool_choice`` and tool-call histories.

Turning a model's text back into ``tool_calls`` needs a parser written for that model's format (vLLM
has dozens, chosen with ``--enable-auto-tool-choice --tool-call-parser NAME``). This server has none,
so, as ``vllm serve`` without those flags does, a request that would need one is refused with a 400
saying so: ``tools`` with ``tool_choice`` "auto" (the default when tools are given), "required" or a
named function. ``tool_choice: "none"`` asks for no call, so it is served: the tools go to the chat
template (as vLLM passes them; a template without tool support ignores them) and the answer is text.
Silently answering text to a request that expected a call is what this file exists to prevent:
LangChain's ``method="function_calling"`` would then return ``parsed=None`` without an error.

A conversation that *contains* earlier calls is fine without a parser: an assistant message with
``content: null`` and ``tool_calls``, then ``role: "tool"`` messages with the results, are rendered
through the chat template as vLLM renders them (content null becomes "", each call's JSON
``arguments`` string becomes a dict, which is what Hugging Face chat templates expect).
"""
from __future__ import annotations

import json

from .protocol import APIError

NO_PARSER = ("this server has no tool-call parser configured, so it cannot turn the model's output into "
             "tool_calls (vLLM needs --enable-auto-tool-choice --tool-call-parser for the same)")


def check_tools(body, parser=None):
    """Raise a 400 for a request whose tools this server cannot honour; ``parser`` is the configured
    tool-call parser (none exists here yet)."""
    tools, choice = body.tools, body.tool_choice
    if tools is not None and not tools:
        raise APIError(400, "tools must not be an empty list (leave the field out instead)", param="tools")
    if choice is not None and tools is None:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if choice is not None and not (choice in ("none", "auto", "required") or _is_named(choice)):
        raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                            f"{{'name': ...}}}}, got {choice!r}", param="tool_choice")
    if _is_named(choice) and choice["function"]["name"] not in {_name(t) for t in tools}:
        raise APIError(400, f"tool_choice names the function {choice['function']['name']!r}, which is not in tools",
                       param="tool_choice")
    for i, tool in enumerate(tools or ()):
        if tool.get("type", "function") != "function" or not isinstance(_name(tool), str):
            raise APIError(400, f"tools.{i} must be {{'type': 'function', 'function': {{'name': ..., "
                                f"'parameters': ...}}}}", param=f"tools.{i}")
    if tools and (choice or "auto") != "none" and parser is None:
        how = "tool_choice='none' for a text answer" if choice in (None, "auto") else "tool_choice='none'"
        raise APIError(400, f"tool_choice={choice or 'auto'!r} with tools: {NO_PARSER}; send {how}, or no tools",
                       param="tool_choice")


def template_tools(body) -> list[dict] | None:
    """The tools the chat template is given (vLLM passes them even with tool_choice 'none')."""
    return list(body.tools) if getattr(body, "tools", None) else None


def _is_named(choice) -> bool:
    return (isinstance(choice, dict) and choice.get("type", "function") == "function"
            and isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str))


def _name(tool: dict):
    function = tool.get("function")
    return function.get("name") if isinstance(function, dict) else None


def template_message(message) -> dict:
    """A ``protocol.Message`` as the chat template takes it (``developer`` is OpenAI's newer ``system``)."""
    content = message.content
    if content is None:
        content = ""
    elif not isinstance(content, str):
        content = [p.model_dump() for p in content]
    out = {"role": "system" if message.role == "developer" else message.role, "content": content}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [_call_for_template(i, call) for i, call in enumerate(message.tool_calls)]
    return out


def _call_for_template(i: int, call: dict) -> dict:
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict) or \
            not isinstance(function.get("name"), str):
        raise APIError(400, f"tool_calls.{i} must be {{'type': 'function', 'id': ..., 'function': {{'name': ..., "
                            f"'arguments': a JSON string}}}}", param="messages")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise APIError(400, f"tool_calls.{i}.function.arguments is not valid JSON", param="messages") from None
    return {**call, "type": "function", "function": {**function, "arguments": arguments}}
