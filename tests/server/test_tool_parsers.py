"""The tool-call parsers of tool_choice "auto": whole answers, and the same answers read
as a stream reads them, a piece at a time."""

from __future__ import annotations

import json

import pytest

from server import tool_parsers, tools
from server.tool_parsers import Scan

WEATHER = {"name": "get_weather", "arguments": json.dumps({"city": "Rome"})}
TIME = {"name": "get_time", "arguments": json.dumps({"zone": "CET", "24h": True})}


def _hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


HERMES_CASES = [
    ("It is sunny.", Scan("It is sunny.")),
    (_hermes(**WEATHER), Scan("", (WEATHER,))),
    ("Let me look.\n" + _hermes(**WEATHER), Scan("Let me look.\n", (WEATHER,))),
    (_hermes(**WEATHER) + "\n" + _hermes(**TIME), Scan("", (WEATHER, TIME))),
    # the answer ended inside a call whose JSON had closed: still a call
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n',
     Scan("", (WEATHER,))),
    # a call that does not parse stays in the content, and so does what follows it
    ("Hm. <tool_call>{not json}</tool_call> done", Scan("Hm. <tool_call>{not json}</tool_call> done")),
    (_hermes(**WEATHER) + "<tool_call>{\"name\": 3}</tool_call>",
     Scan("<tool_call>{\"name\": 3}</tool_call>", (WEATHER,))),
    # text after the calls is kept as content
    (_hermes(**WEATHER) + "\nThat is all.", Scan("\nThat is all.", (WEATHER,))),
    ("a < b and <tool", Scan("a < b and <tool")),
]

LLAMA_CASES = [
    ("The weather is fine.", Scan("The weather is fine.")),
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}', Scan("", (WEATHER,))),
    (' {"name": "get_weather", "parameters": {"city": "Rome"}}; '
     '{"name": "get_time", "parameters": {"zone": "CET", "24h": true}}',
     Scan("", (WEATHER, TIME))),
    ('{"name": "get_weather", "arguments": {"city": "Rome"}}', Scan("", (WEATHER,))),
    ('{"city": "Rome"}', Scan('{"city": "Rome"}')),
    ('{"name": "get_weather", "parameters": {"city": "Ro', Scan('{"name": "get_weather", '
                                                            '"parameters": {"city": "Ro')),
]


@pytest.mark.parametrize(("text", "want"), HERMES_CASES)
def test_hermes_reads_a_whole_answer(text, want):
    assert tool_parsers.get("hermes").scan(text, final=True) == want


@pytest.mark.parametrize(("text", "want"), LLAMA_CASES)
def test_llama3_json_reads_a_whole_answer(text, want):
    assert tool_parsers.get("llama3_json").scan(text, final=True) == want


@pytest.mark.parametrize(("parser", "text"), [("hermes", t) for t, _ in HERMES_CASES]
                         + [("llama3_json", t) for t, _ in LLAMA_CASES])
def test_read_piece_by_piece_the_content_and_calls_only_grow_to_the_whole(parser, text):
    """What a stream sends is never taken back: at every cut of the text the content is a
    prefix of the next cut's and of the whole answer's, and so are the calls."""
    p = tool_parsers.get(parser)
    whole = p.scan(text, final=True)
    before = Scan("")
    for cut in range(len(text) + 1):
        now = p.scan(text[:cut], final=False)
        assert now.content.startswith(before.content), (cut, now, before)
        assert now.calls[:len(before.calls)] == before.calls, (cut, now, before)
        assert whole.content.startswith(now.content) and (
            whole.calls[:len(now.calls)] == now.calls), (cut, now, whole)
        before = now


def test_hermes_holds_back_what_may_begin_a_call_and_no_more():
    p = tool_parsers.get("hermes")
    assert p.scan("Sure <tool_", final=False).content == "Sure "
    assert p.scan("Sure <b>", final=False).content == "Sure <b>"
    assert p.scan("Sure <tool_", final=True).content == "Sure <tool_"
    # a call still being written is not sent until it closes
    assert p.scan('<tool_call>{"name": "get_weather", "arguments": {}}',
                  final=False) == Scan("")


def test_earlier_calls_are_written_back_in_the_parsers_format():
    calls = [tools.call("get_weather", '{"city": "Rome"}'), tools.call("get_time", "{}")]
    hermes = tool_parsers.get("hermes")
    written = hermes.history(calls)
    assert hermes.scan(written, final=True).calls == (
        WEATHER, {"name": "get_time", "arguments": "{}"})
    llama = tool_parsers.get("llama3_json")
    assert llama.scan(llama.history(calls), final=True).calls == (
        WEATHER, {"name": "get_time", "arguments": "{}"})


def test_an_unknown_parser_names_the_parsers():
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        tool_parsers.get("mistral")
