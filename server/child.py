"""A server as a child process, started, waited on until it answers its health route, and
stopped however the caller ends: `batchlens serve` for `batchlens bench api`, the soak and
the tests, the dashboard itself for the browser tests.

    with child_server(serve_command(port, "--dtype", "float32"), health_url(port),
                      log=path, timeout=300) as proc:
        ...                                   # the server answers /health with 200

A child that exits before it is healthy, or is not healthy by `timeout`, raises
`RuntimeError` with the end of its log, so a failed start says why.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx

HOST = "127.0.0.1"
POLL_S = 0.25
STOP_S = 30.0
LOG_TAIL_CHARS = 2000


def free_port(host: str = HOST) -> int:
    """A TCP port free on `host` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_command(port: int, *flags: str, host: str = HOST) -> list[str]:
    """`batchlens serve` on `host`:`port` with `flags`, run by this Python."""
    return [sys.executable, "-m", "batchlens.cli", "serve", "--host", host, "--port",
            str(port), *flags]


def health_url(port: int, path: str = "/health", host: str = HOST) -> str:
    return f"http://{host}:{port}{path}"


def healthy(url: str) -> bool:
    """Whether GET `url` answers 200 now."""
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def child_server(cmd: Sequence[str], health: str, *, log: Path, timeout: float,
                 env: Mapping[str, str] | None = None,
                 cwd: Path | None = None) -> Iterator[subprocess.Popen]:
    """Run `cmd` with its output in `log`; yield the process once GET `health` is 200;
    stop it (terminate, then kill) when the block ends."""
    with Path(log).open("w") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                env=dict(os.environ if env is None else env))
    try:
        deadline = time.monotonic() + timeout
        while not healthy(health):
            if proc.poll() is not None:
                raise RuntimeError(f"{_name(cmd)} exited with {proc.returncode} before it "
                                   f"answered {health}: {_tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{_name(cmd)} did not answer {health} within "
                                   f"{timeout:g} s: {_tail(log)}")
            time.sleep(POLL_S)
        yield proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, grace: float = STOP_S) -> None:
    """Terminate a child, and kill it if it has not exited after `grace` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _name(cmd: Sequence[str]) -> str:
    parts = list(cmd)
    if parts[1:3] == ["-m", "batchlens.cli"]:
        return "batchlens " + parts[3]
    if parts[1:3] == ["-m", "streamlit"]:
        return "streamlit"
    return Path(parts[0]).name


def _tail(log: Path) -> str:
    try:
        text = Path(log).read_text(errors="replace")
    except OSError:
        return f"(no log at {log})"
    return f"log {log}: ...{text[-LOG_TAIL_CHARS:]}" if text else f"log {log} is empty"


__all__ = ["child_server", "free_port", "health_url", "healthy", "serve_command", "stop"]
