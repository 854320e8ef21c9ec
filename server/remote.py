"""A serving side on any OpenAI-compatible server reached over HTTP: `RemoteSide`.

vLLM, SGLang, TGI, llama.cpp's server, Ollama or another `batchlens serve` plays the
datacenter or the local PC behind the same `engine.serving.ServingSide` protocol as the
in-process engine and the simulated local PC, so workloads and pages drive it unchanged:

    side = RemoteSide("http://gpu-box:8000/v1", api_key=..., role="datacenter")
    handle = side.submit("Hello", SamplingParams(max_tokens=32))
    for delta in handle: ...                  # text as its chunks arrive
    side.server_state()                       # the server's own running / waiting / KV use

Roles. As the datacenter every request goes out at once and the server batches them. As
the local PC requests go one at a time in arrival order, through a FIFO with one worker,
exactly like `engine.local.LocalPC`: a queued request's wait counts in its TTFT, and a
laptop's Ollama or llama.cpp server plays "one user at a time" honestly.

Measuring, as `vllm bench serve` does. Every request streams (`stream: true`,
`stream_options.include_usage`); `time.monotonic()` is stamped on arrival of each chunk
that carries text. TTFT: submit -> first such chunk (a local-role request's time in our
FIFO included); ITL: the gaps between such chunks; E2E: submit -> the last one; TPOT:
(E2E - TTFT) / (tokens - 1). Tokens are the `usage.completion_tokens` of the stream's last
chunk, else, for servers that send no usage in streams (llama.cpp's), one per text chunk;
never fewer than the text chunks seen.

Token ids do not come over the OpenAI API. `RequestOutput.token_ids` holds one
placeholder id (`PLACEHOLDER_TOKEN`, -1, never a real id) per counted token, and
`prompt_token_ids` one per `usage.prompt_tokens`, so every caller that counts with
`len(...)` counts right, and one that would decode them fails loudly. `text` is exactly the
streamed text (chat: `delta.content`, and `delta.reasoning_content` of reasoning models;
completions: `text`). `metrics.token_times` holds one time per counted token, as the
engine's do (a token that came in a chunk with others gets that chunk's time, so TTFT,
E2E, TPOT and token throughput are exact), and `metrics.chunk_times` the chunks' own
times, whose gaps are the ITLs (`RemoteMetrics.itls`).

Why one event loop thread and `httpx.AsyncClient`, not a thread per request: a request
must be cancellable at any moment, also while the server sends nothing (queued on its
side, or prefilling a long prompt). Cancelling the request's asyncio task interrupts its
pending read at once and leaving `client.stream(...)` closes the connection, which vLLM,
SGLang and our server take as an abort that frees the request's KV blocks. A sync thread
blocked in a read can only be woken by shutting its socket from another thread, which
httpx offers no way to do. The loop also costs one thread whatever the number of streams
(a datacenter race sends hundreds at once) and keeps one connection pool (no cap on
connections: a client-side cap would queue requests here that the datacenter is meant to
batch). The loop does nothing but I/O and bookkeeping, so a chunk is stamped within a
millisecond of its bytes arriving.

Errors name the endpoint: "remote datacenter http://127.0.0.1:9/v1: unreachable
(connection refused)". At construction (`GET /v1/models`: reachability, the key, the
model) they raise `RemoteError`; afterwards each fails only its own request (finish_reason
"error", `RequestOutput.error` the message): unreachable, 401, 404 model, HTTP errors,
a timeout (`timeout`: the longest wait to connect and between two reads, not a cap on
a whole generation), a malformed stream, an error event mid-stream. The API key goes only
into the `Authorization` header: it is never logged, never in a message, `repr` or stats.

Live server state: `server_state()` is the latest reading of the server's Prometheus
/metrics (`server.remote_metrics`), fetched at construction and refreshed in the
background when `stats()` or `server_state()` is called, at most every `STATE_POLL_S`;
None: not exported by this server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from engine.config import SamplingParams
from engine.metrics import RequestMetrics
from engine.outputs import RequestHandle, RequestOutput
from engine.serving import ALL_STEPS, GIL_SWITCH_INTERVAL_S, ServingBase, ServingStats
from server.remote_metrics import ServerState, metrics_url, state_from_response

if TYPE_CHECKING:
    from engine.models.loaded import Prompt

log = logging.getLogger(__name__)

ROLES = ("datacenter", "local")
APIS = {"chat": "chat/completions", "completions": "completions"}  # paths under /v1
PLACEHOLDER_TOKEN = -1  # the id of every token in a remote output (ids are not sent)
STATE_POLL_S = 0.5  # /metrics is fetched at most this often
METRICS_TIMEOUT_S = 5.0
SHUTDOWN_S = 10.0
DRAIN_S = 1.0  # after [DONE], how long the rest of the response may take (keeps the
               # connection reusable; the request has finished already)
MAX_MESSAGE_CHARS = 300
MAX_KEEPALIVE = 64


class RemoteError(ValueError):
    """The endpoint cannot be used as configured; the message names it and says why."""


@dataclass
class RemoteMetrics(RequestMetrics):
    """`RequestMetrics` of a remote request: `token_times` one per counted token (a
    chunk's time stands for every token it carried), `chunk_times` one per text chunk."""

    chunk_times: list[float] = field(default_factory=list)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive text chunks (tokens inside one chunk have no gap of
        their own to measure)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


@dataclass(eq=False)
class _Call:
    """One request's life on this side (fields written on the loop thread)."""

    request_id: str
    body: dict[str, Any]
    handle: RequestHandle
    metrics: RemoteMetrics
    task: asyncio.Task | None = None
    text: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    done: bool = False


class RemoteSide(ServingBase):
    """Any OpenAI-compatible server as a serving side (`engine.serving.ServingSide`).

    base_url: the `/v1` base, e.g. "http://127.0.0.1:8000/v1".
    model: the model to ask for; None: the first of `GET /v1/models`.
    api_key: sent as `Authorization: Bearer ...`; never shown anywhere.
    role: "datacenter" (all requests at once) or "local" (one at a time, FIFO).
    api: "chat" (/v1/chat/completions: text or chat messages) or "completions"
        (/v1/completions: text or token ids).
    name: what messages call the endpoint besides its URL (e.g. a secrets entry's name).
    timeout: seconds to wait to connect, and between two reads of a stream.

    Raises `RemoteError` naming the endpoint when `/v1/models` cannot be read (unreachable,
    401, timeout, not an OpenAI answer) or does not list `model`; `ValueError` for a bad
    argument.
    """

    _id_prefix = "remote"

    def __init__(self, base_url: str, *, model: str | None = None, api_key: str | None = None,
                 role: str = "datacenter", api: str = "chat", name: str | None = None,
                 timeout: float = 120.0) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if api not in APIS:
            raise ValueError(f"api must be one of {tuple(APIS)}, got {api!r}")
        if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        parts = urlsplit(base_url.strip() if isinstance(base_url, str) else "")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must be an http(s) URL, got {_shown(base_url)!r}")
        self.base_url = base_url.strip().rstrip("/")
        # the URL without user:password@, query or fragment: safe to show
        self.url = urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2],
                               parts.path.rstrip("/"), "", ""))
        self.role, self.api, self.name, self.timeout = role, api, name, float(timeout)
        self.metrics_url = metrics_url(self.base_url)
        # a named endpoint (configured by an admin) is called by its name only: messages
        # reach visitors' pages, and its address stays on the server
        self._where = f"remote {role} {name!r}" if name else f"remote {role} {self.url}"
        self._path = APIS[api]
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model: str = model or ""
        self.max_model_len: int | None = None

        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards the bookkeeping below, read by stats()
        self._calls: dict[str, _Call] = {}  # unfinished requests by id
        self._waiting: dict[str, None] = {}  # local role: ids in our FIFO, in order
        self._running: dict[str, None] = {}  # ids whose HTTP request is out
        self._num_finished = self._num_output_tokens = 0
        self._stopped = False
        self._state: ServerState | None = None
        self._state_time = -float("inf")
        self._state_busy = False
        self._background: set[asyncio.Task] = set()
        self._fifo: asyncio.Queue[_Call] | None = None

        # stamps are taken when the loop thread holds the GIL: hand it over as often as the
        # in-process sides do (engine.serving), whatever else runs Python here
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"batchlens-remote-{role}")
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._setup(model), self._loop).result(
                timeout=2 * self.timeout + METRICS_TIMEOUT_S + 5)
        except BaseException:
            self._stopped = True
            self._stop_thread()
            raise

    def __repr__(self) -> str:
        return (f"RemoteSide({self.url!r}, model={self.model!r}, role={self.role!r}, "
                f"api={self.api!r})")

    # ---- public API ----------------------------------------------------------------
    def cancel(self, request_id: str) -> None:
        """Stop a request: a queued one never goes out; a sent one's stream is closed,
        which the server takes as an abort (its KV blocks are freed)."""
        with self._lock:
            call = self._calls.get(request_id)
            if call is None or self._stopped:
                return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            self._loop.call_soon_threadsafe(self._cancel_call, call)

    def stats(self, steps_after: float | None = ALL_STEPS) -> ServingStats:
        """Our own view: requests queued here (local role) and out at the server, finished
        ones and their tokens. `device` is the endpoint's URL; KV figures are 0 (the server
        keeps them: see `server_state()`). `steps_after` is accepted and unused. Also
        refreshes `server_state()` in the background when due."""
        self._refresh_state()
        with self._lock:
            return ServingStats(
                model=self.model, device=self.url, dtype="unknown",
                dtype_reason="chosen by the remote server (not reported over its API)",
                num_running=len(self._running), num_waiting=len(self._waiting),
                running_ids=tuple(self._running), waiting_ids=tuple(self._waiting),
                num_finished=self._num_finished, num_output_tokens=self._num_output_tokens,
                kv_bytes_per_token=0, kv_reserved_bytes=0, kv_used_bytes=0,
                max_num_running=1 if self.role == "local" else 0,
                n_ctx=self.max_model_len if self.role == "local" else None)

    def server_state(self) -> ServerState | None:
        """The server's own running / waiting requests and KV usage from its /metrics (the
        latest reading; a new one is fetched in the background when due); None when it
        exports none of the known names ("not exported by this server")."""
        self._refresh_state()
        return self._state

    def shutdown(self) -> None:
        """Cancel every request (queued ones never go out; streams are closed), close the
        connection pool and stop the loop. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        try:
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(SHUTDOWN_S)
        except Exception:
            log.warning("%s: shutdown did not finish cleanly", self._where, exc_info=True)
        self._stop_thread()

    def check(self, prompt: Prompt, params: SamplingParams) -> None:
        """None: only the server tokenizes, so a prompt is sent as it is. `ValueError`
        naming the field when this API cannot take the prompt, or when `max_tokens` alone
        exceeds the context `/v1/models` reported."""
        self._checked_body(prompt, params)

    def _checked_body(self, prompt: Prompt, params: SamplingParams) -> dict[str, Any]:
        body = self.body(prompt, params)
        if self.max_model_len is not None and params.max_tokens >= self.max_model_len:
            raise ValueError(f"max_tokens: {params.max_tokens} does not fit the remote model "
                             f"context of {self.max_model_len} tokens (with its prompt)")
        return body

    def body(self, prompt: Prompt, params: SamplingParams) -> dict[str, Any]:
        """The streaming request body for one prompt (`ValueError` naming `prompt` when
        this API cannot take it). vLLM's extensions (`top_k`, `ignore_eos`, `min_tokens`,
        `stop_token_ids`) are sent only when set, since strict servers refuse unknown
        fields."""
        p = params
        body: dict[str, Any] = {"model": self.model, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.api == "chat":
            body["messages"] = _messages(prompt)
        else:
            body["prompt"] = _completion_prompt(prompt)
        body |= {"max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p}
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop:
            body["stop"] = list(p.stop)
        extras = {"top_k": p.top_k, "ignore_eos": p.ignore_eos, "min_tokens": p.min_tokens,
                  "stop_token_ids": list(p.stop_token_ids)}
        return body | {k: v for k, v in extras.items() if v}

    # ---- submission ------------------------------------------------------------------
    def _submit_many(self, prompts: list[Prompt], params: list[SamplingParams],
                     ids: list[str | None]) -> list[RequestHandle]:
        """Build and check every body first, then register them all at one moment and hand
        them to the loop in one callback (so a local FIFO keeps their order)."""
        bodies = [self._checked_body(prompt, p)
                  for prompt, p in zip(prompts, params, strict=True)]
        calls = []
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"{self._where} is shut down")
            rids = [rid or f"{self._id_prefix}-{next(self._ids)}" for rid in ids]
            clash = [r for r in rids if r in self._calls] or \
                [r for r in set(rids) if rids.count(r) > 1]
            if clash:
                raise ValueError(f"request_id {clash[0]!r} is already in flight")
            now = time.monotonic()
            for rid, body in zip(rids, bodies, strict=True):
                call = _Call(rid, body, RequestHandle(rid, [], self.cancel),
                             RemoteMetrics(arrival_time=now))
                self._calls[rid] = call
                (self._waiting if self.role == "local" else self._running)[rid] = None
                calls.append(call)
            # under the lock, so the loop sees submissions in the order they registered
            self._loop.call_soon_threadsafe(self._launch, calls)
        return [c.handle for c in calls]

    # ---- the loop thread -------------------------------------------------------------
    async def _setup(self, model: str | None) -> None:
        self._client = httpx.AsyncClient(
            base_url=self.base_url + "/", headers=self._headers,
            timeout=httpx.Timeout(self.timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=MAX_KEEPALIVE))
        try:
            await self._check_models(model)
        except BaseException:
            await self._client.aclose()
            raise
        if self.role == "local":
            self._fifo = asyncio.Queue()
            self._spawn(self._local_worker())
        self._state_time = time.monotonic()
        self._state_busy = True
        await self._poll_state()

    async def _check_models(self, model: str | None) -> None:
        """GET /v1/models: the endpoint answers, takes the key, and serves `model` (when
        given); without `model`, the first listed is used."""
        try:
            resp = await self._client.get("models")
        except httpx.HTTPError as exc:
            raise self._error(_transport_failure(exc, self.timeout)) from None
        if resp.status_code == 404 and model:  # no model list here: trust the caller
            return
        if resp.status_code != 200:
            raise self._error(self._http_failure(resp.status_code, resp.content,
                                                 f"GET {self._route('models')}"))
        try:
            listed = {m["id"]: m for m in resp.json()["data"]}
            assert all(isinstance(i, str) for i in listed)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise self._error(f"malformed answer to GET {self._route('models')} (not an OpenAI model list): "
                              f"{_clip(resp.text)!r}") from None
        if not listed:
            raise self._error(f"GET {self._route('models')} lists no model")
        if model and model not in listed:
            raise self._error(f"404 model {model!r} not found (the server serves "
                              f"{', '.join(map(repr, listed))})")
        self.model = model or next(iter(listed))
        max_len = listed[self.model].get("max_model_len")
        if isinstance(max_len, int) and not isinstance(max_len, bool):
            self.max_model_len = max_len

    def _spawn(self, coro: Any) -> asyncio.Task:
        """A background task, kept referenced until done."""
        task = self._loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _launch(self, calls: list[_Call]) -> None:
        for call in calls:
            if call.done:  # cancelled before it reached the loop
                continue
            if self._fifo is not None:
                self._fifo.put_nowait(call)
            else:
                self._start(call)

    def _start(self, call: _Call) -> None:
        call.task = self._loop.create_task(self._serve(call))
        # a task cancelled before its first step never runs `_serve`'s own ending
        call.task.add_done_callback(lambda _t: self._finish(call, "cancelled"))

    async def _local_worker(self) -> None:
        """The local PC's one worker: the FIFO's requests one at a time, in order."""
        assert self._fifo is not None
        while True:
            call = await self._fifo.get()
            if call.done:
                continue
            self._start(call)
            assert call.task is not None
            await asyncio.wait({call.task})

    def _cancel_call(self, call: _Call) -> None:
        if call.task is not None:
            call.task.cancel()
        else:  # still queued here: it never goes out
            self._finish(call, "cancelled")

    async def _serve(self, call: _Call) -> None:
        """Stream one request and finish its handle, however it ends."""
        with self._lock:
            self._waiting.pop(call.request_id, None)
            self._running[call.request_id] = None
        call.metrics.first_scheduled_time = time.monotonic()
        reason, error = "error", None
        try:
            reason = await self._stream(call)
        except asyncio.CancelledError:
            reason = "cancelled"
        except RemoteError as exc:
            error = str(exc)
        except httpx.HTTPError as exc:
            error = str(self._error(_transport_failure(exc, self.timeout)))
        except Exception as exc:  # a bug here must fail this request only
            log.exception("%s: request %s failed", self._where, call.request_id)
            error = str(self._error(f"{type(exc).__name__}: {exc}"))
        self._finish(call, reason, error)

    async def _stream(self, call: _Call) -> str:
        """POST the request and read its event stream; the finish reason."""
        async with self._client.stream("POST", self._path, json=call.body) as resp:
            if resp.status_code != 200:
                body = await resp.aread()
                raise self._error(self._http_failure(resp.status_code, body,
                                                     f"POST {self._route(self._path)}",
                                                     call.body["model"]))
            ctype = resp.headers.get("content-type", "")
            if not ctype.startswith("text/event-stream"):
                raise self._error(f"malformed stream: expected text/event-stream, got "
                                  f"{ctype or 'no content type'}")
            events = _sse_events(resp.aiter_lines())
            async for event, data in events:
                if self._on_event(call, event, data):  # [DONE]
                    reason = _finish_reason(call.finish_reason)
                    self._finish(call, reason)
                    with contextlib.suppress(Exception):  # keep the connection reusable
                        await asyncio.wait_for(_drain(events), DRAIN_S)
                    return reason
        if call.finish_reason is None:
            raise self._error("malformed stream: it ended before a finish_reason or [DONE]")
        return _finish_reason(call.finish_reason)

    def _on_event(self, call: _Call, event: str, data: str) -> bool:
        """Take one server-sent event; True at `[DONE]`."""
        if data.strip() == "[DONE]":
            return True
        try:
            chunk = json.loads(data)
        except ValueError:
            raise self._error(f"malformed stream: an event is not JSON: {_clip(data)!r}") from None
        if not isinstance(chunk, dict):
            raise self._error(f"malformed stream: an event is not a JSON object: {_clip(data)!r}")
        if event == "error" or chunk.get("error"):
            raise self._error(f"error from the server mid-stream: {_message_of(chunk)}")
        if isinstance(chunk.get("usage"), dict):
            call.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            raise self._error(f"malformed stream: `choices` is not a list: {_clip(data)!r}")
        text = []
        for choice in choices:
            if not isinstance(choice, dict):
                raise self._error(f"malformed stream: a choice is not an object: {_clip(data)!r}")
            text.append(_choice_text(choice))
            call.finish_reason = choice.get("finish_reason") or call.finish_reason
        delta = "".join(text)
        if delta:
            now = time.monotonic()
            call.metrics.chunk_times.append(now)
            call.metrics.token_times.append(now)
            call.text.append(delta)
            with self._lock:
                self._num_output_tokens += 1
            call.handle._push(delta, len(call.metrics.chunk_times))
        return False

    def _finish(self, call: _Call, reason: str, error: str | None = None) -> None:
        """End a request once (later calls do nothing): count it, hand the output over."""
        now = time.monotonic()
        usage = call.usage or {}
        m = call.metrics
        with self._lock:
            if call.done:
                return
            call.done = True
            rid = call.request_id
            self._calls.pop(rid, None)
            self._waiting.pop(rid, None)
            self._running.pop(rid, None)
            self._num_finished += 1
            chunks = len(m.chunk_times)
            tokens = max(_count(usage.get("completion_tokens")), chunks)
            self._num_output_tokens += tokens - chunks
        if m.token_times:
            m.token_times += [m.token_times[-1]] * (tokens - chunks)
        m.finish_time = now
        details = usage.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
        prompt_ids = [PLACEHOLDER_TOKEN] * _count(usage.get("prompt_tokens"))
        call.handle.prompt_token_ids = prompt_ids
        call.handle._finish(RequestOutput(
            rid, prompt_ids, [PLACEHOLDER_TOKEN] * tokens, "".join(call.text), reason, m,
            error=error, num_cached_tokens=cached))

    # ---- server state ----------------------------------------------------------------
    def _refresh_state(self) -> None:
        """Fetch /metrics in the background when the last reading is old enough."""
        now = time.monotonic()
        with self._lock:
            if self._stopped or self._state_busy or now - self._state_time < STATE_POLL_S:
                return
            self._state_busy = True
            self._state_time = now
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(lambda: self._spawn(self._poll_state()))

    async def _poll_state(self) -> None:
        try:
            resp = await self._client.get(self.metrics_url,
                                          timeout=min(self.timeout, METRICS_TIMEOUT_S))
            self._state = state_from_response(resp)
        except httpx.HTTPError:  # keep the last reading; the requests say what is wrong
            log.debug("%s: /metrics not read", self._where, exc_info=True)
        finally:
            with self._lock:
                self._state_busy = False
                self._state_time = time.monotonic()

    # ---- shutting down -------------------------------------------------------------
    async def _close(self) -> None:
        with self._lock:
            calls = list(self._calls.values())
        for call in calls:
            self._cancel_call(call)
        tasks = [c.task for c in calls if c.task is not None] + list(self._background)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.aclose()

    def _stop_thread(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(SHUTDOWN_S)
        if not self._thread.is_alive():
            self._loop.close()

    # ---- messages --------------------------------------------------------------------
    def _route(self, path: str) -> str:
        """A path under the base URL as the server sees it ("/v1/models")."""
        return f"{urlsplit(self.url).path}/{path}"

    def _error(self, what: str) -> RemoteError:
        return RemoteError(f"{self._where}: {what}")

    def _http_failure(self, status: int, body: bytes, what: str,
                      model: str | None = None) -> str:
        """What an HTTP error answer means, with the server's own message."""
        detail = _server_message(body)
        if status in (401, 403):
            hint = "the API key was refused" if self._headers else "an API key is needed"
            return f"{status} unauthorized: {hint} ({detail})"
        if status == 404 and model is not None and _about_model(body):
            return f"404 model {model!r} not found ({detail})"
        if status == 404:
            url = "its url" if self.name else self.url
            return (f"404 not found: {what} (is {url} the /v1 base of an "
                    f"OpenAI-compatible server?) ({detail})")
        return f"HTTP {status} on {what}: {detail}"


