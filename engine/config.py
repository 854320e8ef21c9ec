"""Validated configuration: `EngineConfig` for the engine, `SamplingParams` per request.

Bad values raise `ValueError` naming the field and the allowed range, so the UI can show
the message as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        upper = "" if high is None else f" and <= {high}"
        raise ValueError(f"{name} must be >= {low}{upper}, got {value}")


GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty / frequency_penalty: [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
SPECULATIVE_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16
MAX_PROMPT_LOOKUP = 16
MAX_N = 16  # parallel sampling: candidates per request
MAX_SEED = 2**63 - 1
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def check_speculative(method: str | None, num_speculative_tokens: int,
                      prompt_lookup_min: int, prompt_lookup_max: int) -> None:
    """Raise `ValueError` naming the field when a speculative-decoding setting is wrong
    (shared by `EngineConfig` and the local PC)."""
    if method is not None and method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative must be None or one of {SPECULATIVE_METHODS}, "
                         f"got {method!r}")
    _check_int("num_speculative_tokens", num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
    _check_int("prompt_lookup_min", prompt_lookup_min, 1, MAX_PROMPT_LOOKUP)
    _check_int("prompt_lookup_max", prompt_lookup_max, prompt_lookup_min, MAX_PROMPT_LOOKUP)


@dataclass(frozen=True)
class StructuredOutput:
    """vLLM's structured outputs: what the answer's text must follow. `kind` is one of
    `STRUCTURED_KINDS`: "json" (`spec`: a JSON schema, as JSON text), "json_object" (any
    JSON object; no spec), "regex" (`spec`: a regular expression), "choice" (`spec`: the
    tuple of strings the answer is one of) or "grammar" (`spec`: an EBNF grammar whose
    start rule is `root`). Whether a spec compiles is known only where the tokenizer is
    (`engine.grammar`)."""

    kind: str
    spec: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured: kind must be one of {STRUCTURED_KINDS}, "
                             f"got {self.kind!r}")
        spec = self.spec
        if self.kind == "json_object":
            if spec:
                raise ValueError("structured: json_object takes no spec")
        elif self.kind == "choice":
            if (not isinstance(spec, tuple) or not spec
                    or any(not isinstance(c, str) or not c for c in spec)):
                raise ValueError("structured: choice must be a non-empty list of non-empty "
                                 f"strings, got {spec!r}")
        elif not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"structured: {self.kind} must be a non-empty string, "
                             f"got {spec!r}")


@dataclass
class EngineConfig:
    """Settings of the datacenter engine.

    model: None for the bundled SmolLM2-135M-Instruct, else a local HF folder or .gguf path.
    num_kv_blocks: size of the KV pool in blocks; None sizes it by `kv_cache_memory_gb`.
    kv_cache_memory_gb: memory budget for the KV pool when `num_kv_blocks` is None;
        None picks a default (1 GiB on CPU, or the RAM free for it where less but at
        least 16,384 tokens; 40% of free memory on CUDA).
    max_prefill_attention: cap on a prefill chunk's tokens x the context it attends to
        (tokens already computed), so that one step of a long prompt stays short and a
        cancel (Stop, a closed tab, a dropped HTTP client) takes effect within a step;
        a chunk is never cut below `MIN_PREFILL_CHUNK` tokens. None: no cap.
    speculative: "ngram" turns on speculative decoding by n-gram prompt lookup (see
        engine/speculative.py); None (the default) leaves it off. Up to
        `num_speculative_tokens` drafts per step are proposed by matching the last
        `prompt_lookup_max` down to `prompt_lookup_min` tokens against earlier text.
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_prefill_attention: int | None = 512 * 1024
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    num_threads: int | None = None
    speculative: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check_int("block_size", self.block_size, 1, 1024)
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 1)
        if self.kv_cache_memory_gb is not None and not (
            isinstance(self.kv_cache_memory_gb, int | float)
            and math.isfinite(self.kv_cache_memory_gb)
            and self.kv_cache_memory_gb > 0
        ):
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")
        _check_int("max_num_seqs", self.max_num_seqs, 1, 4096)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_prefill_attention is not None:
            _check_int("max_prefill_attention", self.max_prefill_attention, 1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2)
        if self.num_threads is not None:
            _check_int("num_threads", self.num_threads, 1, 1024)
        check_speculative(self.speculative, self.num_speculative_tokens,
                          self.prompt_lookup_min, self.prompt_lookup_max)


def _check_range(name: str, value: object, low: float, high: float) -> None:
    if (not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value)
            or not low <= value <= high):
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value!r}")


def _check_logprobs(name: str, value: object) -> None:
    if value is not None:
        _check_int(name, value, 0, MAX_LOGPROBS)


