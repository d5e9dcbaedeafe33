"""Structured output offline (``engine/structured_output.py``): with the real model, what comes out parses
(``json_object``), validates against the schema (``json``, checked with ``jsonschema``), matches the
regex or is one of the choices, greedy and sampled; a schema with keywords xgrammar would ignore is
refused, naming them; the per-request matchers go when the requests do."""
import json
import re

import jsonschema
import pytest

from labsupport import SamplingParams
from labsupport.engine.json_schema_support import unsupported_features

ASK = [{"role": "user", "content": "Describe a person as JSON: their name, age and favourite colours."}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    "nickname": {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]},
}, "required": ["name", "age", "colours", "nickname"], "additionalProperties": False}


def structured(llm, spec, prompt=ASK, n=1, **options):
    params = SamplingParams(max_tokens=120, structured_outputs=spec, n=n, **{"temperature": 0, **options})
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert not llm.engine.runner.sampler.structured.matchers, "a request's matcher goes when it does"
    return out.outputs


@pytest.mark.parametrize("options", [{}, {"temperature": 1.0, "seed": 3}, {"temperature": 0.8, "seed": 11, "top_p": 0.9}])
def test_json_schema_output_validates(llm, options):
    for out in structured(llm, {"json": PERSON}, **options):
        assert out.finish_reason == "stop", out.text  # the grammar ended, then EOS
        jsonschema.validate(json.loads(out.text), PERSON)


def test_json_object_output_parses_and_free_text_does_not(llm):
    free = llm.generate(ASK, SamplingParams(max_tokens=60, temperature=0), use_tqdm=False)[0].text
    with pytest.raises(ValueError):
        assert isinstance(json.loads(free), dict)
    for out in structured(llm, {"json_object": True}, temperature=1.0, seed=5, n=2):
        assert isinstance(json.loads(out.text), dict), out.text


def test_regex_and_choice(llm):
    (phone,) = structured(llm, {"regex": r"\+33 [0-9]{3} [0-9]{3} [0-9]{3}"}, prompt="A phone number in Paris:")
    assert re.fullmatch(r"\+33 [0-9]{3} [0-9]{3} [0-9]{3}", phone.text), phone.text
    question = [{"role": "user", "content": "Is the sea salty?"}]
    (answer,) = structured(llm, {"choice": ["Yes, it is", "No", "Sometimes \"salty\""]}, prompt=question)
    assert answer.text in ("Yes, it is", "No", 'Sometimes "salty"')


def test_a_grammar_that_has_ended_may_stop_despite_min_tokens(llm):
    (out,) = structured(llm, {"choice": ["yes", "no"]}, prompt=[{"role": "user", "content": "Yes or no?"}],
                        min_tokens=30)
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_a_schema_as_a_string_and_the_whitespace_option(llm):
    (out,) = structured(llm, {"json": json.dumps(PERSON), "disable_any_whitespace": True})
    jsonschema.validate(json.loads(out.text), PERSON)
    compact = json.dumps(json.loads(out.text), separators=(",", ":"), ensure_ascii=False)
    assert out.text == compact, "no whitespace between JSON tokens"


@pytest.mark.parametrize("schema, named, forbidden", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "[1,1]"),
    ({"type": "string", "not": {"const": "a"}}, "'not'", '"a"'),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "0.3"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, "maxLength", '"aaaa"'),
    ({"allOf": [{"type": "string"}, {"enum": ["x"]}]}, "allOf", '"y"'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, "dependentRequired", '{"a": 1}'),
])
def test_keywords_xgrammar_ignores_are_refused_by_name(llm, schema, named, forbidden):
    """Each is ignored by xgrammar (its matcher accepts a string the keyword forbids), so it is refused."""
    import xgrammar as xgr
    matcher = xgr.GrammarMatcher(llm.engine.structured_outputs.compiler.compile_json_schema(schema))
    assert matcher.accept_string(forbidden) and matcher.is_completed(), "xgrammar enforces this now: allow it"
    with pytest.raises(ValueError, match=named):
        SamplingParams(structured_outputs={"json": schema})


def test_paths_of_unsupported_features_and_a_schema_that_is_fine():
    assert unsupported_features(PERSON) == []
    deep = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "format": "color"}}}}
    (problem,) = unsupported_features(deep)
    assert "format 'color'" in problem and "$.properties.tags.items" in problem
    nested = {"type": "object"}
    for _ in range(200):
        nested = {"type": "array", "items": nested}
    assert "nesting deeper" in unsupported_features(nested)[0]


@pytest.mark.parametrize("spec, needle", [
    ({"json": "{not json"}, "not valid JSON"), ({"regex": "a("}, "regex cannot be compiled"),
    ({"grammar": "root ::= "}, "grammar cannot be compiled"), ({"choice": []}, "choice"),
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one"), ({}, "exactly one"),
    ({"structural_tag": "{}"}, "unsupported fields"), ({"json_object": "yes"}, "json_object"),
    ({"json": {"type": "strin"}}, "json cannot be compiled"), ("json", "must be a dict"),
])
def test_bad_structured_outputs_are_refused_when_made(spec, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(structured_outputs=spec)


def test_the_structured_bench_prints_the_grammars_cost_per_step(capsys):
    from labsupport.bench.serving.structured_bench import main
    assert main(["--batch", "2", "--tokens", "6"]) == 0
    printed = capsys.readouterr().out
    assert "step, free text" in printed and "step, JSON schema" in printed
    grammar = re.search(r"grammar work in the step: +median +([0-9.]+) ms = ([0-9.]+) ms per constrained", printed)
    assert grammar and float(grammar.group(1)) > 0, printed
