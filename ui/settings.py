"""Sidebar settings of the shared datacenter engine; Apply rebuilds it for everyone."""

from __future__ import annotations

import streamlit as st

from engine import EngineConfig
from ui.shared import SharedEngine

FLASH = "settings_flash"


def admin_password() -> str | None:
    """The admin password from Streamlit secrets, or None when none is set."""
    try:
        value = st.secrets.get("admin_password")
    except FileNotFoundError:  # no secrets file at all
        return None
    return str(value) if value else None


def engine_settings(holder: SharedEngine) -> None:
    """The settings form; applying it rebuilds the engine that every session shares."""
    engine = holder.engine
    cfg = engine.config
    password = admin_password()
    with st.sidebar.form("engine-settings"):
        st.subheader("Datacenter engine")
        st.caption("Shared by every browser session: applying rebuilds it for everyone and "
                   "cancels requests in flight.")
        block_size = st.number_input("Block size (tokens)", 1, 1024, cfg.block_size)
        num_blocks = st.number_input("KV pool (blocks)", 1, 10_000_000, engine.kv.num_blocks)
        max_seqs = st.number_input("Max concurrent sequences", 1, 4096, cfg.max_num_seqs)
        budget = st.number_input("Token budget per step", 1, 1_000_000,
                                 cfg.max_num_batched_tokens)
        prefix = st.checkbox("Prefix caching", cfg.enable_prefix_caching)
        entered = st.text_input("Admin password", type="password") if password else None
        applied = st.form_submit_button("Apply", type="primary")
    if applied:
        _apply(holder, password, entered, dict(
            block_size=int(block_size), num_kv_blocks=int(num_blocks),
            max_num_seqs=int(max_seqs), max_num_batched_tokens=int(budget),
            enable_prefix_caching=bool(prefix)))
    flash = st.session_state.pop(FLASH, None)
    if flash:
        st.sidebar.success(flash)


def _apply(holder: SharedEngine, password: str | None, entered: str | None,
           changes: dict) -> None:
    if password is not None and entered != password:
        st.sidebar.error("Only an admin can change the shared engine: enter the admin password.")
        return
    old = holder.engine.config
    fields = {k: getattr(old, k) for k in ("model", "device", "dtype", "kv_cache_memory_gb",
                                           "max_model_len", "num_threads")}
    try:
        new = holder.rebuild(EngineConfig(**fields, **changes))
    except ValueError as exc:
        st.sidebar.error(f"Not applied: {exc}")
        return
    st.session_state[FLASH] = (f"Engine rebuilt: {new.kv.num_blocks} blocks of "
                               f"{new.kv.block_size} tokens, up to {new.config.max_num_seqs} "
                               "sequences per step.")
    st.rerun()
