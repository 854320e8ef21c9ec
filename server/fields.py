"""Which request fields this server serves, which it refuses, and which it ignores.

A field OpenAI or vLLM defines that this server does not implement (`UNSUPPORTED`: the
legacy `functions`, `suffix`, structural tags, priorities...) is a 400 naming
it when it asks for anything but the default, and so is a sampler another server offers
under its own name (`OTHER_SERVERS`: llama.cpp's `n_predict`, `repeat_penalty`,
`typical_p`, `mirostat`..., TGI's `do_sample`), with the
field to use here where there is one: a client written for llama.cpp's server learns that
its `typical_p` does nothing here instead of reading answers it did not ask for. Any other
field is ignored, as vLLM's server does (rejecting them broke OpenAI clients that send
fields of their own): `ignored_fields` names them for the server's log.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from server.errors import bad_request, shown

Body = dict[str, Any]
Check = tuple[Callable[[Any], bool], str]  # (whether a value asks for nothing missing, why)


def _absent(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


def _default(*values: Any) -> Callable[[Any], bool]:
    """A check that passes None and the given defaults (1 and 1.0 alike)."""
    return lambda v: v is None or (not isinstance(v, bool) and v in values)


# fields OpenAI or vLLM defines and this server does not implement, on both endpoints
UNSUPPORTED: dict[str, Check] = {
    "functions": (_absent, "function calling is not supported here"),
    "function_call": (lambda v: _absent(v) or v == "none", "function calling is not supported here"),
    "guided_whitespace_pattern": (_absent, "a whitespace pattern for JSON is not supported "
                                  "here"),
    "guided_decoding_backend": (lambda v: v in (None, "", "auto", "xgrammar"),
                                "the structured-output backend here is xgrammar"),
    "structural_tag": (_absent, "structural tags are not supported here"),
    "prompt_embeds": (_absent, "prompt_embeds is not supported here"),
    "priority": (_default(0), "requests are served first come, first served here "
                 "(no priority scheduling)"),
    "logits_processors": (_absent, "logits processors are not supported here"),
    "kv_transfer_params": (_absent, "KV transfer (disaggregated serving) is not supported "
                           "here"),
    "vllm_xargs": (_absent, "vllm_xargs is not supported here"),
    "mm_processor_kwargs": (_absent, "the served model takes text only"),
    "audio": (_absent, "audio output is not supported here"),
    "modalities": (lambda v: _absent(v) or v == ["text"], "only text output is supported here"),
    "prediction": (_absent, "predicted outputs are not supported here"),
    "web_search_options": (_absent, "web search is not supported here"),
    "reasoning_effort": (lambda v: v is None, "the served model does not reason, so "
                         "reasoning_effort is not supported here"),
    "verbosity": (lambda v: v is None or v == "medium", "verbosity is not supported here"),
    "store": (_absent, "completions are not stored here"),
    "service_tier": (lambda v: v in (None, "auto", "default"),
                     "service tiers are not offered here"),
}
COMPLETION_UNSUPPORTED: dict[str, Check] = {
    "tools": (_absent, "only /v1/chat/completions takes tools"),
    "tool_choice": (lambda v: _absent(v) or v == "none",
                    "only /v1/chat/completions takes tools"),
    "suffix": (_absent, "suffix (insertion) is not supported here"),
    "add_special_tokens": (lambda v: v is None or v is True,
                           "a text prompt always gets the tokenizer's special tokens here"),
    "chat_template_kwargs": (_absent, "only /v1/chat/completions has a chat template"),
    "add_generation_prompt": (_absent, "only /v1/chat/completions has a chat template"),
    "continue_final_message": (_absent, "only /v1/chat/completions has a chat template"),
}
CHAT_UNSUPPORTED: dict[str, Check] = {
    "echo": (_absent, "only /v1/completions takes echo"),
    "suffix": (_absent, "only /v1/completions takes suffix, and it is not supported here"),
    "add_special_tokens": (lambda v: v is None or v is False,
                           "a chat's templated prompt gets no more special tokens here"),
    "chat_template": (_absent, "a request cannot set the chat template here: the server's "
                      "is used (the model's, or batchlens serve --chat-template)"),
    "documents": (_absent, "documents for the chat template are not supported here"),
}
# samplers and limits other servers offer under their own names (llama.cpp's server, TGI)
OTHER_SERVERS: dict[str, Check] = {
    "n_predict": (_default(-1), "n_predict is llama.cpp's name: send max_tokens"),
    "repeat_penalty": (_default(1), "repeat_penalty is llama.cpp's name: send "
                       "repetition_penalty"),
    "n_probs": (_default(0), "n_probs is llama.cpp's name: send logprobs"),
    "typical_p": (_default(1), "typical sampling is not implemented here"),
    "tfs_z": (_default(1), "tail-free sampling is not implemented here"),
    "mirostat": (_default(0), "mirostat sampling is not implemented here"),
    "top_n_sigma": (_default(-1), "top-n-sigma sampling is not implemented here"),
    "xtc_probability": (_default(0), "XTC sampling is not implemented here"),
    "dry_multiplier": (_default(0), "DRY sampling is not implemented here"),
    "dynatemp_range": (_default(0), "dynamic temperature is not implemented here"),
    "samplers": (_absent, "the samplers' order is fixed here"),
    "do_sample": (lambda v: v is None or v is True, "do_sample is TGI's name: send "
                  "temperature 0 for greedy decoding"),
    "top_n_tokens": (_default(0), "top_n_tokens is TGI's name: send logprobs"),
    "watermark": (_absent, "watermarking is not supported here"),
    "truncate": (_absent, "prompts are never truncated here"),
}
# what the parsers read, and OpenAI's and vLLM's fields that change nothing here
SERVED = frozenset({
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs",
    "top_logprobs", "prompt_logprobs", "echo", "n", "best_of", "stream", "stream_options",
    "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "allowed_token_ids", "include_stop_str_in_output", "truncate_prompt_tokens",
    "skip_special_tokens", "return_tokens_as_token_ids", "return_token_ids", "bad_words",
    # structured outputs, under each name a client may use (server.structured)
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "json_schema", "grammar",
    # a chat's tools (server.tools)
    "tools", "tool_choice",
    "cache_salt", "use_beam_search", "length_penalty",
    # accepted, with nothing to do: who asks, tags, hints, and what is so here anyway
    "user", "metadata", "safety_identifier", "prompt_cache_key", "parallel_tool_calls",
    "request_id", "spaces_between_special_tokens", "cache_prompt",
})


def _tables(chat: bool) -> tuple[dict[str, Check], ...]:
    return (UNSUPPORTED, CHAT_UNSUPPORTED if chat else COMPLETION_UNSUPPORTED, OTHER_SERVERS)


def check_supported(body: Body, chat: bool) -> None:
    """A 400 naming the first field that asks for something not implemented here."""
    for table in _tables(chat):
        for name, (fine, why) in table.items():
            if name in body and not fine(body[name]):
                raise bad_request(f"{name}: {why} (got {shown(body[name])})", name)


def ignored_fields(body: Body, chat: bool) -> tuple[str, ...]:
    """The body's fields this server neither reads nor knows (sorted): ignored, as vLLM
    ignores them, and named in the server's log."""
    known = SERVED.union(*_tables(chat))
    return tuple(sorted(str(k) for k in body if k not in known))
