"""The OpenAI wire format as pure functions: request bodies of /v1/completions and
/v1/chat/completions -> prompts and `SamplingParams`; the response objects, whole and as
server-sent-event chunks, with log-probabilities in OpenAI's two shapes. No web framework
and no engine here, so all of it is tested without a server.

Accepted fields, as vLLM's OpenAI server has them: `model`, `prompt` (completions: text,
token ids, or a list of either: one request each) / `messages` (chat), `max_tokens`
(chat: `max_completion_tokens` too, and it wins), `temperature`, `top_p`, `top_k`,
`min_p`, `seed`, `stop` (a string or a list), `presence_penalty`, `frequency_penalty`,
`repetition_penalty`, `logit_bias`, `logprobs` (completions: how many top tokens; chat:
true with `top_logprobs`), `echo` (completions), `prompt_logprobs`, `n` (1 to 16 choices
per prompt), `stream`, `stream_options.include_usage`; and vLLM's
`stream_options.continuous_usage_stats`, `ignore_eos`, `min_tokens`, `stop_token_ids`,
`allowed_token_ids`, `bad_words`, `include_stop_str_in_output`, `skip_special_tokens`,
`truncate_prompt_tokens`, `return_tokens_as_token_ids`, `return_token_ids`, `cache_salt`,
`chat_template_kwargs` (chat: extra variables for the model's chat template),
`add_generation_prompt` and `continue_final_message` (chat: the template's switches, for
an assistant's prefill); structured outputs under each name a client may use
(`response_format`, vLLM's `structured_outputs`: `server.structured`); a chat's `tools`
and `tool_choice` (`server.tools`).
What is refused and what ignored: `server.fields`. A wrong type or a bad value is an
`APIError` 400 whose `param` names the field; body errors come before an unknown model's
404, as vLLM's.

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
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import GREEDY_EPS, SamplingParams
from engine.models.loaded import Prompt
from server import structured, tools
from server.errors import APIError, bad_request, error_body, shown
from server.fields import check_supported, ignored_fields
from server.tool_parsers import ToolParser

if TYPE_CHECKING:
    from engine import TokenLogprob

COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 256
FINISH_REASONS = ("stop", "length")  # the engine's other endings are errors on the wire
SSE_DONE = "data: [DONE]\n\n"
_SURROGATE = re.compile("[\ud800-\udfff]")

Body = dict[str, Any]


MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_PROMPTS = 64  # prompts in one /v1/completions request


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request: what to submit to the engine and how to answer it. `prompts`
    holds one prompt, or a completions request's list (one engine request each); each
    prompt gets `n` choices, choice index = prompt index * n + candidate (vLLM's order)."""

    prompts: tuple[Prompt, ...]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's: usage so far in every chunk too
    n: int = 1
    chat: bool = False
    max_tokens_param: str | None = None  # the field max_tokens came from; None: the default
    echo: bool = False  # completions: the prompt's text before the answer
    show_prompt_logprobs: bool = False  # vLLM's `prompt_logprobs` field was sent
    # chat only: the template's extra variables and its two switches (`template_switches`)
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    ignored: tuple[str, ...] = ()  # the body's fields this server does not know
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N"
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids too
    bad_words: tuple[str, ...] = ()  # vLLM's: words the answer must not contain
    structured_param: str | None = None  # the field its structured output came from
    tool_plan: tools.ToolPlan | None = None  # chat: its tools and tool_choice
    beam_search: bool = False  # vLLM's use_beam_search: `n` beams (server.beam)
    length_penalty: float = 1.0  # beam search's ranking: log-probability / length ** this

    @property
    def prompt(self) -> Prompt:
        """The first prompt (the only one but for a completions list)."""
        return self.prompts[0]

    def truncated(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's tokens as `truncate_prompt_tokens` keeps them (its last k; -1:
        the context length); a k past the context length is a 400, as in vLLM."""
        k = self.truncate_prompt_tokens
        if k is None:
            return token_ids
        if k > max_model_len:
            raise bad_request(f"truncate_prompt_tokens: {k} is more than the context length "
                              f"({max_model_len})", "truncate_prompt_tokens")
        return token_ids[-(max_model_len if k == -1 else k):]

    def error(self, message: str, index: int | None = None) -> APIError:
        """A 400 for an engine `ValueError` about this request ("prompt: ...",
        "max_tokens must ..."), naming the field as the client named it: `messages` for a
        chat's prompt, `max_completion_tokens` when max_tokens came from that field;
        `index`: which prompt of a list it is about."""
        err = engine_error(message, chat=self.chat, max_tokens_param=self.max_tokens_param,
                           structured_param=self.structured_param)
        if index is not None and len(self.prompts) > 1 and err.param == "prompt":
            return bad_request(f"prompt[{index}]" + err.message[len("prompt"):], "prompt")
        return err


SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
TEMPLATE_FIELDS = frozenset({"chat_template_kwargs", "add_generation_prompt",
                             "continue_final_message", "tools"})


def engine_error(message: str, *, chat: bool, max_tokens_param: str | None,
                 structured_param: str | None = None) -> APIError:
    """A 400 from the engine's or `SamplingParams`' `ValueError` message, which begins
    with the field's name; `param` (and the message's first word) as the client knows it
    (`structured_param`: the field a structured output came from)."""
    m = re.match(r"\w+", message)
    word = m.group(0) if m else ""
    if word == "structured" and structured_param:
        param: str | None = structured_param
    elif word == "prompt":
        param = "messages" if chat else "prompt"
    elif word == "max_tokens":
        param = max_tokens_param or "max_tokens"
    elif word == "logprobs" and chat:
        param = "top_logprobs"
    else:
        param = word if word in SAMPLING_FIELDS or word in TEMPLATE_FIELDS else None
    if param is not None and param != word:
        message = param + message[len(word):]
    return bad_request(message, param)


# ---- request bodies ------------------------------------------------------------------
def parse_completion(body: Body, model_name: str) -> GenerationRequest:
    """Validate a /v1/completions body (already parsed from JSON)."""
    check_supported(body, chat=False)
    req = _request(body, _completion_prompts(body.get("prompt")), chat=False,
                   max_tokens_fields=("max_tokens",))
    check_model(body, model_name)
    return dataclasses.replace(req, ignored=ignored_fields(body, chat=False))


def parse_chat(body: Body, model_name: str, *, tool_parser: ToolParser | None = None,
               chat_template: str | None = None) -> GenerationRequest:
    """Validate a /v1/chat/completions body (already parsed from JSON). The server's
    `tool_parser` serves tool_choice "auto"; its `chat_template` (vLLM's
    `--chat-template`) takes the place of the model's."""
    check_supported(body, chat=True)
    plan = tools.parse(body, tool_parser)
    req = _request(body, (parse_messages(body.get("messages"), tool_parser),), chat=True,
                   max_tokens_fields=("max_completion_tokens", "max_tokens"))
    kwargs = template_kwargs(body.get("chat_template_kwargs")) | template_switches(body)
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    if plan is not None:
        kwargs["tools"] = list(plan.tools)
    if plan is not None and (plan.forced or plan.parser) and req.beam_search:
        raise bad_request("tool_choice: beam search answers text only; send tool_choice "
                          '"none" with it', "tool_choice")
    if plan is not None and plan.forced:
        if req.params.structured is not None:
            raise bad_request(f"tool_choice: a forced tool call is a structured output of "
                              f"its own; it cannot be combined with {req.structured_param}",
                              "tool_choice")
        req = dataclasses.replace(req, params=dataclasses.replace(
            req.params, structured=plan.structured()), structured_param="tools")
    check_model(body, model_name)
    return dataclasses.replace(req, template_kwargs=kwargs, tool_plan=plan,
                               ignored=ignored_fields(body, chat=True))


