"""Token sampling for a whole batch on the logits' device, with per-request parameters.

The order is vLLM V1's sampler's::

    raw logits -> (logprobs, `token_logprobs`)
               -> structured output's mask (engine/grammar) -> allowed_token_ids
               -> bad words -> logit_bias -> penalties                        `process_logits`
               -> greedy rows: argmax
               -> sampled rows: temperature -> min_p -> top-k -> top-p      `filter_batch`
                                -> exponential race                          `sample`

Greedy rows take one batched argmax (`greedy`: in place on a CPU's bfloat16 logits).
Sampled rows apply temperature, min_p, top-k and top-p as tensor ops over all of them at
once, then draw by the exponential race (argmax of probs / E with E ~ Exp(1), which picks
token i with probability probs[i]). The only device->host copy is the final `.tolist()` of
the chosen ids. A batch where no row sets logit_bias or a penalty skips
`process_logits` entirely, and one without min_p skips that step.

Log-probabilities (`token_logprobs`) come from the raw logits, vLLM's default
`logprobs_mode` "raw_logprobs": a float32 log_softmax before logit_bias, penalties,
temperature or any filter, so they describe the model, not the sampling settings. Only
rows that asked for them pay for the log_softmax.

Penalties count tokens as vLLM does: each row's token ids are padded into one [R, L]
tensor (the pad id is `vocab`, one spare column) and `scatter_add`ed into [R, vocab + 1]
counts, so no Python loop runs over the vocabulary.

The model runner's rows map to requests by `spec_offsets`: a request verifying k drafts
owns k + 1 consecutive rows, so its penalties (`token_histories`) and its recorded
log-probabilities (`record_sample_logprobs`) follow its drafts row by row.

Reproducibility: each sampled request keeps its own CPU `torch.Generator` (seeded when
the request gives a seed). For every token it draws one 63-bit number from it (a CPU op,
no device sync), and that number seeds the device generator that fills the row's noise.
So a row's draws depend only on its own generator and its own logits, never on which
other requests share the batch, and the same seed gives the same tokens on the same device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.config import SamplingParams
from engine.grammar import Matcher, mask_rows
from engine.models import native
from engine.sequence import TokenLogprob

if TYPE_CHECKING:
    from engine.sequence import Sequence


def greedy(logits: torch.Tensor) -> list[int]:
    """Each row's argmax: the first largest logit (a NaN above all), as `torch.argmax`.
    Logits on an AVX-512 CPU (bfloat16 as the model made them, float32 after the sampler's
    processing) are read in place by the native kernel; elsewhere torch's argmax runs on a
    float32 copy (on bfloat16 it was 2x slower than copy + argmax)."""
    if native.cpu_kernels(logits.device) and native.avx512():
        return torch.ops.batchlens.argmax_rows(logits).tolist()
    if logits.device.type == "cpu" and logits.dtype != torch.float32:
        logits = logits.float()
    return logits.argmax(dim=-1).tolist()


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A CPU generator for a sampled request (seeded if a seed is given)."""
    if params.greedy:
        return None
    g = torch.Generator(device="cpu")
    if params.seed is not None:
        g.manual_seed(params.seed)
    else:
        g.seed()
    return g


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) on one row of float32 logits."""
    return filter_batch(logits[None], [params])[0]


def filter_batch(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then min_p, then top-k, then top-p on [R, vocab] float32 logits, one
    params per row, as tensor ops for all rows at once; filtered-out tokens get -inf."""
    dev, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([p.temperature or 1.0 for p in params], device=dev)
    x = logits / temps[:, None]
    if any(p.min_p > 0 for p in params):
        x = apply_min_p(x, torch.tensor([p.min_p for p in params], device=dev))
    if all(not (0 < p.top_k < vocab) and p.top_p >= 1.0 for p in params):
        return x
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                         device=dev)
    # 2.0: a row without top-p never drops a token (cumulative sums stay below it)
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], device=dev)
    ranked, order = torch.sort(x, dim=-1, descending=True)
    kth = ranked.gather(1, (top_k - 1)[:, None])
    ranked = ranked.masked_fill(ranked < kth, float("-inf"))
    probs = torch.softmax(ranked, dim=-1)
    # drop a token when the tokens ranked above it already reach top_p
    drop = probs.cumsum(-1) - probs >= top_p[:, None]
    ranked = ranked.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, ranked)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop (to -inf) each row's tokens whose probability is below min_p[row] x the row's
    largest probability; min_p 0 keeps every token."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


