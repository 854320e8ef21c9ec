"""Token sampling for a whole batch on the logits' device, with per-request parameters.

Greedy rows take one batched argmax (`greedy`: in place on a CPU's bfloat16 logits).
Sampled rows apply temperature, top-k and top-p as tensor ops over all of them at once,
then draw by the exponential race (argmax of probs / E with E ~ Exp(1), which picks token
i with probability probs[i]). The only device->host copy is the final `.tolist()` of the
chosen ids.

Reproducibility: each sampled request keeps its own CPU `torch.Generator` (seeded when
the request gives a seed). For every token it draws one 63-bit number from it (a CPU op,
no device sync), and that number seeds the device generator that fills the row's noise.
So a row's draws depend only on its own generator and its own logits, never on which
other requests share the batch, and the same seed gives the same tokens on the same device.
"""

from __future__ import annotations

import torch

from engine.config import SamplingParams
from engine.models import native


def greedy(logits: torch.Tensor) -> list[int]:
    """Each row's argmax: the first largest logit (a NaN above all), as `torch.argmax`.
    bfloat16 logits on an AVX-512 CPU are read in place by the native kernel; elsewhere
    torch's argmax runs on a float32 copy (on bfloat16 it was 2x slower than copy + argmax)."""
    if native.layer_ops(logits.device, logits.dtype) and native.avx512():
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
    """Temperature, then top-k, then top-p on [R, vocab] float32 logits, one params per
    row, as tensor ops for all rows at once; filtered-out tokens get -inf."""
    dev, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([p.temperature or 1.0 for p in params], device=dev)
    x = logits / temps[:, None]
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
