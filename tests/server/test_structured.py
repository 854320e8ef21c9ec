"""Structured outputs over the API: each field a client may use becomes the engine's
`StructuredOutput`, a bad one is a 400 naming it, and over HTTP the official `openai`
client's answers follow their schema, regex and choices (`model` tests, the bundled
float32 model behind a real server).
"""

from __future__ import annotations

import json
import re

import httpx
import pydantic
import pytest

from engine.config import StructuredOutput
from server import protocol, responses
from server.errors import APIError

MODEL = "stub-model"
TIMEOUT_S = 120.0
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                           "population": {"type": "integer"}},
          "required": ["city", "population"], "additionalProperties": False}


def _chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "Hi"}]} | fields


@pytest.mark.parametrize(("fields", "want"), [
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}},
     StructuredOutput("json", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": '{"type": "string"}'}},
     StructuredOutput("json", '{"type": "string"}')),
    ({"structured_outputs": {"regex": "[0-9]+", "disable_fallback": False}},
     StructuredOutput("regex", "[0-9]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput("choice", ("yes", "no"))),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutput("grammar", 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
    ({"guided_choice": ["a", "b"]}, StructuredOutput("choice", ("a", "b"))),
    ({"guided_regex": "a+"}, StructuredOutput("regex", "a+")),
    ({"guided_json": SCHEMA}, StructuredOutput("json", json.dumps(SCHEMA))),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutput("grammar", 'root ::= "a"')),
    ({"json_schema": SCHEMA}, StructuredOutput("json", json.dumps(SCHEMA))),  # llama.cpp's
    ({"grammar": 'root ::= "a"'}, StructuredOutput("grammar", 'root ::= "a"')),  # its GBNF
    ({"response_format": {"type": "text"}}, None),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, StructuredOutput("regex", "a")),
])
def test_every_name_for_a_structured_output_reaches_the_params(fields, want):
    for parse in (protocol.parse_chat, protocol.parse_completion):
        body = _chat(**fields) if parse is protocol.parse_chat else {"prompt": "Hi"} | fields
        req = parse(body, MODEL)
        assert req.params.structured == want
        assert req.ignored == ()
        assert req.structured_param == (next(iter(k for k in fields if k != "guided_decoding_backend"))
                                        if want else None)


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "only one structured output per request (got response_format and guided_regex)"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "response_format.json_schema.schema is required"),
    ({"response_format": {"type": "yaml"}}, "response_format", "must be text, json_object"),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one of json, regex, choice, grammar, json_object (got regex, choice)"),
    ({"structured_outputs": {"disable_fallback": False}}, "structured_outputs", "got none"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs",
     "structured_outputs.whitespace_pattern is not supported here"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs",
     "structured_outputs.regexp is not a structured-outputs option"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs",
     "json_object must be true"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs",
     "structured_outputs.json: the JSON schema is not valid JSON"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs", "must be a JSON schema"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty list of non-empty strings"),
    ({"guided_choice": "a"}, "guided_choice", "non-empty list of non-empty strings"),
    ({"guided_regex": 7}, "guided_regex", "must be a non-empty string"),
    ({"grammar": "   "}, "grammar", "must be a non-empty string"),
])
def test_a_bad_structured_output_is_a_400_naming_its_field(fields, param, words):
    with pytest.raises(APIError) as err:
        protocol.parse_chat(_chat(**fields), MODEL)
    assert (err.value.status, err.value.param) == (400, param)
    assert words in err.value.message, err.value.message


def test_the_engines_compile_error_is_named_as_the_client_named_the_field():
    req = protocol.parse_chat(_chat(structured_outputs={"regex": "[a-"}), MODEL)
    err = req.error("structured: the regular expression does not compile: Unclosed '['")
    assert (err.status, err.param) == (400, "structured_outputs")
    assert err.message.startswith("structured_outputs: the regular expression")
    resp = responses.parse({"input": "Hi", "text": {"format": {
        "type": "json_schema", "name": "city", "schema": SCHEMA}}}, MODEL)
    assert resp.params.structured == StructuredOutput("json", json.dumps(SCHEMA))
    assert resp.error("structured: the JSON schema does not compile: x").param == "text.format"


