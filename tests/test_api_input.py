"""Input the server must refuse cleanly, on a real loopback server: a lone surrogate in any string field
(JSON's ``"\\ud800"``), values of the wrong type (no guessing: ``"stream": "yes"`` is not true), and
an ``/openapi.json`` that documents the 400 the server really answers instead of FastAPI's 422."""
import json

import httpx
import pytest
from server_tools import assert_openai_error

from labsupport.serve.api import create_app
from labsupport.serve.background import BackgroundServer

LONE = "\ud800"
Q = [{"role": "user", "content": "Hi"}]
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(create_app(llm, "smol")) as srv:
        yield srv


def raw_post(srv, path, body):
    """JSON with the surrogate as a ``\\ud800`` escape, as a client's JSON encoder writes it."""
    return httpx.post(srv.url + path, content=json.dumps(body).encode(), timeout=30,
                      headers={"content-type": "application/json"})


@pytest.mark.parametrize("path, body, where", [
    (CHAT, {"messages": [{"role": "user", "content": "a" + LONE}]}, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE + "b"}]}]},
     "messages.0.content.0.text"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "name": LONE}]}, "messages.0.name"),
    (CHAT, {"messages": Q, "model": LONE}, "model"),
    (CHAT, {"messages": Q, "stop": LONE}, "stop"),
    (CHAT, {"messages": Q, "stop": ["ok", "\udfff"]}, "stop.1"),
    (CHAT, {"messages": Q, "user": LONE}, "user"),
    (CHAT, {"messages": Q, "cache_salt": LONE}, "cache_salt"),
    (CHAT, {"messages": Q, "logit_bias": {LONE: 1}}, "logit_bias"),
    (CHAT, {"messages": Q, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "description": LONE}}}},
     "response_format.json_schema.schema.description"),
    (CHAT, {"messages": Q, "tools": [{"type": "function", "function": {"name": LONE}}]}, "tools.0.function.name"),
    (CHAT, {"messages": Q, "kv_transfer_params": {"a": [{"b": LONE}]}}, "kv_transfer_params.a.0.b"),
    (TEXT, {"prompt": LONE}, "prompt"),
    (TEXT, {"prompt": ["fine", "x" + LONE]}, "prompt.1"),
    (TEXT, {"prompt": "hi", "guided_regex": LONE}, "guided_regex"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    ("/tokenize", {"prompt": "hi", "model": LONE}, "model"),
    ("/detokenize", {"tokens": [1], "model": LONE}, "model"),
])
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(llm, server, path, body, where):
    r = raw_post(server, path, {"max_tokens": 2, **body} if path in (CHAT, TEXT) else body)
    assert_openai_error(r.status_code, r.json(), 400)
    assert r.json()["error"]["message"].startswith(f"{where}: a string holds a lone surrogate"), r.json()
    assert r.json()["error"]["param"] == where


def test_paired_surrogates_are_ordinary_text(server):
    r = raw_post(server, CHAT, {"messages": [{"role": "user", "content": "\ud83d\ude00"}], "max_tokens": 2})
    assert r.status_code == 200, r.text  # json.dumps writes 🙂-style pairs as two escapes: one character


def test_deep_nesting_is_400_not_a_recursion_error(server):
    deep = "[" * 5000 + "]" * 5000
    r = httpx.post(server.url + CHAT, content=b'{"messages": [], "kv_transfer_params": {"x": ' + deep.encode() + b"}}",
                   headers={"content-type": "application/json"}, timeout=30)
    assert_openai_error(r.status_code, r.json(), 400)


