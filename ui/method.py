"""The "How this was measured" panels: the method in words, and a race's or a sweep's exact
set-up (which side first, threads, model, batching, KV layout), from the job and the
sides' own stats."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from engine.serving import ServingStats
from workloads.race import Race
from workloads.sides import LABELS
from workloads.sweep import Sweep


def panel(method: str, setup: dict[str, str] | None = None,
          title: str = "How this was measured") -> None:
    """An expander with the method and, once a job exists, its set-up as a table."""
    with st.expander(title):
        st.write(method)
        if setup is not None:
            rows = pd.DataFrame(list(setup.items()), columns=["what", "how"])
            st.dataframe(rows, hide_index=True, width="stretch")


def _order(order: tuple[str, ...]) -> str:
    first, second = (LABELS[s] for s in order)
    return f"{first} first, then {second}: never both at once"


def _threads(num_threads: int) -> str:
    return f"{num_threads} torch threads for each side, in turn"


def _on(stats: ServingStats) -> str:
    return f"{stats.model} on {stats.device}"


def _remote(stats: ServingStats) -> bool:
    """A remote side reports its endpoint's URL as its device."""
    return stats.device.startswith(("http://", "https://"))


def _datacenter(dc: ServingStats) -> str:
    """The datacenter side in words: this process's engine, or a remote server."""
    if _remote(dc):  # only what it reports; its address stays on the server
        return f"{dc.model}: a remote OpenAI-compatible server, every request sent at once"
    return (f"{_on(dc)}, {dc.dtype} ({dc.dtype_reason}); continuous batching, up to "
            f"{dc.max_num_running} sequences per step, paged KV in blocks of "
            f"{dc.kv.block_size} tokens" + _speculation(dc))


def _local(loc: ServingStats) -> str:
    """The local side in words: the simulated PC, or a remote server fed one at a time."""
    if _remote(loc):
        return f"{loc.model}: a remote OpenAI-compatible server, one request at a time"
    return (f"{_on(loc)}, one user at a time (batch 1), FIFO queue, contiguous KV reserved "
            f"for n_ctx={loc.n_ctx} tokens" + _speculation(loc)
            + (f"; {loc.emulated}" if loc.emulated else ""))


def _speculation(stats: ServingStats) -> str:
    return "; speculative decoding (n-gram prompt lookup)" if stats.spec_decode is not None else ""


def race_setup(race: Race) -> dict[str, str]:
    """How this race is measured."""
    dc, loc, p = race.engine.stats(), race.local.stats(), race.params
    return {
        "order": _order(race.order),
        "timeline": "each side's t=0 is its own first request; all users arrive at t=0",
        "threads": _threads(race.num_threads),
        "datacenter": _datacenter(dc),
        "local PC": _local(loc),
        "sampling": f"max_tokens={p.max_tokens}, temperature={p.temperature}, per-user seed "
                    "(same tokens on both sides)"
                    + (f"; n={p.n} answers per user, answer i seeded seed + i" if p.n > 1
                       else ""),
        "shared engine": "other browser sessions' requests share the datacenter engine and "
                         "the cores; the status strip shows them",
    }


def sweep_setup(sweep: Sweep) -> dict[str, str]:
    """How this sweep is measured."""
    dc, loc, s = sweep.engine.stats(steps_after=None), sweep.local.stats(), sweep.plan
    load = ("users: each sends one request at the point's t=0" if s.mode == "users" else
            f"Poisson arrivals for {s.duration_s:g} s (seed {s.seed}), first at t=0")
    return {
        "order": f"at each load {_order(s.order)}",
        "load": load,
        "requests": f"{s.num_requests} per side; greedy, max_tokens={s.max_tokens}, EOS "
                    f"ignored; {sweep.num_prompts} prompts in turn"
                    + (f", {sweep.mean_prompt_tokens:.0f} tokens on average (chat template)"
                       if sweep.mean_prompt_tokens is not None else ""),
        "threads": _threads(sweep.num_threads),
        "datacenter": _datacenter(dc),
        "local PC": _local(loc),
        "shared engine": "other sessions' requests share the datacenter engine and the "
                         "cores: the other_requests and others_cpu columns show them",
    }
