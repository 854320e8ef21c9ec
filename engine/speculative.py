"""Speculative decoding by n-gram prompt lookup: propose drafts, verify them, count them.

No draft model: a request's own text is the draft source. The proposer takes the last n
tokens of the prompt + output (n from `prompt_lookup_max` down to `prompt_lookup_min`),
finds their latest earlier occurrence, and proposes the (up to k) tokens that followed it
there. It pays where the answer copies the prompt: editing, summarising, code changes.

The target model checks a request's drafts in the same step as everything else: its last
token and the drafts are one short prefill chunk on the paged KV cache, and every one of
its positions is sampled::

    tokens   ... t[L-2]  t[L-1] | d1   d2   d3      L = num_tokens, k = 3 drafts
    K/V      in cache    this step, written past num_tokens
    logits           p0   p1   p2   p3      p_j: next-token distribution after d_j

    greedy   accept d1 if it is argmax p0, then d2 if it is argmax p1, ...; the first
             mismatch is replaced by the argmax there; all accepted: argmax p3 is a bonus
    sampled  accept d_j with probability p_{j-1}(d_j); on a rejection, sample from
             p_{j-1} with d_j removed (renormalised) and stop; all accepted: sample p_k.
             For a one-hot proposal this is exact: P(x) = p(x)  (accepted when x = d)
             + (1 - p(d)) * p(x) / (1 - p(d))  (rejected, then drawn, when x != d)

So greedy output is the same token for token as without speculation, and a sampled one
has the same distribution. After the step `num_computed_tokens` counts the last token and
the accepted drafts only: the K/V of rejected drafts lie past it (overwritten later),
blocks past it are freed (`KVCacheManager.truncate`), and prefix-cache hashes are taken
only of verified tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig, check_speculative
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import append_token
from engine.sampler import draw, filter_batch, sample
from engine.sequence import Sequence


@dataclass(frozen=True)
class Speculation:
    """An n-gram speculative-decoding setting: k drafts, the lookup window."""

    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    @classmethod
    def of(cls, method: str | None, num_speculative_tokens: int = 4,
           prompt_lookup_min: int = 2, prompt_lookup_max: int = 4) -> Speculation | None:
        """The setting for `method` ("ngram"), or None when it is off; `ValueError`
        naming the field when a value is wrong."""
        check_speculative(method, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)
        if method is None:
            return None
        return cls(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Speculation | None:
        return cls.of(config.speculative, config.num_speculative_tokens,
                      config.prompt_lookup_min, config.prompt_lookup_max)

    def proposer(self) -> NgramProposer:
        """A proposer for one request."""
        return NgramProposer(self.num_speculative_tokens, self.prompt_lookup_min,
                             self.prompt_lookup_max)


class NgramProposer:
    """One request's n-gram index: where each n-gram of its tokens last ended.

    Built incrementally: each call indexes only the tokens added since the last one, so a
    proposal costs a few dict lookups however long the request is.
    """

    __slots__ = ("k", "n_min", "n_max", "last_end", "indexed")

    def __init__(self, k: int, n_min: int, n_max: int) -> None:
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self.last_end: dict[tuple[int, ...], int] = {}  # n-gram -> position of its last token
        self.indexed = 0  # n-grams ending before this position are in `last_end`

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        """Up to k (and at most `limit`) tokens that followed the latest earlier occurrence
        of the longest matching suffix of `token_ids`; [] when none matches."""
        k = self.k if limit is None else min(self.k, limit)
        end = len(token_ids) - 1  # the suffix ends here; earlier n-grams end before it
        if k <= 0 or end < 1:
            return []
        last, n_min, n_max = self.last_end, self.n_min, self.n_max
        for e in range(self.indexed, end):
            for n in range(n_min, min(n_max, e + 1) + 1):
                last[tuple(token_ids[e - n + 1 : e + 1])] = e
        self.indexed = max(self.indexed, end)
        for n in range(min(n_max, end), n_min - 1, -1):
            e = last.get(tuple(token_ids[end - n + 1 :]))
            if e is not None:
                return token_ids[e + 1 : e + 1 + k]
        return []


@dataclass
class SpecDecodeStats:
    """Speculative-decoding counters (vLLM's `SpecDecodingStats`): verification steps
    with drafts (`num_drafts`), drafts verified, drafts accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts / drafts verified; None before any."""
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a request gains per verification step, the sampled one included
        (vLLM's "mean acceptance length": 1 + accepted / drafts); None before any."""
        if not self.num_drafts:
            return None
        return 1 + self.num_accepted_tokens / self.num_drafts

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)


# ---- verification ----------------------------------------------------------------------
def accept_greedy(drafts: list[int], best: list[int]) -> list[int]:
    """Accepted drafts, then one token: `best[j]` is the argmax after the j-th position
    (len(drafts) + 1 of them)."""
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return drafts[:n] + [best[n]]