@pytest.mark.parametrize("path, extra, field", [
    (CHAT, {"stream": "yes"}, "stream"), (CHAT, {"max_tokens": "4"}, "max_tokens"), (CHAT, {"max_tokens": 4.0}, "max_tokens"),
    (CHAT, {"n": "2"}, "n"), (CHAT, {"temperature": "0.5"}, "temperature"), (CHAT, {"logprobs": "true"}, "logprobs"),
    (CHAT, {"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    (TEXT, {"prompt": [True, False]}, "prompt"), (TEXT, {"prompt": "hi", "echo": 1}, "echo"),
    ("/detokenize", {"tokens": ["1"]}, "tokens.0"),
])
def test_values_of_the_wrong_type_are_400_not_coerced(server, path, extra, field):
    body = {"messages": Q, "max_tokens": 2, **extra} if path == CHAT else {"max_tokens": 2, **extra}
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert_openai_error(r.status_code, r.json(), 400)
    assert r.json()["error"]["param"].startswith(field), r.json()


def test_openapi_documents_400_with_openais_error_body_and_no_422(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    assert "422" not in json.dumps(schema["paths"]) and "HTTPValidationError" not in json.dumps(schema)
    for path in (CHAT, TEXT, "/tokenize", "/detokenize"):
        bad = schema["paths"][path]["post"]["responses"]["400"]
        assert bad["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    error = schema["components"]["schemas"]["ErrorResponse"]
    info = schema["components"]["schemas"][error["properties"]["error"]["$ref"].rsplit("/", 1)[1]]
    assert set(info["properties"]) == {"message", "type", "param", "code"}
    r = httpx.post(server.url + CHAT, json={"messages": "hi"}, timeout=30)
    assert r.status_code == 400 and set(r.json()["error"]) == set(info["properties"])  # what it documents


@pytest.mark.parametrize("path, extra, param, needles", [
    (CHAT, {"n": 100}, "n", ["n=100", "max_num_seqs is 64"]),  # forked samples run together: both numbers
    (CHAT, {"n": 3, "seed": 2**63 - 2}, "seed", ["seed + n - 1 must fit in 64 bits"]),
    (CHAT, {"max_tokens": 9000}, "max_tokens", ["maximum context length is 8192 tokens", "9000 in the completion"]),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 8500}]}, "messages",
     ["maximum context length is 8192 tokens", "input tokens"]),
    (TEXT, {"prompt": [7] * 8200}, "prompt", ["maximum context length is 8192 tokens", "8200 input tokens"]),
])
def test_refusals_of_n_seeds_and_the_context_name_the_field(llm, server, path, extra, param, needles):
    body = {"messages": Q, "max_tokens": 2, **extra} if path == CHAT else {"max_tokens": 2, **extra}
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert_openai_error(r.status_code, r.json(), 400)
    assert r.json()["error"]["param"] == param, r.json()
    assert all(needle in r.json()["error"]["message"] for needle in needles), r.json()
    assert llm.stats()["num_requests_waiting"] == llm.stats()["num_requests_running"] == 0


def test_a_prompt_is_checked_once_on_its_way_in(server, monkeypatch):
    """The engine's prompt rules (``EngineLimits.check_prompt``: the context, the vocabulary, the pool) run once
    per prompt, whatever ``n`` is; the engine trusts that check when the request is added."""
    from labsupport.engine.limits import EngineLimits
    checked = []
    original = EngineLimits.check_prompt
    monkeypatch.setattr(EngineLimits, "check_prompt",
                        lambda self, ids, max_tokens=None: (checked.append(max_tokens), original(self, ids, max_tokens))[1])
    r = httpx.post(server.url + CHAT, json={"messages": Q, "max_tokens": 2, "n": 3}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
    assert checked == [2]
    r = httpx.post(server.url + TEXT, json={"prompt": ["a", "b"], "n": 2}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text
    assert checked == [2, 16, 16]  # text completions default to 16 tokens, as OpenAI's do


@pytest.mark.parametrize("ids", [[True, 2], [1.0], [1, 2.5], ["1"], [None]])
def test_check_prompt_refuses_token_ids_that_are_not_exactly_int(ids):
    """The type test runs in C (``set(map(type, ids))``), so it must still refuse what the per-token test did."""
    import numpy as np

    from labsupport.engine.limits import EngineLimits
    limits = EngineLimits(max_model_len=2048, vocab_size=1000, max_num_batched_tokens=512, enable_chunked_prefill=True)
    assert limits.check_prompt([1, 2, 3], 4) == 4
    for bad in (ids, [np.int64(3)]):
        with pytest.raises(ValueError, match="prompt token ids must be integers"):
            limits.check_prompt(bad, 4)
