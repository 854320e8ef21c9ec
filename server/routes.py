"""The OpenAI-compatible API as Starlette routes over the datacenter engine.

    GET  /v1/models             the served model, with its max_model_len
    GET  /v1/models/{model}     that model alone, as OpenAI's retrieve (404 for another)
    POST /v1/completions        text or token ids in; whole or streamed (SSE)
    POST /v1/chat/completions   messages in, the model's chat template applied
    POST /v1/responses          OpenAI's Responses API: the same chat, answered as a
                                Response (server/responses.py), whole or as its events
    POST /tokenize              text or messages -> token ids, as vLLM's server
    POST /detokenize            token ids -> text, as vLLM's server
    GET  /health                200 while the engine's loop runs, else 503 (no key needed),
                                with the engine's running / waiting requests and KV blocks
    GET  /metrics               Prometheus text, when an exporter is given (no key needed)
    GET  /version               batchlens' version, as vLLM's server answers it (no key needed)

Any other /v1 path, or a route asked with the wrong method, is an OpenAI-shaped 404 or 405
naming the request and the routes served, so a client reaching for an endpoint this server
lacks (embeddings, say) reads why.

A chat page running in a browser on another origin calls these routes only if the server
answers CORS: `cors_middleware` does, for the API's paths alone, from every origin by
default as vLLM's server does (`allowed_origins` narrows it, empty turns it off).

`api_routes` returns the routes, so the dashboard's server mounts them beside its pages on
the shared engine and `batchlens serve` serves them alone.

Waiting on the engine without blocking the event loop: the engine thread pushes each
request's text into its handle's queue, and a handle being waited on tells its event loop
(`RequestHandle.on_progress`, at most one wake-up queued per loop however many handles
move in a step). One `HandleWatcher` task per event loop then polls the handles waiting
there and wakes each coroutine with its new text. A stream costs the loop nothing between
steps, the loop wakes about once per step for all streams together, a token goes out as
soon as its step ends, and no thread pool caps how many clients stream at once.

A client that goes away is noticed while the request runs (the connection's
`http.disconnect`), streaming or not, and its request is cancelled, so its KV blocks are
freed at the engine's next step.

What a shared instance refuses, before anything reaches the engine: a body over
`MAX_BODY_BYTES` (413); a request finding `max_waiting` requests already waiting (429
"busy: N waiting", `Retry-After`); a key past its requests or tokens per minute (429,
`Retry-After`; `server.rate_limit`). Limits are per API key, or per client address where
no key is configured. Prompts are tokenized in a worker thread, so a long one does not
stall the other streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial, wraps
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.to_thread
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.config import SamplingParams
from engine.outputs import RequestHandle, RequestOutput
from server import beam, protocol, responses, tool_parsers, tools
from server.errors import APIError, bad_request, busy, error_body
from server.protocol import FINISH_REASONS, SSE_DONE, GenerationRequest, Reply, sse, sse_error
from server.rate_limit import Charge, RateLimiter

if TYPE_CHECKING:
    from engine.engine import Engine

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0  # /health answers 503 when the engine is not there by then
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_BODY_BYTES = 2 * 2**20  # far above any prompt that fits a context (413 above it)
BUSY_RETRY_AFTER_S = 2.0  # Retry-After of a "busy: N waiting" 429
ANY_METHOD = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


class MetricsExporter(Protocol):
    def render(self) -> tuple[bytes, str]: ...


def api_routes(get_engine: Callable[[], Engine], *, model_name: str,
               api_key: str | Sequence[str] | None = None, max_waiting: int = 256,
               requests_per_minute: int | None = None, tokens_per_minute: int | None = None,
               metrics: MetricsExporter | None = None, tool_parser: str | None = None,
               chat_template: str | None = None) -> list[BaseRoute]:
    """The API's routes. `get_engine` is called per request (in a worker thread: it may
    block while a shared engine is built); `model_name` is what clients send as `model`;
    with `api_key` (one key, or several), every /v1 route needs
    `Authorization: Bearer <key>`; a request finding `max_waiting` requests already waiting
    in the engine is refused with 429 "busy: N waiting"; `requests_per_minute` and
    `tokens_per_minute` (None: no limit) bound each key, or each client address where no
    key is configured; `metrics` (an object with `render() -> (body, content type)`) is
    served at /metrics; `tool_parser` (one of `tool_parsers.PARSERS`; None: tool_choice
    "auto" is a 400) finds the model's own tool calls in its answers; `chat_template`
    (Jinja text) takes the place of the model's chat template."""
    if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
        raise ValueError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    api = _API(get_engine, model_name, keys, max_waiting,
               RateLimiter(requests_per_minute, tokens_per_minute),
               None if tool_parser is None else tool_parsers.get(tool_parser), chat_template)
    routes: list[BaseRoute] = [
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/responses", api.responses, methods=["POST"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
    ]
    if metrics is not None:
        async def scrape(request: Request) -> Response:
            body, content_type = await anyio.to_thread.run_sync(metrics.render)
            return Response(body, headers={"Content-Type": content_type})

        routes.append(Route("/metrics", scrape, methods=["GET"]))
    api.served = [r for r in routes if isinstance(r, Route)]
    # last: Starlette takes a route matching path and method before it
    routes.append(Route("/v1/{path:path}", api.not_served, methods=ANY_METHOD))
    return routes


