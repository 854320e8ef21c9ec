"""The two serving sides every workload compares, by name, and how a sentence names them
(the pages' chart legends and colours are built from these in `ui.palette`), the most users
a workload sends at once; the prompt
check both sides pass before a workload starts, and counts worded with their plural."""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence

from engine.config import SamplingParams
from engine.models.loaded import Prompt
from engine.serving import ServingSide

SIDES = ("datacenter", "local")
LABELS = {"datacenter": "datacenter", "local": "local PC"}
MAX_USERS = 256  # users of one race or sweep point, headless (the pages cap theirs lower)
_LIMIT = re.compile(r" of ([\d,]+) tokens")  # the limit a `check_fit` message names


def count(n: int, noun: str, plural: str | None = None) -> str:
    """"1 user", "2 users", "0 users" (`plural` where adding "s" is wrong)."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def check_order(order: tuple[str, ...]) -> None:
    """Raise `ValueError` unless `order` names each side exactly once."""
    if sorted(order) != sorted(SIDES):
        raise ValueError(f"order: must name each of {SIDES} once, got {order}")


def prompts_for(name: str, server: ServingSide, prompts: Sequence[Prompt],
                params: SamplingParams) -> list[Prompt]:
    """What `server`, the side called `name`, is sent for each prompt: the token ids it will
    run where it tokenizes (so both in-process sides run the very same tokens), else the
    prompt itself; `ValueError` naming the side when one does not fit. Equal prompts are
    checked once."""
    checked: dict[str, Prompt] = {}
    out = []
    for prompt in prompts:
        key = repr(prompt)
        if key not in checked:
            try:
                ids = server.check(prompt, params)
            except ValueError as exc:
                raise ValueError(f"{LABELS[name]}: {exc}") from None
            checked[key] = ids if ids is not None else prompt
        out.append(checked[key])
    return out


def prompts_for_sides(servers: Mapping[str, ServingSide], prompts: Sequence[Prompt],
                      params: SamplingParams) -> dict[str, list[Prompt]]:
    """`prompts_for` on every side at once, so a prompt that does not fit is refused with
    the smallest limit among the sides it does not fit (a prompt shortened to the range the
    message gives then fits every side, not only the first one checked)."""
    out: dict[str, list[Prompt]] = {}
    errors: list[ValueError] = []
    for name, server in servers.items():
        try:
            out[name] = prompts_for(name, server, prompts, params)
        except ValueError as exc:
            errors.append(exc)
    if errors:
        raise min(errors, key=_limit_of)
    return out


def _limit_of(exc: ValueError) -> int:
    """The token limit an error names (the largest possible when it names none)."""
    m = _LIMIT.search(str(exc))
    return int(m.group(1).replace(",", "")) if m else sys.maxsize
