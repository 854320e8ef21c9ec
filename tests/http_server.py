"""A real HTTP server for tests: uvicorn on 127.0.0.1 in a thread (httpx's ASGI transport
does not stream)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import uvicorn
from polling import wait_for
from starlette.applications import Starlette


@contextlib.contextmanager
def serving(routes, middleware=()) -> Iterator[str]:
    """uvicorn on a free 127.0.0.1 port in a thread; yields the base URL; stops it after."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(Starlette(routes=routes, middleware=list(middleware)),
                            log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout=10, message="uvicorn did not start")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
