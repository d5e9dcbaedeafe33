"""The OpenAI surface real clients use, on a real loopback server: nothing a client sends is silently
ignored. logit_bias and the penalties change the answer as the offline reference says; echo with
max_tokens=0 returns the prompt's logprobs (lm-eval's loglikelihood request); response_format and
vLLM's structured-output fields constrain the answer; tools without a tool-call parser, and suffix,
are refused with a 400 that says why, while tool-call histories render; LangChain's
``with_structured_output`` parses."""
import json

import httpx
import jsonschema
import openai
import pytest
from server_tools import assert_openai_error, post
from test_logits_processors import PROMPT, reference_decode

from labsupport import SamplingParams
from labsupport.serve.api import create_app
from labsupport.serve.background import BackgroundServer

ASK = "Return a JSON object with two keys, name and age, for a cat."
Q = [{"role": "user", "content": ASK}]
CAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                        "age": {"type": "integer", "minimum": 0, "maximum": 30}},
       "required": ["name", "age"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
GREEDY = {"model": "smol", "temperature": 0}


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(create_app(llm, "smol")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def banana(llm) -> int:
    return llm.tokenizer(" banana").input_ids[0]


# ------------------------------------------------------------------ logit_bias and penalties


def test_logit_bias_makes_the_token_appear_on_both_endpoints(llm, client):
    bias = {str(banana(llm)): 100}
    chat = client.chat.completions.create(messages=Q, max_tokens=4, logit_bias=bias, **GREEDY)
    text = client.completions.create(prompt="My favourite fruit is", max_tokens=4, logit_bias=bias, **GREEDY)
    assert chat.choices[0].message.content == text.choices[0].text == " banana" * 4


def test_penalties_change_a_repetitive_greedy_answer_as_the_reference_predicts(llm, hf_model, client):
    prompt = llm.tokenizer(PROMPT).input_ids
    rules = {"frequency_penalty": 1.5, "presence_penalty": 2.0}
    plain = client.completions.create(prompt=PROMPT, max_tokens=10, extra_body={"ignore_eos": True}, **GREEDY)
    ruled = client.completions.create(prompt=PROMPT, max_tokens=10, extra_body={"ignore_eos": True}, **rules, **GREEDY)
    repeated = client.completions.create(prompt=PROMPT, max_tokens=10, **GREEDY,
                                         extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    want, _ = reference_decode(hf_model, prompt, 10, rules)
    want_rep, _ = reference_decode(hf_model, prompt, 10, {"repetition_penalty": 1.3})
    assert ruled.choices[0].text == llm.tokenizer.decode(want, skip_special_tokens=True) != plain.choices[0].text
    assert repeated.choices[0].text == llm.tokenizer.decode(want_rep, skip_special_tokens=True) != plain.choices[0].text


@pytest.mark.parametrize("extra, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {"banana": 1}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"), ({"logit_bias": {"5": "x"}}, "logit_bias"),
])
def test_bad_penalties_and_biases_are_400(server, extra, field):
    r = post(server, {"model": "smol", "messages": Q, "max_tokens": 2, **extra})
    assert_openai_error(r.status_code, r.json(), 400)
    assert field in r.json()["error"]["message"]


# ------------------------------------------------------------------ echo with max_tokens=0


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(llm, client):
    prompt = "The capital of France is Paris"
    resp = client.completions.create(prompt=prompt, max_tokens=0, echo=True, logprobs=1, **GREEDY)
    choice, lp = resp.choices[0], resp.choices[0].logprobs
    ids = llm.tokenizer(prompt).input_ids
    ref = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)[0]
    assert choice.text == prompt and "".join(lp.tokens) == prompt and choice.finish_reason == "length"
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([d[t] for d, t in zip(ref.prompt_logprobs[1:], ids[1:])])
    assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(prompt=prompt, max_tokens=0, echo=True, logprobs=1, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == prompt
    assert [x for c in chunks for x in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    bare = client.completions.create(prompt=prompt, max_tokens=0, echo=True, **GREEDY)
    assert bare.choices[0].text == prompt and bare.choices[0].logprobs is None


@pytest.mark.parametrize("body, path", [({"prompt": "Hi", "max_tokens": 0}, "/v1/completions"),
                                        ({"messages": Q, "max_tokens": 0, "echo": True}, "/v1/chat/completions")])
def test_max_tokens_0_without_echo_is_400(server, body, path):
    r = post(server, {"model": "smol", **body}, path)
    assert_openai_error(r.status_code, r.json(), 400)
    assert "max_tokens" in r.json()["error"]["message"]


# ------------------------------------------------------------------ structured output


def test_response_format_json_object_and_json_schema(client):
    obj = client.chat.completions.create(messages=Q, max_tokens=120, response_format={"type": "json_object"}, **GREEDY)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    schema = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT, "strict": True}}
    for options in ({}, {"temperature": 1.0, "seed": 4}):
        resp = client.chat.completions.create(messages=Q, max_tokens=120, response_format=schema,
                                              **{**GREEDY, **options})
        jsonschema.validate(json.loads(resp.choices[0].message.content), CAT)
    streamed = client.chat.completions.create(messages=Q, max_tokens=120, response_format=schema, stream=True, **GREEDY)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in streamed if c.choices)), CAT)


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": "[0-9]{2}:[0-9]{2}"}}, lambda t: len(t) == 5 and t[2] == ":"),
    ({"guided_regex": "[0-9]{2}:[0-9]{2}"}, lambda t: len(t) == 5 and t[2] == ":"),
    ({"structured_outputs": {"choice": ["morning", "evening"]}}, lambda t: t in ("morning", "evening")),
    ({"guided_choice": ["morning", "evening"]}, lambda t: t in ("morning", "evening")),
    ({"guided_json": CAT}, lambda t: jsonschema.validate(json.loads(t), CAT) is None),
    ({"structured_outputs": {"json": CAT}}, lambda t: jsonschema.validate(json.loads(t), CAT) is None),
])
def test_vllms_structured_output_fields(client, extra, check):
    resp = client.completions.create(prompt="The time now is", max_tokens=40, extra_body=extra, **GREEDY)
    assert check(resp.choices[0].text), resp.choices[0].text


