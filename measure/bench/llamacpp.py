"""llama.cpp beside this engine, same weights and thread count: `llama-bench` (tg128 and
pp512) and `llama-batched-bench` (decode with 1 and with the bench's top concurrency of
parallel sequences), printed beside the engine's own figures from the same bench run.

`llama-bench` runs twice, before the engine's runs and after them, and its figures are the
mean of both sets: its tests take seconds while the engine's batch-1 run takes a minute or
more, and on a shared host the memory's speed moves from one minute to the next, so runs
on both sides of the engine's stand for the same stretch of time.

The binaries and the GGUF come from `make compat` (scripts/build_llama_server.sh): it builds
them from the llama-cpp-python sdist's vendored tree into the cache, and converts the
engine's cached safetensors folder with that tree's `convert_hf_to_gguf.py`, so both sides
read the same weights (a GGUF named after the folder and the dtype).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.models.loader import cache_root

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the sdist scripts/build_llama_server.sh builds from
TOOLS = ("llama-bench", "llama-batched-bench")
OUTTYPE = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}  # torch dtype -> GGUF
REPETITIONS = 3  # llama-bench's runs per test; it reports their mean
TIMEOUT_S = 1800.0


class LlamaCppMissing(RuntimeError):
    """The llama.cpp binaries or the GGUF are not there; the message says what to run."""


@dataclass(frozen=True)
class LlamaCpp:
    """Where the built tools and the GGUF of the engine's weights lie."""

    bin_dir: Path
    gguf: Path

    def command(self, tool: str, *args: str) -> tuple[list[str], dict[str, str]]:
        """A tool's command line and environment (its shared libraries lie beside it)."""
        libs = f"{self.bin_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}"
        return [str(self.bin_dir / tool), *args], os.environ | {"LD_LIBRARY_PATH": libs}


@dataclass(frozen=True)
class BenchFigure:
    """One `llama-bench` test: tg128 (128 tokens decoded at batch 1) or pp512 (a
    512-token prompt), its mean tokens/s over the repetitions and each repetition's; the
    first `before` samples ran before the engine's runs (`bracketed`)."""

    test: str
    tokens_per_s: float
    samples: list[float]
    threads: int
    before: int = 0


@dataclass(frozen=True)
class BatchedFigure:
    """One `llama-batched-bench` row: `pl` sequences each given a `pp`-token prompt, then
    `tg` decode steps for all of them; prompt and decode tokens/s."""

    pp: int
    tg: int
    pl: int
    prompt_tokens_per_s: float
    decode_tokens_per_s: float
    threads: int


def cache_dir() -> Path:
    """The build's cache folder (where scripts/build_llama_server.sh puts it)."""
    env = os.environ.get("BATCHLENS_LLAMA_CACHE")
    return Path(env) if env else cache_root() / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"


def gguf_for(folder: Path, dtype: str) -> Path:
    """The GGUF the build script converts `folder` into, for a torch dtype name."""
    if dtype not in OUTTYPE:
        raise ValueError(f"dtype {dtype!r}: llama.cpp comparison supports {sorted(OUTTYPE)}")
    return cache_dir() / "gguf" / f"{folder.name}.{OUTTYPE[dtype]}.gguf"


def find_tools() -> Path:
    """The folder of the built tools; `LlamaCppMissing` when any is not built."""
    bin_dir = cache_dir() / "build" / "bin"
    if missing := [t for t in TOOLS if not (bin_dir / t).is_file()]:
        raise LlamaCppMissing(f"--llamacpp: {', '.join(missing)} not built in {bin_dir}; "
                              "run `make compat` first (or `make llama-server`)")
    return bin_dir


def find(folder: Path, dtype: str) -> LlamaCpp:
    """The tools and the GGUF of the weights in `folder` at `dtype`, or `LlamaCppMissing`
    naming the command that makes what is missing."""
    bin_dir = find_tools()
    gguf = gguf_for(folder, dtype)
    if not gguf.is_file():
        raise LlamaCppMissing(
            f"--llamacpp: no GGUF of these weights at {gguf}; run `make compat` first "
            f"(the bundled model) or `scripts/build_llama_server.sh --convert {folder} "
            f"{OUTTYPE[dtype]}`")
    return LlamaCpp(bin_dir, gguf)


def parse_llama_bench(text: str) -> list[BenchFigure]:
    """`llama-bench -o json` output: one figure per test, named as llama-bench names it."""
    figures = []
    for row in json.loads(text):
        n_prompt, n_gen = int(row["n_prompt"]), int(row["n_gen"])
        test = f"pp{n_prompt}" if n_gen == 0 else f"tg{n_gen}" if n_prompt == 0 else \
            f"pp{n_prompt}+tg{n_gen}"
        figures.append(BenchFigure(test, float(row["avg_ts"]),
                                   [float(s) for s in row["samples_ts"]], int(row["n_threads"])))
    return figures


def parse_batched_bench(text: str) -> list[BatchedFigure]:
    """`llama-batched-bench --output-format jsonl` output: one figure per JSON line (its
    log lines, which start otherwise, are skipped)."""
    figures = []
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        figures.append(BatchedFigure(int(r["pp"]), int(r["tg"]), int(r["pl"]),
                                     float(r["speed_pp"]), float(r["speed_tg"]),
                                     int(r["n_threads"])))
    if not figures:
        raise ValueError("llama-batched-bench printed no result line: "
                         f"{text.strip()[-500:] or '(nothing)'}")
    return figures


def _run(tools: LlamaCpp, tool: str, *args: str) -> str:
    cmd, env = tools.command(tool, *args)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): "
                           f"{done.stderr.strip()[-1000:]}")
    return done.stdout