async def version(request: Request) -> Response:
    """GET /version: `{"version": ...}`, as vLLM's server answers it."""
    try:
        return JSONResponse({"version": package_version("batchlens")})
    except PackageNotFoundError:  # run from a checkout that was never installed
        return JSONResponse({"version": "unknown"})


API_PATHS = ("/v1/", "/tokenize", "/detokenize", "/health", "/metrics", "/version")


def cors_middleware(allowed_origins: Sequence[str] = ("*",)) -> list[Middleware]:
    """Middleware answering browsers' CORS requests (preflights too) on `API_PATHS` from
    `allowed_origins` ("*": any, as vLLM's default), with any method and header (an API
    key's `Authorization` included); other paths (the dashboard's) pass untouched. An
    empty list: no middleware."""
    origins = [o for o in allowed_origins if o]
    return [Middleware(_ApiCors, origins=origins)] if origins else []


class _ApiCors:
    """Starlette's CORS middleware on the API's paths only."""

    def __init__(self, app: ASGIApp, origins: list[str]) -> None:
        self.app = app
        self.cors = CORSMiddleware(app, allow_origins=origins, allow_methods=["*"],
                                   allow_headers=["*"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(API_PATHS):
            await self.cors(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def error_response(err: APIError) -> Response:
    """OpenAI's error body (ASCII JSON: a message quoting a client's broken text, such as a
    lone surrogate, still renders), with the error's headers (`Retry-After`)."""
    return Response(json.dumps(error_body(err)), status_code=err.status,
                    headers=err.headers, media_type="application/json")


def _answers_errors(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """An endpoint that answers an `APIError` (or a bug) with OpenAI's error body."""
    @wraps(handler)
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as err:
            return error_response(err)
        except Exception:
            log.exception("%s %s failed", request.method, request.url.path)
            return error_response(APIError(500, "internal server error"))
    return endpoint


class _API:
    """The endpoints, sharing the settings and one `HandleWatcher`."""

    def __init__(self, get_engine: Callable[[], Engine], model_name: str,
                 api_keys: tuple[str, ...], max_waiting: int, limits: RateLimiter,
                 tool_parser: tool_parsers.ToolParser | None, chat_template: str | None
                 ) -> None:
        self.get_engine = get_engine
        self.tool_parser = tool_parser
        self.chat_template = chat_template
        self.model_name = model_name
        self.api_keys = tuple(k.encode() for k in api_keys if k)
        self.max_waiting = max_waiting
        self.limits = limits
        self.watcher = HandleWatcher()
        self.models = _answers_errors(self._models)
        self.model = _answers_errors(self._model)
        self.not_served = _answers_errors(self._not_served)
        self.served: list[Route] = []  # the routes above, for what not_served names
        self.completions = _answers_errors(self._completions)
        self.chat_completions = _answers_errors(self._chat_completions)
        self.responses = _answers_errors(self._responses)
        self.tokenize = _answers_errors(self._tokenize)
        self.detokenize = _answers_errors(self._detokenize)

    # ---- the endpoints ---------------------------------------------------------------
    async def _models(self, request: Request) -> Response:
        self._authorize(request)
        engine = await self._engine()
        return JSONResponse(protocol.model_list(self.model_name, engine.loaded.name,
                                                engine.max_model_len))

    async def _not_served(self, request: Request) -> Response:
        """Every other /v1 path: 405 with `Allow` where the path is served with other
        methods, else 404; both name the request and the routes served."""
        self._authorize(request)
        asked = f"{request.method} {request.url.path}"
        allowed = sorted({m for r in self.served if r.methods and r.path_regex.match(
            request.url.path) for m in r.methods})
        if allowed:
            raise APIError(405, f"{asked}: this route takes {', '.join(allowed)}",
                           allow=allowed)
        listing = ", ".join(f"{'/'.join(sorted(r.methods - {'HEAD'}))} "
                            f"{re.sub(r':[a-z]+}', '}', r.path)}"
                            for r in self.served if r.methods)
        raise APIError(404, f"{asked} is not served here; this server serves {listing}",
                       code="route_not_found")

    async def _model(self, request: Request) -> Response:
        self._authorize(request)
        protocol.check_model({"model": request.path_params["model"]}, self.model_name)
        engine = await self._engine()
        return JSONResponse(protocol.model_list(self.model_name, engine.loaded.name,
                                                engine.max_model_len)["data"][0])

    async def _completions(self, request: Request) -> Response:
        key = self._authorize(request)
        req = protocol.parse_completion(await _json_body(request), self.model_name)
        return await self._generate(request, req, key)

    async def _chat_completions(self, request: Request) -> Response:
        key = self._authorize(request)
        req = protocol.parse_chat(await _json_body(request), self.model_name,
                                  tool_parser=self.tool_parser,
                                  chat_template=self.chat_template)
        return await self._generate(request, req, key)

    async def _responses(self, request: Request) -> Response:
        """OpenAI's Responses API over the chat underneath it (server/responses.py)."""
        key = self._authorize(request)
        body = await _json_body(request)
        req = responses.parse(body, self.model_name, self.chat_template, self.tool_parser)
        shape = responses.Shape.new(self.model_name, body)
        _, handles, close = await self._start(request, req, shape.id, key)
        if req.stream:
            events = responses.Events(shape, tools=req.tool_plan is not None)
            return EventStream(self._response_events(handles[0], req, events),
                               on_close=close)
        await self._wait(request, handles, close)
        out = handles[0].result()
        if out.finish_reason not in FINISH_REASONS:
            raise _failure(out)
        content, calls = _answer(req, out)
        return JSONResponse(shape.whole(content, _finish(req, out), _usage([out]), calls))

    async def _beam_search(self, request: Request, req: GenerationRequest,
                           key: str | None) -> Response:
        """vLLM's `use_beam_search`: each prompt's `n` best beams (`server.beam`), whole
        or (`stream`) in a chunk each once the search has ended; the client going away
        stops the search at the next step."""
        _log_ignored(request, req)
        engine = await self._engine()
        checked, charge = await self._checked(request, engine, req, key)
        ends = engine.loaded.eos_token_ids
        gone, found = threading.Event(), []
        failed: Exception | None = None
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(_on_disconnect, request.receive, gone.set)
                try:  # caught here: the task group would wrap it in an ExceptionGroup
                    for token_ids, p in checked:
                        found.append(await anyio.to_thread.run_sync(partial(
                            beam.search, engine.submit_many, token_ids, p.n, p.max_tokens,
                            req.length_penalty, frozenset() if p.ignore_eos else ends, gone,
                            p.cache_salt)))
                except (beam.Cancelled, beam.StepFailed, ValueError, RuntimeError) as exc:
                    failed = exc
                tasks.cancel_scope.cancel()
        finally:
            if charge is not None:
                charge.settle(sum(len(ids) + sum(len(b.token_ids) for b in beams)
                                  for (ids, _), beams in zip(checked, found, strict=False)))
        if isinstance(failed, beam.Cancelled):
            return Response(status_code=499)  # nobody is there to read it
        if isinstance(failed, beam.StepFailed):
            raise _failure(failed.out)
        if failed is not None:
            raise _refused(req, failed)
        reply, tokenizer = Reply.new(req.chat, self.model_name), engine.loaded.tokenizer
        show = req.return_token_ids
        answers = [(i * p.n + j, prompt, b, tokenizer.decode(
            list(b.token_ids), skip_special_tokens=p.skip_special_tokens))
            for i, ((prompt, p), beams) in enumerate(zip(checked, found, strict=True))
            for j, b in enumerate(beams)]
        made = sum(len(b.token_ids) for beams in found for b in beams)
        usage = protocol.usage(sum(len(ids) for ids, _ in checked), made, 0)
        if req.stream:  # as vLLM's: the search is whole before anything is sent
            return EventStream(_beam_events(reply, req, answers, usage), on_close=lambda: None)
        choices = [reply.choice(text, "stop" if b.finished else "length", index=k,
                                token_ids=b.token_ids if show else None,
                                prompt_token_ids=prompt if show else None)
                   for k, prompt, b, text in answers]
        extra = {"prompt_token_ids": checked[0][0]} if show and req.chat else {}
        return JSONResponse(reply.whole_of(choices, usage, **extra))

    async def _response_events(self, handle: RequestHandle, req: GenerationRequest,
                               events: responses.Events) -> AsyncIterator[str]:
        """A Responses stream: opened, each new text a delta (tool calls as their own
        items), closed with the response and its usage; an engine error as an `error`
        event."""
        calls = _StreamCalls(req.tool_plan)

        def said(content: str | None, deltas: list[dict[str, Any]] | None) -> list[str]:
            return (events.delta(content) if content else []) + [
                e for d in deltas or [] for e in events.call(d)]

        try:
            for event in events.opening():
                yield event
            async for _, text, _ in self._progress([handle]):
                for event in said(*calls.delta(text)):
                    yield event
            out = handle.result()
            if out.finish_reason not in FINISH_REASONS:
                yield events.error(_failure(out))
                return
            for event in said(*calls.end(out)) + events.closing(_finish(req, out),
                                                                _usage([out])):
                yield event
        except Exception:
            log.exception("stream %s failed", events.shape.id)
            yield events.error(APIError(500, "internal server error"))

    async def _tokenize(self, request: Request) -> Response:
        self._authorize(request)
        body = await _json_body(request)
        engine = await self._engine()
        ids = await anyio.to_thread.run_sync(_tokenize, engine, body, self.chat_template,
                                             self.tool_parser)
        protocol.check_model(body, self.model_name)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len,
                               "tokens": ids, "token_strs": None}
        if protocol.flag(body, "return_token_strs", False):
            out["token_strs"] = engine.loaded.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(out)

    async def _detokenize(self, request: Request) -> Response:
        self._authorize(request)
        body = await _json_body(request)
        engine = await self._engine()
        ids = protocol.token_ids(body, "tokens", engine.loaded.model.arch.vocab_size)
        protocol.check_model(body, self.model_name)
        text = await anyio.to_thread.run_sync(
            lambda: engine.loaded.tokenizer.decode(ids, skip_special_tokens=False))
        return JSONResponse({"prompt": text})

    async def health(self, request: Request) -> Response:
        try:
            with anyio.fail_after(HEALTH_TIMEOUT_S):
                engine = await anyio.to_thread.run_sync(self.get_engine,
                                                        abandon_on_cancel=True)
        except TimeoutError:
            return JSONResponse({"status": "starting"}, status_code=503)
        except Exception as exc:
            return JSONResponse({"status": f"no engine: {exc}"}, status_code=503)
        stopped = engine.stopped_reason
        if stopped is not None:
            return JSONResponse({"status": f"engine {stopped}"}, status_code=503)
        stats = engine.stats(steps_after=None)
        kv = stats.kv
        return JSONResponse({"status": "ok", "num_requests_running": stats.num_running,
                             "num_requests_waiting": stats.num_waiting,
                             "kv_blocks_used": kv.used_blocks if kv else 0,
                             "kv_blocks_total": kv.num_blocks if kv else 0})

    # ---- generation ------------------------------------------------------------------
    async def _generate(self, request: Request, req: GenerationRequest,
                        key: str | None) -> Response:
        if req.beam_search:
            return await self._beam_search(request, req, key)
        reply = Reply.new(req.chat, self.model_name)
        engine, handles, close = await self._start(request, req, reply.id, key)
        choices = [c for h in handles for c in h.candidates]  # prompt i's n, in order
        texts = TokenText(engine.loaded.tokenizer, as_ids=req.return_tokens_as_token_ids)
        if req.stream:
            return EventStream(self._events(handles, choices, req, reply, texts),
                               on_close=close)
        await self._wait(request, handles, close)
        outs = [c.result() for c in choices]
        for out in outs:
            if out.finish_reason not in FINISH_REASONS:
                raise _failure(out)
        ids = req.return_token_ids
        shaped = []
        for i, out in enumerate(outs):
            content, calls = _answer(req, out)
            shaped.append(reply.choice(
                None if content is None else _echo(req, i, texts) + content,
                _finish(req, out), index=i, logprobs=_whole_logprobs(req, out, texts),
                token_ids=out.token_ids if ids else None,
                prompt_token_ids=out.prompt_token_ids if ids else None, tool_calls=calls))
        extra: dict[str, Any] = {}
        if ids and req.chat:  # vLLM: the prompt's ids at the top level for chat
            extra["prompt_token_ids"] = list(outs[0].prompt_token_ids)
        if req.show_prompt_logprobs:
            shown = [protocol.prompt_logprobs(out.prompt_logprobs or [], texts.mark)
                     for out in outs]
            if req.chat:  # vLLM: top level for chat, per choice for completions
                extra["prompt_logprobs"] = shown[0]
            else:
                for choice, entries in zip(shaped, shown, strict=True):
                    choice["prompt_logprobs"] = entries
        usage = _usage([h.result() for h in handles])
        return JSONResponse(reply.whole_of(shaped, usage, **extra))

    async def _start(self, request: Request, req: GenerationRequest, request_id: str,
                     key: str | None
                     ) -> tuple[Engine, list[RequestHandle], Callable[[], None]]:
        """Submit `req` (`_submit`): the engine, the requests' handles, and the close that
        cancels whatever has not finished (freeing its blocks) and settles the key's
        rate-limit charge with the tokens used."""
        _log_ignored(request, req)
        engine = await self._engine()
        handles, charge = await self._submit(request, engine, req, request_id, key)

        def close() -> None:  # nothing when they finished; frees blocks when they had not
            for handle in handles:
                handle.cancel()
            if charge is not None:
                charge.settle(sum(_tokens_used(h) for h in handles))

        return engine, handles, close

    async def _wait(self, request: Request, handles: list[RequestHandle],
                    close: Callable[[], None]) -> None:
        """Wait for every request and its choices to end (the client going away cancels
        them), then `close`."""
        def cancel() -> None:
            for handle in handles:
                handle.cancel()

        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(_on_disconnect, request.receive, cancel)
                for handle in [*handles, *(c for h in handles for c in h.candidates)]:
                    await self.watcher.wait_done(handle)  # a request ends after its choices
                tasks.cancel_scope.cancel()
        finally:
            close()

    async def _submit(self, request: Request, engine: Engine, req: GenerationRequest,
                      request_id: str, key: str | None
                      ) -> tuple[list[RequestHandle], Charge | None]:
        """Check and charge the request (`_checked`), then submit every prompt (a list of
        prompts is refused whole or run whole)."""
        checked, charge = await self._checked(request, engine, req, key)
        handles: list[RequestHandle] = []
        try:
            for i, (token_ids, params) in enumerate(checked):
                rid = request_id if len(checked) == 1 else f"{request_id}-{i}"
                handles.append(engine.submit(token_ids, params, rid))
            return handles, charge
        except BaseException as exc:
            for handle in handles:
                handle.cancel()
            if charge is not None:
                charge.settle(0)
            if isinstance(exc, ValueError | RuntimeError):
                raise _refused(req, exc) from None
            raise

    async def _checked(self, request: Request, engine: Engine, req: GenerationRequest,
                       key: str | None
                       ) -> tuple[list[tuple[list[int], SamplingParams]], Charge | None]:
        """Check the queue, encode every prompt (in a worker thread), fit a default
        max_tokens, check them all and charge the key's rate limits: each prompt's token
        ids and parameters."""
        waiting = engine.stats(steps_after=None).num_waiting
        if waiting >= self.max_waiting:
            raise busy(waiting, BUSY_RETRY_AFTER_S)
        if req.bad_words:  # words become token ids here, where the tokenizer is
            barred = protocol.bad_words_token_ids(req.bad_words, engine.loaded.tokenizer)
            req = dataclasses.replace(req, params=dataclasses.replace(
                req.params, bad_words_token_ids=barred))
        checked = []
        for i, prompt in enumerate(req.prompts):
            try:
                token_ids = req.truncated(
                    await anyio.to_thread.run_sync(engine.loaded.encode, prompt,
                                                   req.template_kwargs), engine.max_model_len)
                one = protocol.fit_default_max_tokens(
                    req, len(token_ids), min(engine.max_model_len, engine.pool_tokens))
                # a request that cannot run is not charged; in a worker thread, as a
                # structured output's grammar compiles here (xgrammar loads on the first)
                await anyio.to_thread.run_sync(engine.check, token_ids, one.params)
            except ValueError as exc:
                raise req.error(str(exc), i) from None
            checked.append((token_ids, one.params))
        charge = None
        if self.limits.enabled:
            who = "this API key" if key is not None else "this client"
            ident = key if key is not None else f"client {_client_host(request)}"
            charge = self.limits.admit(
                ident, sum(len(ids) + p.n * p.max_tokens for ids, p in checked), who)
        return checked, charge

    async def _events(self, handles: list[RequestHandle], choices: list[RequestHandle],
                      req: GenerationRequest, reply: Reply, texts: TokenText
                      ) -> AsyncIterator[str]:
        """The SSE stream: each choice's text in chunks as the engine makes it (with the
        log-probabilities of its tokens when asked), its finish reason, usage when asked,
        `[DONE]`; an engine error as an `error` event. `choices` are the requests'
        candidates' handles in choice order."""
        logprobs = [_StreamLogprobs(req, h, texts) for h in choices]
        ids = [_StreamIds(req, h) for h in choices]
        calls = [_StreamCalls(req.tool_plan) for _ in choices]
        echoed = [not req.echo] * len(choices)
        prompt_tokens = sum(len(h.prompt_token_ids) for h in handles)

        def so_far() -> dict[str, int] | None:
            """vLLM's continuous usage stats: the tokens up to this chunk."""
            if not req.continuous_usage:
                return None
            made = sum(h.num_tokens for h in choices)
            return {"prompt_tokens": prompt_tokens, "completion_tokens": made,
                    "total_tokens": prompt_tokens + made}

        try:
            if reply.chat:
                yield sse(reply.chunk("", role=True, usage=so_far(),
                                      prompt_token_ids=ids[0].prompt()))
            async for i, text, done in self._progress(choices):
                if text and not echoed[i]:  # the prompt's text once its logprobs are known
                    echoed[i] = True
                    yield sse(reply.chunk(_echo(req, i, texts), index=i,
                                          logprobs=logprobs[i].prompt(), usage=so_far(),
                                          **ids[i].first()))
                content, deltas = calls[i].delta(text)
                if content or deltas:  # else held: a call's text, sent as a call later
                    yield sse(reply.chunk(content, index=i, logprobs=logprobs[i].new(),
                                          usage=so_far(), tool_calls=deltas, **ids[i].new()))
                if not done:
                    continue
                out = choices[i].result()
                if out.finish_reason not in FINISH_REASONS:
                    yield sse_error(_failure(out))
                    yield SSE_DONE
                    return
                if not echoed[i]:
                    echoed[i] = True
                    yield sse(reply.chunk(_echo(req, i, texts), index=i,
                                          logprobs=logprobs[i].prompt(), usage=so_far(),
                                          **ids[i].first()))
                content, deltas = calls[i].end(out)
                yield sse(reply.chunk(content or None, _finish(req, out), index=i,
                                      logprobs=logprobs[i].new(out), usage=so_far(),
                                      tool_calls=deltas, **ids[i].new(out)))
            if req.include_usage:
                for handle in handles:  # a request ends just after its last choice
                    await self.watcher.wait_done(handle)
                yield sse(reply.usage_chunk(_usage([h.result() for h in handles])))
        except Exception:
            log.exception("stream %s failed", reply.id)
            yield sse_error(APIError(500, "internal server error"))
        yield SSE_DONE

    async def _progress(self, handles: list[RequestHandle]
                        ) -> AsyncIterator[tuple[int, str, bool]]:
        """(choice index, new text, whether it ended) as the requests make progress; a
        single request is read directly, several through one queue."""
        if len(handles) == 1:
            done = False
            while not done:
                text, done = await self.watcher.next_text(handles[0])
                yield 0, text, done
            return
        queue: asyncio.Queue[tuple[int, str, bool]] = asyncio.Queue()

        async def pump(i: int, handle: RequestHandle) -> None:
            done = False
            while not done:
                text, done = await self.watcher.next_text(handle)
                queue.put_nowait((i, text, done))

        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
        try:
            left = len(handles)
            while left:
                item = await queue.get()
                left -= item[2]
                yield item
        finally:
            for task in tasks:
                task.cancel()

    # ---- helpers ---------------------------------------------------------------------
    def _authorize(self, request: Request) -> str | None:
        """The caller's key (None where no key is configured); 401 without a valid one."""
        if not self.api_keys:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(401, "missing API key: send the header "
                           "`Authorization: Bearer <key>`", code="invalid_api_key")
        given = token.strip().encode("utf-8", "surrogateescape")
        # compare with every key, so the time taken does not tell which one nearly matched
        found = [hmac.compare_digest(given, key) for key in self.api_keys]
        if not any(found):
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return token.strip()

    async def _engine(self) -> Engine:
        try:
            return await anyio.to_thread.run_sync(self.get_engine)
        except Exception as exc:
            raise APIError(503, f"the engine is not available: {exc}") from None


class _Waiting:
    """The requests one event loop waits on, and the wake-up the engine thread sends it:
    at most one queued at a time, however many handles move in one step."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: list[tuple[RequestHandle, asyncio.Future, bool]] = []
        self.moved = asyncio.Event()
        self._queued = False

    def wake(self) -> None:
        """Any thread: have the loop look at its handles soon."""
        if self._queued:  # a wake-up not yet run covers this push too
            return
        self._queued = True
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
            self.loop.call_soon_threadsafe(self._set)

    def _set(self) -> None:
        self._queued = False  # before set: a push from here on queues its own wake-up
        self.moved.set()


class HandleWatcher:
    """Wakes coroutines when their requests make progress: each watched handle tells its
    event loop's task (`RequestHandle.on_progress`), which polls the handles waiting there
    and stops when none is."""

    def __init__(self) -> None:
        self._waiting: dict[asyncio.AbstractEventLoop, _Waiting] = {}
        self._tasks: set[asyncio.Task] = set()

    async def next_text(self, handle: RequestHandle) -> tuple[str, bool]:
        """The text made since the last call and whether the request has ended (then the
        text is the rest); waits until there is either."""
        waiting = self._watch(handle)  # before the poll: a push after it wakes the loop
        done = handle.done  # read before polling, so nothing after it is missed
        text = handle.poll()
        if text or done:
            return text, done
        return await self._wait(waiting, handle, want_text=True)

    async def wait_done(self, handle: RequestHandle) -> None:
        """Wait until the request has ended."""
        waiting = self._watch(handle)
        if not handle.done:
            await self._wait(waiting, handle, want_text=False)

    def _watch(self, handle: RequestHandle) -> _Waiting:
        loop = asyncio.get_running_loop()
        waiting = self._waiting.get(loop)
        if waiting is None:
            waiting = self._waiting[loop] = _Waiting(loop)
        handle.on_progress(waiting.wake)
        return waiting

    def _wait(self, waiting: _Waiting, handle: RequestHandle, want_text: bool) -> asyncio.Future:
        fut = waiting.loop.create_future()
        if not waiting.items:  # no task polls for this loop now
            task = waiting.loop.create_task(self._run(waiting))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        waiting.items.append((handle, fut, want_text))
        return fut

    async def _run(self, waiting: _Waiting) -> None:
        try:
            await self._poll(waiting)
        finally:
            if self._waiting.get(waiting.loop) is waiting:
                del self._waiting[waiting.loop]

    @staticmethod
    async def _poll(waiting: _Waiting) -> None:
        while waiting.items:
            await waiting.moved.wait()
            waiting.moved.clear()  # before the polls: what is pushed after them sets it again
            still = []
            for handle, fut, want_text in waiting.items:
                if fut.done():  # its waiter was cancelled
                    continue
                done = handle.done
                text = handle.poll() if want_text else ""
                if text or done:
                    fut.set_result((text, done))
                else:
                    still.append((handle, fut, want_text))
            waiting.items[:] = still


class EventStream(StreamingResponse):
    """A `text/event-stream` response that listens for the client going away whatever
    the server's ASGI version: a disconnect (or a failed send) ends the stream, and
    `on_close` runs however it ended."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tasks:
                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-send
                        await self.stream_response(send)
                    tasks.cancel_scope.cancel()

                tasks.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tasks.cancel_scope.cancel()
        finally:
            self._on_close()


async def _beam_events(reply: Reply, req: GenerationRequest,
                       answers: list[tuple[int, list[int], beam.Beam, str]],
                       usage: dict[str, Any]) -> AsyncIterator[str]:
    """A beam search's stream: each answer's text in one chunk and its finish reason in
    the next (a chat's role first), then the usage where asked for (with
    continuous_usage_stats, on every chunk: the search is over, so it is the whole)."""
    so_far = usage if req.continuous_usage else None
    show = req.return_token_ids
    if reply.chat:
        yield sse(reply.chunk("", role=True, usage=so_far, prompt_token_ids=(
            answers[0][1] if show else None)))
    for k, prompt, b, text in answers:
        yield sse(reply.chunk(text, index=k, usage=so_far,
                              token_ids=b.token_ids if show else None,
                              prompt_token_ids=prompt if show and not reply.chat else None))
        yield sse(reply.chunk(None, "stop" if b.finished else "length", index=k,
                              usage=so_far))
    if req.include_usage:
        yield sse(reply.usage_chunk(usage))
    yield SSE_DONE


def _log_ignored(request: Request, req: GenerationRequest) -> None:
    """As vLLM's server: fields unknown here are accepted, and named where the operator
    reads."""
    if req.ignored:
        log.warning("%s: fields ignored (unknown here): %s", request.url.path,
                    ", ".join(req.ignored))


async def _on_disconnect(receive: Receive, then: Callable[[], None]) -> None:
    """Call `then` once the client disconnects (the body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    then()


def _client_host(request: Request) -> str:
    return request.client.host if request.client else "unknown"


async def _json_body(request: Request) -> dict[str, Any]:
    """The body as a JSON object: 413 past `MAX_BODY_BYTES`, 400 when it is not JSON, too
    deeply nested to parse, or not an object."""
    too_large = APIError(413, f"request body too large: at most {MAX_BODY_BYTES} bytes",
                         code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except ValueError as exc:
        raise bad_request(f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise bad_request("malformed JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _tokens_used(handle: RequestHandle) -> int:
    """Prompt and output tokens of a request (every candidate's): exact once it ended,
    else those seen so far."""
    if handle.done:
        out = handle.result()
        return len(out.prompt_token_ids) + sum(len(a.token_ids) for a in out.answers)
    return len(handle.prompt_token_ids) + sum(c.num_tokens for c in handle.candidates)


def _usage(outs: list[RequestOutput]) -> dict[str, Any]:
    """Usage of the requests' outputs: each prompt once, every candidate's tokens."""
    return protocol.usage(sum(len(o.prompt_token_ids) for o in outs),
                          sum(len(a.token_ids) for o in outs for a in o.answers),
                          sum(o.num_cached_tokens for o in outs))


def _tokenize(engine: Engine, body: dict[str, Any], chat_template: str | None = None,
              tool_parser: tool_parsers.ToolParser | None = None) -> list[int]:
    """POST /tokenize's token ids: a `prompt` as text, or `messages` through the chat
    template (the server's `chat_template`, else the model's; `add_generation_prompt`,
    default true; `continue_final_message`; `chat_template_kwargs`; earlier tool calls
    in `tool_parser`'s format), as vLLM's server tokenizes them."""
    special = protocol.flag(body, "add_special_tokens", "messages" not in body)
    tokenizer = engine.loaded.tokenizer
    if "messages" in body:
        messages = protocol.parse_messages(body["messages"], tool_parser)
        kwargs = protocol.template_kwargs(body.get("chat_template_kwargs"))
        switches = protocol.template_switches(body)
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, **{"add_generation_prompt": True, **switches},
                **kwargs, **({} if chat_template is None else {"chat_template": chat_template}))
        except Exception as exc:  # a template's own error (jinja's), or a clash
            if not (kwargs or switches):
                raise
            param = "chat_template_kwargs" if kwargs else next(reversed(switches))
            raise bad_request(f"{param}: the chat template failed with it: {exc}",
                              param) from None
        return list(tokenizer(text, add_special_tokens=special)["input_ids"])
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("prompt must be a string (or send messages)", "prompt")
    if not prompt.strip():
        raise bad_request("prompt must not be empty", "prompt")
    return list(tokenizer(protocol.check_unicode(prompt, "prompt"),
                          add_special_tokens=special)["input_ids"])


class TokenText:
    """Each token's own text (decoded once per token id), and how log-probabilities name
    it (`mark`): its text, or "token_id:N" where vLLM's `return_tokens_as_token_ids` asks
    for the id itself (a token whose text is not valid UTF-8 on its own stays exact)."""

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self.as_ids = as_ids

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self._tokenizer.decode([token],
                                                               skip_special_tokens=False)
        return text

    def mark(self, token: int) -> str:
        return f"token_id:{token}" if self.as_ids else self(token)


def _echo(req: GenerationRequest, i: int, texts: TokenText) -> str:
    """The text `echo` puts before choice `i`'s answer: its prompt as sent ("" without);
    choice i answers prompt i // n."""
    if not req.echo:
        return ""
    prompt = req.prompts[i // req.n]
    return prompt if isinstance(prompt, str) else "".join(texts(t) for t in prompt)


def _whole_logprobs(req: GenerationRequest, out: RequestOutput,
                    texts: TokenText) -> dict[str, Any] | None:
    """A whole response's `logprobs` for one choice (None: not asked)."""
    if out.logprobs is None:
        return None
    if req.chat:
        return protocol.chat_logprobs(out.logprobs, texts.mark)
    ids, entries = [e.token_id for e in out.logprobs], list(out.logprobs)
    if req.echo and out.prompt_logprobs is not None:
        ids = list(out.prompt_token_ids) + ids
        entries = list(out.prompt_logprobs) + entries
    return protocol.completion_logprobs(ids, entries, texts.mark)


def _unsent(items: Sequence[Any], sent: int, handle: RequestHandle, done: bool
            ) -> tuple[list[Any], int]:
    """A stream's per-token items not yet sent, past the first `sent`, and the new count:
    up to the handle's token count while it runs (the engine appends a token's items
    before counting the token), all of them once the choice is `done`."""
    end = len(items) if done else min(handle.num_tokens, len(items))
    return list(items[sent:end]), max(sent, end)


class _StreamLogprobs:
    """The log-probabilities a stream owes one choice: those of the tokens made since the
    last chunk (the engine appends a token's entry before counting the token)."""

    def __init__(self, req: GenerationRequest, handle: RequestHandle, texts: TokenText) -> None:
        self.req, self.handle, self.texts = req, handle, texts
        self.sent = 0
        self.offset = 0  # completions' text_offset of the next token

    def prompt(self) -> dict[str, Any] | None:
        """The echoed prompt's (completions with echo and logprobs)."""
        entries = self.handle.prompt_logprobs
        if self.req.params.logprobs is None or entries is None:
            return None
        ids = list(self.handle.prompt_token_ids)
        return self._shaped(ids, list(entries))

    def new(self, out: RequestOutput | None = None) -> dict[str, Any] | None:
        """Those of the tokens not yet sent: up to the handle's count, or all of `out`'s."""
        if self.req.params.logprobs is None:
            return None
        entries = (out.logprobs or []) if out is not None else self.handle.token_logprobs
        batch, self.sent = _unsent(entries, self.sent, self.handle, out is not None)
        return self._shaped([e.token_id for e in batch], batch)

    def _shaped(self, ids: list[int], entries: list) -> dict[str, Any]:
        if self.req.chat:
            return protocol.chat_logprobs(entries, self.texts.mark)
        shaped = protocol.completion_logprobs(ids, entries, self.texts.mark, self.offset)
        self.offset += sum(len(t) for t in shaped["tokens"])
        return shaped


def _answer(req: GenerationRequest, out: RequestOutput
            ) -> tuple[str | None, list[dict[str, Any]] | None]:
    """A choice's content and tool calls (None: none): its text, or what its tools make
    of it (`tools.ToolPlan.answer`)."""
    if req.tool_plan is None:
        return out.text, None
    return req.tool_plan.answer(out.text)


def _finish(req: GenerationRequest, out: RequestOutput) -> str:
    """The finish reason as OpenAI gives it: "tool_calls" for an answer that stopped on
    calls of the model's own ("auto") or a whole list of them ("required"); a named call,
    forced, ends "stop"."""
    plan = req.tool_plan
    if plan is None or out.finish_reason != "stop":
        return out.finish_reason
    if plan.forced and plan.name is None or not plan.forced and _answer(req, out)[1]:
        return "tool_calls"
    return out.finish_reason


class _StreamCalls:
    """A choice's answer streamed as content and OpenAI's `tool_calls` deltas: plain text
    as content; a named function's arguments as they come (its name and id first);
    "required"'s list of calls whole at the end, once its JSON has closed; "auto"'s
    content as its parser knows it, and each call whole once it has closed."""

    def __init__(self, plan: tools.ToolPlan | None) -> None:
        self.plan = plan if plan is not None and (plan.forced or plan.parser) else None
        self.opened = False
        self.text = ""  # the answer handed to `delta` so far
        self.sent = 0  # "auto": characters of its content sent
        self.called = 0  # "auto": calls sent

    def delta(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """The content and the call deltas to send for new answer text (None: none)."""
        if self.plan is None:
            return text, None
        self.text += text
        if self.plan.parser is not None:
            return self._found(self.plan, self.plan.parser, final=False)
        if self.plan.name is None or not text:
            return None, None
        return None, self._arguments(self.plan.name, text)

    def end(self, out: RequestOutput) -> tuple[str | None, list[dict[str, Any]] | None]:
        """The last content and deltas: the rest of a named call's arguments, every call
        of the list (none where max_tokens cut it), or what "auto"'s parser settles."""
        if self.plan is None:
            return None, None
        rest, self.text = out.text[len(self.text):], out.text
        if self.plan.parser is not None:
            return self._found(self.plan, self.plan.parser, final=True)
        if self.plan.name is not None:
            return None, (self._arguments(self.plan.name, rest) if rest or not self.opened
                          else None)
        return None, [{"index": j} | c for j, c in enumerate(self.plan.calls(out.text) or [])]

    def _arguments(self, name: str, text: str) -> list[dict[str, Any]]:
        """A named call's delta: its name and id first, then more of its arguments."""
        if self.opened:
            return [{"index": 0, "function": {"arguments": text}}]
        self.opened = True
        return [{"index": 0} | tools.call(name, text)]

    def _found(self, plan: tools.ToolPlan, parser: tool_parsers.ToolParser, final: bool
               ) -> tuple[str | None, list[dict[str, Any]] | None]:
        """"auto": the content and the calls its parser has found since the last chunk."""
        scan = parser.scan(self.text, final)
        content, self.sent = scan.content[self.sent:], max(self.sent, len(scan.content))
        new = plan.found(scan.calls, self.called)
        deltas = [{"index": self.called + j} | c for j, c in enumerate(new)]
        self.called += len(new)
        return content or None, deltas or None


class _StreamIds:
    """The token ids a stream owes one choice when vLLM's `return_token_ids` asks for them:
    its prompt's on its first chunk (a chat's: its first chunk's top level, once), then
    those of the tokens made since the last chunk."""

    def __init__(self, req: GenerationRequest, handle: RequestHandle) -> None:
        self.req, self.handle = req, handle
        self.sent = 0
        self.prompt_sent = not req.return_token_ids

    def prompt(self) -> list[int] | None:
        """The prompt's ids, the first time they are asked for; then None."""
        if self.prompt_sent:
            return None
        self.prompt_sent = True
        return list(self.handle.prompt_token_ids)

    def first(self) -> dict[str, Any]:
        """A completion choice's first chunk: its prompt's ids (a chat's went first)."""
        return {} if self.req.chat else {"prompt_token_ids": self.prompt()}

    def new(self, out: RequestOutput | None = None) -> dict[str, Any]:
        """The ids not yet sent (up to the handle's count, or all of `out`'s), and on a
        completion choice's first chunk its prompt's."""
        if not self.req.return_token_ids:
            return {}
        made = out.token_ids if out is not None else self.handle.token_ids
        batch, self.sent = _unsent(made, self.sent, self.handle, out is not None)
        return self.first() | {"token_ids": batch}


def _refused(req: GenerationRequest, exc: ValueError | RuntimeError) -> APIError:
    """The error for a submit the engine refused: the request's own 400 (ValueError),
    or a 503 when the engine is shut down or its loop stopped (RuntimeError)."""
    if isinstance(exc, ValueError):
        return req.error(str(exc))
    return APIError(503, f"the engine is not serving: {exc}")


def _failure(out: RequestOutput) -> APIError:
    """The error for a request the engine ended without finishing it."""
    if out.finish_reason == "cancelled":
        return APIError(503, "the request was cancelled (the engine is shutting down)")
    return APIError(500, f"the engine failed this request: {out.error}")
