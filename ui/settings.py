"""Sidebar settings of the shared datacenter engine; Apply rebuilds it for everyone.

The pool is shown in blocks and GiB, beside what this machine's memory leaves for it; a new
block size keeps the pool's bytes (its block count follows), and a pool that does not fit
is refused before anything is allocated, naming the largest that does
(`engine.memory.budget.check_pool_memory`). Requests running on the old engine finish there
(`SharedEngine.rebuild` drains it). On a shared instance (`ui.hosting`) the form is the
admin's: read-only without the admin password, and locked when none is configured. Every
failure on Apply is one line; the server's log keeps the details.
"""

from __future__ import annotations

import hmac
import logging

import streamlit as st

from engine import Engine, EngineConfig
from engine.memory.budget import gib, largest_pool, memory_budget, pool_bytes
from ui import hosting
from ui.hosting import admin_password
from ui.shared import SharedEngine

FLASH = "settings_flash"
LOCKED = ("Read-only: this is a shared instance and no admin password is configured, so "
          "the engine settings cannot be changed from the page.")
log = logging.getLogger(__name__)

__all__ = ["admin_password", "engine_settings", "pool_caption"]


def pool_caption(engine: Engine) -> str:
    """The pool now, in blocks and GiB, and the most this machine's memory leaves for one."""
    kv, per_token = engine.kv, engine.kv_bytes_per_token
    now = pool_bytes(kv.num_blocks, kv.block_size, per_token)
    text = (f"KV pool now: {kv.num_blocks:,} blocks x {kv.block_size} tokens = {gib(now)} "
            f"({per_token / 1024:,.1f} KiB per token)")
    budget = memory_budget(str(engine.loaded.model.device))
    if budget is not None:
        fits = largest_pool(kv.block_size, per_token, budget)
        text += (f"; {budget.what} leaves room for {gib(budget.limit)} more "
                 f"({fits:,} blocks of {kv.block_size})")
    return text + ". A new block size keeps the pool's memory."


def engine_settings(holder: SharedEngine) -> None:
    """The settings form; applying it rebuilds the engine that every session shares (the
    old one drains). On a shared instance only the admin may apply it."""
    engine = holder.engine
    cfg = engine.config
    password = admin_password()
    locked = password is None and hosting.is_hosted()
    with st.sidebar.form("engine-settings"):
        st.subheader("Datacenter engine")
        st.caption("Shared by every browser session: applying rebuilds it for everyone; "
                   "requests already running finish on the old engine.")
        # no min/max: Streamlit drops an out-of-range number without a word; EngineConfig
        # and the memory check name the field and its range instead
        block_size = st.number_input("Block size (tokens)", value=cfg.block_size, step=1,
                                     disabled=locked)
        num_blocks = st.number_input("KV pool (blocks)", value=engine.kv.num_blocks, step=1,
                                     disabled=locked,
                                     help="Leave it as it is when changing the block size: "
                                          "the pool then keeps its memory, not its count.")
        st.caption(pool_caption(engine))
        max_seqs = st.number_input("Max concurrent sequences", value=cfg.max_num_seqs,
                                   step=1, disabled=locked)
        budget = st.number_input("Token budget per step", value=cfg.max_num_batched_tokens,
                                 step=1, disabled=locked)
        prefix = st.checkbox("Prefix caching", cfg.enable_prefix_caching, disabled=locked)
        speculative = st.checkbox("Speculative decoding (n-gram)", cfg.speculative is not None,
                                  disabled=locked,
                                  help="Up to 4 tokens looked up in each request's earlier "
                                       "text are checked in one step (the same tokens come "
                                       "out); the KV cache page's step timeline shows the "
                                       "drafts accepted.")
        entered = (st.text_input("Admin password", type="password") if password else None)
        applied = st.form_submit_button("Apply", type="primary", disabled=locked)
    if locked:
        st.sidebar.info(LOCKED)
    if engine.stopped_reason is not None:
        _restart_control(holder, password, locked)
    if applied and not locked:
        _apply(holder, password, entered, dict(
            block_size=int(block_size), num_kv_blocks=int(num_blocks),
            max_num_seqs=int(max_seqs), max_num_batched_tokens=int(budget),
            enable_prefix_caching=bool(prefix), speculative="ngram" if speculative else None))
    flash = st.session_state.pop(FLASH, None)
    if flash:
        st.sidebar.success(flash)


def _apply(holder: SharedEngine, password: str | None, entered: str | None,
           changes: dict) -> None:
    if password is not None and not hmac.compare_digest((entered or "").encode(),
                                                        password.encode()):
        st.sidebar.error("Only an admin can change the shared engine: enter the admin password.")
        return
    engine = holder.engine
    old, kv = engine.config, engine.kv
    kept = changes["block_size"] != kv.block_size and changes["num_kv_blocks"] == kv.num_blocks
    if kept and changes["block_size"] > 0:  # a new block size keeps the pool's bytes
        changes["num_kv_blocks"] = max(1, kv.num_blocks * kv.block_size
                                       // changes["block_size"])
    fields = {k: getattr(old, k) for k in ("model", "device", "dtype", "kv_cache_memory_gb",
                                           "max_model_len", "num_threads",
                                           "num_speculative_tokens", "prompt_lookup_min",
                                           "prompt_lookup_max")}
    try:
        new = holder.rebuild(EngineConfig(**fields, **changes))
    except ValueError as exc:
        st.sidebar.error(f"Not applied: {_one_line(exc)}")
        return
    except Exception as exc:  # never a traceback on the page: one line, details in the log
        log.exception("Apply: the engine could not be built")
        st.sidebar.error(f"Not applied: the engine could not be built with these settings "
                         f"({type(exc).__name__}; the server's log has the details). The "
                         "engine is unchanged.")
        return
    size = gib(pool_bytes(new.kv.num_blocks, new.kv.block_size, new.kv_bytes_per_token))
    st.session_state[FLASH] = (
        f"Engine rebuilt: {new.kv.num_blocks:,} blocks of {new.kv.block_size} tokens "
        f"({size}{', the same memory' if kept else ''}), up to {new.config.max_num_seqs} "
        "sequences per step. Requests already running finish on the previous engine.")
    st.rerun()


def _restart_control(holder: SharedEngine, password: str | None, locked: bool) -> None:
    """The engine's loop has stopped (a failure outside a model step): the admin (anyone
    on a local instance) restarts it on the same weights and KV pool."""
    st.sidebar.error("Engine stopped: the shared engine serves no requests until it is "
                     "restarted. The server's log has the reason.")
    if locked:
        return
    entered = (st.sidebar.text_input("Admin password", type="password", key="restart-password")
               if password else None)
    if st.sidebar.button("Restart engine", key="restart-engine", type="primary"):
        if password is not None and not hmac.compare_digest((entered or "").encode(),
                                                            password.encode()):
            st.sidebar.error("Only an admin can restart the shared engine: enter the admin "
                             "password.")
            return
        holder.restart()
        st.session_state[FLASH] = "Engine restarted: it serves requests again."
        st.rerun()


def _one_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
