"""The prompts workloads send: chat-form messages, and the prompt sets of
assets/prompts.json (named presets for the presenter's own prompt, varied short prompts
for everyone else)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parent.parent / "assets" / "prompts.json"
Chat = tuple[dict[str, str], ...]


@dataclass(frozen=True)
class PromptSets:
    presets: dict[str, str]  # menu name -> prompt text
    others: tuple[str, ...]  # varied prompts for the other users


@cache
def load_prompts(path: Path = PROMPTS_FILE) -> PromptSets:
    """The prompt sets of `path` (read once per process)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return PromptSets({p["name"]: p["prompt"] for p in data["presets"]}, tuple(data["others"]))


def chat(text: str, system: str | None = None) -> Chat:
    """A chat-form prompt (the model's chat template is applied when it is encoded)."""
    msgs = ({"role": "system", "content": system},) if system else ()
    return (*msgs, {"role": "user", "content": text})


def varied_prompts(path: Path = PROMPTS_FILE) -> list[Chat]:
    """The short, varied prompts ("others"), as chats."""
    return [chat(text) for text in load_prompts(path).others]


def user_prompts(yours: str, users: int, varied: bool, you_last: bool,
                 others: tuple[str, ...]) -> tuple[list[Chat], int]:
    """Every user's prompt in arrival order, and the index of yours among them: the others
    send `others` in turn (`varied`) or your prompt too."""
    rest = [others[i % len(others)] if varied and others else yours for i in range(users - 1)]
    texts = rest + [yours] if you_last else [yours] + rest
    return [chat(t) for t in texts], (users - 1 if you_last else 0)
