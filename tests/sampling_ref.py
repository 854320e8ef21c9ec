"""A plain, one-row-at-a-time reference of vLLM's sampling steps, for the sampler tests.

Written for reading, not speed: loops over a row's tokens with Python and torch scalar
ops, in the order vLLM V1's sampler applies them.
"""

from __future__ import annotations

from collections import Counter

import torch

from engine.config import SamplingParams


def reference_penalize(
    row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """logit_bias, then repetition, frequency and presence penalties, on one float32 row."""
    x = row.clone()
    for token, bias in p.logit_bias.items():
        x[token] += bias
    if p.repetition_penalty != 1.0:
        for token in set(prompt) | set(output):
            if x[token] > 0:
                x[token] = x[token] / p.repetition_penalty
            else:
                x[token] = x[token] * p.repetition_penalty
    for token, count in Counter(output).items():
        x[token] -= p.frequency_penalty * count
        x[token] -= p.presence_penalty
    return x


def reference_filter(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then min_p, then top-k, then top-p on one processed row; dropped
    tokens get -inf."""
    x = row / (p.temperature or 1.0)
    vocab = x.shape[0]
    if p.min_p > 0:
        probs = torch.softmax(x, dim=-1)
        floor = p.min_p * float(probs.max())
        for t in range(vocab):
            if probs[t] < floor:
                x[t] = float("-inf")
    if 0 < p.top_k < vocab:
        kth = torch.sort(x, descending=True).values[p.top_k - 1]
        for t in range(vocab):
            if x[t] < kth:
                x[t] = float("-inf")
    if p.top_p < 1.0:
        probs = torch.softmax(x, dim=-1)
        above = 0.0  # probability of the tokens ranked above this one
        for t in torch.sort(x, descending=True).indices.tolist():
            if above >= p.top_p:
                x[t] = float("-inf")
            above += float(probs[t])
    return x


def reference_process(
    row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """Every step that changes the logits: penalties, and for a sampled row the filters."""
    x = reference_penalize(row, p, prompt, output)
    return x if p.greedy else reference_filter(x, p)


def reference_draw(processed: torch.Tensor, generator: torch.Generator) -> int:
    """The sampler's documented exponential race for one token: one 63-bit seed from the
    request's generator seeds a generator that fills Exp(1) noise; argmax(probs / noise)."""
    seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator))
    noise = torch.empty_like(processed).exponential_(
        generator=torch.Generator(device=processed.device).manual_seed(seed)
    )
    return int((torch.softmax(processed, dim=-1) / noise).argmax())
