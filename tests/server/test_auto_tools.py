"""tool_choice "auto" on a server with a tool-call parser (vLLM's
`--enable-auto-tool-choice --tool-call-parser hermes`): the model answers text or calls
in its own format, and the server finds the calls. Model-free tests check the plan;
`model` tests serve the bundled model with `deploy/chat_templates/hermes_tools.jinja`
and drive the official `openai` client, the model calling for real after one example.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from http_server import serving

from server import protocol, responses, tool_parsers
from server.errors import APIError
from server.routes import api_routes

MODEL = "stub-model"
TEMPLATE = Path(__file__).parents[2] / "deploy" / "chat_templates" / "hermes_tools.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
HERMES = tool_parsers.get("hermes")
# one earlier call, sent as OpenAI's tool_calls: the template shows it in hermes' format
EXAMPLE = [{"role": "user", "content": "What is the weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [{
               "id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
ASK_ROME = EXAMPLE + [{"role": "user", "content": "What is the weather in Rome?"}]


def test_auto_needs_the_servers_parser_and_then_plans_the_models_own_calls():
    body = {"messages": ASK_ROME, "tools": [WEATHER]}
    with pytest.raises(APIError) as err:
        protocol.parse_chat(body, MODEL)
    assert err.value.param == "tool_choice" and "--tool-call-parser" in err.value.message
    for choice in (None, "auto"):
        req = protocol.parse_chat(body | ({"tool_choice": choice} if choice else {}), MODEL,
                                  tool_parser=HERMES)
        plan = req.tool_plan
        assert plan.parser is HERMES and not plan.forced and req.params.structured is None
        assert req.template_kwargs["tools"] == [WEATHER]
    # the earlier call reaches the template in the parser's own format
    sent = req.prompts[0][1]["content"]
    assert HERMES.scan(sent, final=True).calls == (
        {"name": "get_weather", "arguments": '{"city": "Paris"}'},)


def test_an_auto_answer_is_its_content_and_its_calls():
    req = protocol.parse_chat({"messages": ASK_ROME, "tools": [WEATHER]}, MODEL,
                              tool_parser=HERMES)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    content, calls = req.tool_plan.answer("Looking it up.\n" + call + call)
    assert content == "Looking it up.\n" and len(calls) == 2
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert calls[0]["id"] != calls[1]["id"]
    content, (alone,) = req.tool_plan.answer(call)
    assert content is None and alone["function"] == calls[0]["function"]
    assert req.tool_plan.answer("No call here.") == ("No call here.", None)
    single = protocol.parse_chat({"messages": ASK_ROME, "tools": [WEATHER],
                                  "parallel_tool_calls": False}, MODEL, tool_parser=HERMES)
    assert len(single.tool_plan.answer(call + call)[1]) == 1


def test_the_servers_chat_template_replaces_the_models():
    req = protocol.parse_chat({"messages": ASK_ROME}, MODEL, chat_template="{{ 'x' }}")
    assert req.template_kwargs["chat_template"] == "{{ 'x' }}"
    answer = responses.parse({"input": "Hi"}, MODEL, chat_template="{{ 'x' }}")
    assert answer.template_kwargs["chat_template"] == "{{ 'x' }}"
    with pytest.raises(APIError) as err:  # a request cannot set it through the kwargs
        protocol.parse_chat({"messages": ASK_ROME,
                             "chat_template_kwargs": {"chat_template": "y"}}, MODEL)
    assert err.value.param == "chat_template_kwargs"


def test_a_chat_template_is_read_from_a_file_or_as_itself(tmp_path):
    assert protocol.read_chat_template(str(TEMPLATE)) == TEMPLATE.read_text()
    assert protocol.read_chat_template("{{ messages[0]['content'] }}").startswith("{{")
    with pytest.raises(ValueError, match="no such file"):
        protocol.read_chat_template(str(tmp_path / "missing.jinja"))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m }")
    with pytest.raises(ValueError, match="line 2"):
        protocol.read_chat_template(str(bad))


# ---- over HTTP, the official client against the bundled model ----------------------------
@pytest.fixture(scope="module")
def auto_client(api_engine, name):
    """`api_engine` served with the hermes parser and the tools template."""
    routes = api_routes(lambda: api_engine, model_name=name, tool_parser="hermes",
                        chat_template=protocol.read_chat_template(str(TEMPLATE)))
    with serving(routes) as base, openai.OpenAI(base_url=f"{base}/v1", api_key="none",
                                               max_retries=0, timeout=120.0) as c:
        yield c


@pytest.mark.model
def test_the_model_calls_a_tool_and_the_server_finds_the_call(auto_client, name, api_engine):
    """Greedy: with tools "none" the same prompt shows the model's raw text, a hermes
    call; with "auto" (the default) that text comes back as the call."""
    kwargs = dict(model=name, messages=ASK_ROME, tools=[WEATHER], max_tokens=48,
                  temperature=0)
    raw = auto_client.chat.completions.create(tool_choice="none", **kwargs).choices[0]
    assert "<tool_call>" in raw.message.content and not raw.message.tool_calls
    got = auto_client.chat.completions.create(**kwargs).choices[0]
    assert got.finish_reason == "tool_calls" and got.message.content is None
    (call,) = got.message.tool_calls
    want = HERMES.scan(raw.message.content, final=True).calls[0]
    assert {"name": call.function.name, "arguments": call.function.arguments} == want
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Rome"}
    assert api_engine.stats(steps_after=None).kv.used_blocks == 0


@pytest.mark.model
def test_a_streamed_call_adds_up_to_the_whole_one(auto_client, name):
    kwargs = dict(model=name, messages=ASK_ROME, tools=[WEATHER], max_tokens=48,
                  temperature=0)
    whole = auto_client.chat.completions.create(**kwargs).choices[0]
    chunks = list(auto_client.chat.completions.create(stream=True, **kwargs))
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)  # no raw tags
    with auto_client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


@pytest.mark.model
def test_without_a_call_the_answer_is_text_whole_or_streamed(auto_client, name):
    kwargs = dict(model=name, messages=[{"role": "user", "content": "Hi! How are you?"}],
                  tools=[WEATHER], max_tokens=24, temperature=0)
    whole = auto_client.chat.completions.create(**kwargs).choices[0]
    assert whole.message.content and not whole.message.tool_calls
    assert whole.finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in auto_client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == whole.message.content


@pytest.mark.model
def test_a_tool_loop_answers_after_the_tools_result(auto_client, name):
    first = auto_client.chat.completions.create(model=name, messages=ASK_ROME,
                                                tools=[WEATHER], max_tokens=48,
                                                temperature=0).choices[0].message
    (call,) = first.tool_calls
    turn = ASK_ROME + [first.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    answer = auto_client.chat.completions.create(model=name, messages=turn, tools=[WEATHER],
                                                 max_tokens=24, temperature=0)
    message = answer.choices[0].message
    assert message.content or message.tool_calls  # text, or another call: both parsed


@pytest.mark.model
def test_tokenize_renders_the_servers_template_and_the_parsers_history(auto_client):
    base = str(auto_client.base_url).removesuffix("/").removesuffix("/v1")
    turn = EXAMPLE + [{"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    ids = httpx.post(f"{base}/tokenize", json={"messages": turn}, timeout=30).json()
    text = httpx.post(f"{base}/detokenize", json={"tokens": ids["tokens"]},
                      timeout=30).json()["prompt"]
    assert HERMES.history(EXAMPLE[1]["tool_calls"]) in text  # the earlier call, as hermes
    assert "<tool_response>\n18 C\n</tool_response>" in text  # the server's template
    assert text.endswith("<|im_start|>assistant\n")


# the same example as Responses input items, and the tool as the Responses API writes it
EXAMPLE_ITEMS = [{"role": "user", "content": "What is the weather in Paris?"},
                 {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                  "arguments": '{"city": "Paris"}'},
                 {"role": "user", "content": "What is the weather in Rome?"}]
FLAT_WEATHER = {"type": "function"} | WEATHER["function"]


@pytest.mark.model
def test_the_responses_api_returns_the_models_own_call_whole_or_streamed(auto_client, name):
    kwargs = dict(model=name, input=EXAMPLE_ITEMS, tools=[FLAT_WEATHER],
                  max_output_tokens=48, temperature=0)
    whole = auto_client.responses.create(**kwargs)
    (call,) = whole.output
    assert whole.status == "completed" and call.type == "function_call"
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Rome"}
    with auto_client.responses.stream(**kwargs) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.output_text.delta" not in kinds  # the call's raw text never shows
    assert [(o.type, o.name, o.arguments) for o in final.output] == [
        ("function_call", call.name, call.arguments)]
    loop = auto_client.responses.create(**kwargs | {"input": EXAMPLE_ITEMS + [
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}],
        "max_output_tokens": 16})
    assert loop.output and loop.output[0].type in ("message", "function_call")
