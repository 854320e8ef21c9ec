"""llama.cpp's own `llama-server` on 127.0.0.1, built once from the llama-cpp-python sdist
(scripts/build_llama_server.sh), serving the bundled GGUF: one server with one slot (the
local PC a laptop runs) and one with eight (a small datacenter), each started once per
session and stopped at the end. The in-process engine races against them, as the
dashboard's Arena does with a configured endpoint."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine import Engine
from engine.models.loader import bundled_gguf_path

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "scripts" / "build_llama_server.sh"
BUILD_TIMEOUT_S = 3600.0  # the first build takes ~8 min on 2 cores
START_TIMEOUT_S = 120.0
DATACENTER_SLOTS = 8
SLOT_CONTEXT = 1024  # tokens per slot: a chat prompt and 32 tokens fit with room to spare
# llama.cpp's threads wait for each other at every op, spinning: on a machine shared with
# other work one descheduled thread stalls the rest (500 ms a token instead of 9 with two
# threads beside a busy test run), so one thread unless BATCHLENS_LLAMA_THREADS says more
THREADS = int(os.environ.get("BATCHLENS_LLAMA_THREADS", "1"))


def llama_server_binary() -> Path:
    """The built `llama-server` (building it first when it is not cached)."""
    # the script's PY converts the model too: it needs this venv (torch, engine)
    env = os.environ | {"PY": os.environ.get("PY", sys.executable)}
    subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, env=env, timeout=BUILD_TIMEOUT_S)
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--path"], check=True, text=True,
                         capture_output=True).stdout.strip()
    return Path(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    """llama-server answers /health with 200 once the model is loaded (503 before)."""
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def llama_server(binary: Path, slots: int, log_path: Path) -> Iterator[str]:
    """`llama-server` on a free 127.0.0.1 port with `slots` parallel sequences and
    /metrics on, its output in `log_path`; yields its /v1 base URL once /health answers;
    stops it after."""
    port = free_port()
    # --no-repack: on a CPU with AMX, ggml repacks the GGUF's Q4_1 weights for its AMX
    # kernels, which stop the server with an illegal instruction (a tile op before any tile
    # configuration) at its warm-up; repacking changes how fast it answers, not what
    cmd = [str(binary), "-m", str(bundled_gguf_path()), "--host", "127.0.0.1",
           "--port", str(port), "--metrics", "-np", str(slots),
           "-c", str(slots * SLOT_CONTEXT), "-t", str(THREADS), "-tb", str(THREADS),
           "--no-repack"]
    # the shared libraries (libllama, libggml*) lie beside the binary
    libs = f"{binary.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, env=os.environ | {"LD_LIBRARY_PATH": libs}, stdout=log,
                                stderr=subprocess.STDOUT)
    print(f"\nllama-server -np {slots} -t {THREADS} at {url} (log: {log_path})", flush=True)
    try:
        end = time.monotonic() + START_TIMEOUT_S
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() > end:
                pytest.fail(f"llama-server ({' '.join(cmd)}) did not start:\n"
                            f"{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url + "/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture(scope="session")
def llama_binary() -> Path:
    return llama_server_binary()


@pytest.fixture(scope="session")
def llama_local(llama_binary: Path, tmp_path_factory) -> Iterator[str]:
    """A one-slot llama-server: the local PC (its /v1 URL)."""
    log = tmp_path_factory.mktemp("llama") / "llama-server-local.log"
    with llama_server(llama_binary, 1, log) as url:
        yield url


@pytest.fixture(scope="session")
def llama_datacenter(llama_binary: Path, tmp_path_factory) -> Iterator[str]:
    """An eight-slot llama-server (`-np 8`): the datacenter (its /v1 URL)."""
    log = tmp_path_factory.mktemp("llama") / "llama-server-datacenter.log"
    with llama_server(llama_binary, DATACENTER_SLOTS, log) as url:
        yield url


@pytest.fixture(scope="session")
def in_process_engine() -> Iterator[Engine]:
    """The in-process datacenter engine on the bundled model, as the dashboard's default."""
    with Engine() as engine:
        yield engine