def _check_logit_bias(bias: object) -> None:
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    for token, value in bias.items():
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ValueError(f"logit_bias: token ids must be integers >= 0, got {token!r}")
        _check_range(f"logit_bias[{token}]", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)


def check_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Raise `ValueError` naming the field when `params` names a token id past the
    vocabulary (known only where the model is: each side's `check`)."""
    for token in params.logit_bias:
        if token >= vocab_size:
            raise ValueError(f"logit_bias: token id {token} is out of range "
                             f"(vocabulary of {vocab_size})")
    for name, tokens in (("allowed_token_ids", params.allowed_token_ids or ()),
                         ("bad_words_token_ids", [t for w in params.bad_words_token_ids
                                                  for t in w])):
        for token in tokens:
            if token >= vocab_size:
                raise ValueError(f"{name}: token id {token} is out of range "
                                 f"(vocabulary of {vocab_size})")


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops. temperature 0 means greedy.

    As vLLM's sampler: logprobs come from the raw logits; then logit_bias, then the
    repetition, frequency and presence penalties change the logits (greedy rows take
    their argmax); sampled rows then apply temperature, min_p, top-k and top-p.

    presence_penalty, frequency_penalty: subtracted once per token present in the output,
        and once per occurrence there (OpenAI's definition).
    repetition_penalty: divides a positive logit (multiplies a negative one) of every token
        in the prompt or the output; 1 is off.
    logit_bias: token id -> value added to its logit.
    allowed_token_ids: vLLM's: only these tokens may be chosen (None: any).
    include_stop_str_in_output: vLLM's: a stop string that ends the answer stays in it.
    skip_special_tokens: vLLM's: special tokens (an end of turn) add no text; False keeps
        theirs.
    bad_words_token_ids: vLLM's bad words, tokenized: the last token of each is barred
        where the output so far ends with the ones before it.
    structured: vLLM's structured outputs (`StructuredOutput`): each step bars every token
        that would take the answer off its schema, regex, choices or grammar.
    cache_salt: vLLM's: the prompt's blocks are prefix-cache hits only for requests with
        the same salt (not a sampling setting; it travels with them, as vLLM's request
        field does with its request).
    min_p: drop tokens whose probability is below min_p x the most likely token's.
    logprobs: None for none; k for the chosen token's log-probability and the top k.
    prompt_logprobs: the same for every prompt token (the first has none).
    n: parallel sampling, the number of candidates (answers) to the one prompt. Candidate i
        samples with its own generator, seeded `seed + i` when a seed is given, so it equals
        the single request with that seed (see `candidate_params`).
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids are not honoured before this many tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    structured: StructuredOutput | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1)
        t = self.temperature
        if not isinstance(t, int | float) or isinstance(t, bool) or math.isnan(t) or t < 0:
            raise ValueError(f"temperature must be a number >= 0, got {t!r}")
        if math.isinf(t):
            raise ValueError("temperature must be finite, got inf")
        _check_int("top_k", self.top_k, 0)
        p = self.top_p
        if not isinstance(p, int | float) or math.isnan(p) or not (0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        _check_int("n", self.n, 1, MAX_N)
        if self.seed is not None:  # every candidate's seed, seed + i, stays in range
            _check_int("seed", self.seed, 0, MAX_SEED - (self.n - 1))
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if any(not isinstance(i, int) or i < 0 for i in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of token ids >= 0")
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        _check_range("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_range("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        r = self.repetition_penalty
        if (not isinstance(r, int | float) or isinstance(r, bool) or not math.isfinite(r)
                or r <= 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        _check_logit_bias(self.logit_bias)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_logprobs("logprobs", self.logprobs)
        _check_logprobs("prompt_logprobs", self.prompt_logprobs)
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, list) or not allowed or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in allowed)):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids >= 0, "
                             f"got {allowed!r}")
        if not isinstance(self.bad_words_token_ids, list) or any(
                not isinstance(w, list) or not w
                or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in w)
                for w in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must be a list of non-empty lists of token "
                             f"ids >= 0, got {self.bad_words_token_ids!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError("structured must be a StructuredOutput or None, "
                             f"got {self.structured!r}")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or so close to it (< 1e-5, as vLLM) that dividing the logits by
        it would overflow: both sample the argmax."""
        return self.temperature < GREEDY_EPS

    @property
    def processes_logits(self) -> bool:
        """logit_bias, allowed_token_ids, bad words, a structured output or a penalty is
        set: the logits change before greedy or sampling."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.allowed_token_ids is not None
                    or self.bad_words_token_ids or self.structured is not None)


def candidate_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params candidate `index` of a parallel-sampling request samples with: the same,
    with the seed `seed + index` when one is given (candidate 0 keeps the request's)."""
    if params.seed is None or index == 0:
        return params
    return replace(params, seed=params.seed + index)
