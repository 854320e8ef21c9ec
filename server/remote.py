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

Measuring, as `vllm bench serve` does, and with its code: every request is built, sent,
read and measured by `server.stream_client`, the one streaming client that `batchlens
bench serve` (`measure.bench.serve`) uses too, so a remote side in a race or a sweep and
the load generator measure alike. Every request streams (`stream: true`,
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
None: not exported by this server. When it is exported, /metrics is also read every
`STATE_POLL_S` while requests are out, and `server_history()` keeps the readings with
their times (the page charts them over time).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from engine.config import SamplingParams
from engine.metrics import RequestMetrics
from engine.outputs import RequestHandle, RequestOutput
from engine.serving import ALL_STEPS, GIL_SWITCH_INTERVAL_S, ServingBase, ServingStats
from server.connections import async_client
from server.remote_metrics import ServerState, StateSample, metrics_url, state_from_response
from server.stream_client import (
    APIS,
    StreamError,
    StreamRecord,
    clip,
    http_failure,
    request_body,
    stream,
    transport_failure,
)

if TYPE_CHECKING:
    from engine.models.loaded import Prompt

log = logging.getLogger(__name__)

ROLES = ("datacenter", "local")
PLACEHOLDER_TOKEN = -1  # the id of every token in a remote output (ids are not sent)
STATE_POLL_S = 0.5  # /metrics is fetched at most this often
METRICS_TIMEOUT_S = 5.0
HISTORY_LEN = 1200  # /metrics readings kept for the chart: 10 minutes at STATE_POLL_S
SHUTDOWN_S = 10.0
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
    record: StreamRecord  # its chunk_times are the metrics' own list
    task: asyncio.Task | None = None
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
        self._history: collections.deque[StateSample] = collections.deque(maxlen=HISTORY_LEN)
        self._watching = False  # a task reads /metrics while requests are out
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

    def server_history(self) -> list[StateSample]:
        """The readings of /metrics so far, oldest first (at most `HISTORY_LEN`): one when
        requests are sent, then every `STATE_POLL_S` while any is out, and one after the
        last ends, besides those `server_state()` fetched. Empty when the server exports
        none of the known names."""
        with self._lock:
            return list(self._history)

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
        naming the field when this API cannot take the prompt, when `max_tokens` alone
        exceeds the context `/v1/models` reported, or when `n` is not 1 or log-probabilities
        are asked (`server.stream_client.request_body`)."""
        self._checked_body(prompt, params)

    def _checked_body(self, prompt: Prompt, params: SamplingParams) -> dict[str, Any]:
        body = self.body(prompt, params)
        if self.max_model_len is not None and params.max_tokens >= self.max_model_len:
            raise ValueError(f"max_tokens: {params.max_tokens} does not fit the remote model "
                             f"context of {self.max_model_len} tokens (with its prompt)")
        return body

    def body(self, prompt: Prompt, params: SamplingParams) -> dict[str, Any]:
        """The streaming request body for one prompt, as the load generator builds it
        (`server.stream_client.request_body`; `ValueError` naming `prompt` when this API
        cannot take it)."""
        return request_body(self.model, self.api, prompt, params)

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
                metrics = RemoteMetrics(arrival_time=now)
                call = _Call(rid, body, RequestHandle(rid, [], self.cancel), metrics,
                             StreamRecord(chunk_times=metrics.chunk_times))
                self._calls[rid] = call
                (self._waiting if self.role == "local" else self._running)[rid] = None
                calls.append(call)
            # under the lock, so the loop sees submissions in the order they registered
            self._loop.call_soon_threadsafe(self._launch, calls)
        return [c.handle for c in calls]

    # ---- the loop thread -------------------------------------------------------------
    async def _setup(self, model: str | None) -> None:
        self._client = async_client(base_url=self.base_url + "/", headers=self._headers,
                                    timeout=self.timeout,
                                    max_keepalive_connections=MAX_KEEPALIVE)
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
            raise self._error(transport_failure(exc, self.timeout)) from None
        if resp.status_code == 404 and model:  # no model list here: trust the caller
            return
        if resp.status_code != 200:
            raise self._error(http_failure(resp.status_code, resp.content,
                                           f"GET {self._route('models')}",
                                           keyed=bool(self._headers),
                                           where="its url" if self.name else self.url))
        try:
            listed = {m["id"]: m for m in resp.json()["data"]}
            assert all(isinstance(i, str) for i in listed)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise self._error(f"malformed answer to GET {self._route('models')} (not an OpenAI model list): "
                              f"{clip(resp.text)!r}") from None
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
        if self._state is not None and not self._watching:
            self._watching = True
            self._spawn(self._watch_state())
        for call in calls:
            if call.done:  # cancelled before it reached the loop
                continue
            if self._fifo is not None:
                self._fifo.put_nowait(call)
            else:
                self._start(call)

    def _start(self, call: _Call) -> None:
        # kept in the background set until done: a stream still draining after its
        # [DONE] has left `_calls`, and shutdown must cancel it too
        call.task = self._spawn(self._serve(call))
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
            # the load generator's own request function (`batchlens bench serve`)
            await stream(self._client, self._path, call.body, call.record,
                         on_text=lambda text, now: self._on_text(call, text, now),
                         on_done=lambda: self._finish(call, _reason(call.record)),
                         timeout=self.timeout, keyed=bool(self._headers),
                         where="its url" if self.name else self.url)
            reason = _reason(call.record)
        except asyncio.CancelledError:
            reason = "cancelled"
        except StreamError as exc:
            error = str(self._error(str(exc)))
        except Exception as exc:  # a bug here must fail this request only
            log.exception("%s: request %s failed", self._where, call.request_id)
            error = str(self._error(f"{type(exc).__name__}: {exc}"))
        self._finish(call, reason, error)

    def _on_text(self, call: _Call, text: str, now: float) -> None:
        """A content chunk arrived (its time is in `call.metrics.chunk_times` already)."""
        call.metrics.token_times.append(now)
        with self._lock:
            self._num_output_tokens += 1
        call.handle._push(text, len(call.metrics.chunk_times))

    def _finish(self, call: _Call, reason: str, error: str | None = None) -> None:
        """End a request once (later calls do nothing): count it, hand the output over."""
        now = time.monotonic()
        rec, m = call.record, call.metrics
        with self._lock:
            if call.done:
                return
            call.done = True
            rid = call.request_id
            self._calls.pop(rid, None)
            self._waiting.pop(rid, None)
            self._running.pop(rid, None)
            self._num_finished += 1
            tokens = rec.output_tokens
            self._num_output_tokens += tokens - len(m.token_times)
        m.token_times[:] = rec.token_times()
        m.finish_time = now
        prompt_ids = [PLACEHOLDER_TOKEN] * rec.prompt_tokens
        call.handle.prompt_token_ids = prompt_ids
        call.handle._finish(RequestOutput(
            rid, prompt_ids, [PLACEHOLDER_TOKEN] * tokens, rec.text, reason, m,
            error=error, num_cached_tokens=rec.cached_tokens))

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
            self._state = state = state_from_response(resp)
            if state is not None:
                with self._lock:
                    self._history.append(StateSample(time.monotonic(), state))
        except httpx.HTTPError:  # keep the last reading; the requests say what is wrong
            log.debug("%s: /metrics not read", self._where, exc_info=True)
        finally:
            with self._lock:
                self._state_busy = False
                self._state_time = time.monotonic()

    async def _watch_state(self) -> None:
        """While requests are out, read /metrics every `STATE_POLL_S` (the history a chart
        draws), and once more after the last one ends."""
        try:
            while True:
                with self._lock:
                    due = not self._state_busy
                    self._state_busy = True
                    out = bool(self._calls)
                if due:
                    await self._poll_state()
                if not out:
                    return
                await asyncio.sleep(STATE_POLL_S)
        finally:
            self._watching = False

    # ---- shutting down -------------------------------------------------------------
    async def _close(self) -> None:
        with self._lock:
            calls = list(self._calls.values())
        for call in calls:
            self._cancel_call(call)
        tasks = list(self._background)  # every stream, the state poller, the local worker
        for task in tasks:
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


# ---- pure helpers ------------------------------------------------------------------------
def _reason(record: StreamRecord) -> str:
    """A finished stream's finish reason as the engine's ("length" or "stop")."""
    return "length" if record.finish_reason == "length" else "stop"


def _shown(url: object) -> str:
    """A URL as it may be shown in an error: without user:password@."""
    text = str(url)
    scheme, sep, rest = text.partition("://")
    return scheme + sep + rest.rpartition("@")[2] if sep else text


__all__ = ["PLACEHOLDER_TOKEN", "RemoteError", "RemoteMetrics", "RemoteSide"]
