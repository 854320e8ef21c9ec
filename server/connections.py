"""The HTTP client every request to a remote server goes through: `async_client()`.

Why it is not a plain `httpx.AsyncClient`: servers close idle keep-alive connections on a
timer — llama.cpp's server and uvicorn (vLLM, SGLang, `batchlens serve`) after 5 s — and
httpx's pool kept them 5 s too, so a request that took a pooled connection at that
boundary was written onto a socket the server had just closed and failed with "Server
disconnected without sending a response". Two things prevent that here:

- the pool drops a connection after `KEEPALIVE_EXPIRY_S` idle, below those servers' 5 s;
- a request whose connection fails before any byte of the answer arrived (a connection
  reset, refused, or closed without a response) is sent once more, on a fresh connection
  of its own (`RetryTransport`). The server never answered it, so it did not run there;
  the race also hits any server whose own keep-alive timer is shorter than ours.

A request is never sent again once a byte of its answer arrived: then the server may be
generating for it, and a second copy would generate twice. The transport knows by
counting the bytes read for each request (`_ReadCounter`), not by guessing from the
error's text: a server that sends half a status line and resets is not retried.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

import httpcore
import httpx

log = logging.getLogger(__name__)

KEEPALIVE_EXPIRY_S = 2.0  # below the 5 s idle timeout of llama.cpp's server and uvicorn
# errors that may mean "the connection was dead before the server read the request"
RETRIED = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)

# bytes read on the connection since the current request began (one list per request)
_received: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "batchlens_response_bytes", default=None)


class _CountedStream(httpcore.AsyncNetworkStream):
    """A network stream that adds every read's length to the current request's count."""

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data = await self._inner.read(max_bytes, timeout)
        count = _received.get()
        if count is not None:
            count[0] += len(data)
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        return _CountedStream(await self._inner.start_tls(ssl_context, server_hostname,
                                                          timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _ReadCounter(httpcore.AsyncNetworkBackend):
    """The default network backend, with every stream counted (`_CountedStream`)."""

    def __init__(self) -> None:
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        return _CountedStream(await self._inner.connect_tcp(
            host, port, timeout=timeout, local_address=local_address,
            socket_options=socket_options))

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        return _CountedStream(await self._inner.connect_unix_socket(
            path, timeout=timeout, socket_options=socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class RetryTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over a pool whose idle connections expire after
    `keepalive_expiry`, sending a request once more on a fresh connection when its first
    try failed before any byte of the answer arrived."""

    def __init__(self, *, max_connections: int | None = None,
                 max_keepalive_connections: int | None = None,
                 keepalive_expiry: float = KEEPALIVE_EXPIRY_S) -> None:
        super().__init__()
        # the pool httpx would build, with a network backend that counts what is read
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(), max_connections=max_connections,
            max_keepalive_connections=max_keepalive_connections,
            keepalive_expiry=keepalive_expiry, network_backend=_ReadCounter())
        # one connection per request, closed after it: a retry never meets a stale one
        self._fresh = httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))
        self.num_retries = 0  # requests sent a second time

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        count = [0]
        token = _received.set(count)
        try:
            return await super().handle_async_request(request)
        except RETRIED as exc:
            if count[0]:  # the server began to answer: never send it twice
                raise
            log.info("%s %s: the connection failed before any answer (%s: %s); sending "
                     "it once more on a fresh connection", request.method, request.url.path,
                     type(exc).__name__, exc)
        finally:
            _received.reset(token)
        self.num_retries += 1
        return await self._fresh.handle_async_request(request)

    async def aclose(self) -> None:
        await super().aclose()
        await self._fresh.aclose()


def async_client(*, base_url: str = "", headers: dict[str, str] | None = None,
                 timeout: float, max_connections: int | None = None,
                 max_keepalive_connections: int | None = None) -> httpx.AsyncClient:
    """An `httpx.AsyncClient` over a `RetryTransport` (the remote side's and the load
    generator's one client code). `timeout`: seconds to connect and between two reads."""
    transport = RetryTransport(max_connections=max_connections,
                               max_keepalive_connections=max_keepalive_connections)
    return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=httpx.Timeout(timeout),
                             transport=transport)


__all__ = ["KEEPALIVE_EXPIRY_S", "RetryTransport", "async_client"]
