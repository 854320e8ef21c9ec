"""The two serving sides every workload compares, by name, and how a sentence names them
(the pages' chart legends and colours are built from these in `ui.palette`)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import SamplingParams
from engine.models.loaded import Prompt
from engine.serving import ServingSide

SIDES = ("datacenter", "local")
LABELS = {"datacenter": "datacenter", "local": "local PC"}


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
