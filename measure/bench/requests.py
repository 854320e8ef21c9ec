"""The bench's request mix: prompts cut from a fixed English text, lengths drawn from a
seeded generator, so every run and every machine gets the same requests."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

TEXT = (
    "The old lighthouse stood at the edge of the cliff for more than a century, guiding ships "
    "through fog and storm. Its keeper climbed the spiral stairs every evening to light the lamp, "
    "and every morning he wrote the weather, the passing ships and the state of the sea in a "
    "thick leather book. When the lamp was finally automated, the book was given to the town "
    "library, where children still read it on rainy afternoons.\n\n"
    "Bread is one of the oldest prepared foods. Flour and water are mixed into a dough, yeast "
    "makes it rise, and heat turns it into a loaf with a crisp crust and a soft crumb. Bakers "
    "adjust the time, the temperature and the amount of water to suit the flour of each season, "
    "and a good baker can tell by touch alone whether the dough is ready for the oven.\n\n"
    "A computer runs a program by fetching instructions from memory, decoding them and executing "
    "them one after another. Modern processors overlap these stages, predict which way branches "
    "will go and keep recently used data in small, fast caches. Much of the speed of a program "
    "therefore depends less on how many operations it performs than on how well it uses memory.\n\n"
    "The river rises in the mountains, gathers the melting snow in spring and winds through "
    "farmland and forests before it reaches the sea. Towns grew up along its banks because it "
    "brought water, fish and trade. Today the old mills are museums, and people walk and cycle "
    "along the towpaths where horses once pulled heavy boats upstream against the current."
)

# the mix's prompt and output lengths in tokens (inclusive ranges): the full bench, --quick
MIX_PROMPT_LEN, MIX_MAX_TOKENS = (10, 300), (16, 256)
QUICK_PROMPT_LEN, QUICK_MAX_TOKENS = (10, 100), (8, 48)


def mix_lengths(quick: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """The mix's (prompt, max_tokens) length ranges: --quick's, or the full bench's."""
    return (QUICK_PROMPT_LEN, QUICK_MAX_TOKENS) if quick else (MIX_PROMPT_LEN, MIX_MAX_TOKENS)


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: prompt token ids and the exact number of tokens to generate."""

    prompt_ids: tuple[int, ...]
    max_tokens: int

    @property
    def halfway_context(self) -> int:
        """Its tokens of context halfway through its output: the bench's profiled decode
        step has its requests there (`measure.bench.runs.profile_breakdown`)."""
        return len(self.prompt_ids) + self.max_tokens // 2


def make_requests(
    corpus_ids: list[int], n: int, seed: int, prompt_len: tuple[int, int],
    max_tokens: tuple[int, int],
) -> list[BenchRequest]:
    """Deterministic requests: prompts are slices of `corpus_ids` (cyclic, from a random
    offset, so prompts rarely share a prefix), lengths uniform in the inclusive ranges."""
    if not corpus_ids:
        raise ValueError("corpus_ids must not be empty")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length, off = rng.randint(*prompt_len), rng.randrange(len(corpus_ids))
        ids = [corpus_ids[(off + i) % len(corpus_ids)] for i in range(length)]
        out.append(BenchRequest(tuple(ids), rng.randint(*max_tokens)))
    return out


def tokenize_corpus(tokenizer: Any) -> list[int]:
    """`TEXT` as token ids, without special tokens: what the prompts are cut from."""
    return list(tokenizer(TEXT, add_special_tokens=False)["input_ids"])
