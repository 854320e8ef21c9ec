"""Remote serving sides an admin configured, picked by name.

Endpoints come from Streamlit secrets only, one `[[endpoints]]` table each::

    [[endpoints]]
    name = "vLLM cluster"             # what visitors see and pick
    url = "http://10.0.0.5:8000/v1"   # the /v1 base; never shown to visitors
    model = "meta-llama/Llama-3.1-8B-Instruct"   # optional: the first of /v1/models
    api_key = "..."                   # optional; never leaves the server
    role = "datacenter"               # or "local": one request at a time
    timeout = 30                      # optional: seconds to wait to connect and between
                                      # two reads of a stream (default 120)

A visitor chooses among these names (next to this process's engine and the simulated
local PC); there is no field where a URL can be typed, so the server only ever fetches
addresses the admin wrote down.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import streamlit as st

from engine.serving import ServingSide
from server.remote import RemoteSide

ROLES = ("datacenter", "local")
IN_PROCESS = {"datacenter": "this process's engine", "local": "simulated local PC"}


@dataclass(frozen=True)
class Endpoint:
    """One configured endpoint (the key is kept out of repr, so it is never printed)."""

    name: str
    url: str
    role: str
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)
    timeout: float | None = None  # None: RemoteSide's default


def configured() -> list[Endpoint]:
    """The endpoints in Streamlit secrets; `ValueError` naming the entry when one is wrong."""
    try:
        entries = st.secrets.get("endpoints", [])
    except Exception:  # no secrets file
        return []
    out = []
    for i, e in enumerate(entries):
        where = f"secrets [[endpoints]] #{i + 1}"
        missing = [k for k in ("name", "url", "role") if not str(e.get(k, "")).strip()]
        if missing:
            raise ValueError(f"{where}: missing {', '.join(missing)}")
        if e["role"] not in ROLES:
            raise ValueError(f"{where} ({e['name']}): role must be one of {ROLES}")
        if e["name"] in IN_PROCESS.values() or any(o.name == e["name"] for o in out):
            raise ValueError(f"{where}: the name {e['name']!r} is taken")
        out.append(Endpoint(str(e["name"]), str(e["url"]), e["role"],
                            e.get("model") or None, e.get("api_key") or None,
                            _timeout(e.get("timeout"), f"{where} ({e['name']})")))
    return out


def _timeout(value: object, where: str) -> float | None:
    """An entry's optional `timeout` in seconds; `ValueError` naming the entry unless it
    is a number > 0."""
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{where}: timeout must be a number of seconds > 0, got {value!r}")
    return float(value)


def choices(role: str) -> list[str]:
    """What a visitor can pick for a side: the in-process default, then configured names."""
    return [IN_PROCESS[role]] + [e.name for e in configured() if e.role == role]


def remote_side(name: str, role: str) -> RemoteSide | None:
    """The configured endpoint called `name` as a serving side; None for the in-process
    default. Only configured names resolve: anything else raises `ValueError`."""
    if name == IN_PROCESS[role]:
        return None
    for e in configured():
        if e.name == name and e.role == role:
            timeout = {} if e.timeout is None else {"timeout": e.timeout}
            return RemoteSide(e.url, model=e.model, api_key=e.api_key, role=role, name=e.name,
                              **timeout)
    raise ValueError(f"{role} side: no endpoint called {name!r} is configured")


def pickers(prefix: str, disabled: bool) -> None:
    """A choice of server per side (`{prefix}_dc_side`, `{prefix}_local_side`), shown only
    where the admin configured endpoints for that role."""
    try:
        dc, local = choices("datacenter"), choices("local")
    except ValueError as exc:
        st.caption(f"Remote endpoints are misconfigured, so none is offered: {exc}")
        return
    if len(dc) > 1:
        st.selectbox("Datacenter side", dc, key=f"{prefix}_dc_side", disabled=disabled)
    if len(local) > 1:
        st.selectbox("Local PC side", local, key=f"{prefix}_local_side", disabled=disabled)


def picked(prefix: str, role: str) -> RemoteSide | None:
    """The remote side this session picked for `role` with `pickers`, connected now; None
    for the in-process default."""
    key = f"{prefix}_{'dc' if role == 'datacenter' else 'local'}_side"
    return remote_side(st.session_state.get(key, IN_PROCESS[role]), role)


@contextlib.contextmanager
def sides(prefix: str, engine: ServingSide, local_pc: Callable[[], ServingSide],
          ) -> Iterator[tuple[ServingSide, ServingSide, bool]]:
    """The two sides this session picked with `pickers`: (datacenter, local, whether the
    datacenter is a remote side built here). The in-process defaults are `engine` and a new
    `local_pc()`. The sides built here are shut down again if the body raises (a job that
    did not start); a job that starts owns them."""
    built: list[ServingSide] = []
    try:
        remote_dc = picked(prefix, "datacenter")
        if remote_dc is not None:
            built.append(remote_dc)
        local = picked(prefix, "local") or local_pc()
        built.append(local)
        yield remote_dc or engine, local, remote_dc is not None
    except BaseException:
        for side in built:
            side.shutdown()
        raise
