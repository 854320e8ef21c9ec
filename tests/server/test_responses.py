"""OpenAI's Responses API (`POST /v1/responses`): the body as the chat underneath it, the
Response object and its events without a server, then the official `openai` client's
`responses.create` and `responses.stream` against a real engine on 127.0.0.1."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from http_server import serving

from server import responses
from server.errors import APIError
from server.routes import api_routes

MODEL = "stub-model"
TIMEOUT_S = 120


# ---- the wire format, no server -------------------------------------------------------
def test_instructions_and_input_become_the_chats_messages():
    req = responses.parse({"model": MODEL, "instructions": "Be brief.", "input": [
        {"role": "developer", "content": "No lists."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Name "}, {"type": "input_text", "text": "a city."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
        {"role": "user", "content": "Another."}], "max_output_tokens": 7,
        "temperature": 0, "store": False, "metadata": {"a": "b"}, "frobnicate": 1,
        "max_tokens": 99}, MODEL)
    assert req.chat and req.prompt == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "No lists."},
        {"role": "user", "content": "Name a city."}, {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "Another."}]
    assert (req.params.max_tokens, req.params.temperature) == (7, 0.0)
    # named in the log: a chat field a Responses request has no place for, an unknown one
    assert req.ignored == ("frobnicate", "max_tokens")
    plain = responses.parse({"input": "Hi"}, MODEL)
    assert plain.prompt == [{"role": "user", "content": "Hi"}] and not plain.stream


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools",
     "tools[0]: only function tools are supported here, got web_search"),
    ({"input": "Hi", "tools": [{"type": "function"}]}, "tools", "tools[0].name must be"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": [1]}]},
     "tools", "tools[0].parameters must be a JSON schema"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f"}]}, "tool_choice",
     "--tool-call-parser"),  # "auto", the default, on a server without a parser
    ({"input": "Hi", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "function", "name": "g"}}, "tool_choice", "no tool is named 'g'"),
    ({"input": "Hi", "tool_choice": {"type": "allowed_tools"}}, "tool_choice",
     'tool_choice must be "none", "auto", "required" or'),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input",
     "input[0].call_id must be a string"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input",
     "input[0].output must be a string or text parts"),
    ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
    ({"input": "Hi", "reasoning": {"effort": "low"}}, "reasoning", "does not reason"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format",
     "text.format.schema is required"),
    ({"input": "Hi", "text": {"format": {"type": "grammar"}}}, "text.format",
     "text.format.type must be text, json_object or json_schema"),
    ({"input": "Hi", "text": {"verbosity": "low"}}, "text", "only text.format"),
    ({"input": "Hi", "text": {"stop": "x"}}, "text", "only text.format"),
    ({"input": "Hi", "background": True}, "background", "background"),
    ({"input": "Hi", "store": True}, "store", "responses are not stored here"),
    ({"input": "Hi", "top_logprobs": 2}, "top_logprobs", "/v1/chat/completions has them"),
    ({}, "input", "input is required"),
    ({"input": []}, "input", "input must be a string or a list"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input",
     "input[0]: only messages, function calls and their outputs are supported here, got "
     "reasoning"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input",
     "input[0].content[0]: only text parts"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "input[0].role must be one of"),
    ({"input": "Hi", "instructions": ["x"]}, "instructions", "must be a string"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must"),
    ({"input": "Hi", "temperature": "hot"}, "temperature", "temperature must be a number"),
    ({"input": "   "}, "input", "must not be empty"),
])
def test_what_a_response_cannot_be_is_a_400_naming_the_responses_field(body, param, words):
    with pytest.raises(APIError) as err:
        responses.parse(body, MODEL)
    assert (err.value.status, err.value.param) == (400, param)
    assert words in err.value.message, err.value.message


def test_the_defaults_of_such_fields_are_accepted():
    for extra in ({"tools": []}, {"tool_choice": "auto"}, {"truncation": "disabled"},
                  {"text": {"verbosity": "medium"}},
                  {"text": {"format": {"type": "text"}}}, {"service_tier": "auto"},
                  {"include": []}, {"background": False}, {"parallel_tool_calls": True}):
        assert responses.parse({"input": "Hi"} | extra, MODEL).ignored == ()


def test_a_streams_events_are_numbered_in_openais_order():
    events = responses.Events(responses.Shape.new(MODEL, {"input": "Hi",
                                                          "max_output_tokens": 2}))
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
             "prompt_tokens_details": {"cached_tokens": 1}}
    wire = [*events.opening(), *events.delta("Hel"), *events.delta("lo"),
            *events.closing("length", usage)]
    parsed = [(e.split("\n")[0].removeprefix("event: "), json.loads(e.split("\n")[1][6:]))
              for e in wire]
    assert [kind for kind, _ in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [d["sequence_number"] for _, d in parsed] == list(range(len(wire)))
    assert all(d["type"] == kind for kind, d in parsed)
    last = parsed[-1][1]["response"]
    assert (last["status"], last["incomplete_details"]) == (
        "incomplete", {"reason": "max_output_tokens"})
    assert last["output"][0]["content"][0]["text"] == "Hello" == parsed[6][1]["text"]
    assert last["usage"] == {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5,
                             "input_tokens_details": {"cached_tokens": 1},
                             "output_tokens_details": {"reasoning_tokens": 0}}


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}
NAMED = {"type": "function", "name": "get_weather"}


def test_function_tools_and_earlier_calls_become_the_chats():
    req = responses.parse({"input": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "21 C"}]}],
        "tools": [WEATHER], "tool_choice": NAMED}, MODEL)
    assert req.template_kwargs["tools"] == [{"type": "function", "function": {
        k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    assert req.tool_plan.forced and req.tool_plan.name == "get_weather"
    user, calls, first, second = req.prompts[0]
    assert calls["role"] == "assistant"  # the two calls of one turn, as one message
    assert calls["content"].count("get_weather") == 2 and "Rome" in calls["content"]
    assert (first, second) == ({"role": "tool", "content": "18 C"},
                               {"role": "tool", "content": "21 C"})


def _wire(events: list[str]) -> list[tuple[str, dict]]:
    return [(e.split("\n")[0].removeprefix("event: "), json.loads(e.split("\n")[1][6:]))
            for e in events]


def test_a_call_streams_as_its_own_item_after_any_text():
    shape = responses.Shape.new(MODEL, {"input": "Hi", "tools": [WEATHER]})
    events = responses.Events(shape, tools=True)
    usage = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": '}}
    wire = _wire([*events.opening(), *events.delta("Let me see."), *events.call(call),
                  *events.call({"index": 0, "function": {"arguments": '"Rome"}'}}),
                  *events.closing("tool_calls", usage)])
    assert [kind for kind, _ in wire] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [d["sequence_number"] for _, d in wire] == list(range(len(wire)))
    assert [d["output_index"] for kind, d in wire if "output_index" in d] == [0] * 6 + [1] * 5
    done = wire[-1][1]["response"]
    assert done["status"] == "completed" and done["tools"] == [WEATHER]
    message, fc = done["output"]
    assert message["content"][0]["text"] == "Let me see."
    assert (fc["type"], fc["call_id"], fc["name"], fc["arguments"], fc["status"]) == (
        "function_call", "call_1", "get_weather", '{"city": "Rome"}', "completed")
    assert wire[-2][1]["item"] == fc and fc["id"].startswith("fc_")
    # calls alone: no message at all; nothing at all: an empty message
    alone = responses.Events(shape, tools=True)
    wire = _wire([*alone.opening(), *alone.call(call), *alone.closing("tool_calls", usage)])
    assert [o["type"] for o in wire[-1][1]["response"]["output"]] == ["function_call"]
    empty = responses.Events(shape, tools=True)
    wire = _wire([*empty.opening(), *empty.closing("stop", usage)])
    assert [o["type"] for o in wire[-1][1]["response"]["output"]] == ["message"]


def test_the_route_answers_a_bad_body_before_any_engine():
    class NoEngine:
        loaded = None

    with serving(api_routes(lambda: NoEngine(), model_name=MODEL)) as url:
        r = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "Hi",
                                                    "tools": [{"type": "function"}]},
                       timeout=TIMEOUT_S)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        r = httpx.post(url + "/v1/responses", json={"model": "gpt-x", "input": "Hi"},
                       timeout=TIMEOUT_S)
        assert r.status_code == 404


# ---- a real engine ---------------------------------------------------------------------
@pytest.mark.model
def test_a_response_is_the_chats_answer(name, client):
    """The same greedy answer and token counts as the chat it is underneath."""
    msgs = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=name, messages=msgs, max_tokens=12,
                                          temperature=0)
    got = client.responses.create(model=name, instructions="Answer briefly.",
                                  input="What is the capital of France?",
                                  max_output_tokens=12, temperature=0)
    assert got.object == "response" and got.id.startswith("resp_") and got.model == name
    assert got.output_text == chat.choices[0].message.content
    assert (got.usage.input_tokens, got.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert got.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                          else "completed")


@pytest.mark.model
def test_the_sdks_stream_helper_reads_the_events_to_the_final_response(name, client):
    with client.responses.stream(model=name, input="Count to ten.", max_output_tokens=8,
                                 temperature=0, extra_body={"ignore_eos": True}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert len(deltas) > 1 and "".join(deltas) == final.output_text
    assert final.status == "incomplete" and final.incomplete_details.reason == (
        "max_output_tokens")
    assert final.usage.output_tokens == 8
    whole = client.responses.create(model=name, input="Count to ten.", max_output_tokens=8,
                                    temperature=0)
    assert whole.output_text == final.output_text


@pytest.mark.model
def test_the_sdk_sees_a_refused_field_as_a_400(name, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=name, input="Hi", previous_response_id="resp_x")
    assert err.value.param == "previous_response_id"


@pytest.mark.model
def test_a_forced_function_call_comes_back_as_a_function_call_item(name, client):
    """A named tool_choice: the answer is the function's arguments, whole or streamed
    through the SDK's helper (greedy: the same call)."""
    kwargs = dict(model=name, input="What is the weather in Paris?", tools=[WEATHER],
                  tool_choice=NAMED, max_output_tokens=40, temperature=0)
    whole = client.responses.create(**kwargs)
    (call,) = whole.output
    assert whole.status == "completed" and call.type == "function_call"
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    with client.responses.stream(**kwargs) as stream:
        deltas = [e.delta for e in stream
                  if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    (streamed,) = final.output
    assert "".join(deltas) == streamed.arguments == call.arguments
    required = client.responses.create(**kwargs | {"tool_choice": "required"})
    assert [o.type for o in required.output] == ["function_call"] * len(required.output)
    cut = client.responses.create(**kwargs | {"max_output_tokens": 3})
    assert cut.status == "incomplete" and [(o.type, o.status) for o in cut.output] == [
        ("function_call", "incomplete")]
