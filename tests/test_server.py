"""The server's HTTP surface on a real loopback port: answers equal the offline engine's, every error
is OpenAI's JSON with the right status, odd values get a 400 or a correct answer, API keys make
tenants. ``test_api_openai.py`` drives it with the official client, ``test_api_lifecycle.py``
through disconnects, overload, failures and shutdown."""
import json

import httpx
import openai
import pytest
from server_tools import QUESTION, post, wait_idle_and_free

from labsupport import LLM, SamplingParams
from labsupport.serve.api import create_app
from labsupport.serve.background import BackgroundServer


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(create_app(llm, "smol")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def cached_llm():
    """A small engine with both caches (the session ``llm`` has neither)."""
    return LLM(device="cpu", enable_prefix_caching=True, enable_result_cache=True, num_blocks=128)


def test_chat_completion_equals_offline_generate(llm, client):
    resp = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=8, temperature=0)
    ref = llm.generate(QUESTION, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    assert resp.choices[0].message.content == ref.text
    assert resp.choices[0].finish_reason == ref.finish_reason
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_streaming_with_a_stop_string_never_sends_text_the_stop_cuts(client):
    """The stream holds back what may begin a stop string, so streamed text equals the full answer."""
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7, 8"
    full = client.completions.create(model="smol", prompt=prompt, max_tokens=12, temperature=0)
    stop = full.choices[0].text[4:7]  # three characters in the middle of the answer
    cut = client.completions.create(model="smol", prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smol", prompt=prompt, max_tokens=12, temperature=0, stop=[stop], stream=True) if c.choices)
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert streamed == cut.choices[0].text == full.choices[0].text[:full.choices[0].text.find(stop)]


def test_unknown_model_is_404_with_openai_error(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-9", messages=QUESTION, max_tokens=4)
    assert "gpt-9" in err.value.body["message"]


@pytest.mark.parametrize("body, needle", [
    ({"messages": []}, "messages"),
    ({"messages": QUESTION, "max_tokens": 0}, "max_tokens"),
    ({"messages": QUESTION, "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "word " * 9000}]}, "maximum context length is 8192 tokens"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"messages": QUESTION, "seed": 2**63}, "seed"),
    ({"messages": QUESTION, "seed": 10**30}, "seed"),
    ({"messages": QUESTION, "stop": [""]}, "stop"),
    ({"messages": QUESTION, "n": 0}, "n"),
    ({"messages": QUESTION, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"messages": QUESTION, "top_p": 0}, "top_p"),
    ({"messages": QUESTION, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"messages": QUESTION, "presence_penalty": 2.5}, "presence_penalty"),  # honoured in [-2, 2]
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "content"),
])
def test_bad_requests_get_400_json_errors(server, body, needle):
    r = post(server, {"model": "smol", **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("prompt, needle", [
    ([], "empty"), ([5, -1], "token ids"), ([10**30], "token ids"), (["a", 3], "mixes"), ([[]], "empty"),
])
def test_bad_completion_prompts_get_400(server, prompt, needle):
    r = post(server, {"model": "smol", "prompt": prompt, "max_tokens": 2}, "/v1/completions")
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_over_the_context_says_both_numbers_as_vllm_does(server):
    r = post(server, {"model": "smol", "messages": QUESTION, "max_tokens": 9000})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "maximum context length is 8192 tokens" in msg
    assert "(37 in the messages, 9000 in the completion)" in msg and "9037" in msg


@pytest.mark.parametrize("raw", [b"{not json", b"[]", b'"hi"', b"\xff\xfe", b'{"model": "smol", "messages": '
                                 b'[{"role": "user", "content": "hi"}], "temperature": NaN}',
                                 b'{"model": "smol", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}'])
def test_malformed_bodies_are_400_not_a_traceback(server, raw):
    r = httpx.post(server.url + "/v1/chat/completions", content=raw, timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("extra", [
    {"max_tokens": 2**64}, {"top_k": 2**70}, {"stop_token_ids": [2**70]}, {"seed": -2**63}, {"n": 10**9},
    {"temperature": 1e308}, {"stream": "maybe"}, {"cache_salt": ""}, {"stop": ["日本", "\n", "🙂"]},
    {"messages": [{"role": "user", "content": "\x00 日本の首都 🙂 \ud7ff"}]}, {"logprobs": True, "top_logprobs": 20},
    {"max_tokens": True}, {"temperature": "0"}, {"stream_options": {"include_usage": 1}},
])
def test_odd_values_get_a_400_or_a_correct_answer(llm, server, extra):
    r = post(server, {"model": "smol", "messages": QUESTION, "max_tokens": 2, "temperature": 0, **extra})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    wait_idle_and_free(llm)


def test_n_without_forking_is_n_requests_with_the_same_seeds():
    """Contiguous KV cannot fork samples (they share the prompt's blocks): the server sends n requests instead,
    seeded seed + i as the fork would be, so a client gets its n choices, the same ones, on any engine."""
    contiguous = LLM(device="cpu", kv_cache="contiguous")
    body = {"model": "smol", "messages": QUESTION, "max_tokens": 5, "temperature": 1.0, "seed": 11, "n": 3,
            "ignore_eos": True}
    with BackgroundServer(create_app(contiguous, "smol")) as srv:
        whole = post(srv, body).json()
        texts = [c["message"]["content"] for c in whole["choices"]]
        assert [c["index"] for c in whole["choices"]] == [0, 1, 2] and len(set(texts)) == 3
        assert texts == [post(srv, {**body, "n": 1, "seed": 11 + i}).json()["choices"][0]["message"]["content"]
                         for i in range(3)]
        assert whole["usage"]["prompt_tokens"] == 37 and whole["usage"]["completion_tokens"] == 15
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        streamed = {}
        for chunk in chunks:
            for c in chunk["choices"]:
                streamed[c["index"]] = streamed.get(c["index"], "") + (c["delta"].get("content") or "")
        assert streamed == dict(enumerate(texts))
    assert not contiguous.engine.has_unfinished_requests()
    contiguous.shutdown()


def test_unknown_routes_and_methods_answer_openai_errors(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_models_health_version(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    model = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert model["id"] == "smol" and model["max_model_len"] == 8192
    assert httpx.get(server.url + "/version").json()["version"]
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200 and "labsupport:num_requests_running" in metrics.text


def test_tokenize_and_detokenize_round_trip(llm, server):
    r = post(server, {"model": "smol", "prompt": "北京是中国的首都。"}, "/tokenize").json()
    assert r["tokens"] == llm.tokenizer("北京是中国的首都。").input_ids and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 8192
    assert post(server, {"tokens": r["tokens"]}, "/detokenize").json()["prompt"] == "北京是中国的首都。"
    chat = post(server, {"messages": QUESTION}, "/tokenize").json()
    bare = post(server, {"messages": QUESTION, "add_generation_prompt": False}, "/tokenize").json()
    assert chat["tokens"] == llm.tokenize(QUESTION)[0] and chat["count"] > bare["count"]
    assert post(server, {"tokens": [10**9]}, "/detokenize").status_code == 400
    assert post(server, {"prompt": "x", "messages": QUESTION}, "/tokenize").status_code == 400
    assert post(server, {"model": "gpt-9", "prompt": "x"}, "/tokenize").status_code == 404


def test_bodies_over_the_limit_are_413_by_header_or_by_count(llm):
    with BackgroundServer(create_app(llm, "smol", max_request_body_bytes=1000)) as srv:
        big = {"model": "smol", "messages": [{"role": "user", "content": "x" * 2000}]}
        r = post(srv, big)
        assert r.status_code == 413 and "1000" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: the server must count
            yield json.dumps(big).encode()[:600]
            yield json.dumps(big).encode()[600:]

        r = httpx.post(srv.url + "/v1/chat/completions", content=chunks(), timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert post(srv, {"model": "smol", "messages": QUESTION, "max_tokens": 1}).status_code == 200


def test_api_keys_guard_v1_and_each_key_is_a_tenant(cached_llm):
    """With several keys, a tenant's repeated prompt hits its own prefix cache; another tenant's identical
    first prompt finds nothing: no KV block (nor cached result) is shared across keys."""
    app = create_app(cached_llm, "smol", api_keys=["key-a", "key-b"])
    with BackgroundServer(app) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200  # probes need no key
        body = {"model": "smol", "messages": [{"role": "system", "content": "You are a helpful botanist. " * 4},
                                              *QUESTION], "max_tokens": 2, "temperature": 0}
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-a"}):
            r = post(srv, body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        a, b = (openai.OpenAI(base_url=srv.url + "/v1", api_key=k) for k in ("key-a", "key-b"))
        uncached = {"extra_body": {"skip_result_cache": True}}
        first = a.chat.completions.create(**body, **uncached)
        again = a.chat.completions.create(**body, **uncached)
        other = b.chat.completions.create(**body, **uncached)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert other.usage.prompt_tokens_details.cached_tokens == 0
        hits = cached_llm.stats()["result_cache_hits"]
        b.chat.completions.create(**body)  # stores b's answer ...
        assert a.chat.completions.create(**body).choices[0].message.content == first.choices[0].message.content
        assert cached_llm.stats()["result_cache_hits"] == hits  # ... which a never receives
    wait_idle_and_free(cached_llm)


def test_server_result_cache_respects_salts_and_bypass(cached_llm):
    body = {"model": "smol", "messages": QUESTION, "max_tokens": 4, "temperature": 0}
    with BackgroundServer(create_app(cached_llm, "smol")) as srv:
        hits = lambda: cached_llm.stats()["result_cache_hits"]  # noqa: E731
        first = post(srv, {**body, "cache_salt": "a"}).json()
        start = hits()
        again = post(srv, {**body, "cache_salt": "a"}).json()
        assert hits() == start + 1 and again["choices"] == first["choices"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"]
        post(srv, {**body, "cache_salt": "b"})  # another tenant: no reuse
        post(srv, {**body, "cache_salt": "a", "skip_result_cache": True})
        assert hits() == start + 1
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        chunks = list(client.chat.completions.create(**body, stream=True, extra_body={"cache_salt": "a"}))
        assert hits() == start + 2
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            first["choices"][0]["message"]["content"]
