"""Tool calls as vLLM's server makes them without a tool-call parser: a named tool_choice
or "required" is a structured output whose answer comes back as `tool_calls`; "auto" is a
400; "none" shows the tools to the template only. Model-free tests check the plan and the
wire shapes; `model` tests drive the official `openai` client against the bundled model.
"""

from __future__ import annotations

import json

import openai
import pydantic
import pytest

from engine.config import StructuredOutput
from server import protocol, tools
from server.errors import APIError

MODEL = "stub-model"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                  "b": {"type": "integer"}},
                                  "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _chat(**fields) -> dict:
    return {"messages": ASK} | fields


def test_a_named_choice_is_its_functions_parameters_as_a_structured_output():
    req = protocol.parse_chat(_chat(tools=[WEATHER, ADD], tool_choice=NAMED), MODEL)
    params = WEATHER["function"]["parameters"]
    assert req.params.structured == StructuredOutput("json", json.dumps(params))
    assert req.template_kwargs["tools"] == [WEATHER, ADD]  # shown to the template
    calls = req.tool_plan.calls('{"city": "Paris", "unit": "C"}')
    assert [c["function"] for c in calls] == [{"name": "get_weather",
                                               "arguments": '{"city": "Paris", "unit": "C"}'}]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")


def test_required_is_a_list_of_calls_to_any_tool():
    req = protocol.parse_chat(_chat(tools=[WEATHER, ADD], tool_choice="required"), MODEL)
    schema = json.loads(req.params.structured.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["add"]]
    calls = req.tool_plan.calls('[{"name": "add", "parameters": {"a": 1, "b": 2}}, '
                                '{"name": "get_weather", "parameters": {"city": "Rome", '
                                '"unit": "F"}}]')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome", "unit": "F"})]
    assert "maxItems" not in schema  # parallel_tool_calls' default: as many as it makes
    single = protocol.parse_chat(_chat(tools=[WEATHER, ADD], tool_choice="required",
                                       parallel_tool_calls=False), MODEL)
    assert json.loads(single.params.structured.spec)["maxItems"] == 1
    assert req.tool_plan.calls('[{"name": "add", "param') is None  # cut at max_tokens
    assert req.tool_plan.calls('[1, 2]') is None and req.tool_plan.calls('{"a": 1}') is None


def test_none_shows_the_tools_to_the_template_and_answers_text():
    req = protocol.parse_chat(_chat(tools=[WEATHER], tool_choice="none"), MODEL)
    assert req.params.structured is None and req.template_kwargs["tools"] == [WEATHER]
    assert not req.tool_plan.forced


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"tools": [WEATHER]}, "tool_choice", 'tool_choice "auto" (the default once tools'),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tool_choice": "required"}, "tool_choice", "no tools were sent"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "no tool is named 'x' (the tools are get_weather)"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tools": {"type": "function"}}, "tools", "tools must be a list"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools",
     "only function tools are supported here"),
    ({"tools": [{"type": "function", "function": {}}], "tool_choice": "none"}, "tools",
     "tools[0].function must be an object with a name"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "none"}, "tools", "two tools are named"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
      "tool_choice": "required"}, "tools", "parameters must be a JSON schema"),
    ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "no"},
     "parallel_tool_calls", "parallel_tool_calls must be true or false"),
    ({"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined with response_format"),
])
def test_a_bad_tool_or_choice_is_a_400_naming_its_field(fields, param, words):
    with pytest.raises(APIError) as err:
        protocol.parse_chat(_chat(**fields), MODEL)
    assert (err.value.status, err.value.param) == (400, param)
    assert words in err.value.message, err.value.message


def test_completions_take_no_tools():
    with pytest.raises(APIError) as err:
        protocol.parse_completion({"prompt": "Hi", "tools": [WEATHER]}, MODEL)
    assert err.value.param == "tools" and "only /v1/chat/completions" in err.value.message


