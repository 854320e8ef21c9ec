"""`batchlens serve`: the OpenAI-compatible API alone, without the dashboard.

    batchlens serve [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--max-waiting N]
        [--requests-per-minute N] [--tokens-per-minute N] [engine flags]
        [--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}']
        [--chat-template FILE] [--enable-auto-tool-choice --tool-call-parser NAME]

One engine is built at start (the model loads once) and serves every request; the API key
comes from `--api-key` or the environment variable BATCHLENS_API_KEY (none: no auth;
several keys separated by commas). Rate limits are per key, or per client address without
one. Prometheus metrics are served at /metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Any

from engine.config import DEVICES, DTYPES, EngineConfig
from server.tool_parsers import PARSERS

PROG = "batchlens serve"
API_KEY_ENV = "BATCHLENS_API_KEY"


def origins(text: str) -> list[str]:
    """`--allowed-origins`: a JSON list of origins (strings)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(o, str) for o in value):
        raise argparse.ArgumentTypeError(f"a JSON list of origins such as "
                                         f"'[\"https://chat.example\"]', got {text!r}")
    return value


def prefix(text: str) -> str:
    """`--metrics-prefix`: a Prometheus name prefix (`server.metrics.metrics_prefix`)."""
    from server.metrics import metrics_prefix

    try:
        return metrics_prefix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("metrics prefix: ")) from None


def template(value: str) -> str:
    """`--chat-template`: a Jinja file, or the template itself (`protocol.read_chat_template`)."""
    from server.protocol import read_chat_template

    try:
        return read_chat_template(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("chat template: ")) from None


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    ap.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    ap.add_argument("--api-key", help=f"require `Authorization: Bearer KEY` on /v1 routes "
                    f"(default: ${API_KEY_ENV}, else none)")
    ap.add_argument("--max-waiting", type=int, default=256,
                    help="refuse requests (429) while this many wait (default: %(default)s)")
    ap.add_argument("--requests-per-minute", type=int,
                    help="per API key (or client address): 429 past it (default: no limit)")
    ap.add_argument("--tokens-per-minute", type=int,
                    help="prompt + output tokens per API key (or client address) per minute "
                    "(default: no limit)")
    ap.add_argument("--allowed-origins", type=origins, default=["*"], metavar="JSON",
                    help="origins a browser page may call the API from, a JSON list as "
                    "vLLM's flag takes (default: %(default)s; [] for none)")
    ap.add_argument("--metrics-prefix", type=prefix, default="batchlens:", metavar="NAME",
                    help="what /metrics' names start with: vllm lets a dashboard built for "
                    "vLLM read them unmodified (default: batchlens)")
    ap.add_argument("--chat-template", type=template, metavar="FILE",
                    help="a Jinja chat template in place of the model's, as vLLM's flag "
                    "(e.g. deploy/chat_templates/hermes_tools.jinja: tools for the bundled "
                    "model)")
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help='serve tool_choice "auto" (the default once tools are sent): the '
                    "model's own calls, found by --tool-call-parser")
    ap.add_argument("--tool-call-parser", choices=PARSERS,
                    help="the model's tool-call format (hermes: Hermes, Qwen2.5 and "
                    "hermes_tools.jinja; llama3_json: Llama 3.1-3.3)")
    ap.add_argument("--log-level", default="info",
                    choices=("critical", "error", "warning", "info", "debug"))
    eng = ap.add_argument_group("engine")
    defaults = EngineConfig()
    eng.add_argument("--model", help="a local HF folder or .gguf file (default: the "
                     "bundled SmolLM2-135M-Instruct)")
    eng.add_argument("--device", choices=DEVICES, default=defaults.device)
    eng.add_argument("--dtype", choices=DTYPES, default=defaults.dtype)
    eng.add_argument("--block-size", type=int, default=defaults.block_size,
                     help="tokens per KV block (default: %(default)s)")
    eng.add_argument("--num-kv-blocks", type=int, help="KV pool size in blocks "
                     "(default: sized by --kv-cache-memory-gb)")
    eng.add_argument("--kv-cache-memory-gb", type=float,
                     help="KV pool budget (default: 1 GiB on CPU, less where less RAM is "
                     "free; 40%% of free GPU memory)")
    eng.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                     help="requests running at once (default: %(default)s)")
    eng.add_argument("--max-num-batched-tokens", type=int,
                     default=defaults.max_num_batched_tokens,
                     help="token budget of one step (default: %(default)s)")
    eng.add_argument("--no-prefix-caching", action="store_true",
                     help="turn the prefix cache off")
    eng.add_argument("--speculative-config", metavar="JSON",
                     help='speculative decoding, as vLLM\'s flag: e.g. \'{"method": "ngram", '
                     '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                     '"prompt_lookup_min": 2}\' (default: off)')
    return ap