def template_switches(body: Body) -> dict[str, bool]:
    """vLLM's `add_generation_prompt` (default true: the template opens the assistant's
    turn) and `continue_final_message` (default false: true continues the last message,
    an assistant's prefill, in place), each where it differs from its default; both true
    is a 400, as in vLLM."""
    add = flag(body, "add_generation_prompt", True)
    cont = flag(body, "continue_final_message", False)
    if add and cont:
        raise bad_request("continue_final_message: the final message cannot be continued "
                          "while add_generation_prompt opens a new turn; send "
                          "add_generation_prompt: false with it", "continue_final_message")
    return ({} if add else {"add_generation_prompt": False}) | (
        {"continue_final_message": True} if cont else {})


def read_chat_template(value: str) -> str:
    """vLLM's `--chat-template`: a Jinja file's text, or the template itself where `value`
    is no file but reads as one; ValueError naming what is wrong (no such file, or the
    template's syntax error with its line)."""
    path = Path(value).expanduser()
    if path.is_file():
        text = path.read_text(encoding="utf-8")
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"chat template: no such file {value!r} (a path to a Jinja "
                         "file, or the template itself)")
    import jinja2  # transformers' own dependency, for its chat templates

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template: line {exc.lineno}: {exc.message}") from None
    return text


# apply_chat_template's own arguments and the variables it gives every template
TEMPLATE_RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "bos_token", "eos_token", "unk_token", "pad_token", "raise_exception", "strftime_now"})


