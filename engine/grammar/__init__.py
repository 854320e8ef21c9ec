"""Structured outputs: the tokens a request may take next, as a mask over the vocabulary.

xgrammar (vLLM's and SGLang's default backend) compiles a request's `StructuredOutput`
against the tokenizer's vocabulary once (`Grammars.compile`, cached by spec), and a
`Matcher` per sequence follows its output: each step it fills the sequence's row of a
bitmask with the tokens that keep the text inside the grammar, and the sampler sets every
other token's logit to -inf (`mask_rows`), before greedy, sampling or a draft's check.
Once the grammar is complete only the end-of-text tokens are left, so the answer stops.

A matcher follows a token history, not a step count: `Matcher.follow` rolls back to the
longest prefix it shares with the history it is asked for, then accepts the rest. So a
verification's row j (the output plus its first j drafts), drafts rejected afterwards and
a preempted request's recompute need no special cases. A draft the grammar refuses leaves
the rows after it unmasked: the draft itself was barred in its own row, so the check
rejects it and nothing sampled past it is kept.

xgrammar is imported on the first structured request, so a server that never gets one
never loads it.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch

from engine.config import StructuredOutput
from engine.models import native

CACHED_GRAMMARS = 128  # compiled specs kept per model
COMPILER_CACHE_BYTES = 64 * 2**20  # xgrammar's own cache of compiled pieces


def _xgr() -> Any:
    import xgrammar

    return xgrammar


def choice_grammar(choices: Iterable[str]) -> str:
    """An EBNF grammar whose `root` is exactly one of `choices` (JSON-escaped literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Grammars:
    """The compiler for one model's vocabulary: `StructuredOutput` -> compiled grammar.
    Thread-safe: the API's handlers compile while the engine thread builds matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]):
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stops = sorted(stop_token_ids)
        self._compiler: Any = None
        # the latest specs compiled, most recent last: a server that meets a new schema
        # with every request keeps only these (and xgrammar's own cache is bounded too)
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()

    def _compiler_for(self) -> Any:
        if self._compiler is None:
            xgr = _xgr()
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stops or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1,
                                                 cache_limit_bytes=COMPILER_CACHE_BYTES)
        return self._compiler

    def compile(self, so: StructuredOutput) -> Any:
        """The compiled grammar of `so`; `ValueError` ("structured: ...") naming what is
        wrong with a schema, regex or grammar that does not compile or allows no answer.
        Compiles run outside the lock (xgrammar's compiler is thread-safe), so one spec
        that is slow to compile holds up no other request."""
        with self._lock:
            if so in self._cache:
                self._cache.move_to_end(so)
                return self._cache[so]
            compiler = self._compiler_for()
        try:
            if so.kind == "json":
                json.loads(str(so.spec))
                compiled = compiler.compile_json_schema(so.spec)
            elif so.kind == "json_object":
                compiled = compiler.compile_builtin_json_grammar()
            elif so.kind == "regex":
                compiled = compiler.compile_regex(so.spec)
            elif so.kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(so.spec))
            else:
                compiled = compiler.compile_grammar(so.spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured: the JSON schema is not valid JSON: {exc}") from None
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"structured: the {_NAMES[so.kind]} does not compile: "
                             f"{_reason(exc)}") from None
        bitmask = _xgr().allocate_token_bitmask(1, self.vocab_size)
        if Matcher(compiled).fill(bitmask, 0) and not bitmask.any():
            raise ValueError(f"structured: the {_NAMES[so.kind]} allows no answer (no token "
                             "can start one)")
        with self._lock:
            self._cache[so] = compiled
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled


def _reason(exc: Exception) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /project/cpp/x.cc:94: ")."""
    lines = str(exc).strip().splitlines()
    return _LOG_PREFIX.sub("", lines[0]) if lines else type(exc).__name__


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_NAMES = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regular expression",
          "choice": "list of choices", "grammar": "grammar"}


class Matcher:
    """One sequence's place in its grammar: the tokens it has accepted so far."""

    def __init__(self, compiled: Any):
        self._matcher = _xgr().GrammarMatcher(compiled)
        self.accepted: list[int] = []

    def follow(self, history: list[int]) -> bool:
        """Move to the end of `history` (the output so far, drafts included): roll back
        past what it does not share, accept the rest. False if the grammar refuses one of
        its tokens (the matcher then stays at the last token it took)."""
        common = 0
        for a, b in zip(self.accepted, history, strict=False):
            if a != b:
                break
            common += 1
        if common < len(self.accepted):
            self._matcher.rollback(len(self.accepted) - common)
            del self.accepted[common:]
        for token in history[common:]:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                return False
            self.accepted.append(token)
        return True

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self._matcher.stop_token_ids)

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into `bitmask[row]`; False (row left as it is)
        once the grammar has ended, where any token may follow (`ignore_eos`)."""
        if self._matcher.is_terminated():
            return False
        self._matcher.fill_next_token_bitmask(bitmask, row)
        return True


def _allow_only(row: torch.Tensor, token_ids: Iterable[int]) -> None:
    """Set a bitmask row (32 tokens per int32 word, bit i of word w: token 32w + i) to
    allow exactly `token_ids`."""
    words: dict[int, int] = {}
    for t in token_ids:
        words[t // 32] = words.get(t // 32, 0) | (1 << (t % 32))
    row.zero_()
    for w, bits in words.items():
        row[w] = bits - (1 << 32) if bits >= 1 << 31 else bits  # as a signed int32


def mask_rows(logits: torch.Tensor, matchers: list[Matcher | None],
              outputs: list[list[int]]) -> torch.Tensor:
    """Bar in place, in each row with a matcher, every token its grammar refuses after
    that row's output `outputs[r]`; `logits` are [R, vocab] float32."""
    rows = [r for r, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    xgr = _xgr()
    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[-1])
    masked = []
    for r in rows:
        m = matchers[r]
        if m.follow(outputs[r]) and m.fill(bitmask, r):
            masked.append(r)
            if not bitmask[r].any():  # a dead end: the end of text, not a token it bars
                _allow_only(bitmask[r], m.stop_token_ids)
    if masked and native.cpu_kernels(logits.device) and logits.dtype == torch.float32:
        # xgrammar's CPU apply is a scalar loop; the masked stores write 16 tokens at once
        torch.ops.batchlens.bar_tokens(logits, bitmask, torch.tensor(masked, dtype=torch.long))
    elif masked:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=masked,
                                        vocab_size=logits.shape[-1])
    return logits
