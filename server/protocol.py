"""The OpenAI wire format as pure functions: request bodies of /v1/completions and
/v1/chat/completions -> a prompt and `SamplingParams`; the response objects, whole and as
server-sent-event chunks. No web framework and no engine here, so all of it is tested
without a server.

Accepted fields: `model`, `prompt` (completions: text or token ids) / `messages` (chat),
`max_tokens` (chat: `max_completion_tokens` too, and it wins), `temperature`, `top_p`,
`top_k`, `seed`, `stop` (a string or a list), `n` (1 only), `stream`,
`stream_options.include_usage`, and vLLM's extensions `ignore_eos`, `min_tokens` and
`stop_token_ids`. Any other field is ignored, as OpenAI-compatible servers do; a wrong type
or a bad value is an `APIError` 400 whose `param` names the field.

Default `max_tokens`: 16 for completions, as OpenAI's. For chat, vLLM's default is the
rest of the context; here it is `CHAT_DEFAULT_MAX_TOKENS` (256), because a small model left
to ramble to the end of an 8k context holds its KV blocks for minutes of a shared engine.
Either default is cut to what the context leaves after the prompt
(`fit_default_max_tokens`); a `max_tokens` the client sent is never cut.

Hostile input is refused here with a 400, never reaching the engine as something that
could fail a whole step: text with a lone surrogate (valid JSON, not valid Unicode); a
temperature below `GREEDY_EPS` is greedy, as vLLM's, since dividing logits by a
denormal gives infinities. A value quoted back in a message is clipped (`shown`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import reprlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

from engine.config import GREEDY_EPS, SamplingParams
from engine.models.loaded import Prompt
from server.errors import APIError, bad_request, error_body

COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 256
FINISH_REASONS = ("stop", "length")  # the engine's other endings are errors on the wire
SSE_DONE = "data: [DONE]\n\n"
_SURROGATE = re.compile("[\ud800-\udfff]")
_SHOWN = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 2, 60, 60
_SHOWN.maxlist = _SHOWN.maxdict = 4

Body = dict[str, Any]


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request: what to submit to the engine and how to answer it."""

    prompt: Prompt
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    chat: bool = False
    max_tokens_param: str | None = None  # the field max_tokens came from; None: the default

    def error(self, message: str) -> APIError:
        """A 400 for an engine `ValueError` about this request ("prompt: ...",
        "max_tokens must ..."), naming the field as the client named it: `messages` for a
        chat's prompt, `max_completion_tokens` when max_tokens came from that field."""
        return engine_error(message, chat=self.chat, max_tokens_param=self.max_tokens_param)


SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def engine_error(message: str, *, chat: bool, max_tokens_param: str | None) -> APIError:
    """A 400 from the engine's or `SamplingParams`' `ValueError` message, which begins
    with the field's name; `param` (and the message's first word) as the client knows it."""
    m = re.match(r"\w+", message)
    word = m.group(0) if m else ""
    if word == "prompt":
        param: str | None = "messages" if chat else "prompt"
    elif word == "max_tokens":
        param = max_tokens_param or "max_tokens"
    else:
        param = word if word in SAMPLING_FIELDS else None
    if param is not None and param != word:
        message = param + message[len(word):]
    return bad_request(message, param)


# ---- request bodies ------------------------------------------------------------------
def parse_completion(body: Body, model_name: str) -> GenerationRequest:
    """Validate a /v1/completions body (already parsed from JSON)."""
    check_model(body, model_name)
    return _request(body, _completion_prompt(body.get("prompt")), chat=False,
                    max_tokens_fields=("max_tokens",))


def parse_chat(body: Body, model_name: str) -> GenerationRequest:
    """Validate a /v1/chat/completions body (already parsed from JSON)."""
    check_model(body, model_name)
    return _request(body, _messages(body.get("messages")), chat=True,
                    max_tokens_fields=("max_completion_tokens", "max_tokens"))


