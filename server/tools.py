"""Tool calls: forced ones as vLLM's server makes them without a tool-call parser, and
"auto" through one (`server.tool_parsers`).

A named `tool_choice` (`{"type": "function", "function": {"name": ...}}`) makes the
answer that function's arguments: its `parameters` schema becomes a structured output,
and the text comes back as one tool call. `tool_choice: "required"` makes it a JSON list
of `{"name", "parameters"}` calls, one of the tools' schemas each (one call in all with
`parallel_tool_calls: false`), and each comes back as a tool call. "auto", OpenAI's
default once tools are sent, lets the model answer text or call in its own format: the
server needs a parser for that format (`--enable-auto-tool-choice --tool-call-parser
NAME`, as vLLM's), else "auto" is a 400, as vLLM's answer without them. "none" sends the
tools to the chat template only.

The tools also go to the chat template (`tools`), as vLLM sends them: a template that
knows tools shows them to the model. Earlier turns may hold the assistant's tool calls
and the tools' answers (`role: "tool"`): `history` turns each call into text the template
can show, in the parser's format where there is one.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.config import StructuredOutput
from server.errors import bad_request, shown
from server.tool_parsers import ToolParser

Body = dict[str, Any]
AUTO_REFUSED = ('tool_choice "auto" (the default once tools are sent) needs a parser for '
                "the model's own tool-call format, which this server was not started with "
                "(batchlens serve --enable-auto-tool-choice --tool-call-parser NAME, as "
                "vLLM's; the dashboard's tool_call_parser setting): send tool_choice "
                "\"required\", a named function "
                '({"type": "function", "function": {"name": ...}}) or "none"')


@dataclass(frozen=True)
class ToolPlan:
    """What a chat's tools ask of its answer: nothing but the template's view of them
    (`forced` false: tool_choice "none"), text or calls in the model's format (`forced`
    false with a `parser`: "auto"), one call of the function `name` (a named
    tool_choice), or, with no name, a list of calls to any of them ("required")."""

    tools: tuple[dict[str, Any], ...]  # the tools, as sent
    forced: bool
    name: str | None = None
    parallel: bool = True  # OpenAI's parallel_tool_calls: false holds the answer to one call
    parser: ToolParser | None = None  # "auto": the model's own calls, found in its text

    def answer(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """A whole answer as a chat message's `content` and `tool_calls` (None: none)."""
        if self.forced:
            return None, self.calls(text) or []
        if self.parser is None:
            return text, None
        scan = self.parser.scan(text, final=True)
        if not scan.calls:
            return scan.content, None
        return scan.content if scan.content.strip() else None, self.found(scan.calls)

    def found(self, calls: Sequence[dict[str, str]], first: int = 0) -> list[dict[str, Any]]:
        """A parser's calls from `first` on as OpenAI's `tool_calls`, each with a new id;
        with `parallel` false only the answer's first call is kept."""
        kept = calls if self.parallel else calls[:1]
        return [call(c["name"], c["arguments"]) for c in kept[first:]]

    def structured(self) -> StructuredOutput:
        """The answer's schema: the named function's parameters, or the list of calls."""
        if self.name is not None:
            return StructuredOutput("json", json.dumps(_parameters(self._function(self.name))))
        calls = [{"type": "object", "properties": {"name": {"enum": [f["name"]]},
                                                   "parameters": _parameters(f)},
                  "required": ["name", "parameters"]} for f in self._functions()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutput("json", json.dumps(schema))

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The answer as OpenAI's `tool_calls`; None where it is not a whole call (the
        answer was cut at max_tokens before its JSON closed)."""
        if self.name is not None:
            return [call(self.name, text)]
        try:  # the grammar makes it a list of calls; text past its end (ignore_eos) does not
            return [call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                    for c in json.loads(text)]
        except (json.JSONDecodeError, KeyError, TypeError):
            return None

    def _functions(self) -> list[dict[str, Any]]:
        return [t["function"] for t in self.tools]

    def _function(self, name: str) -> dict[str, Any]:
        return next(f for f in self._functions() if f["name"] == name)


def call(name: str, arguments: str) -> dict[str, Any]:
    """One tool call as OpenAI's API writes it."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def parse(body: Body, parser: ToolParser | None = None) -> ToolPlan | None:
    """The chat body's tools and tool_choice as a plan (None: the answer is text); a 400
    naming the field for a malformed tool, an unknown function, or "auto" on a server
    without a tool-call `parser`."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise bad_request(f"tool_choice: no tools were sent (got {shown(choice)})",
                              "tool_choice")
        return None
    checked = _check_tools(tools)
    if choice == "none":
        return ToolPlan(checked, forced=False)
    if choice in (None, "auto", "required"):
        parallel = body.get("parallel_tool_calls")
        if parallel is not None and not isinstance(parallel, bool):
            raise bad_request(f"parallel_tool_calls must be true or false, got "
                              f"{shown(parallel)}", "parallel_tool_calls")
        if choice == "required":
            return ToolPlan(checked, forced=True, parallel=parallel is not False)
        if parser is None:
            raise bad_request(AUTO_REFUSED, "tool_choice")
        return ToolPlan(checked, forced=False, parallel=parallel is not False, parser=parser)
    name = _named(choice)
    if name not in {t["function"]["name"] for t in checked}:
        raise bad_request(f"tool_choice: no tool is named {name!r} (the tools are "
                          f"{', '.join(t['function']['name'] for t in checked)})",
                          "tool_choice")
    return ToolPlan(checked, forced=True, name=name)


def _named(choice: Any) -> str:
    if (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        return choice["function"]["name"]
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": '
                      f'"function", "function": {{"name": ...}}}}, got {shown(choice)}',
                      "tool_choice")


def _check_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(tools, list):
        raise bad_request(f"tools must be a list of tools, got {shown(tools)}", "tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"{where}: only function tools are supported here, got "
                              f"{shown(tool)}", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"{where}.function must be an object with a name", "tools")
        if fn["name"] in names:
            raise bad_request(f"{where}: two tools are named {fn['name']!r}", "tools")
        names.add(fn["name"])
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema (an "
                              f"object), got {shown(params)}", "tools")
    return tuple(tools)


def history(message: dict[str, Any], parser: ToolParser | None = None) -> str:
    """An earlier assistant turn's tool calls as text after its content, for a chat
    template without tools of its own: in the parser's format, else one JSON object per
    call."""
    if parser is not None:
        return parser.history(message.get("tool_calls") or [])
    functions = [c.get("function") for c in message.get("tool_calls") or []
                 if isinstance(c, dict)]
    return "\n".join(json.dumps({"name": f.get("name"), "arguments": f.get("arguments")},
                                ensure_ascii=False)
                     for f in functions if isinstance(f, dict))
