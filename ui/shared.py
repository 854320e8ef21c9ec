"""The one model and one datacenter engine of this server process, shared by every
browser session (`st.cache_resource`), so teammates' requests are batched together.

    browser A --\\
    browser B ---+--> SharedEngine --> Engine (continuous batching) --> LoadedModel
    browser C --/        rebuild(config): new Engine on the same weights; the old one drains
    API client --/       (ui/api.py: the same engine over HTTP, on the same port)

A rebuild does not cut anyone off: new requests go to the new engine at once, while the old
one finishes what it had (a race started before the rebuild runs to its end) for up to
`DRAIN_S` seconds; then it is shut down (what is left ends as cancelled, and the race says
the admin changed the engine) and its memory is given back (`release_memory`).

Set BATCHLENS_MODEL to a local HF folder or .gguf path to serve another Llama-family model;
BATCHLENS_DTYPE to force a dtype (default "auto").
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import threading
import time
from collections.abc import Callable

import streamlit as st
import torch
from streamlit.runtime import Runtime
from streamlit.runtime.scriptrunner import get_script_run_ctx

from engine import Engine, EngineConfig, LoadedModel

FIRST_LOAD = ("Loading the model: the very first start converts the GGUF file (~20 s) and "
              "compiles the CPU attention kernel (~10 s); later starts read both from the "
              "cache (~2 s)...")


@st.cache_resource(show_spinner=FIRST_LOAD)
def loaded_model(device: str = "auto") -> LoadedModel:
    """The loaded weights for a device; loaded once per server process."""
    return LoadedModel.load(os.environ.get("BATCHLENS_MODEL"), device,
                             os.environ.get("BATCHLENS_DTYPE", "auto"))


DRAIN_S = 60.0  # a replaced engine finishes its requests for up to this long
DRAIN_POLL_S = 0.2

# Called with every shared engine built (the first, and each rebuild), e.g. the API's
# metrics exporter, which must see every engine's finished requests.
ENGINE_WATCHERS: list[Callable[[Engine], None]] = []


def _build(config: EngineConfig, loaded: LoadedModel) -> Engine:
    engine = Engine(config, loaded=loaded)
    for watch in ENGINE_WATCHERS:
        watch(engine)
    return engine


class SharedEngine:
    """Holds the current shared `Engine`; `rebuild` swaps it for one with new settings."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self._lock = threading.Lock()
        self.engine = _build(config or EngineConfig(), loaded)
        self.draining: list[Engine] = []  # replaced engines still finishing their requests

    def rebuild(self, config: EngineConfig, drain_s: float | None = None) -> Engine:
        """Build a new engine on the same weights (no reload) and serve new requests there;
        the old one drains for up to `drain_s` (default `DRAIN_S`) seconds, then is shut
        down and released.
        Raises `ValueError` (and keeps the old engine) when the settings are impossible,
        e.g. a pool that does not fit beside the old one while it drains."""
        new = _build(config, self.loaded)
        with self._lock:
            old, self.engine = self.engine, new
            self.draining.append(old)
        drain_s = DRAIN_S if drain_s is None else drain_s
        threading.Thread(target=self._retire, args=(old, drain_s), daemon=True,
                         name="batchlens-drain").start()
        return new

    def _retire(self, old: Engine, drain_s: float) -> None:
        """Wait until `old` has no request left (or `drain_s` passed), shut it down, free it."""
        deadline = time.monotonic() + drain_s
        try:
            while time.monotonic() < deadline:
                stats = old.stats(steps_after=None)
                if not (stats.num_running or stats.num_waiting) or stats.stopped:
                    break
                time.sleep(DRAIN_POLL_S)
        finally:
            old.shutdown()
            with self._lock:
                if old in self.draining:
                    self.draining.remove(old)
            release_memory(old)

    def wait_drained(self, timeout: float | None = None) -> bool:
        """Block until every replaced engine is shut down and released; False on timeout."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.draining:
            if end is not None and time.monotonic() > end:
                return False
            time.sleep(DRAIN_POLL_S / 4)
        return True

    def restart(self) -> bool:
        """Restart the current engine's step loop once it has stopped (`Engine.restart`:
        same settings and weights); False while it still runs."""
        return self.engine.restart()

    def shutdown(self) -> None:
        """Shut down the current engine and those still draining, and give their memory
        back: `st.cache_resource` calls this when its cache is cleared, while other
        sessions' finished jobs may still hold the engines (though not their KV)."""
        with self._lock:
            engines = [self.engine, *self.draining]
        for engine in engines:
            self._retire(engine, drain_s=0)


def release_memory(engine: Engine) -> None:
    """Give a shut-down engine's memory back to the operating system.

    Other sessions' finished jobs may still hold the `Engine` object (a race keeps its
    datacenter side, and every request handle keeps the engine's `cancel`), which is fine
    for reading its stats but must not keep its model runner: the KV tensors (and, on a
    GPU, the buffers and CUDA graphs over them) go with it. Then glibc is asked to return
    the freed pages: it keeps freed heap memory otherwise (measured: +1 GiB of RSS per
    1 GiB pool rebuilt, none of it given back by `gc.collect()` alone)."""
    engine.runner = engine.core.runner = None  # its loop has ended: nothing steps it again
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    _malloc_trim()


def _malloc_trim() -> None:
    """glibc's malloc_trim(0): return free heap pages to the OS (a no-op elsewhere)."""
    with contextlib.suppress(AttributeError, OSError, TypeError):  # not glibc
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)


@st.cache_resource(show_spinner="Starting the datacenter engine...",
                   on_release=SharedEngine.shutdown)
def shared_engine() -> SharedEngine:
    """The datacenter engine every browser session of this server shares."""
    return SharedEngine(loaded_model())


def local_model(choice: str) -> LoadedModel:
    """Weights for the local PC: "cpu" (a laptop's reality) or "gpu" (batch 1 on the GPU)."""
    want = "cuda" if choice == "gpu" and has_gpu() else "cpu"
    engine_model = shared_engine().loaded
    if engine_model.model.device.type == want:
        return engine_model
    return loaded_model(want)


def has_gpu() -> bool:
    return torch.cuda.is_available()


def session_connected() -> Callable[[], bool] | None:
    """A check, safe from any thread, that this browser session's websocket is still open;
    None without a script run context, or where this session is not a connected one now
    (AppTest's mocked runtime), leaving the jobs to the heartbeat alone."""
    ctx = get_script_run_ctx()
    if ctx is None or not Runtime.exists():
        return None
    runtime, session_id = Runtime.instance(), ctx.session_id
    if runtime.is_active_session(session_id) is not True:
        return None
    return lambda: runtime.is_active_session(session_id) is True