def test_earlier_calls_and_tool_answers_reach_the_template_as_text():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = protocol.parse_messages(ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}])
    assert msgs[1] == {"role": "assistant", "content": json.dumps(
        {"name": "get_weather", "arguments": '{"city": "Paris"}'})}
    assert msgs[2] == {"role": "tool", "content": "18 C"}
    odd = protocol.parse_messages(ASK + [{"role": "assistant", "content": "ok",
                                          "tool_calls": [{"function": "f"}, 3]}])
    assert odd[1]["content"] == "ok"  # calls without a function object add nothing
    for bad in (7, "call", {"id": "x"}):
        with pytest.raises(APIError) as err:
            protocol.parse_messages(ASK + [{"role": "assistant", "tool_calls": bad}])
        assert err.value.param == "messages" and "messages[1].tool_calls must be a list" in (
            err.value.message)


def test_tool_calls_go_beside_content_on_the_wire():
    reply = protocol.Reply.new(True, MODEL)
    calls = [tools.call("add", '{"a": 1, "b": 2}')]
    whole = reply.choice(None, "tool_calls", tool_calls=calls)
    assert whole["message"] == {"role": "assistant", "content": None, "tool_calls": calls}
    said = reply.choice("Adding.", "tool_calls", tool_calls=calls)
    assert said["message"] == {"role": "assistant", "content": "Adding.", "tool_calls": calls}
    delta = reply.chunk(None, index=0, tool_calls=[{"index": 0} | calls[0]])
    assert delta["choices"][0]["delta"] == {"tool_calls": [{"index": 0} | calls[0]]}
    both = reply.chunk("x", index=0, tool_calls=[{"index": 0} | calls[0]])
    assert both["choices"][0]["delta"] == {"content": "x",
                                           "tool_calls": [{"index": 0} | calls[0]]}
    assert reply.chunk(None, tool_calls=[])["choices"][0]["delta"] == {}


# ---- over HTTP, the official client against the bundled model ----------------------------
class Weather(pydantic.BaseModel):
    city: str
    unit: str


@pytest.mark.model
def test_the_sdks_strict_function_tool_comes_back_parsed(client, name, api_engine):
    """`chat.completions.parse` with `pydantic_function_tool` (a strict tool) and the tool
    named in tool_choice, as LangChain's `with_structured_output` sends it: the call's
    arguments parse into the model, the content is null and the answer ends "stop"."""
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    got = client.chat.completions.parse(model=name, messages=ASK, tools=[tool], max_tokens=60,
                                        temperature=0, tool_choice=NAMED)
    choice = got.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(call.function.parsed_arguments, Weather)
    assert api_engine.stats(steps_after=None).kv.used_blocks == 0


@pytest.mark.model
def test_streamed_calls_add_up_to_the_whole_answers(client, name):
    """Greedy, so the same call whole or streamed: a named call's arguments stream in
    pieces the SDK's helper joins; "required"'s list comes whole in one delta."""
    for choice, end in ((NAMED, "stop"), ("required", "tool_calls")):
        kwargs = dict(model=name, messages=ASK, tools=[WEATHER, ADD], tool_choice=choice,
                      max_tokens=80, temperature=0)
        whole = client.chat.completions.create(**kwargs)
        assert whole.choices[0].finish_reason == end
        with client.chat.completions.stream(**kwargs) as stream:
            for _ in stream:
                pass
            streamed = stream.get_final_completion()
        want = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
        got = [(c.function.name, c.function.arguments)
               for c in streamed.choices[0].message.tool_calls]
        assert got == want and want
        for fn, args in want:
            assert fn in ("get_weather", "add") and isinstance(json.loads(args), dict)


@pytest.mark.model
def test_parallel_tool_calls_false_makes_required_one_call(client, name):
    got = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Weather in Paris and Rome, and 2+3?"}],
        tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False,
        max_tokens=80, temperature=1.0, seed=2)
    assert got.choices[0].finish_reason == "tool_calls"
    assert len(got.choices[0].message.tool_calls) == 1


@pytest.mark.model
def test_a_tool_loop_goes_on_after_the_tools_answer(client, name):
    first = client.chat.completions.create(model=name, messages=ASK, tools=[WEATHER],
                                           tool_choice=NAMED, max_tokens=60, temperature=0)
    (call,) = first.choices[0].message.tool_calls
    turn = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    answer = client.chat.completions.create(model=name, messages=turn, tools=[WEATHER],
                                            tool_choice="none", max_tokens=20, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=name, messages=ASK, tools=[WEATHER], max_tokens=4)
    assert err.value.param == "tool_choice"
