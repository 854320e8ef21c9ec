"""Tool-call parsers for tool_choice "auto": the calls a model writes in its own format,
found in its text, as vLLM's `--tool-call-parser` finds them.

- **hermes** (Hermes, Qwen2.5, and `deploy/chat_templates/hermes_tools.jinja` for models
  whose template shows no tools): each call is `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`; text before the first call is the answer's content.
- **llama3_json** (Llama 3.1-3.3's JSON tool calling): the whole answer is a call
  `{"name": ..., "parameters": {...}}`, or several joined by `;`.

A parser reads an answer's text so far (`scan`) as its content and the calls closed so
far. Both only grow as text comes: a stream sends the content as it is known (text that
may begin a call is held back) and each call whole once it has closed. A call that does
not parse as JSON with a name and an object of arguments is left in the content, so no
text is lost.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class Scan:
    """An answer's text read by a parser: its content, and its calls as OpenAI's
    `tool_calls` entries without ids (`{"name", "arguments"}`, arguments a JSON string)."""

    content: str
    calls: tuple[dict[str, str], ...] = ()


class ToolParser(Protocol):
    name: str

    def scan(self, text: str, final: bool) -> Scan:
        """The content and the calls in `text`; `final`: the answer has ended, so text
        held back as a call's possible start is settled."""

    def history(self, calls: list[dict[str, Any]]) -> str:
        """Earlier calls (OpenAI's `tool_calls`) as this format writes them, for the
        chat template."""


def get(name: str) -> ToolParser:
    """The parser named `name` (one of PARSERS); ValueError naming them otherwise."""
    if name == "hermes":
        return Hermes()
    if name == "llama3_json":
        return Llama3Json()
    raise ValueError(f"unknown tool-call parser {name!r}; the parsers are "
                     f"{', '.join(PARSERS)}")


def _one(obj: Any, arguments_key: str) -> dict[str, str] | None:
    """A call object as `{"name", "arguments"}` (arguments as JSON text); None where it
    is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def _arguments(function: dict[str, Any]) -> Any:
    """An earlier call's arguments as an object where its JSON text parses."""
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


def _functions(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c["function"] for c in calls
            if isinstance(c, dict) and isinstance(c.get("function"), dict)]


class Hermes:
    """`<tool_call>JSON</tool_call>` blocks after the content."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(self.start)
        if first < 0:
            return Scan(text if final else text[:len(text) - self._partial(text)])
        calls: list[dict[str, str]] = []
        rest = first  # where the text not read as calls begins
        for block in self._block.finditer(text, first):
            closed = block.group(0).endswith(self.end)
            if not closed and not final:
                break  # still being written
            try:
                one = _one(json.loads(block.group(1)), "arguments")
            except json.JSONDecodeError:
                one = None
            if one is None:
                break
            calls.append(one)
            rest = block.end()
        tail = text[rest:]
        if final and tail.strip():  # a call that does not parse: text, not dropped
            return Scan(text[:first] + tail, tuple(calls))
        return Scan(text[:first], tuple(calls))

    def _partial(self, text: str) -> int:
        """The length of the text's end that could begin `<tool_call>`."""
        for n in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-n:]):
                return n
        return 0

    def history(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(
            f"{self.start}\n" + json.dumps({"name": f.get("name"), "arguments": _arguments(f)},
                                           ensure_ascii=False) + f"\n{self.end}"
            for f in _functions(calls))


class Llama3Json:
    """The whole answer as `{"name", "parameters"}` objects joined by `;`."""

    name = "llama3_json"

    def scan(self, text: str, final: bool) -> Scan:
        body = text.lstrip()
        if body and not body.startswith("{"):
            return Scan(text)
        if not final:
            return Scan("")  # a call's start, or nothing yet: held until the end
        calls: list[dict[str, str]] = []
        decoder, at = json.JSONDecoder(), 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return Scan(text)
            one = _one(obj, "parameters")
            if one is None:
                return Scan(text)
            calls.append(one)
            sep = re.compile(r"\s*;?\s*").match(body, at)
            at = sep.end() if sep else at
        return Scan("", tuple(calls))

    def history(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": f.get("name"), "parameters": _arguments(f)},
                                    ensure_ascii=False) for f in _functions(calls))

