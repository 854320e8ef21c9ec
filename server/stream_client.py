"""One HTTP streaming client for OpenAI-compatible servers, shared by the remote serving
side (`server.remote.RemoteSide`: a race's or a sweep's remote side) and the load
generator (`measure.bench.serve`, `batchlens bench serve`), so both send the same bodies,
read the same events, measure the same way and fail with the same messages:

    body = request_body(model, "chat", prompt, params)   # stream + include_usage
    rec = StreamRecord()
    await stream(client, url, body, rec, on_text=...)    # StreamError: what went wrong
    rec.chunk_times, rec.text, rec.output_tokens, rec.usage

Measuring as `vllm bench serve` does: the time of each network read is taken once
(`time.monotonic()`) and given to every event it carried; an event whose choices bring
text is a content chunk, stamped in `chunk_times`. Tokens are the `usage.completion_tokens`
of the stream's usage chunk (asked with `stream_options.include_usage`), else, for servers
that send no usage in streams (llama.cpp's), one per content chunk; never fewer than the
chunks seen.

The events are split from the raw bytes here (`SSEDecoder`), not with httpx's line
iterator: one pass per network read instead of an async step per line, which keeps the
client's share of a small machine's CPU low while it streams many requests at once.

Errors are `StreamError`s whose message says what went wrong in a few words ("timeout:
nothing received for 5 s", "malformed stream: an event is not JSON: ...", "401
unauthorized: ..."); the caller prefixes the endpoint's name. `http_failure` and
`transport_failure` phrase the same for any other request to the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from engine.config import SamplingParams

if TYPE_CHECKING:
    from engine.models.loaded import Prompt

APIS = {"chat": "chat/completions", "completions": "completions"}  # paths under /v1
DRAIN_S = 1.0  # after [DONE], how long the rest of the response may take (keeps the
               # connection reusable; the request has finished already)
MAX_MESSAGE_CHARS = 300


class StreamError(Exception):
    """A request failed; the message says how, without naming the endpoint."""


# ---- the request body ------------------------------------------------------------------
def request_body(model: str, api: str, prompt: Prompt, params: SamplingParams) -> dict[str, Any]:
    """The streaming request body for one prompt (`ValueError` naming the field when this
    API cannot take the prompt, or `n` or log-probabilities are asked: one stream is read
    per request, for its text only). Every sampling field that is set goes out, none is
    dropped; vLLM's extensions (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
    `min_tokens`, `stop_token_ids`) only when set, since strict servers refuse unknown
    fields."""
    if api not in APIS:
        raise ValueError(f"api must be one of {tuple(APIS)}, got {api!r}")
    p = params
    if p.n != 1:  # one stream per request: its choices would be mixed in one text
        raise ValueError(f"n: a remote endpoint is sent one candidate per request, "
                         f"got n={p.n} (allowed: 1)")
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(p, name) is not None:
            raise ValueError(f"{name}: a remote endpoint's streams are read for their text "
                             f"only, not for log-probabilities")
    body: dict[str, Any] = {"model": model, "stream": True,
                            "stream_options": {"include_usage": True}}
    if api == "chat":
        body["messages"] = _messages(prompt)
    else:
        body["prompt"] = _completion_prompt(prompt)
    body |= {"max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p}
    if p.seed is not None:
        body["seed"] = p.seed
    if p.stop:
        body["stop"] = list(p.stop)
    extras = {"top_k": p.top_k, "ignore_eos": p.ignore_eos, "min_tokens": p.min_tokens,
              "stop_token_ids": list(p.stop_token_ids), "min_p": p.min_p,
              "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
              "logit_bias": {str(t): b for t, b in p.logit_bias.items()}}
    if p.repetition_penalty != 1.0:
        extras["repetition_penalty"] = p.repetition_penalty
    return body | {k: v for k, v in extras.items() if v}


def _messages(prompt: Prompt) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("prompt must not be empty")
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list | tuple) and prompt and all(isinstance(m, dict) for m in prompt):
        return [dict(m) for m in prompt]
    raise ValueError("prompt: the chat API takes text or chat messages "
                     "(token ids need api='completions')")


def _completion_prompt(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("prompt must not be empty")
        return prompt
    if isinstance(prompt, list | tuple) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise ValueError("prompt: the completions API takes text or token ids "
                     "(chat messages need api='chat')")


# ---- one streamed request ------------------------------------------------------------------
@dataclass
class StreamRecord:
    """What one stream brought, filled in as it arrives (so a stream that failed or was
    cancelled keeps what came before): each content chunk's arrival time and text, the
    usage chunk, the last finish reason."""

    chunk_times: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def output_tokens(self) -> int:
        """The server's count from usage, never fewer than the content chunks."""
        return max(_count((self.usage or {}).get("completion_tokens")), len(self.chunk_times))

    @property
    def prompt_tokens(self) -> int:
        """The server's prompt count from usage (0: not sent)."""
        return _count((self.usage or {}).get("prompt_tokens"))

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the server found in its prefix cache (0: not sent)."""
        details = (self.usage or {}).get("prompt_tokens_details")
        return _count(details.get("cached_tokens")) if isinstance(details, dict) else 0

    def token_times(self) -> list[float]:
        """One time per output token: the chunks' times, the last one standing for the
        tokens that came without a chunk of their own (so TTFT, E2E and TPOT are exact)."""
        times = list(self.chunk_times)
        return times + times[-1:] * (self.output_tokens - len(times))


async def stream(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                 record: StreamRecord, *, on_text: Callable[[str, float], None] | None = None,
                 on_done: Callable[[], None] | None = None, timeout: float,
                 keyed: bool = False, where: str = "its url") -> None:
    """POST `body` to `url` (absolute, or relative to the client's base URL) and read its
    event stream into `record`; `on_text(text, arrival time)` for each content chunk,
    `on_done()` at `[DONE]` (before the rest of the response is drained, so the request
    counts as finished then). Returns after `[DONE]` (the rest drained, so the connection
    is reused) or at a stream's end after a finish reason. `StreamError` for an HTTP error answer,
    a transport failure (`timeout`: the seconds the client waits for a read), a
    malformed stream or an error event; `keyed` and `where` (how a 404 calls the
    server's URL) phrase an HTTP error. Cancelling the calling task closes the stream."""
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                raise StreamError(http_failure(
                    resp.status_code, await resp.aread(), f"POST {resp.request.url.path}",
                    model=body.get("model"), keyed=keyed, where=where))
            ctype = resp.headers.get("content-type", "")
            if not ctype.startswith("text/event-stream"):
                raise StreamError(f"malformed stream: expected text/event-stream, got "
                                  f"{ctype or 'no content type'}")
            decoder = SSEDecoder()
            chunks = resp.aiter_bytes()
            async for raw in chunks:
                now = time.monotonic()
                for event, data in decoder.feed(raw):
                    if _take(record, event, data, now, on_text):  # [DONE]
                        if on_done is not None:
                            on_done()
                        with contextlib.suppress(Exception):  # keep the connection reusable
                            await asyncio.wait_for(_drain(chunks), DRAIN_S)
                        return
            for event, data in decoder.close():
                if _take(record, event, data, time.monotonic(), on_text):
                    if on_done is not None:
                        on_done()
                    return
    except httpx.HTTPError as exc:
        raise StreamError(transport_failure(exc, timeout)) from None
    if record.finish_reason is None:
        raise StreamError("malformed stream: it ended before a finish_reason or [DONE]")


def _take(record: StreamRecord, event: str, data: str, now: float,
          on_text: Callable[[str, float], None] | None) -> bool:
    """Take one server-sent event into `record`; True at `[DONE]`."""
    if data.strip() == "[DONE]":
        return True
    try:
        chunk = json.loads(data)
    except ValueError:
        raise StreamError(f"malformed stream: an event is not JSON: {clip(data)!r}") from None
    if not isinstance(chunk, dict):
        raise StreamError(f"malformed stream: an event is not a JSON object: {clip(data)!r}")
    if event == "error" or chunk.get("error"):
        raise StreamError(f"error from the server mid-stream: {message_of(chunk)}")
    if isinstance(chunk.get("usage"), dict):
        record.usage = chunk["usage"]
    choices = chunk.get("choices") or []
    if not isinstance(choices, list):
        raise StreamError(f"malformed stream: `choices` is not a list: {clip(data)!r}")
    text = []
    for choice in choices:
        if not isinstance(choice, dict):
            raise StreamError(f"malformed stream: a choice is not an object: {clip(data)!r}")
        text.append(_choice_text(choice))
        record.finish_reason = choice.get("finish_reason") or record.finish_reason
    delta = "".join(text)
    if delta:
        record.chunk_times.append(now)
        record.texts.append(delta)
        if on_text is not None:
            on_text(delta, now)
    return False


def _choice_text(choice: dict[str, Any]) -> str:
    """A choice's new text: completions' `text`, chat's `delta.content` (and a reasoning
    model's `delta.reasoning_content`)."""
    parts = [choice.get("text")]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        parts += [delta.get("reasoning_content"), delta.get("content")]
    return "".join(p for p in parts if isinstance(p, str))


async def _drain(chunks: Any) -> None:
    async for _ in chunks:
        pass


class SSEDecoder:
    """Server-sent events from raw bytes as they come: `feed(bytes)` gives the (event
    type, data) of every event completed so far, `close()` the one left at the end.
    Lines end in LF, CRLF or CR; comments, `id:`, `retry:` and lines without a field name
    are skipped, as the SSE specification says."""

    def __init__(self) -> None:
        self._buffer = b""
        self._event, self._data = "message", []

    def feed(self, raw: bytes) -> list[tuple[str, str]]:
        buf = self._buffer + raw
        if b"\r" in buf:
            if buf.endswith(b"\r"):  # perhaps half of a CRLF: wait for the next read
                buf, keep = buf[:-1], b"\r"
            else:
                keep = b""
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + keep
        *lines, self._buffer = buf.split(b"\n")
        return self._lines(lines)

    def close(self) -> list[tuple[str, str]]:
        rest, self._buffer = self._buffer.rstrip(b"\r"), b""
        return self._lines([rest, b""] if rest else [b""])

    def _lines(self, lines: list[bytes]) -> list[tuple[str, str]]:
        out = []
        for raw in lines:
            if not raw:
                if self._data:
                    out.append((self._event, "\n".join(self._data)))
                self._event, self._data = "message", []
                continue
            name, _, value = raw.decode("utf-8", "replace").partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                self._data.append(value)
            elif name == "event":
                self._event = value
        return out


# ---- messages ---------------------------------------------------------------------------
def http_failure(status: int, body: bytes, what: str, *, model: str | None = None,
                 keyed: bool = False, where: str = "its url") -> str:
    """What an HTTP error answer to `what` ("POST /v1/completions") means, with the
    server's own message; `keyed`: an API key was sent; `where`: how a 404 calls the
    server's URL."""
    detail = server_message(body)
    if status in (401, 403):
        hint = "the API key was refused" if keyed else "an API key is needed"
        return f"{status} unauthorized: {hint} ({detail})"
    if status == 404 and model is not None and _about_model(body):
        return f"404 model {model!r} not found ({detail})"
    if status == 404:
        return (f"404 not found: {what} (is {where} the /v1 base of an OpenAI-compatible "
                f"server?) ({detail})")
    return f"HTTP {status} on {what}: {detail}"


def transport_failure(exc: httpx.HTTPError, timeout: float) -> str:
    """What a transport error means, in a few words."""
    if isinstance(exc, httpx.ConnectTimeout):
        return f"timeout: no connection within {timeout:g} s"
    if isinstance(exc, httpx.ReadTimeout):
        return f"timeout: nothing received for {timeout:g} s"
    if isinstance(exc, httpx.TimeoutException):
        return f"timeout: {type(exc).__name__} after {timeout:g} s"
    if isinstance(exc, httpx.ConnectError):
        causes = list(_causes(exc))
        if any(isinstance(c, ConnectionRefusedError) for c in causes):
            return "unreachable (connection refused)"
        if any(isinstance(c, socket.gaierror) for c in causes):
            return "unreachable (host name not found)"
        return f"unreachable ({clip(str(causes[-1])) or type(exc).__name__})"
    if isinstance(exc, httpx.RemoteProtocolError):
        return f"the connection broke mid-answer ({clip(str(exc))})"
    if isinstance(exc, httpx.ReadError | httpx.WriteError):
        cause = next((c for c in _causes(exc) if isinstance(c, OSError)), None)
        why = clip(str(exc)) or (type(cause).__name__ if cause else "closed by the server")
        return f"the connection broke mid-answer ({why})"
    return f"{type(exc).__name__}: {clip(str(exc))}"


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """An exception and the ones it was raised from (anyio's "All connection attempts
    failed" hides the `ConnectionRefusedError` there)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _parse(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def message_of(obj: Any) -> str:
    """The message of an error object in any server's shape: OpenAI's and llama.cpp's
    {"error": {"message"}}, Ollama's {"error": "..."}, vLLM's older {"message"}."""
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("detail")
            return clip(str(msg)) if msg else clip(json.dumps(err))
        if err:
            return clip(str(err))
    return clip(json.dumps(obj))


def server_message(body: bytes) -> str:
    """The message in an error answer's body (JSON in any server's shape, else text)."""
    obj = _parse(body)
    if obj is None:
        return clip(body.decode("utf-8", "replace")) or "no message"
    return message_of(obj)


def _about_model(body: bytes) -> bool:
    """Whether a 404's body blames the model (OpenAI's code, vLLM's message, Ollama's)."""
    obj = _parse(body)
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return (err.get("code") == "model_not_found" or err.get("param") == "model"
                or "model" in str(err.get("message", "")).lower())
    return "model" in str(err).lower()


def clip(text: str) -> str:
    """`text` on one line, at most `MAX_MESSAGE_CHARS` characters."""
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "..."


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


__all__ = ["APIS", "SSEDecoder", "StreamError", "StreamRecord", "http_failure",
           "message_of", "request_body", "server_message", "stream", "transport_failure"]