def template_kwargs(value: Any) -> dict[str, Any]:
    """vLLM's `chat_template_kwargs`: an object of extra variables for the chat template
    (`{"enable_thinking": false}`), none of them one the template is already given."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"chat_template_kwargs must be an object, got {shown(value)}",
                          "chat_template_kwargs")
    if taken := sorted(TEMPLATE_RESERVED.intersection(value)):
        raise bad_request(f"chat_template_kwargs: {', '.join(taken)} is set by the server, "
                          "not by a request", "chat_template_kwargs")
    return dict(value)


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


def _request(body: Body, prompts: tuple[Prompt, ...], *, chat: bool,
             max_tokens_fields: tuple[str, ...]) -> GenerationRequest:
    n = _int(body, "n", 1)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:  # best_of == n returns every candidate: n
        raise bad_request(f"best_of: only best_of equal to n ({n}) is supported here "
                          f"(got {shown(best_of)})", "best_of")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request(f"stream_options must be an object, got {shown(options)}",
                          "stream_options")
    include_usage = _bool(options or {}, "include_usage", False, "stream_options.include_usage")
    continuous = _bool(options or {}, "continuous_usage_stats", False,
                       "stream_options.continuous_usage_stats")
    if continuous and not include_usage:
        raise bad_request("stream_options.continuous_usage_stats: only with include_usage "
                          "true, as in vLLM", "stream_options.continuous_usage_stats")
    if options and not stream:  # as vLLM: options for a stream that is not one
        raise bad_request(f"stream_options: only with stream=true (got {shown(options)})",
                          "stream_options")
    max_tokens_param = next((f for f in max_tokens_fields if body.get(f) is not None), None)
    min_tokens = _int(body, "min_tokens", 0)
    default = CHAT_DEFAULT_MAX_TOKENS if chat else COMPLETION_DEFAULT_MAX_TOKENS
    max_tokens = (_int(body, max_tokens_param, 0) if max_tokens_param
                  else max(default, min_tokens))
    top_k = _int(body, "top_k", 0)
    temperature = _number(body, "temperature", 1.0)
    echo = False if chat else _bool(body, "echo", False)
    logprobs = _chat_logprobs(body) if chat else _int(body, "logprobs", None)
    prompt_logprobs = _int(body, "prompt_logprobs", None)
    if echo and logprobs is not None:  # the prompt's tokens come with theirs too
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    fields = {
        "max_tokens": max_tokens,
        "temperature": 0.0 if 0 <= temperature < GREEDY_EPS else temperature,
        "top_p": _number(body, "top_p", 1.0),
        "top_k": 0 if top_k == -1 else top_k,  # vLLM's -1: no top-k
        "min_p": _number(body, "min_p", 0.0),
        "seed": _int(body, "seed", None),
        "stop": _stop(body.get("stop")),
        "stop_token_ids": _int_list(body, "stop_token_ids"),
        "ignore_eos": _bool(body, "ignore_eos", False),
        "min_tokens": min_tokens,
        "presence_penalty": _number(body, "presence_penalty", 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0),
        "logit_bias": _logit_bias(body.get("logit_bias")),
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "n": n,
        "allowed_token_ids": (_int_list(body, "allowed_token_ids")
                              if body.get("allowed_token_ids") is not None else None),
        "include_stop_str_in_output": _bool(body, "include_stop_str_in_output", False),
        "skip_special_tokens": _bool(body, "skip_special_tokens", True),
        "cache_salt": body.get("cache_salt"),  # SamplingParams checks it
    }
    fields["structured"], structured_param = structured.parse(body)
    try:
        params = SamplingParams(**fields)
    except ValueError as exc:
        raise engine_error(str(exc), chat=chat, max_tokens_param=max_tokens_param) from None
    words = tuple(_words(body.get("bad_words")))
    beam = _beam_search(body, params, chat, structured_param,
                        refused={"echo": echo, "bad_words": words})
    truncate = _int(body, "truncate_prompt_tokens", None)
    if truncate is not None and truncate < 1 and truncate != -1:
        raise bad_request(f"truncate_prompt_tokens must be >= 1, or -1 for the context "
                          f"length, got {truncate}", "truncate_prompt_tokens")
    return GenerationRequest(prompts, params, stream=stream, include_usage=include_usage,
                             continuous_usage=continuous, n=n, chat=chat,
                             max_tokens_param=max_tokens_param, echo=echo,
                             show_prompt_logprobs=body.get("prompt_logprobs") is not None,
                             truncate_prompt_tokens=truncate,
                             return_tokens_as_token_ids=_bool(
                                 body, "return_tokens_as_token_ids", False),
                             return_token_ids=_bool(body, "return_token_ids", False),
                             bad_words=words,
                             structured_param=structured_param,
                             beam_search=beam is not None, length_penalty=beam or 1.0)


# a beam search's sampling fields: each other one it cannot honour is a 400 naming it
BEAM_FREE = frozenset({"max_tokens", "n", "temperature", "seed", "ignore_eos",
                       "include_stop_str_in_output", "skip_special_tokens", "cache_salt"})


def _beam_search(body: Body, params: SamplingParams, chat: bool,
                 structured_param: str | None, refused: dict[str, Any]) -> float | None:
    """vLLM's `use_beam_search` and its `length_penalty` (None: no beam search; else the
    penalty); a 400 naming `length_penalty` without beam search, a width (`n`) past
    `beam.MAX_WIDTH`, or any field the search cannot honour: it ranks beams by the model's
    own log-probabilities, so samplers, penalties, biases, stop strings, structured
    outputs and log-probabilities of its own have no place in it, nor the request's
    other fields in `refused` (parsed) that are set."""
    on = _bool(body, "use_beam_search", False)
    penalty = _number(body, "length_penalty", 1.0)
    if not on:
        if penalty != 1.0:
            raise bad_request(f"length_penalty needs beam search (use_beam_search: true), "
                              f"got {penalty}", "length_penalty")
        return None
    from server.beam import MAX_WIDTH

    if params.n > MAX_WIDTH:
        raise bad_request(f"n: beam search takes at most {MAX_WIDTH} beams, got {params.n}",
                          "n")
    temperature = body.get("temperature")
    if temperature is not None and temperature not in (0, 1):
        raise bad_request("temperature: beam search ranks the model's own log-probabilities, "
                          f"which temperature does not change (got {shown(temperature)})",
                          "temperature")
    taken = [name for name, value in refused.items() if value]
    default = SamplingParams()
    taken += [f.name for f in dataclasses.fields(SamplingParams)
              if f.name not in BEAM_FREE and getattr(params, f.name) != getattr(default, f.name)]
    if taken:
        name = {"logprobs": "top_logprobs" if chat else "logprobs",
                "structured": structured_param}.get(taken[0], taken[0])
        raise bad_request(f"{name}: beam search does not take it here (use_beam_search "
                          f"takes n, max_tokens, length_penalty and ignore_eos)", name)
    return penalty


def _chat_logprobs(body: Body) -> int | None:
    """Chat's `logprobs` (true/false) and `top_logprobs` as the engine's count."""
    wanted = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None)
    if top is not None and not wanted:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be >= 0 and <= {MAX_LOGPROBS}, got {top}",
                          "top_logprobs")
    return (top or 0) if wanted else None


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's {"token id": bias} (keys are strings in JSON) as {id: bias}."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"logit_bias must be an object of token id -> bias, got "
                          f"{shown(value)}", "logit_bias")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"logit_bias: {shown(key)} is not a token id",
                              "logit_bias") from None
        if not isinstance(bias, int | float) or isinstance(bias, bool):
            raise bad_request(f"logit_bias: the bias of token {token} must be a number, got "
                              f"{shown(bias)}", "logit_bias")
        out[token] = _float(bias, f"logit_bias[{token}]", "logit_bias")
    return out


def check_unicode(text: str, param: str) -> str:
    """`text` if it is valid Unicode; else a 400: JSON's \\ud800 escapes decode to lone
    surrogates, which no tokenizer or UTF-8 encoder takes."""
    if _SURROGATE.search(text):
        raise bad_request(f"{param}: the text holds a lone surrogate (not valid Unicode)",
                          param)
    return text


def _completion_prompts(prompt: Any) -> tuple[Prompt, ...]:
    """Text, token ids, or a list of either (each its own request)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(f"prompt: at most {MAX_PROMPTS} prompts in one request, got "
                              f"{len(prompt)}", "prompt")
        return tuple(_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt))
    return (_one_prompt(prompt, "prompt"),)