@pytest.mark.parametrize("extra, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}},
     "'uniqueItems': true at $.properties.tags"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}}, "'not'"),
    ({"response_format": {"type": "structural_tag"}}, "structural_tag"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "only one kind"),
    ({"structured_outputs": {"regex": "a("}}, "regex cannot be compiled"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "xgrammar"),
])
def test_unsupported_structured_output_is_400_naming_it(server, extra, needle):
    r = post(server, {"model": "smol", "messages": Q, "max_tokens": 4, **extra})
    assert_openai_error(r.status_code, r.json(), 400)
    assert needle in r.json()["error"]["message"], r.json()


def test_langchain_with_structured_output_parses(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        name: str = Field(max_length=16)
        age: int = Field(ge=0, le=30)

    chat = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="x", model="smol", temperature=0,
                                       max_tokens=120)
    cat = chat.with_structured_output(Cat).invoke(ASK)
    assert isinstance(cat, Cat)
    loose = chat.with_structured_output(Cat.model_json_schema(), method="json_mode").invoke(ASK)
    assert isinstance(loose, dict)
    with pytest.raises(openai.BadRequestError, match="tool-call parser"):
        chat.with_structured_output(Cat, method="function_calling").invoke("A cat, please.")


# ------------------------------------------------------------------ tools, tool-call histories, suffix


@pytest.mark.parametrize("extra, needle", [
    ({"tools": TOOLS}, "no tool-call parser"), ({"tools": TOOLS, "tool_choice": "auto"}, "no tool-call parser"),
    ({"tools": TOOLS, "tool_choice": "required"}, "no tool-call parser"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "weather"}}}, "no tool-call parser"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "not in tools"),
    ({"tools": []}, "empty"), ({"tool_choice": "none"}, "needs tools"), ({"tools": TOOLS, "tool_choice": "x"}, "'x'"),
])
def test_tools_without_a_parser_are_400(server, extra, needle):
    r = post(server, {"model": "smol", "messages": Q, "max_tokens": 2, **extra})
    assert_openai_error(r.status_code, r.json(), 400)
    assert needle in r.json()["error"]["message"]


def test_tool_choice_none_answers_text(client):
    resp = client.chat.completions.create(messages=Q, max_tokens=3, tools=TOOLS, tool_choice="none", **GREEDY)
    assert resp.choices[0].message.content and not resp.choices[0].message.tool_calls


def test_a_tool_call_history_is_rendered_through_the_chat_template(llm, server, client):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny, 24 C"}]}]
    resp = client.chat.completions.create(messages=history, max_tokens=4, **GREEDY)
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Weather in Paris?"},
                                              {"role": "assistant", "content": ""},
                                              {"role": "tool", "content": "sunny, 24 C"}],
                                             add_generation_prompt=True, tokenize=False)
    assert resp.usage.prompt_tokens == len(llm.tokenizer(text, add_special_tokens=False).input_ids)
    counted = httpx.post(server.url + "/tokenize", json={"messages": history}).json()
    assert counted["count"] == resp.usage.prompt_tokens
    bad = post(server, {"model": "smol", "max_tokens": 2, "messages": [{"role": "user", "content": None}]})
    assert bad.status_code == 400 and "content" in bad.json()["error"]["message"]


def test_suffix_is_400(server):
    r = post(server, {"model": "smol", "prompt": "def f(", "suffix": "return x", "max_tokens": 4}, "/v1/completions")
    assert_openai_error(r.status_code, r.json(), 400)
    assert "suffix" in r.json()["error"]["message"]