# ---- logit_bias and penalties (they change greedy choices too) -----------------------------
def process_logits(logits: torch.Tensor, params: list[SamplingParams],
                   histories: list[tuple[list[int], list[int]]],
                   matchers: list[Matcher | None] | None = None) -> torch.Tensor:
    """The structured output's mask, allowed_token_ids, bad words, logit_bias, then the
    repetition, frequency and presence penalties, on [R, vocab] float32 logits;
    `histories[r]` is row r's (prompt ids, output ids so far), `matchers[r]` its
    sequence's grammar matcher (None: no structured output). Only the rows that set one of
    them are computed; the others come back as they are."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    every = len(rows) == len(params)  # one copy, not a gather and a scatter of them all
    index = torch.tensor(rows, device=logits.device)
    x = logits.clone() if every else logits.index_select(0, index)
    sub = [params[i] for i in rows]
    if matchers is not None:
        x = mask_rows(x, [matchers[i] for i in rows], [histories[i][1] for i in rows])
    x = apply_allowed(x, sub)
    x = apply_bad_words(x, sub, [histories[i][1] for i in rows])
    x = apply_logit_bias(x, sub)
    if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
           for p in sub):  # their counts are [rows, vocab] tensors: built only when asked
        x = apply_penalties(x, sub, [histories[i] for i in rows])
    return x if every else logits.index_copy(0, index, x)


def apply_allowed(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """vLLM's allowed_token_ids: every other token's logit to -inf, in the rows that set
    them (so neither greedy nor sampling can choose one)."""
    rows = [(r, p.allowed_token_ids) for r, p in enumerate(params)
            if p.allowed_token_ids is not None]
    if not rows:
        return logits
    barred = torch.zeros_like(logits, dtype=torch.bool)
    for r, allowed in rows:
        barred[r] = True
        barred[r, torch.tensor(allowed, device=logits.device)] = False
    return logits.masked_fill(barred, float("-inf"))


def apply_bad_words(logits: torch.Tensor, params: list[SamplingParams],
                    outputs: list[list[int]]) -> torch.Tensor:
    """vLLM's bad words: in each row, the last token of every bad word whose tokens before
    it end the row's output so far (a one-token word: always) to -inf."""
    barred = [(r, word[-1]) for r, (p, out) in enumerate(zip(params, outputs, strict=True))
              for word in p.bad_words_token_ids
              if len(word) == 1 or (len(word) - 1 <= len(out) and out[len(out) - len(word) + 1:]
                                    == word[:-1])]
    if not barred:
        return logits
    rows, tokens = zip(*barred, strict=True)
    dev = logits.device
    return logits.index_put((torch.tensor(rows, device=dev), torch.tensor(tokens, device=dev)),
                            torch.tensor(float("-inf"), dtype=logits.dtype, device=dev))


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Add each row's logit_bias values to its tokens' logits (one indexed add)."""
    rows, tokens, values = [], [], []
    for r, p in enumerate(params):
        rows += [r] * len(p.logit_bias)
        tokens += p.logit_bias.keys()
        values += p.logit_bias.values()
    if not rows:
        return logits
    dev = logits.device
    index = (torch.tensor(rows, device=dev), torch.tensor(tokens, device=dev))
    return logits.index_put(index, torch.tensor(values, dtype=logits.dtype, device=dev),
                            accumulate=True)


def token_counts(token_ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, vocab] int64: how often each token occurs in each row's `token_ids`."""
    width = max(map(len, token_ids), default=0)
    padded = torch.full((len(token_ids), width), vocab, dtype=torch.long)
    for r, ids in enumerate(token_ids):
        padded[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    padded = padded.to(device)
    counts = torch.zeros(len(token_ids), vocab + 1, dtype=torch.long, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    histories: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """vLLM's penalties: repetition on tokens of the prompt or the output (a positive logit
    divided by it, a negative one multiplied), then frequency x count and presence x
    (count > 0) subtracted for tokens of the output."""
    dev, vocab = logits.device, logits.shape[-1]
    output_counts = token_counts([h[1] for h in histories], vocab, dev)
    output_mask = output_counts > 0
    if any(p.repetition_penalty != 1.0 for p in params):
        # a row without a repetition penalty needs no prompt counts
        prompts = [h[0] if p.repetition_penalty != 1.0 else []
                   for p, h in zip(params, histories, strict=True)]
        seen = (token_counts(prompts, vocab, dev) > 0) | output_mask
        rep = torch.tensor([p.repetition_penalty for p in params], device=dev)
        scale = torch.where(seen, rep[:, None], 1.0)
        logits = torch.where(logits > 0, logits / scale, logits * scale)
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev)
    presence = torch.tensor([p.presence_penalty for p in params], device=dev)
    return logits - freq[:, None] * output_counts - presence[:, None] * output_mask


# ---- log-probabilities ---------------------------------------------------------------------
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


_device_generators: dict[torch.device, torch.Generator] = {}


def _row_generator(device: torch.device, seed: int) -> torch.Generator:
    """The device's noise generator, reseeded for one row (a kernel already queued keeps
    the seed it was launched with, so reseeding for the next row is safe)."""
    gen = _device_generators.get(device)
    if gen is None:
        gen = _device_generators[device] = torch.Generator(device=device)
    return gen.manual_seed(seed)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """One token per row of `logits` ([R, vocab], float32), on the logits' device."""
    chosen = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return chosen.tolist()
    dev = logits.device
    index = torch.tensor(rows, device=dev)
    probs = torch.softmax(filter_batch(logits.index_select(0, index), [params[i] for i in rows]),
                          dim=-1)
    noise = torch.empty_like(probs)
    for j, i in enumerate(rows):
        seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generators[i]))
        noise[j].exponential_(generator=_row_generator(dev, seed))
    return chosen.index_copy(0, index, (probs / noise).argmax(dim=-1)).tolist()


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a row of (possibly unnormalised) probabilities, by the exponential
    race as `sample` draws: a seed from the request's `generator` seeds the device's noise."""
    seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator))
    noise = torch.empty_like(probs).exponential_(generator=_row_generator(probs.device, seed))
    return int((probs / noise).argmax())


# ---- a step's rows and their requests ------------------------------------------------------
def spec_offsets(seqs: list[Sequence]) -> list[int]:
    """Each logits row's index within its request's rows: 0 for a plain request; 0..k for
    one verifying k drafts (its rows are consecutive)."""
    offsets, prev, j = [], None, 0
    for s in seqs:
        j = j + 1 if s is prev else 0
        offsets.append(j)
        prev = s
    return offsets


def token_histories(seqs: list[Sequence]) -> list[tuple[list[int], list[int]]]:
    """Each logits row's (prompt ids, output ids before it), for the penalties: a
    verification's row j follows the request's output and its first j drafts."""
    out = []
    for seq, j in zip(seqs, spec_offsets(seqs), strict=True):
        output = seq.output_token_ids
        out.append((seq.prompt_token_ids, output + seq.spec_token_ids[:j] if j else output))
    return out


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