def _one_prompt(prompt: Any, name: str) -> Prompt:
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise bad_request(f"{name} must not be empty", "prompt")
        return check_unicode(prompt, "prompt")
    if isinstance(prompt, list):
        if not prompt:
            raise bad_request(f"{name} must not be empty", "prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
    raise bad_request(f"{name} must be a string or a list of token ids "
                      "(or prompt a list of those)", "prompt")


def parse_messages(messages: Any, tool_parser: ToolParser | None = None
                   ) -> list[dict[str, str]]:
    """Chat messages as {"role", "content"} with text content (text parts are joined, an
    assistant's earlier `tool_calls` added as text, in `tool_parser`'s format where there
    is one); a 400 naming `messages` otherwise."""
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
        content = _content(m.get("content"), i)
        if m.get("tool_calls"):  # an earlier call, shown as text to any template
            if not isinstance(m["tool_calls"], list):
                raise bad_request(f"messages[{i}].tool_calls must be a list of tool calls, "
                                  f"got {shown(m['tool_calls'])}", "messages")
            content = "\n".join(t for t in (content, tools.history(m, tool_parser)) if t)
        out.append({"role": check_unicode(m["role"], "messages"),
                    "content": check_unicode(content, "messages")})
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
    return _float(value, name, name)


def _float(value: int | float, name: str, param: str) -> float:
    """`value` as a float; a JSON integer past a float's range (1e309 written out) is a
    400 naming the field, not an `OverflowError`."""
    try:
        return float(value)
    except OverflowError:
        raise bad_request(f"{name} is out of range, got an integer of {len(str(value))} "
                          f"digits", param) from None


def flag(body: Body, name: str, default: bool) -> bool:
    """A true/false field of `body` (`default` when absent); a 400 naming it otherwise."""
    return _bool(body, name, default)


def token_ids(body: Body, name: str, vocab_size: int) -> list[int]:
    """A required list of token ids in [0, vocab_size); a 400 naming `name` otherwise."""
    if body.get(name) is None:
        raise bad_request(f"{name} is required", name)
    ids = _int_list(body, name)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"{name}: token id {bad} is out of range (vocabulary of "
                          f"{vocab_size})", name)
    return ids


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
    return [check_unicode(s, "stop") for s in stop]


