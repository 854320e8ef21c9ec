"""Preset prompts (assets/prompts.json) and the prompts each simulated user sends."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parent.parent / "assets" / "prompts.json"
Chat = list[dict[str, str]]


@dataclass(frozen=True)
class Presets:
    presets: dict[str, str]  # menu name -> prompt text
    others: tuple[str, ...]  # varied prompts for the other users


@cache
def load_presets(path: Path = PROMPTS_FILE) -> Presets:
    data = json.loads(path.read_text(encoding="utf-8"))
    return Presets({p["name"]: p["prompt"] for p in data["presets"]}, tuple(data["others"]))


def chat(text: str) -> Chat:
    """A user message in chat form, so the model's chat template is applied."""
    return [{"role": "user", "content": text}]


def user_prompts(yours: str, users: int, varied: bool, you_last: bool,
                 others: tuple[str, ...]) -> tuple[list[Chat], int]:
    """Prompts in arrival order and the index of yours among them."""
    rest = [others[i % len(others)] if varied and others else yours for i in range(users - 1)]
    texts = rest + [yours] if you_last else [yours] + rest
    return [chat(t) for t in texts], (users - 1 if you_last else 0)