# ---- pure helpers ------------------------------------------------------------------------
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


async def _sse_events(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, str]]:
    """(event type, data) of each server-sent event; comments, `id:`, `retry:` and lines
    without a field name are skipped, as the SSE spec says."""
    event, data = "message", []
    async for line in lines:
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
    if data:
        yield event, "\n".join(data)


async def _drain(events: AsyncIterator[tuple[str, str]]) -> None:
    async for _ in events:
        pass


def _choice_text(choice: dict[str, Any]) -> str:
    """A choice's new text: completions' `text`, chat's `delta.content` (and a reasoning
    model's `delta.reasoning_content`)."""
    parts = [choice.get("text")]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        parts += [delta.get("reasoning_content"), delta.get("content")]
    return "".join(p for p in parts if isinstance(p, str))


def _finish_reason(reason: Any) -> str:
    return "length" if reason == "length" else "stop"


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _transport_failure(exc: httpx.HTTPError, timeout: float) -> str:
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
        return f"unreachable ({_clip(str(causes[-1])) or type(exc).__name__})"
    if isinstance(exc, httpx.RemoteProtocolError):
        return f"the connection broke mid-answer ({_clip(str(exc))})"
    return f"{type(exc).__name__}: {_clip(str(exc))}"


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


def _message_of(obj: Any) -> str:
    """The message of an error object in any server's shape: OpenAI's and llama.cpp's
    {"error": {"message"}}, Ollama's {"error": "..."}, vLLM's older {"message"}."""
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("detail")
            return _clip(str(msg)) if msg else _clip(json.dumps(err))
        if err:
            return _clip(str(err))
    return _clip(json.dumps(obj))


def _server_message(body: bytes) -> str:
    obj = _parse(body)
    if obj is None:
        return _clip(body.decode("utf-8", "replace")) or "no message"
    return _message_of(obj)


def _about_model(body: bytes) -> bool:
    """Whether a 404's body blames the model (OpenAI's code, vLLM's message, Ollama's)."""
    obj = _parse(body)
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return (err.get("code") == "model_not_found" or err.get("param") == "model"
                or "model" in str(err.get("message", "")).lower())
    return "model" in str(err).lower()


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "..."


def _shown(url: object) -> str:
    """A URL as it may be shown in an error: without user:password@."""
    text = str(url)
    scheme, sep, rest = text.partition("://")
    return scheme + sep + rest.rpartition("@")[2] if sep else text


__all__ = ["PLACEHOLDER_TOKEN", "RemoteError", "RemoteMetrics", "RemoteSide"]