def accept_sampled(probs: torch.Tensor, drafts: list[int], p_drafts: list[float],
                   generator: torch.Generator | None) -> list[int]:
    """Accepted drafts, then one sampled token, keeping the target distribution exactly.

    probs: [len(drafts) + 1, vocab] target probabilities (after temperature, top-k, top-p)
    of each position; p_drafts[j] = probs[j, drafts[j]]. Draws come from the request's own
    `generator` only, so a seeded request is reproducible."""
    out: list[int] = []
    for j, x in enumerate(drafts):
        if float(torch.rand((), generator=generator)) < p_drafts[j]:
            out.append(x)
            continue
        residual = probs[j].clone()  # p with the draft removed: drawn from, renormalised
        residual[x] = 0.0
        out.append(draw(residual, generator))
        return out
    out.append(draw(probs[len(drafts)], generator))
    return out


def verify_batch(
    logits: torch.Tensor, entries: list[tuple[Sequence, int]], rows: list[int],
    generators: dict[str, torch.Generator | None],
) -> dict[int, int | list[int]]:
    """Sample a step in which some entries verify drafts.

    `rows[r]` is the entry index of logits row r; an entry with drafts has 1 + len(drafts)
    consecutive rows. Entry index -> one token for a plain entry (as `sample`), or the
    accepted drafts then one token for a verifying one."""
    out: dict[int, int | list[int]] = {}
    plain: list[int] = []
    spans: list[tuple[int, int, Sequence]] = []  # (entry, first row, sequence)
    r = 0
    while r < len(rows):
        seq = entries[rows[r]][0]
        if seq.spec_token_ids:
            spans.append((rows[r], r, seq))
            r += len(seq.spec_token_ids) + 1
        else:
            plain.append(r)
            r += 1
    dev = logits.device
    if plain:
        seqs = [entries[rows[r]][0] for r in plain]
        tokens = sample(logits.index_select(0, torch.tensor(plain, device=dev)),
                        [s.params for s in seqs], [generators.get(s.request_id) for s in seqs])
        out.update(zip((rows[r] for r in plain), tokens, strict=True))
    greedy = [s for s in spans if s[2].params.greedy]
    if greedy:
        best = logits.argmax(dim=-1).tolist()
        for e, first, seq in greedy:
            k = len(seq.spec_token_ids)
            out[e] = accept_greedy(seq.spec_token_ids, best[first : first + k + 1])
    sampled = [s for s in spans if not s[2].params.greedy]
    if sampled:
        index, params, drafts = [], [], []
        for _, first, seq in sampled:
            k = len(seq.spec_token_ids)
            index += range(first, first + k + 1)
            params += [seq.params] * (k + 1)
            drafts += [*seq.spec_token_ids, 0]  # the last row's 0 is not read
        probs = torch.softmax(filter_batch(logits.index_select(0, torch.tensor(index,
                              device=dev)), params), dim=-1)
        p_drafts = probs[torch.arange(len(index), device=dev),
                         torch.tensor(drafts, device=dev)].tolist()
        at = 0
        for e, _, seq in sampled:
            k = len(seq.spec_token_ids)
            out[e] = accept_sampled(probs[at : at + k + 1], seq.spec_token_ids,
                                    p_drafts[at : at + k], generators.get(seq.request_id))
            at += k + 1
    return out


def append_verified(
    seq: Sequence, tokens: list[int], now: float, detok: IncrementalDetokenizer,
    eos_token_ids: frozenset[int], max_model_len: int,
) -> str | None:
    """Apply one verification to its request: count the drafts, append the accepted ones
    and the sampled token (up to a finish reason), move `num_computed_tokens` to the
    verified tokens (the last token and the accepted drafts), clear the drafts. Returns
    the finish reason, or None."""
    assert seq.num_computed_tokens == seq.num_tokens - 1, "drafts follow the last token"
    accepted = len(tokens) - 1
    seq.num_drafts += 1
    seq.num_draft_tokens += len(seq.spec_token_ids)
    seq.num_accepted_tokens += accepted
    counts = seq.accepted_per_position
    counts.extend([0] * (accepted - len(counts)))
    for i in range(accepted):  # drafts are accepted in order: positions 0 .. accepted - 1
        counts[i] += 1
    seq.spec_token_ids = []
    verified = seq.num_tokens + accepted
    reason = None
    for token in tokens:
        reason = append_token(seq, token, now, detok, eos_token_ids, max_model_len)
        if reason:
            break
    seq.num_computed_tokens = min(verified, seq.num_tokens)
    if len(seq.logprobs) > len(seq.output_token_ids):  # tokens past a finish: not kept
        del seq.logprobs[len(seq.output_token_ids) :]
    return reason


def draft_limit(seq: Sequence, max_model_len: int) -> int:
    """The most drafts a request may verify now: its answer's remaining tokens and the
    context, less the one token every step samples anyway."""
    return min(seq.params.max_tokens - len(seq.output_token_ids),
               max_model_len - seq.num_tokens) - 1
