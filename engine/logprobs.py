"""Log-probabilities of chosen and prompt tokens, as vLLM returns them.

They come from the raw logits (vLLM's default `logprobs_mode` "raw_logprobs"): a float32
log_softmax before logit_bias, penalties, temperature or any filter, so they describe the
model, not the sampling settings. Only rows that asked for them pay for the log_softmax.

A request with `logprobs=k` gets one `TokenLogprob` per output token; with
`prompt_logprobs=k` one per prompt token, the first `None` (nothing predicts it).
Position p's logits predict token p + 1::

    prompt   t0    t1    t2    t3  | o0 ...
    logits   l0    l1    l2    l3
    records  None  l0(t1) l1(t2) l2(t3)    l3 is sampled: o0's logprob, if asked
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-probability under the raw distribution, its rank, and the top k."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of token_id in the raw distribution (1 = argmax)
    top: tuple[tuple[int, float], ...]  # the top-k (token id, logprob), best first


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_logprobs: list[int]
) -> list[TokenLogprob]:
    """Row r's `TokenLogprob` of `token_ids[r]` with its top `num_logprobs[r]`, from raw
    logits [R, vocab] (any float dtype, computed in float32 on their device)."""
    if not token_ids:
        return []
    dev = logits.device
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(token_ids, device=dev)[:, None])
    # vLLM's rank: tokens at least as likely as the chosen one (ties rank it lower)
    ranks = (lp >= chosen).sum(dim=-1).tolist()
    k = max(num_logprobs)
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    return [
        TokenLogprob(t, c, rank, tuple(zip(top_ids[r][:n], top_lp[r][:n], strict=True)))
        for r, (t, c, rank, n) in enumerate(
            zip(token_ids, chosen[:, 0].tolist(), ranks, num_logprobs, strict=True)
        )
    ]


def spec_offsets(seqs: list[Sequence]) -> list[int]:
    """Each logits row's index within its request's rows: 0 for a plain request; 0..k for
    one verifying k drafts (its rows are consecutive)."""
    offsets, prev, j = [], None, 0
    for s in seqs:
        j = j + 1 if s is prev else 0
        offsets.append(j)
        prev = s
    return offsets


def record_sample_logprobs(
    logits: torch.Tensor,
    seqs: list[Sequence],
    entries: list[int],
    sampled: dict[int, int | list[int]],
) -> None:
    """Append to each asking sequence's `logprobs` the entries of the tokens sampled from
    raw `logits` (row r belongs to `seqs[r]`, entry `entries[r]`; a verification's row j
    gives its j-th verified token, and rows past them give none)."""
    rows, tokens, ks, owners = [], [], [], []
    for r, (seq, j) in enumerate(zip(seqs, spec_offsets(seqs), strict=True)):
        k = seq.params.logprobs
        if k is None:
            continue
        out = sampled[entries[r]]
        if isinstance(out, list):
            if j >= len(out):
                continue
            out = out[j]
        rows.append(r)
        tokens.append(out)
        ks.append(k)
        owners.append(seq)
    if not rows:
        return
    index = torch.tensor(rows, device=logits.device)
    for seq, lp in zip(
        owners, token_logprobs(logits.index_select(0, index), tokens, ks), strict=True
    ):
        seq.logprobs.append(lp)


def record_prompt_logprobs(logits: torch.Tensor, rows: list[tuple[Sequence, int]]) -> None:
    """Append prompt token p + 1's entry to `seq.prompt_logprobs` for each (seq, p) of
    `rows`, logits row r from position p of rows[r] (positions ascending per request)."""
    tokens = [seq.prompt_token_ids[p + 1] for seq, p in rows]
    ks = [seq.params.prompt_logprobs for seq, _ in rows]
    for (seq, p), lp in zip(rows, token_logprobs(logits, tokens, ks), strict=True):
        assert len(seq.prompt_logprobs) == p + 1, "prompt logprobs are recorded in order"
        seq.prompt_logprobs.append(lp)
