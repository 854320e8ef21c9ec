"""OpenAI's Responses API (`POST /v1/responses`, what the OpenAI Agents SDK and newer
OpenAI clients call by default) as the chat it is underneath, in pure functions as
`server.protocol`: `instructions` and `input` become a chat's messages, and the answer
is an output message of output text and, with function tools, `function_call` items,
whole or streamed as the Responses events (`response.created` ...
`response.output_text.delta` ... `response.function_call_arguments.delta` ...
`response.completed`).

Accepted: `model`, `input` (a string, or items: messages whose content is a string or
`input_text` / `output_text` parts, the assistant's earlier `function_call`s and their
`function_call_output`s), `instructions` (a string), `max_output_tokens`, `temperature`,
`top_p`, `stream`, `text.format` (text, `json_object`, or `json_schema` with its
`schema`: a structured output, `server.structured`), function `tools` with `tool_choice`
and `parallel_tool_calls` (the chat's tool calls, `server.tools`: "auto" on a server with
a tool-call parser), what changes nothing here (`store: false`, `metadata`, `user`,
`safety_identifier`, `prompt_cache_key`, `service_tier` "auto" or "default",
`truncation` "disabled"), and the chat's sampling fields as vLLM's server takes them
(`seed`, `stop`, `ignore_eos`, `top_k`, ...: `server.protocol`). Everything else a
Responses request can ask for (hosted tools, stored responses, `previous_response_id` and
conversations, reasoning, images, background runs, log-probabilities) is a 400 naming
the field; a field unknown here is accepted and named in the server's log, as on the
other routes.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from server import protocol, structured
from server.errors import APIError, bad_request, shown
from server.tool_parsers import ToolParser

Body = dict[str, Any]

# field -> (is the value one this server can answer, why not)
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "previous_response_id": (lambda v: v is None,
                             "responses are not stored here; send the whole input"),
    "conversation": (lambda v: v is None, "conversations are not stored here"),
    "store": (lambda v: v in (None, False), "responses are not stored here"),
    "reasoning": (lambda v: v is None, "the served model does not reason"),
    "include": (lambda v: v in (None, []), "no extra output is offered here"),
    "background": (lambda v: v in (None, False), "background responses are not offered"),
    "prompt": (lambda v: v is None, "stored prompt templates are not offered here"),
    "top_logprobs": (lambda v: v in (None, 0), "log-probabilities are not offered on "
                     "/v1/responses here; /v1/chat/completions has them"),
    "truncation": (lambda v: v in (None, "disabled"), "only truncation 'disabled' is "
                   "offered here"),
    "max_tool_calls": (lambda v: v is None, "a limit on tool calls is not offered here"),
    "service_tier": (lambda v: v in (None, "auto", "default"),
                     "service tiers are not offered here"),
    "text": (lambda v: v is None or (isinstance(v, dict) and set(v) <= {"format", "verbosity"}
                                     and v.get("verbosity") in (None, "medium")),
             "only text.format (and the default verbosity) is offered here"),
}
# the Responses request's own fields: the rest of a body goes to the chat underneath it
OWN = frozenset({"input", "instructions", "max_output_tokens", "tools", "tool_choice",
                 *UNSUPPORTED})
# the chat's fields a Responses request has no place for (its answer is one message, its
# length max_output_tokens, its log-probabilities not offered): unknown here
CHAT_ONLY = frozenset({"messages", "max_tokens", "max_completion_tokens", "n", "best_of",
                       "logprobs", "echo", "stream_options", "response_format",
                       "functions", "function_call"})
# the chat request's fields as the Responses request names them
RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format"}
TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "assistant", "system", "developer")


def parse(body: Body, model_name: str, chat_template: str | None = None,
          tool_parser: ToolParser | None = None) -> protocol.GenerationRequest:
    """Validate a /v1/responses body (already parsed from JSON) into the chat request it
    is (`chat_template`: the server's, in place of the model's; `tool_parser`: the
    server's, for tool_choice "auto"); a 400 names the field as the Responses API names
    it."""
    for name, (fine, why) in UNSUPPORTED.items():
        if name in body and not fine(body[name]):
            raise bad_request(f"{name}: {why} (got {shown(body[name])})", name)
    chat = {k: v for k, v in body.items() if k not in OWN | CHAT_ONLY} | {
        "messages": _messages(body), "max_completion_tokens": body.get("max_output_tokens"),
        "response_format": _response_format(body)} | _tools(body)
    try:
        req = protocol.parse_chat(chat, model_name, chat_template=chat_template,
                                  tool_parser=tool_parser)
    except APIError as err:
        raise _renamed(err) from None
    unknown = {*req.ignored, *(k for k in body if k in CHAT_ONLY - OWN)}
    return dataclasses.replace(req, ignored=tuple(sorted(unknown)),
                               structured_param=req.structured_param and "text.format")


def _tools(body: Body) -> Body:
    """Function `tools` (flat: `name`, `parameters` beside `type`) and `tool_choice`
    (`{"type": "function", "name": ...}`) as the chat's; a 400 for any other tool."""
    out: Body = {}
    tools = body.get("tools")
    if tools not in (None, []):
        if not isinstance(tools, list):
            raise bad_request(f"tools must be a list of tools, got {shown(tools)}", "tools")
        out["tools"] = [_function(tool, i) for i, tool in enumerate(tools)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": '
                              f'"function", "name": ...}}, got {shown(choice)}', "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return out | ({} if choice is None else {"tool_choice": choice})


def _function(tool: Any, i: int) -> Body:
    """One function tool as the chat's: its fields under `function`."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else shown(tool)
        raise bad_request(f"{where}: only function tools are supported here, got {kind}",
                          "tools")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise bad_request(f"{where}.name must be a non-empty string", "tools")
    if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
        raise bad_request(f"{where}.parameters must be a JSON schema (an object), got "
                          f"{shown(tool['parameters'])}", "tools")
    return {"type": "function", "function": {
        k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}}


def _response_format(body: Body) -> dict[str, Any] | None:
    """`text.format` (flat: `name` and `schema` beside `type`) as the chat's
    response_format; None for text."""
    fmt = (body.get("text") or {}).get("format")
    if fmt is None:
        return None
    so = structured.from_response_format(fmt, "text.format")
    if so is None:
        return None
    if so.kind == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"schema": json.loads(str(so.spec))}}


def _renamed(err: APIError) -> APIError:
    """A chat request's error as the Responses request names its field."""
    if err.param not in RENAMED:
        return err
    name = RENAMED[err.param]
    message = err.message
    if message.startswith(err.param):
        message = name + message[len(err.param):]
    return bad_request(message, name) if err.status == 400 else err


def _messages(body: Body) -> list[Body]:
    """`instructions` as a system message, then `input` as messages."""
    out: list[Body] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request(f"instructions must be a string here, got {shown(instructions)}",
                              "instructions")
        out.append({"role": "system", "content": instructions})
    given = body.get("input")
    if given is None:
        raise bad_request("input is required", "input")
    if isinstance(given, str):
        return [*out, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad_request(f"input must be a string or a list of messages, got {shown(given)}",
                          "input")
    for i, item in enumerate(given):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "function_call":
            call = _call(item, i)
            if out and out[-1].get("tool_calls") and out[-1]["content"] is None:
                out[-1]["tool_calls"].append(call)  # calls made together, one turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(_call_output(item, i))
        else:
            out.append(_message(item, i))
    return out


def _call(item: Body, i: int) -> Body:
    """An earlier `function_call` item as the chat's tool call."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise bad_request(f"input[{i}].{key} must be a string, got {shown(item.get(key))}",
                              "input")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _call_output(item: Body, i: int) -> Body:
    """A `function_call_output` item as the chat's tool message."""
    if not isinstance(item.get("call_id"), str):
        raise bad_request(f"input[{i}].call_id must be a string, got "
                          f"{shown(item.get('call_id'))}", "input")
    return {"role": "tool", "tool_call_id": item["call_id"],
            "content": _text(item.get("output"), f"input[{i}].output")}


def _text(content: Any, where: str) -> str:
    """Content as text: a string, or text parts joined."""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(
                    part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else shown(part)
                raise bad_request(f"{where}[{j}]: only text parts are supported here, "
                                  f"got {kind}", "input")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad_request(f"{where} must be a string or text parts, got {shown(content)}",
                          "input")
    return content


def _message(item: Any, i: int) -> dict[str, str]:
    """One input item: a message whose content is text (a string or text parts)."""
    where = f"input[{i}]"
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        kind = item.get("type") if isinstance(item, dict) else shown(item)
        raise bad_request(f"{where}: only messages, function calls and their outputs are "
                          f"supported here, got {kind}", "input")
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got "
                          f"{shown(role)}", "input")
    content = _text(item.get("content"), f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": content}


@dataclass(frozen=True)
class Shape:
    """One response's fixed fields and the objects and events built from them."""

    id: str
    message_id: str
    created: int
    model: str
    settings: dict[str, Any]  # what the request set, echoed as the Response object does

    @classmethod
    def new(cls, model: str, body: Body) -> Shape:
        parallel = body.get("parallel_tool_calls")
        settings = {"instructions": body.get("instructions"),
                    "max_output_tokens": body.get("max_output_tokens"),
                    "temperature": body.get("temperature", 1.0),
                    "top_p": body.get("top_p", 1.0), "metadata": body.get("metadata") or {},
                    "store": False,
                    "text": {"format": (body.get("text") or {}).get("format")
                             or {"type": "text"}},
                    "tools": body.get("tools") or [],
                    "tool_choice": body.get("tool_choice") or "auto",
                    "parallel_tool_calls": parallel if isinstance(parallel, bool) else True}
        return cls(f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", int(time.time()),
                   model, settings)

    def response(self, status: str, output: list[dict[str, Any]] | None = None,
                 finish_reason: str | None = None,
                 usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """The Response object: in progress (no output yet), or ended with its `output`
        items."""
        incomplete = finish_reason == "length"
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "model": self.model, "output": output or [],
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None, "usage": _usage(usage) if usage else None, **self.settings}

    def message(self, text: str | None, status: str, item_id: str | None = None
                ) -> dict[str, Any]:
        """An output message item (no content while in progress)."""
        content = [] if text is None else [self.part(text)]
        return {"id": item_id or self.message_id, "type": "message", "role": "assistant",
                "status": status, "content": content}

    @staticmethod
    def call(call: dict[str, Any], status: str, item_id: str | None = None
             ) -> dict[str, Any]:
        """A `function_call` output item for one of the chat's tool calls."""
        fn = call["function"]
        return {"id": item_id or f"fc_{uuid.uuid4().hex}", "type": "function_call",
                "status": status, "call_id": call["id"], "name": fn["name"],
                "arguments": fn["arguments"]}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def whole(self, text: str | None, finish_reason: str, usage: dict[str, Any],
              calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """A non-streaming response: the message (where there is text, or no call) and
        the function calls."""
        status = status_of(finish_reason)
        output = [] if text is None and calls else [self.message(text or "", status)]
        output += [self.call(c, status) for c in calls or []]
        return self.response(status, output, finish_reason, usage)


def status_of(finish_reason: str) -> str:
    """A Response's status for the chat's finish reason: cut at max_output_tokens is
    "incomplete", as OpenAI answers it."""
    return "incomplete" if finish_reason == "length" else "completed"


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A chat usage object as the Responses API names its counts."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens_details": {"reasoning_tokens": 0}}


class Events:
    """A stream's events in order, each numbered (`sequence_number`) as OpenAI's are.
    Output items open and close as the answer comes: a message for text, a
    `function_call` for each of the chat's tool calls. Without tools the message opens at
    once; with tools it opens at the first text, as the answer may be calls alone."""

    def __init__(self, shape: Shape, tools: bool = False) -> None:
        self.shape = shape
        self.number = 0
        self.lazy = tools
        self.items: list[dict[str, Any]] = []  # the output items closed so far
        # the item being streamed: its type, id and text so far (a call: its item too)
        self.open: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> str:
        """One server-sent event: `event: kind`, its data carrying `type` too."""
        data = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def opening(self) -> list[str]:
        """Created and in progress, then (without tools) the message and its text part
        opened."""
        s = self.shape
        opened = [self.event("response.created", response=s.response("in_progress")),
                  self.event("response.in_progress", response=s.response("in_progress"))]
        return opened if self.lazy else opened + self._open_message()

    def delta(self, text: str) -> list[str]:
        """New text of the answer, in the open message (opened here if need be)."""
        out = [] if self.open is not None and self.open["type"] == "message" else (
            self._close("completed") + self._open_message())
        assert self.open is not None
        self.open["text"] += text
        return out + [self.event("response.output_text.delta", **self._where(),
                                 content_index=0, delta=text, logprobs=[])]

    def call(self, delta: dict[str, Any]) -> list[str]:
        """A chat tool-call delta: a new call (with its id) closes what is open and opens a
        `function_call` item; its arguments come as argument deltas."""
        out = []
        if "id" in delta:
            out += self._close("completed")
            item = self.shape.call(delta | {"function": delta["function"] | {"arguments": ""}},
                                   "in_progress")
            self.open = {"type": "function_call", "id": item["id"], "text": "", "item": item}
            out.append(self.event("response.output_item.added", output_index=len(self.items),
                                  item=item))
        args = delta.get("function", {}).get("arguments", "")
        if args and self.open is not None and self.open["type"] == "function_call":
            self.open["text"] += args
            out.append(self.event("response.function_call_arguments.delta", **self._where(),
                                  delta=args))
        return out

    def closing(self, finish_reason: str, usage: dict[str, Any]) -> list[str]:
        """What is open done (a message with nothing said opens first where there is
        no other output), then `response.completed` with the response, whose status says
        "incomplete" where max_output_tokens cut it (as vLLM sends it: the OpenAI SDK's
        stream helper waits for that event alone)."""
        status = status_of(finish_reason)
        out = self._open_message() if self.open is None and not self.items else []
        out += self._close(status)
        return out + [self.event("response.completed", response=self.shape.response(
            status, self.items, finish_reason, usage))]

    def _open_message(self) -> list[str]:
        s = self.shape
        item_id = s.message_id if not self.items else f"msg_{uuid.uuid4().hex}"
        self.open = {"type": "message", "id": item_id, "text": ""}
        return [self.event("response.output_item.added", output_index=len(self.items),
                           item=s.message(None, "in_progress", item_id)),
                self.event("response.content_part.added", **self._where(), content_index=0,
                           part=s.part(""))]

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items)}  # it is next

    def _close(self, status: str) -> list[str]:
        """The open item done, and kept for the response."""
        if self.open is None:
            return []
        s, where, text = self.shape, self._where(), self.open["text"]
        if self.open["type"] == "message":
            item = s.message(text, status, self.open["id"])
            out = [self.event("response.output_text.done", **where, content_index=0,
                              text=text, logprobs=[]),
                   self.event("response.content_part.done", **where, content_index=0,
                              part=s.part(text))]
        else:
            item = self.open["item"] | {"arguments": text, "status": status}
            out = [self.event("response.function_call_arguments.done", **where,
                              arguments=text)]
        self.items.append(item)
        self.open = None
        return out + [self.event("response.output_item.done",
                                 output_index=where["output_index"], item=item)]

    def error(self, err: APIError) -> str:
        """A failure after the stream began: OpenAI's `error` event."""
        return self.event("error", code=err.code, message=err.message, param=err.param)