def _words(words: Any) -> list[str]:
    """vLLM's `bad_words`: a list of words (each with a character that is not a space)."""
    if words is None:
        return []
    if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
        raise bad_request(f"bad_words must be a list of words, got {shown(words)}",
                          "bad_words")
    return [check_unicode(w, "bad_words") for w in words]


def bad_words_token_ids(words: tuple[str, ...], tokenizer: Any) -> list[list[int]]:
    """Each bad word's tokens as vLLM bars them: the word alone and after a space (a
    word inside a sentence is usually another token), each without special tokens."""
    out: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if ids and ids not in out:
                out.append(ids)
    return out


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

    def choice(self, text: str | None, finish_reason: str, *, index: int = 0,
               logprobs: dict[str, Any] | None = None,
               token_ids: Sequence[int] | None = None,
               prompt_token_ids: Sequence[int] | None = None,
               tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """One choice of a whole response (a chat's: its text, None beside `tool_calls`
        with no text before them); vLLM's `return_token_ids` adds its `token_ids` and,
        on completions, its prompt's (a chat's are at the top level: `whole_of`)."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text} | (
                {} if tool_calls is None else {"tool_calls": tool_calls})
        else:
            choice["text"] = text or ""
        return choice | {"logprobs": logprobs, "finish_reason": finish_reason} | _ids(
            token_ids, None if self.chat else prompt_token_ids)

    def whole(self, text: str, finish_reason: str, usage: dict[str, Any], *,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """The non-streaming response of one choice."""
        return self.whole_of([self.choice(text, finish_reason, logprobs=logprobs)], usage)

    def whole_of(self, choices: list[dict[str, Any]], usage: dict[str, Any],
                 **extra: Any) -> dict[str, Any]:
        """The non-streaming response of these choices (`extra`: vLLM's top-level
        fields, such as a chat's `prompt_logprobs`)."""
        return self._head(False) | {"choices": choices, "usage": usage} | extra

    def chunk(self, text: str | None, finish_reason: str | None = None,
              role: bool = False, *, index: int = 0,
              logprobs: dict[str, Any] | None = None,
              usage: dict[str, Any] | None = None,
              token_ids: Sequence[int] | None = None,
              prompt_token_ids: Sequence[int] | None = None,
              tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """One stream chunk of choice `index`: new text (None: none, e.g. the closing
        chunk), the finish reason on the last one, the assistant role on a chat's first
        one, the log-probabilities of the tokens it carries, (vLLM's continuous usage
        stats) the usage so far, and (vLLM's `return_token_ids`) the ids of the tokens it
        carries and, on the first, the prompt's: a chat's at the top level, as vLLM's.
        A chat's `tool_calls` deltas go beside its text."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice |= {"logprobs": logprobs, "finish_reason": finish_reason}
        choice |= _ids(token_ids, None if self.chat else prompt_token_ids)
        top = _ids(None, prompt_token_ids) if self.chat else {}
        return self._head(True) | {"choices": [choice]} | (
            {"usage": usage} if usage is not None else {}) | top

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The closing chunk `stream_options.include_usage` asks for: usage, no choices."""
        return self._head(True) | {"choices": [], "usage": usage}


def _ids(token_ids: Sequence[int] | None,
         prompt_token_ids: Sequence[int] | None) -> dict[str, list[int]]:
    """vLLM's `token_ids` and `prompt_token_ids` fields, those given."""
    out = {}
    if prompt_token_ids is not None:
        out["prompt_token_ids"] = list(prompt_token_ids)
    if token_ids is not None:
        out["token_ids"] = list(token_ids)
    return out


# ---- log-probabilities ------------------------------------------------------------------
LOGPROB_FLOOR = -9999.0  # vLLM's stand-in for -inf, which JSON cannot carry


def _finite(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprob | None],
                        token_text: Callable[[int], str], offset: int = 0) -> dict[str, Any]:
    """OpenAI's legacy completions `logprobs` for these tokens: `tokens`,
    `token_logprobs`, `top_logprobs` (the token itself and the top k, by text) and
    `text_offset` (where each token's text begins, from `offset`); an entry of None (a
    prompt's first token) has null log-probabilities, as lm-evaluation-harness reads it."""
    tokens, values, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries, strict=True):
        text = token_text(token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(_finite(entry.logprob))
        top = {token_text(t): _finite(lp) for t, lp in entry.top}
        top.setdefault(text, _finite(entry.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(entries: Sequence[TokenLogprob],
                  token_text: Callable[[int], str]) -> dict[str, Any]:
    """OpenAI's chat `logprobs`: `content`, one object per token with its text, bytes,
    log-probability and the top k."""
    def item(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    return {"content": [item(e.token_id, e.logprob)
                        | {"top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def prompt_logprobs(entries: Sequence[TokenLogprob | None],
                    token_text: Callable[[int], str]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} for the token itself and the top k."""
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        ranked = {t: (lp, r) for r, (t, lp) in enumerate(e.top, start=1)}
        ranked.setdefault(e.token_id, (e.logprob, e.rank))
        out.append({str(t): {"logprob": _finite(lp), "rank": r, "decoded_token": token_text(t)}
                    for t, (lp, r) in ranked.items()})
    return out


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
