"""The one model and one datacenter engine of this server process, shared by every
browser session (`st.cache_resource`), so teammates' requests are batched together.

    browser A --\\
    browser B ---+--> SharedEngine --> Engine (continuous batching) --> LoadedModel
    browser C --/        rebuild(config): new Engine on the same weights, old one shut down
    API client --/       (ui/api.py: the same engine over HTTP, on the same port)

Set BATCHLENS_MODEL to a local HF folder or .gguf path to serve another Llama-family model;
BATCHLENS_DTYPE to force a dtype (default "auto").
"""

from __future__ import annotations

import os
import threading
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

    def rebuild(self, config: EngineConfig) -> Engine:
        """Build a new engine on the same weights (no reload); shut the old one down.
        Raises `ValueError` (and keeps the old engine) when the settings are impossible."""
        new = _build(config, self.loaded)
        with self._lock:
            old, self.engine = self.engine, new
        old.shutdown()
        return new

    def shutdown(self) -> None:
        self.engine.shutdown()


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
    None without a script run context. Under AppTest (a mocked runtime) it is never true,
    leaving the jobs to the heartbeat alone."""
    ctx = get_script_run_ctx()
    if ctx is None or not Runtime.exists():
        return None
    runtime, session_id = Runtime.instance(), ctx.session_id
    return lambda: runtime.is_active_session(session_id) is True
