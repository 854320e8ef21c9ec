"""Remote requests survive servers that close idle keep-alive connections
(`server.connections`), and are never sent twice once an answer began.

The stand-in is a raw HTTP/1.1 server on 127.0.0.1 (a socket per connection, in threads),
so it can misbehave exactly as real servers do at the keep-alive boundary: it keeps a
connection open after each answer (no `Connection: close`), then drops a request that
arrives on it — after N requests on one connection, or after the connection sat idle for
a while — by closing without a byte of answer (FIN, or RST as a kernel does when unread
data is left). That is what a client sees when its pooled connection was closed by the
server at the moment it was reused: "Server disconnected without sending a response".

Model-free and fast: every answer is a canned stream; each test sends a few requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from engine import SamplingParams
from measure.bench.serve import LoadRequest, run_load
from server.connections import KEEPALIVE_EXPIRY_S, async_client
from server.remote import RemoteSide

RESULT_S = 20.0
COMMON_SERVER_IDLE_S = 5.0  # llama.cpp's server and uvicorn close idle connections so


def _stream_body(text: str) -> bytes:
    chunks = [{"id": "c", "object": "chat.completion.chunk", "model": "stub",
               "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]},
              {"id": "c", "object": "chat.completion.chunk", "model": "stub",
               "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    events = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return events.encode()


def _answer(status: str, ctype: str, body: bytes) -> bytes:
    head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Keep-Alive: timeout=5, max=100\r\n\r\n")
    return head.encode() + body


MODELS = _answer("200 OK", "application/json",
                 json.dumps({"object": "list", "data": [{"id": "stub", "object": "model"}]})
                 .encode())
NOT_FOUND = _answer("404 Not Found", "application/json", b'{"error": {"message": "no"}}')


@dataclass
class StandIn:
    """What the stand-in does and saw. `drop_after`: requests answered per connection
    before it drops the next; `drop_idle_s`: a request arriving on a connection idle this
    long is dropped; `rst`: drop with a reset instead of a close; `break_after`: answer
    POSTs with only this many bytes of a stream, then close."""

    drop_after: int | None = None
    drop_idle_s: float | None = None
    rst: bool = False
    break_after: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    connections: int = 0
    posts: int = 0  # generation requests whose bytes reached the server
    dropped: int = 0
    port: int = 0

    def handle(self, conn: socket.socket) -> None:
        with self.lock:
            self.connections += 1
        served, last = 0, time.monotonic()
        buf = b""
        with contextlib.closing(conn):
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(buf) < length:
                    buf += conn.recv(65536)
                buf = buf[length:]
                method, path = head.split(b" ")[:2]
                idle = time.monotonic() - last
                if method == b"POST":
                    with self.lock:
                        self.posts += 1
                if ((self.drop_after is not None and served >= self.drop_after)
                        or (self.drop_idle_s is not None and served and idle >= self.drop_idle_s)):
                    with self.lock:
                        self.dropped += 1
                    if self.rst:  # SO_LINGER 0: close sends RST
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                        struct.pack("ii", 1, 0))
                    return
                if path.endswith(b"/models"):
                    conn.sendall(MODELS)
                elif method == b"POST":
                    answer = _answer("200 OK", "text/event-stream", _stream_body("hello"))
                    if self.break_after is not None:
                        conn.sendall(answer[: self.break_after])
                        return
                    conn.sendall(answer)
                else:
                    conn.sendall(NOT_FOUND)
                served += 1
                last = time.monotonic()


@contextlib.contextmanager
def stand_in(**kwargs) -> Iterator[StandIn]:
    server = StandIn(**kwargs)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.settimeout(0.1)  # so the accept loop sees `stop`
    server.port = sock.getsockname()[1]
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            threading.Thread(target=server.handle, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        sock.close()
        thread.join(timeout=5)


def _race_one_at_a_time(server: StandIn, n: int, gap_s: float = 0.0) -> list:
    """`n` requests through a local-role remote side (one at a time, one pooled
    connection), `gap_s` idle between them; their outputs."""
    side = RemoteSide(f"http://127.0.0.1:{server.port}/v1", role="local", timeout=RESULT_S)
    try:
        outs = []
        for i in range(n):
            if i and gap_s:
                time.sleep(gap_s)
            outs.append(side.submit(f"prompt {i}", SamplingParams(max_tokens=4))
                        .result(timeout=RESULT_S))
        return outs
    finally:
        side.shutdown()


@pytest.mark.parametrize("rst", [False, True], ids=["closed", "reset"])
def test_a_request_on_a_connection_the_server_dropped_is_sent_again(rst):
    # the remote side's own /v1/models and /metrics reads use the connection first, so
    # the drop lands on a generation request
    with stand_in(drop_after=3, rst=rst) as server:
        outs = _race_one_at_a_time(server, 6)
    assert [o.error for o in outs] == [None] * 6
    assert [o.text for o in outs] == ["hello"] * 6
    assert server.dropped >= 1
    assert server.posts == 6 + server.dropped  # each dropped request was sent once more


def test_a_request_at_the_keepalive_boundary_is_sent_again():
    # the server closes a connection idle just under the client pool's expiry: the client
    # still takes the connection, the server has closed it (the race real servers run)
    with stand_in(drop_idle_s=KEEPALIVE_EXPIRY_S - 0.5) as server:
        outs = _race_one_at_a_time(server, 3, gap_s=KEEPALIVE_EXPIRY_S - 0.25)
    assert [o.error for o in outs] == [None] * 3
    assert server.dropped >= 1


def test_the_pool_lets_idle_connections_go_before_a_five_second_server_does():
    assert KEEPALIVE_EXPIRY_S < COMMON_SERVER_IDLE_S
    # a server whose idle timer is just above our expiry never has to drop a request
    with stand_in(drop_idle_s=KEEPALIVE_EXPIRY_S + 1.0) as server:
        outs = _race_one_at_a_time(server, 2, gap_s=KEEPALIVE_EXPIRY_S + 0.5)
    assert [o.error for o in outs] == [None] * 2
    assert server.dropped == 0
    assert server.connections >= 2  # the idle connection was not reused


def test_the_load_generator_survives_dropped_connections_too():
    requests = [LoadRequest(f"prompt {i}", 4, 4) for i in range(6)]
    with stand_in(drop_after=2) as server:
        load = run_load(f"http://127.0.0.1:{server.port}/v1", "stub", requests,
                        max_concurrency=1, endpoint="chat", timeout=RESULT_S)
    assert [r.error for r in load.results] == [None] * 6
    assert server.dropped >= 1


@pytest.mark.parametrize("sent", [12, 120, 200], ids=["half-status-line", "headers",
                                                      "part-of-the-stream"])
def test_a_request_whose_answer_began_is_never_sent_twice(sent):
    with stand_in(break_after=sent) as server:
        side = RemoteSide(f"http://127.0.0.1:{server.port}/v1", role="datacenter",
                          timeout=RESULT_S)
        try:
            out = side.submit("prompt", SamplingParams(max_tokens=4)).result(timeout=RESULT_S)
        finally:
            side.shutdown()
    assert out.finish_reason == "error"
    assert "mid-answer" in out.error or "malformed" in out.error, out.error
    assert server.posts == 1


def test_a_server_that_is_not_there_is_tried_twice_and_named_unreachable():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now

    async def go() -> str:
        async with async_client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            try:
                await client.get("/v1/models")
            except httpx.ConnectError as exc:
                return f"{type(exc).__name__} after {client._transport.num_retries} retry"
        return "answered"

    assert asyncio.run(go()) == "ConnectError after 1 retry"
