"""OpenAI's Responses API (`POST /v1/responses`, what the OpenAI Agents SDK and newer
OpenAI clients call by default) as the chat it is underneath, in pure functions as
`server.protocol`: `instructions` and `input` become a chat's messages, and the answer
is one output message of output text, whole or streamed as the Responses events
(`response.created` ... `response.output_text.delta` ... `response.completed`).

Accepted: `model`, `input` (a string, or message items whose content is a string or
`input_text` / `output_text` parts), `instructions` (a string), `max_output_tokens`,
`temperature`, `top_p`, `stream`, `text.format` (text, `json_object`, or
`json_schema` with its `schema`: a structured output, `server.structured`), what changes
nothing here (`store: false`, `metadata`,
`user`, `safety_identifier`, `prompt_cache_key`, `parallel_tool_calls`, `service_tier`
"auto" or "default", `tool_choice` "auto" or "none" without tools, `truncation`
"disabled"), and the chat's sampling fields as vLLM's server takes them (`seed`, `stop`,
`ignore_eos`, `top_k`, ...: `server.protocol`). Everything else a Responses request can
ask for (tools, stored responses, `previous_response_id` and conversations, reasoning,
images, background runs, log-probabilities) is a 400 naming the
field; a field unknown here is accepted and named in the server's log, as on the other
routes.
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

Body = dict[str, Any]

# field -> (is the value one this server can answer, why not)
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "tools": (lambda v: v in (None, []), "tools are not supported here"),
    "tool_choice": (lambda v: v in (None, "auto", "none"), "tools are not supported here"),
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
    "max_tool_calls": (lambda v: v is None, "tools are not supported here"),
    "service_tier": (lambda v: v in (None, "auto", "default"),
                     "service tiers are not offered here"),
    "text": (lambda v: v is None or (isinstance(v, dict) and set(v) <= {"format", "verbosity"}
                                     and v.get("verbosity") in (None, "medium")),
             "only text.format (and the default verbosity) is offered here"),
}
# the Responses request's own fields: the rest of a body goes to the chat underneath it
OWN = frozenset({"input", "instructions", "max_output_tokens", *UNSUPPORTED})
# the chat's fields a Responses request has no place for (its answer is one message, its
# length max_output_tokens, its log-probabilities not offered): unknown here
CHAT_ONLY = frozenset({"messages", "max_tokens", "max_completion_tokens", "n", "best_of",
                       "logprobs", "echo", "stream_options", "response_format", "tools",
                       "functions", "function_call"})
# the chat request's fields as the Responses request names them
RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format"}
TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "assistant", "system", "developer")


def parse(body: Body, model_name: str, chat_template: str | None = None
          ) -> protocol.GenerationRequest:
    """Validate a /v1/responses body (already parsed from JSON) into the chat request it
    is (`chat_template`: the server's, in place of the model's); a 400 names the field as
    the Responses API names it."""
    for name, (fine, why) in UNSUPPORTED.items():
        if name in body and not fine(body[name]):
            raise bad_request(f"{name}: {why} (got {shown(body[name])})", name)
    chat = {k: v for k, v in body.items() if k not in OWN | CHAT_ONLY} | {
        "messages": _messages(body), "max_completion_tokens": body.get("max_output_tokens"),
        "response_format": _response_format(body)}
    try:
        req = protocol.parse_chat(chat, model_name, chat_template=chat_template)
    except APIError as err:
        raise _renamed(err) from None
    unknown = {*req.ignored, *(k for k in body if k in CHAT_ONLY - OWN)}
    return dataclasses.replace(req, ignored=tuple(sorted(unknown)),
                               structured_param=req.structured_param and "text.format")


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


def _messages(body: Body) -> list[dict[str, str]]:
    """`instructions` as a system message, then `input` as messages."""
    out = []
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
    return out + [_message(item, i) for i, item in enumerate(given)]


def _message(item: Any, i: int) -> dict[str, str]:
    """One input item: a message whose content is text (a string or text parts)."""
    where = f"input[{i}]"
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        kind = item.get("type") if isinstance(item, dict) else shown(item)
        raise bad_request(f"{where}: only messages are supported here, got {kind}", "input")
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got "
                          f"{shown(role)}", "input")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(
                    part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else shown(part)
                raise bad_request(f"{where}.content[{j}]: only text parts are supported here, "
                                  f"got {kind}", "input")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string or text parts, got "
                          f"{shown(content)}", "input")
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
        settings = {"instructions": body.get("instructions"),
                    "max_output_tokens": body.get("max_output_tokens"),
                    "temperature": body.get("temperature", 1.0),
                    "top_p": body.get("top_p", 1.0), "metadata": body.get("metadata") or {},
                    "store": False,
                    "text": {"format": (body.get("text") or {}).get("format")
                             or {"type": "text"}}}
        return cls(f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", int(time.time()),
                   model, settings)

    def response(self, status: str, text: str | None = None,
                 finish_reason: str | None = None,
                 usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """The Response object: in progress (no output yet), or ended with `text`."""
        ended = text is not None
        incomplete = finish_reason == "length"
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "model": self.model,
            "output": [self.message(text, "incomplete" if incomplete else "completed")]
            if ended else [],
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None, "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
            "usage": _usage(usage) if usage else None,
            **self.settings}

    def message(self, text: str | None, status: str) -> dict[str, Any]:
        """The output message item (no content while in progress)."""
        content = [] if text is None else [self.part(text)]
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "status": status, "content": content}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def whole(self, text: str, finish_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        """A non-streaming response."""
        return self.response(status_of(finish_reason), text, finish_reason, usage)


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
    """A stream's events in order, each numbered (`sequence_number`) as OpenAI's are."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.number = 0
        self.text = ""

    def event(self, kind: str, **fields: Any) -> str:
        """One server-sent event: `event: kind`, its data carrying `type` too."""
        data = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def opening(self) -> list[str]:
        """Created and in progress, then the message and its text part opened."""
        s = self.shape
        where = {"item_id": s.message_id, "output_index": 0, "content_index": 0}
        return [self.event("response.created", response=s.response("in_progress")),
                self.event("response.in_progress", response=s.response("in_progress")),
                self.event("response.output_item.added", output_index=0,
                           item=s.message(None, "in_progress")),
                self.event("response.content_part.added", **where, part=s.part(""))]

    def delta(self, text: str) -> str:
        self.text += text
        return self.event("response.output_text.delta", item_id=self.shape.message_id,
                          output_index=0, content_index=0, delta=text, logprobs=[])

    def closing(self, finish_reason: str, usage: dict[str, Any]) -> list[str]:
        """The text, part and message done, then `response.completed` with the response,
        whose status says "incomplete" where max_output_tokens cut it (as vLLM sends it:
        the OpenAI SDK's stream helper waits for that event alone)."""
        s, text, status = self.shape, self.text, status_of(finish_reason)
        where = {"item_id": s.message_id, "output_index": 0, "content_index": 0}
        return [self.event("response.output_text.done", **where, text=text, logprobs=[]),
                self.event("response.content_part.done", **where, part=s.part(text)),
                self.event("response.output_item.done", output_index=0,
                           item=s.message(text, status)),
                self.event("response.completed",
                           response=s.response(status, text, finish_reason, usage))]

    def error(self, err: APIError) -> str:
        """A failure after the stream began: OpenAI's `error` event."""
        return self.event("error", code=err.code, message=err.message, param=err.param)
