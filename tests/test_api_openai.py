"""The server through the official ``openai`` client: both endpoints, streamed and not, ``n``, log
probabilities in both OpenAI formats, vLLM's sampling extensions. A streamed answer always joins to
exactly the non-streamed one, non-ASCII text included."""
import httpx
import openai
import pytest
from server_tools import wait_idle_and_free

from labsupport import LLM
from labsupport.serve.api import create_app
from labsupport.serve.background import BackgroundServer

QUESTION = [{"role": "user", "content": "Name a fruit that is yellow."}]
GREEDY = {"model": "smol", "temperature": 0}


@pytest.fixture(scope="module")
def served():
    """A small engine with prefix caching, as ``vllm serve`` runs by default."""
    return LLM(device="cpu", enable_prefix_caching=True, num_blocks=128)


@pytest.fixture(scope="module")
def server(served):
    with BackgroundServer(create_app(served, "smol")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def joined(chunks, field="content"):
    """Streamed text per choice index."""
    texts = {}
    for c in chunks:
        for ch in c.choices:
            piece = ch.delta.content if field == "content" else ch.text
            texts[ch.index] = texts.get(ch.index, "") + (piece or "")
    return texts


def test_chat_streamed_equals_whole_with_a_final_usage_chunk(client):
    whole = client.chat.completions.create(messages=QUESTION, max_tokens=8, **GREEDY)
    chunks = list(client.chat.completions.create(messages=QUESTION, max_completion_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert joined(chunks) == {0: whole.choices[0].message.content}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_request_shaped_like_vllm_bench_serve(client):
    """Content as a list of parts, ``max_completion_tokens``, ``ignore_eos``, usage at the end."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a fruit"},
                                          {"type": "text", "text": " that is yellow."}]}]
    chunks = list(client.chat.completions.create(messages=parts, max_completion_tokens=5, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}, **GREEDY))
    plain = client.chat.completions.create(messages=QUESTION, max_tokens=5, **GREEDY)
    assert joined(chunks) == {0: plain.choices[0].message.content}
    assert chunks[-1].usage.completion_tokens == 5
    developer = [{"role": "developer", "content": "Answer briefly."}, *QUESTION]
    assert client.chat.completions.create(messages=developer, max_tokens=2, **GREEDY).choices[0].message.content


def test_cjk_deltas_join_to_the_whole_text_and_never_carry_a_broken_character(client):
    """Byte-level BPE splits each CJK character over several tokens; a delta never ends mid-character."""
    body = {"prompt": "日本の首都は", "max_tokens": 16, **GREEDY}
    whole = client.completions.create(**body).choices[0].text
    deltas = [c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices]
    assert "".join(deltas) == whole and any(ord(ch) > 0x3000 for ch in whole)
    assert not any("\ufffd" in d for d in deltas[:-1])  # only a length cut may end the last one mid-character
    if not whole.endswith("\ufffd"):
        assert "\ufffd" not in deltas[-1]


def test_text_completions_take_text_token_ids_or_a_list_of_prompts(served, client):
    ids = served.tokenizer("The capital of France is").input_ids
    by_text = client.completions.create(prompt="The capital of France is", max_tokens=4, **GREEDY)
    by_ids = client.completions.create(prompt=ids, max_tokens=4, **GREEDY)
    both = client.completions.create(prompt=["The capital of France is", "1, 2, 3,"], max_tokens=4, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text == both.choices[0].text
    assert [c.index for c in both.choices] == [0, 1] and both.choices[1].text
    streamed = joined(client.completions.create(prompt=["The capital of France is", "1, 2, 3,"], max_tokens=4,
                                                stream=True, **GREEDY), "text")
    assert streamed == {0: both.choices[0].text, 1: both.choices[1].text}
    assert both.usage.prompt_tokens == len(ids) + len(served.tokenizer("1, 2, 3,").input_ids)


def test_n_choices_fork_from_one_prompt_and_stream_like_they_answer(served, client):
    """n = 3 is one engine request: the prompt is computed once (each extra sample recomputes only its last
    token, to draw its own first one), choice i is sample i, drawn with seed + i, so it equals a request
    alone with that seed; usage counts the prompt once and every choice's tokens."""
    body = {"model": "smol", "messages": [{"role": "user", "content": "Invent a name for a blue bird."}],
            "max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 3, "extra_body": {"ignore_eos": True}}
    before = served.stats()["prompt_tokens_computed"]
    whole = client.chat.completions.create(**body)
    computed = served.stats()["prompt_tokens_computed"] - before
    cached = whole.usage.prompt_tokens_details.cached_tokens
    assert computed == whole.usage.prompt_tokens - cached + 2  # n separate requests: most of it 3 times
    assert whole.usage.prompt_tokens % 16 > 1  # tokens past its last full block: separate requests recompute them
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) == 3  # seeds 7, 8 and 9
    assert whole.usage.completion_tokens == 18 and all(c.finish_reason == "length" for c in whole.choices)
    assert whole.usage.prompt_tokens < 40  # the prompt counts once, not three times
    alone = [client.chat.completions.create(**{**body, "n": 1, "seed": 7 + i}).choices[0].message.content
             for i in range(3)]
    assert alone == texts  # reproducible: sample i is the seed + i draw
    streamed = joined(client.chat.completions.create(**body, stream=True))
    assert streamed == dict(enumerate(texts))
    wait_idle_and_free(served)


def test_n_choices_of_several_prompts_are_indexed_prompt_major(served, client):
    prompts = ["The capital of France is", "1, 2, 3,"]
    body = dict(model="smol", prompt=prompts, max_tokens=4, temperature=1.0, seed=3, n=2,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**body)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    for k, prompt in enumerate(prompts):
        for i in range(2):
            alone = client.completions.create(**{**body, "prompt": prompt, "n": 1, "seed": 3 + i})
            assert whole.choices[2 * k + i].text == alone.choices[0].text
    assert whole.usage.prompt_tokens == sum(len(served.tokenizer(p).input_ids) for p in prompts)
    assert whole.usage.completion_tokens == 4 * 4
    streamed = joined(client.completions.create(**body, stream=True), "text")
    assert streamed == {c.index: c.text for c in whole.choices}


def test_chat_logprobs_in_openai_format(client):
    resp = client.chat.completions.create(messages=QUESTION, max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 6
    assert b"".join(bytes(e.bytes) for e in content).decode() == resp.choices[0].message.content
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 3 and [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].token == entry.token and tops[0].logprob == entry.logprob <= 0  # greedy: the top one
    chunks = list(client.chat.completions.create(messages=QUESTION, max_tokens=6, logprobs=True, top_logprobs=3,
                                                 stream=True, **GREEDY))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_completion_logprobs_with_echo_in_the_legacy_format(served, client):
    prompt = "The capital of France is"
    n_prompt = len(served.tokenizer(prompt).input_ids)
    resp = client.completions.create(prompt=prompt, max_tokens=4, logprobs=2, echo=True, **GREEDY)
    choice, lp = resp.choices[0], resp.choices[0].logprobs
    assert choice.text.startswith(prompt) and len(lp.tokens) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(t) in (2, 3) and tok in t for t, tok in zip(lp.top_logprobs[1:], lp.tokens[1:]))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[n_prompt] == len(prompt)
    assert "".join(lp.tokens) == choice.text
    chunks = list(client.completions.create(prompt=prompt, max_tokens=4, logprobs=2, echo=True, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [x for c in chunks for x in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_every_forked_choice_echoes_the_prompt_with_its_logprobs(served, client):
    """The prompt's logprobs are computed once, before the fork, and every sample's choice shows them."""
    prompt = "The capital of France is"
    n_prompt = len(served.tokenizer(prompt).input_ids)
    resp = client.completions.create(model="smol", prompt=prompt, max_tokens=3, temperature=1.0, seed=2, n=2,
                                     logprobs=1, echo=True)
    first, second = (c.logprobs for c in resp.choices)
    assert len(first.tokens) == len(second.tokens) == n_prompt + 3
    assert first.token_logprobs[:n_prompt] == second.token_logprobs[:n_prompt] and first.token_logprobs[0] is None
    assert all(c.text.startswith(prompt) and "".join(c.logprobs.tokens) == c.text for c in resp.choices)


def test_vllm_sampling_extensions(server, client):
    greedy = client.completions.create(prompt="Once upon a time", max_tokens=6, **GREEDY)
    top1 = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=6, temperature=1.0,
                                     extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy.choices[0].text
    seeded = [client.completions.create(model="smol", prompt="Once upon a time", max_tokens=6, temperature=1.0,
                                        seed=3).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    # the greedy answer's third token, as an id: tokenize prompt + answer, take what follows the prompt
    count = httpx.post(server.url + "/tokenize", json={"prompt": "Once upon a time"}).json()["count"]
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "Once upon a time" + greedy.choices[0].text}).json()
    stop_id = ids["tokens"][count + 2]
    stopped = client.completions.create(prompt="Once upon a time", max_tokens=6,
                                        extra_body={"stop_token_ids": [stop_id]}, **GREEDY)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens <= 3
    held = client.completions.create(prompt="Once upon a time", max_tokens=6,
                                     extra_body={"stop_token_ids": [stop_id], "min_tokens": 5}, **GREEDY)
    assert held.usage.completion_tokens >= 5  # min_tokens keeps the stop token from ending it early


def test_models_and_errors_through_the_client(client):
    assert [m.id for m in client.models.list()] == ["smol"]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(messages=QUESTION, max_tokens=10**6, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=1)