def run_llama_bench(tools: LlamaCpp, threads: int) -> list[BenchFigure]:
    """tg128 and pp512 on `threads` threads, `REPETITIONS` runs each."""
    out = _run(tools, "llama-bench", "-m", str(tools.gguf), "-p", "512", "-n", "128",
               "-t", str(threads), "-r", str(REPETITIONS), "-o", "json")
    return parse_llama_bench(out)


def bracketed(before: list[BenchFigure], after: list[BenchFigure]) -> list[BenchFigure]:
    """Each test of `after` with the samples of the same test in `before` ahead of its own,
    and the mean of them all."""
    earlier = {f.test: f for f in before}
    out = []
    for f in after:
        first = earlier[f.test].samples if f.test in earlier else []
        samples = [*first, *f.samples]
        out.append(BenchFigure(f.test, statistics.mean(samples), samples, f.threads,
                               len(first)))
    return out


def run_batched_bench(tools: LlamaCpp, threads: int, parallel: list[int], pp: int,
                      tg: int) -> list[BatchedFigure]:
    """`pl` sequences of a `pp`-token prompt then `tg` decode steps, for each `pl` in
    `parallel`, on `threads` threads; the context holds the largest."""
    ctx = max(parallel) * (pp + tg)
    out = _run(tools, "llama-batched-bench", "-m", str(tools.gguf), "-c", str(ctx),
               "-npp", str(pp), "-ntg", str(tg), "-npl", ",".join(map(str, parallel)),
               "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl")
    return parse_batched_bench(out)


def engine_figures(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The engine's figures to set beside llama.cpp's, from the bench's runs (name ->
    {"summary": ..., "time": step_breakdown}): decode-only tokens/s and prompt tokens/s of
    engine@1 (at concurrency 1 a step with prompt tokens holds nothing else), decode-only
    tokens/s and end-to-end tokens/s of every engine@c."""
    out: dict[str, float] = {}
    for name, r in runs.items():
        t = r.get("time") or {}
        if not name.startswith("engine@"):
            continue
        if t.get("decode_s"):
            out[f"{name} decode"] = t["decode_tokens"] / t["decode_s"]
        if name == "engine@1" and t.get("prefill_s"):
            out["engine@1 prompt"] = t["prefill_tokens"] / t["prefill_s"]
        if r.get("summary"):
            out[f"{name} end to end"] = r["summary"]["throughput"]
    return out


def comparison(bench: list[BenchFigure], batched: list[BatchedFigure],
               engine: dict[str, float], gguf: Path) -> str:
    """The side-by-side table as printed: each llama.cpp figure, the engine's figure it
    compares with, and their ratio."""
    rows: list[tuple[str, float, str, float | None]] = []
    by_test = {b.test: b for b in bench}
    if "tg128" in by_test:
        rows.append(("llama-bench tg128 (batch 1)", by_test["tg128"].tokens_per_s,
                     "engine@1 decode", engine.get("engine@1 decode")))
    if "pp512" in by_test:
        rows.append(("llama-bench pp512", by_test["pp512"].tokens_per_s,
                     "engine@1 prompt", engine.get("engine@1 prompt")))
    for b in batched:
        rows.append((f"batched-bench {b.pl} seqs decode", b.decode_tokens_per_s,
                     f"engine@{b.pl} decode", engine.get(f"engine@{b.pl} decode")))
    threads = {f.threads for f in [*bench, *batched]}
    lines = [f"llama.cpp beside this engine (tokens/s; {gguf.name}, "
             f"{'/'.join(map(str, sorted(threads)))} threads):",
             f"{'llama.cpp':<34}{'tok/s':>9}   {'engine':<22}{'tok/s':>9}{'ratio':>8}"]
    for name, theirs, ours_name, ours in rows:
        ours_s = f"{ours:>9.1f}{ours / theirs:>7.2f}x" if ours else f"{'n/a':>9}{'':>8}"
        lines.append(f"{name:<34}{theirs:>9.1f}   {ours_name:<22}{ours_s}")
    if batched:
        b = batched[0]
        lines.append(f"(batched-bench: {b.pp}-token prompts, {b.tg} decode steps, the mix's "
                     "means; engine decode: its decode-only steps in this bench run)")
    if "tg128" in by_test and len(by_test["tg128"].samples) > 1:
        tg = by_test["tg128"]
        spread = statistics.pstdev(tg.samples)
        when = (f", {tg.before} before the engine's runs and {len(tg.samples) - tg.before} "
                "after" if tg.before else "")
        lines.append(f"(tg128 over {len(tg.samples)} runs{when}: "
                     f"{', '.join(f'{s:.1f}' for s in tg.samples)}; sd {spread:.1f})")
    return "\n".join(lines)


def measure(tools: LlamaCpp, threads: int, parallel: list[int], pp: int, tg: int,
            before: list[BenchFigure] | None = None) -> dict[str, Any]:
    """Both tools' figures, as saved in the bench's JSON; `llama-bench`'s with the runs of
    it `before` the engine's (`bracketed`) where given."""
    bench = run_llama_bench(tools, threads)
    return {"gguf": str(tools.gguf), "threads": threads,
            "llama_bench": [asdict(f) for f in bracketed(before or [], bench)],
            "batched_bench": [asdict(f) for f in
                              run_batched_bench(tools, threads, parallel, pp, tg)]}


def report(figures: dict[str, Any], runs: dict[str, dict[str, Any]]) -> str:
    """`comparison` from saved figures (`measure`) and the bench's runs."""
    return comparison([BenchFigure(**f) for f in figures["llama_bench"]],
                      [BatchedFigure(**f) for f in figures["batched_bench"]],
                      engine_figures(runs), Path(figures["gguf"]))
