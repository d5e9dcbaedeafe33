"""The minimal OpenAI-compatible server, on a real loopback port, driven by the official client."""
import time

import httpx
import openai
import pytest

from labsupport import SamplingParams
from labsupport.serve.api import create_app
from labsupport.serve.background import BackgroundServer

QUESTION = [{"role": "user", "content": "Name a fruit that is yellow."}]


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(create_app(llm, "smol")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def test_chat_completion_equals_offline_generate(llm, client):
    resp = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=16, temperature=0)
    ref = llm.generate(QUESTION, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0]
    assert resp.choices[0].message.content == ref.text
    assert resp.choices[0].finish_reason == ref.finish_reason
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_streamed_chunks_add_up_to_the_full_answer_with_usage(client):
    full = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="smol", messages=QUESTION, max_completion_tokens=16,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


def test_streaming_with_a_stop_string_never_sends_text_the_stop_cuts(client):
    """The stream holds back what may begin a stop string, so streamed text equals the full answer."""
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7, 8"
    full = client.completions.create(model="smol", prompt=prompt, max_tokens=24, temperature=0)
    stop = full.choices[0].text[4:7]  # three characters in the middle of the answer
    cut = client.completions.create(model="smol", prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smol", prompt=prompt, max_tokens=24, temperature=0, stop=[stop], stream=True) if c.choices)
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert streamed == cut.choices[0].text == full.choices[0].text[:full.choices[0].text.find(stop)]


def test_message_content_as_a_list_of_text_parts(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a fruit"}, {"type": "text", "text": " that is yellow."}]}]
    a = client.chat.completions.create(model="smol", messages=parts, max_tokens=8, temperature=0)
    b = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_text_completion_endpoint(llm, client):
    resp = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=8, temperature=0)
    ref = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    assert resp.choices[0].text == ref.text


def test_unknown_model_is_404_with_openai_error(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-9", messages=QUESTION, max_tokens=4)
    assert "gpt-9" in err.value.body["message"]


@pytest.mark.parametrize("body, needle", [
    ({"messages": []}, "messages"),
    ({"messages": QUESTION, "max_tokens": 0}, "max_tokens"),
    ({"messages": QUESTION, "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "word " * 9000}]}, "shorten"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"messages": QUESTION, "seed": 2**63}, "seed"),
    ({"messages": QUESTION, "seed": 10**30}, "seed"),
    ({"messages": QUESTION, "stop": [""]}, "stop"),
])
def test_bad_requests_get_400_json_errors(server, body, needle):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "smol", **body}, timeout=30)
    assert r.status_code == 400
    assert needle in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_malformed_json_is_400_not_a_traceback(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_client_disconnecting_mid_stream_aborts_its_request(llm, server):
    body = {"model": "smol", "messages": QUESTION, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # hang up after a few tokens
    deadline = time.time() + 20
    while llm.stats()["num_requests_running"] and time.time() < deadline:
        time.sleep(0.1)
    assert llm.stats()["num_requests_running"] == 0
    # the server still answers afterwards
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "smol", "messages": QUESTION, "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200


def test_models_and_health(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "smol"


def test_server_result_cache_respects_tenants_and_bypass():
    from labsupport import LLM
    cached = LLM(device="cpu", enable_prefix_caching=True, enable_result_cache=True)
    body = {"model": "smol", "messages": QUESTION, "max_tokens": 8, "temperature": 0}
    with BackgroundServer(create_app(cached, "smol")) as srv:
        url = srv.url + "/v1/chat/completions"
        first = httpx.post(url, json={**body, "cache_salt": "a"}, timeout=60).json()
        assert cached.stats()["result_cache_hits"] == 0
        again = httpx.post(url, json={**body, "cache_salt": "a"}, timeout=60).json()
        assert cached.stats()["result_cache_hits"] == 1
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        httpx.post(url, json={**body, "cache_salt": "b"}, timeout=60)  # another tenant: no reuse
        httpx.post(url, json={**body, "cache_salt": "a", "skip_result_cache": True}, timeout=60)
        assert cached.stats()["result_cache_hits"] == 1
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        chunks = list(client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=8, temperature=0,
                                                     stream=True, extra_body={"cache_salt": "a"}))
        assert cached.stats()["result_cache_hits"] == 2
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            first["choices"][0]["message"]["content"]