SPEC_KEYS = {"method": "speculative", "num_speculative_tokens": "num_speculative_tokens",
             "prompt_lookup_min": "prompt_lookup_min", "prompt_lookup_max": "prompt_lookup_max"}


def speculative_fields(text: str | None) -> dict[str, Any]:
    """`--speculative-config` as `EngineConfig` fields; `ValueError` naming what is wrong."""
    if not text:
        return {}
    try:
        given = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config: not JSON ({exc.msg})") from None
    if not isinstance(given, dict) or "method" not in given:
        raise ValueError('--speculative-config: a JSON object with "method" is needed')
    if unknown := sorted(set(given) - set(SPEC_KEYS)):
        raise ValueError(f"--speculative-config: unknown keys {unknown} "
                         f"(known: {', '.join(SPEC_KEYS)})")
    return {SPEC_KEYS[k]: v for k, v in given.items()}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine settings the flags ask for (raises ValueError naming a bad one)."""
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        **speculative_fields(args.speculative_config))


def metrics_for(engine: Any, prefix: str = "batchlens:") -> Any | None:
    """A Prometheus exporter watching `engine`, its names under `prefix` (None when
    server.metrics is absent)."""
    try:
        from server.metrics import ServerMetrics
    except ImportError:
        return None
    metrics = ServerMetrics(lambda: engine, model_name=engine.loaded.name, prefix=prefix)
    metrics.watch(engine)
    return metrics


def unbindable(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (in use, no such address), or None.
    Bound as uvicorn binds (SO_REUSEADDR), then let go."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"--host {host}: not an address here ({exc.strerror})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror}"
    return None


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Build the engine, then serve the API with uvicorn until interrupted."""
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        ap.error("--enable-auto-tool-choice needs --tool-call-parser (one of "
                 f"{', '.join(PARSERS)})")
    if args.tool_call_parser is not None and not args.enable_auto_tool_choice:
        print(f"{prog}: --tool-call-parser serves tool_choice \"auto\" only with "
              "--enable-auto-tool-choice, as vLLM's; without it \"auto\" is a 400",
              file=sys.stderr, flush=True)
    if not 1 <= args.port <= 65535:
        ap.error(f"--port must be in [1, 65535], got {args.port}")
    if (taken := unbindable(args.host, args.port)) is not None:
        ap.error(taken)  # before the model loads, not after
    if args.max_waiting < 0:
        ap.error("--max-waiting must be >= 0")
    for flag in ("requests_per_minute", "tokens_per_minute"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    try:
        config = engine_config(args)
    except ValueError as exc:
        ap.error(str(exc))

    import uvicorn
    from starlette.applications import Starlette

    from engine.engine import Engine
    from server.routes import api_routes, cors_middleware

    print(f"{prog}: loading the model ...", file=sys.stderr, flush=True)
    engine = Engine(config)
    try:
        stats = engine.stats(steps_after=None)
        print(f"{prog}: {engine.loaded.name} on {stats.device} ({stats.dtype}), "
              f"{engine.kv.num_blocks} KV blocks of {config.block_size} tokens; "
              f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
        key = args.api_key or os.environ.get(API_KEY_ENV) or ""
        routes = api_routes(lambda: engine, model_name=engine.loaded.name,
                            api_key=[k.strip() for k in key.split(",") if k.strip()],
                            max_waiting=args.max_waiting,
                            requests_per_minute=args.requests_per_minute,
                            tokens_per_minute=args.tokens_per_minute,
                            metrics=metrics_for(engine, args.metrics_prefix),
                            tool_parser=(args.tool_call_parser
                                         if args.enable_auto_tool_choice else None),
                            chat_template=args.chat_template)
        app = Starlette(routes=routes, middleware=cors_middleware(args.allowed_origins))
        uvicorn.run(app, host=args.host, port=args.port,
                    log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