def test_a_responses_text_format_is_echoed_in_its_response():
    fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA}
    shape = responses.Shape.new(MODEL, {"input": "Hi", "text": {"format": fmt}})
    assert shape.whole("{}", "stop", protocol.usage(1, 1, 0))["text"] == {"format": fmt}
    plain = responses.Shape.new(MODEL, {"input": "Hi"})
    assert plain.whole("x", "stop", protocol.usage(1, 1, 0))["text"] == {
        "format": {"type": "text"}}


# ---- over HTTP, the official client against the bundled model ----------------------------
class City(pydantic.BaseModel):
    city: str
    population: int


@pytest.mark.model
def test_the_sdks_parse_helper_gets_an_object_of_its_schema(client, name, api_engine):
    """`chat.completions.parse` sends a pydantic model as a strict json_schema and parses
    the answer back into it: the text is JSON of that schema, or the helper fails."""
    msgs = [{"role": "user", "content": "Name the largest city in France and its population."}]
    got = client.chat.completions.parse(model=name, messages=msgs, response_format=City,
                                        max_tokens=60, temperature=0)
    choice = got.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, City)
    free = client.chat.completions.create(model=name, messages=msgs, max_tokens=60,
                                          temperature=0)
    assert free.choices[0].message.content != choice.message.content
    kv = api_engine.stats(steps_after=None).kv
    assert kv.used_blocks == 0


@pytest.mark.model
def test_choices_and_regexes_hold_for_every_sampled_candidate(client, name):
    """Four sampled candidates (n=4, a seed) on /v1/completions with vLLM's choice, and a
    streamed chat with a regex: every answer is one the constraint allows."""
    choices = ["red", "green", "blue"]
    got = client.completions.create(model=name, prompt="My favourite colour is", n=4,
                                    max_tokens=8, temperature=1.0, seed=5,
                                    extra_body={"structured_outputs": {"choice": choices}})
    assert [c.text in choices for c in got.choices] == [True] * 4
    assert {c.finish_reason for c in got.choices} == {"stop"}
    pattern = r"\(\d{3}\) \d{3}-\d{4}"
    stream = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "A phone number, please."}],
        max_tokens=30, temperature=0.7, seed=1, stream=True,
        extra_body={"structured_outputs": {"regex": pattern}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert re.fullmatch(pattern, text), text


@pytest.mark.model
def test_a_responses_json_schema_answer_parses(client, name):
    got = client.responses.create(model=name, input="Name a city and its population.",
                                  max_output_tokens=60, temperature=0, text={"format": {
                                      "type": "json_schema", "name": "city", "schema": SCHEMA,
                                      "strict": True}})
    assert got.status == "completed"
    City.model_validate_json(got.output_text)
    assert got.text.format.type == "json_schema"
    parsed = client.responses.parse(model=name, input="Name a city and its population.",
                                    max_output_tokens=60, temperature=0, text_format=City)
    assert isinstance(parsed.output_parsed, City)


@pytest.mark.model
def test_a_spec_that_does_not_compile_is_a_400_and_the_engine_serves_on(url, name, client):
    for body, param in (({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
                        ({"guided_json": {"type": "objec"}}, "guided_json"),
                        ({"grammar": "root ::= missing"}, "grammar")):
        r = httpx.post(url + "/v1/completions", json={"model": name, "prompt": "Hi"} | body,
                       timeout=TIMEOUT_S)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "does not compile" in err["message"], err
    ok = client.completions.create(model=name, prompt="Hi", max_tokens=3)
    assert ok.usage.completion_tokens >= 1