def check_model(body: Body, model_name: str) -> None:
    """`model`, when given, must be the served model: 404 otherwise, as OpenAI answers."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad_request(f"model must be a string, got {shown(model)}", "model")
    if model != model_name:
        clipped = model if len(model) <= 80 else model[:80] + "..."
        raise APIError(404, f"The model `{clipped}` does not exist; this server serves "
                       f"`{model_name}` (GET /v1/models)", param="model",
                       code="model_not_found")


def fit_default_max_tokens(req: GenerationRequest, prompt_tokens: int,
                           limit: int) -> GenerationRequest:
    """Cut a defaulted max_tokens to what `limit` (context or KV pool, in tokens) leaves
    after the prompt; a max_tokens the client sent stays as it is (the engine then says
    whether it fits)."""
    room = limit - prompt_tokens
    if req.max_tokens_param is not None or room < 1 or req.params.max_tokens <= room:
        return req
    params = dataclasses.replace(req.params, max_tokens=room,
                                 min_tokens=min(req.params.min_tokens, room))
    return dataclasses.replace(req, params=params)


def _request(body: Body, prompt: Prompt, *, chat: bool,
             max_tokens_fields: tuple[str, ...]) -> GenerationRequest:
    n = _int(body, "n", 1)
    if n != 1:
        raise bad_request(f"n: only n=1 is supported, got {n}", "n")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request(f"stream_options must be an object, got {shown(options)}",
                          "stream_options")
    include_usage = _bool(options or {}, "include_usage", False, "stream_options.include_usage")
    max_tokens_param = next((f for f in max_tokens_fields if body.get(f) is not None), None)
    min_tokens = _int(body, "min_tokens", 0)
    default = CHAT_DEFAULT_MAX_TOKENS if chat else COMPLETION_DEFAULT_MAX_TOKENS
    max_tokens = (_int(body, max_tokens_param, 0) if max_tokens_param
                  else max(default, min_tokens))
    top_k = _int(body, "top_k", 0)
    temperature = _number(body, "temperature", 1.0)
    fields = {
        "max_tokens": max_tokens,
        "temperature": 0.0 if 0 <= temperature < GREEDY_EPS else temperature,
        "top_p": _number(body, "top_p", 1.0),
        "top_k": 0 if top_k == -1 else top_k,  # vLLM's -1: no top-k
        "seed": _int(body, "seed", None),
        "stop": _stop(body.get("stop")),
        "stop_token_ids": _int_list(body, "stop_token_ids"),
        "ignore_eos": _bool(body, "ignore_eos", False),
        "min_tokens": min_tokens,
    }
    try:
        params = SamplingParams(**fields)
    except ValueError as exc:
        raise engine_error(str(exc), chat=chat, max_tokens_param=max_tokens_param) from None
    return GenerationRequest(prompt, params, stream=stream, include_usage=include_usage,
                             n=n, chat=chat, max_tokens_param=max_tokens_param)


def shown(value: Any) -> str:
    """`repr(value)` clipped for a message (long strings, deep or long lists shortened)."""
    return _SHOWN.repr(value)


def _check_unicode(text: str, param: str) -> str:
    """`text` if it is valid Unicode; else a 400: JSON's \\ud800 escapes decode to lone
    surrogates, which no tokenizer or UTF-8 encoder takes."""
    if _SURROGATE.search(text):
        raise bad_request(f"{param}: the text holds a lone surrogate (not valid Unicode)",
                          param)
    return text


def _completion_prompt(prompt: Any) -> Prompt:
    """Text or token ids; a list holding one of those is taken as that one prompt."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise bad_request("prompt must not be empty", "prompt")
        return _check_unicode(prompt, "prompt")
    if isinstance(prompt, list):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if all(isinstance(p, str | list) for p in prompt):
            raise bad_request(f"prompt: one prompt per request (got {len(prompt)})", "prompt")
    raise bad_request("prompt must be a string or a list of token ids", "prompt")


def _messages(messages: Any) -> list[dict[str, str]]:
    """Chat messages as {"role", "content"} with text content (text parts are joined)."""
    if messages is None:
        raise bad_request("messages is required", "messages")
    if not isinstance(messages, list):
        raise bad_request("messages must be a list of {role, content} objects", "messages")
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string role",
                              "messages")
        out.append({"role": _check_unicode(m["role"], "messages"),
                    "content": _check_unicode(_content(m.get("content"), i), "messages")})
    if not any(m["content"].strip() for m in out):
        raise bad_request("messages must not be empty (every content is blank)", "messages")
    return out


def _content(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise bad_request(f"messages[{i}].content: only text parts are supported",
                                  "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                      "messages")


def _int(body: Body, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_request(f"{name} must be an integer, got {shown(value)}", name)
    return value


def _number(body: Body, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise bad_request(f"{name} must be a number, got {shown(value)}", name)
    return float(value)


def _bool(body: Body, name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{param or name} must be true or false, got {shown(value)}",
                          param or name)
    return value


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("stop must be a non-empty string or a list of them", "stop")
    return [_check_unicode(s, "stop") for s in stop]


def _int_list(body: Body, name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise bad_request(f"{name} must be a list of integers", name)
    return value


# ---- response objects ----------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; cached tokens are the prompt's prefix-cache hits."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass(frozen=True)
class Reply:
    """The fixed fields of one request's answer (kind, id, creation time, model) and the
    objects built from them. The id doubles as the engine's request id."""

    chat: bool
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str) -> Reply:
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(chat, model, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    def _head(self, chunk: bool) -> dict[str, Any]:
        if not self.chat:
            obj = "text_completion"  # OpenAI names completion chunks so too
        else:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        """The non-streaming response."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice |= {"logprobs": None, "finish_reason": finish_reason}
        return self._head(False) | {"choices": [choice], "usage": usage}

    def chunk(self, text: str | None, finish_reason: str | None = None,
              role: bool = False) -> dict[str, Any]:
        """One stream chunk: new text (None: none, e.g. the closing chunk), the finish
        reason on the last one, the assistant role on a chat's first one."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice |= {"logprobs": None, "finish_reason": finish_reason}
        return self._head(True) | {"choices": [choice]}

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The closing chunk `stream_options.include_usage` asks for: usage, no choices."""
        return self._head(True) | {"choices": [], "usage": usage}


def model_list(model_name: str, root: str, max_model_len: int) -> dict[str, Any]:
    """GET /v1/models, as vLLM answers it."""
    return {"object": "list", "data": [{
        "id": model_name, "object": "model", "created": int(time.time()),
        "owned_by": "batchlens", "root": root, "parent": None,
        "max_model_len": max_model_len}]}


# ---- server-sent events --------------------------------------------------------------
def sse(obj: dict[str, Any]) -> str:
    """One `data:` event."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def sse_error(err: APIError) -> str:
    """An error after the stream began: an `error` event with the error body (then the
    caller sends `SSE_DONE`)."""
    return f"event: error\ndata: {json.dumps(error_body(err), separators=(',', ':'))}\n\n"
