"""Host overhead per engine step: what the engine loop costs around the model.

`batchlens bench --host-overhead [--json PATH]` runs the real threaded engine (scheduler,
the runner's input preparation, the sampler, the core's update with detokenization, and
streaming to handles) over `InstantModel`, a stand-in for the model that returns logits at
once. With N requests all decoding, the time from one step's start to the next is pure
host time: on a GPU that is what a decode step costs on top of its kernels.

    running   ms/step   us/seq
          1      0.45      450       (figures are examples)
        256      2.90       11

Each size runs `repeats` windows of `steps` decode steps; the best window counts (other
processes share the cores). The stand-in's logits are `LOGITS_WIDTH` wide instead of the
vocabulary, so the sampler's argmax costs its launch, not a read of 49,152 floats per row
that a GPU would do in microseconds (on a small CPU an argmax over 1,024 x 1,024 float32
takes about three times as long as over 1,024 x 320).
"""

from __future__ import annotations

import datetime
import json
import math
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.config import EngineConfig, SamplingParams
from engine.core import StepStats
from engine.engine import Engine
from engine.models import native
from engine.models.attention import AttentionMetadata
from engine.models.device import device_name, pick_device, pick_dtype
from engine.models.llama import ModelArch
from engine.models.loaded import LoadedModel, freeze_heap
from engine.serving import ALL_STEPS

HOST_SIZES = (1, 64, 256, 1024)
PROMPT_LEN = 32
LOGITS_WIDTH = 320
BLOCK_SIZE = 16
MAX_TOKENS = 2000  # more than any size needs: requests are still decoding when it stops
# SmolLM2-135M's shapes, with no layers: the runner allocates no KV tensors, so a pool for
# 1,024 requests costs no memory, while block tables and slot mappings keep their sizes.
SMOLLM2_SHAPES = ModelArch(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
    max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
)


class InstantModel:
    """Stand-in for `LlamaModel`, used by the host-overhead bench and its tests only.

    `forward` takes the same inputs as the real model and returns float32 logits of the
    rows to sample at once, each row peaking at a fixed token (256 + 37 x row mod 64: 64
    common word pieces of SmolLM2's vocabulary, so requests stream different text),
    without touching the KV cache.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, max_rows: int = 4096) -> None:
        self.arch = replace(SMOLLM2_SHAPES, num_layers=0)
        self.device, self.dtype = device, dtype
        rows = torch.arange(max_rows)
        logits = torch.zeros(max_rows, LOGITS_WIDTH)
        logits[rows, 256 + (rows * 37) % (LOGITS_WIDTH - 256)] = 1.0
        self.logits = logits.to(device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv_caches: list, logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        return self.logits[: logits_rows.shape[0]]


def instant_loaded(tokenizer: Any, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """A `LoadedModel` whose model is the stand-in; `tokenizer` is used as it is. The heap
    is frozen afterwards, as `LoadedModel.load` does, so garbage collections do not walk
    the libraries' objects during the steps."""
    loaded = LoadedModel("instant (stand-in)", folder=None,  # type: ignore[arg-type]
                         model=InstantModel(device, dtype), tokenizer=tokenizer,
                         dtype_reason="stand-in model", eos_token_ids=frozenset({2}))
    freeze_heap()
    return loaded


@dataclass(frozen=True)
class HostFigure:
    """Host time of one engine step with `num_seqs` requests decoding."""

    num_seqs: int
    ms_per_step: float
    windows_ms: tuple[float, ...]  # every window's mean, best first
    cpu_ms_per_step: float  # process CPU time per decode step (all threads)

    @property
    def us_per_seq(self) -> float:
        return 1000 * self.ms_per_step / self.num_seqs


def measure_size(loaded: LoadedModel, num_seqs: int, steps: int = 20, repeats: int = 3,
                 timeout_s: float = 120.0) -> HostFigure:
    """Run `num_seqs` requests to steady decode, then time `repeats` windows of `steps`
    decode steps (step start to step start) on the real threaded engine; also the process
    CPU time per step over at least as many decode steps (less sensitive to other
    processes taking the cores than wall time)."""
    warm = 4
    max_tokens = MAX_TOKENS
    blocks = num_seqs * (-(-(PROMPT_LEN + max_tokens) // BLOCK_SIZE)) + 1
    config = EngineConfig(device=str(loaded.model.device),
                          dtype=str(loaded.model.dtype).removeprefix("torch."),
                          block_size=BLOCK_SIZE, num_kv_blocks=blocks, max_num_seqs=num_seqs,
                          max_num_batched_tokens=max(512, min(num_seqs * PROMPT_LEN, 8192)))
    g = torch.Generator().manual_seed(num_seqs)
    prompts = torch.randint(256, LOGITS_WIDTH, (num_seqs, PROMPT_LEN), generator=g).tolist()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    need = warm + repeats * (steps + 1)
    cpu0 = n0 = None
    with Engine(config, loaded=loaded) as eng:
        eng.submit_many(prompts, [params] * num_seqs)
        deadline = time.monotonic() + timeout_s
        seen: list[StepStats] = []
        while True:
            time.sleep(0.05)
            cpu, n = time.process_time(), eng.core.num_steps
            seen += eng.stats(steps_after=seen[-1].start if seen else ALL_STEPS).recent_steps
            decode = [s for s in seen
                      if s.num_decode_tokens == num_seqs and not s.num_prefill_tokens]
            if cpu0 is None and len(decode) >= warm:
                cpu0, n0 = cpu, n
            if len(decode) >= need and n0 is not None and n - n0 >= repeats * steps:
                break
            if time.monotonic() > deadline or not eng.core.has_work:
                raise TimeoutError(f"host bench at {num_seqs} requests: {len(decode)} of "
                                   f"{need} decode steps after {timeout_s:.0f} s")
    starts = [s.start for s in decode[warm:need]]
    windows = []
    for r in range(repeats):
        w = starts[r * (steps + 1): (r + 1) * (steps + 1)]
        windows.append(1000 * (w[-1] - w[0]) / steps)
    windows.sort()
    assert cpu0 is not None and n0 is not None
    return HostFigure(num_seqs, windows[0], tuple(windows), 1000 * (cpu - cpu0) / (n - n0))


def run_host_bench(loaded: LoadedModel, sizes: tuple[int, ...] = HOST_SIZES, steps: int = 20,
                   repeats: int = 3) -> dict[str, Any]:
    """Every size in turn; the figures as the JSON the bench saves."""
    figures = [measure_size(loaded, n, steps, repeats) for n in sizes]
    dev = loaded.model.device
    return {
        "host_ms_per_step": {str(f.num_seqs): round(f.ms_per_step, 4) for f in figures},
        "host_us_per_seq": {str(f.num_seqs): round(f.us_per_seq, 3) for f in figures},
        "windows_ms": {str(f.num_seqs): [round(w, 4) for w in f.windows_ms] for f in figures},
        "cpu_ms_per_step": {str(f.num_seqs): round(f.cpu_ms_per_step, 4) for f in figures},
        "steps_per_window": steps, "repeats": repeats, "best_of": repeats,
        "device": str(dev), "dtype": str(loaded.model.dtype).removeprefix("torch."),
        "machine": device_name(dev.type),
        "attention": (native.status(loaded.model.dtype) if dev.type == "cpu"
                      else "n/a (stand-in model)"),
        "model": "InstantModel: SmolLM2-135M shapes, logits returned at once "
                 f"({LOGITS_WIDTH} wide), no KV tensors",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def format_host(result: dict[str, Any]) -> str:
    """The printed table: ms per step and us per sequence at each size."""
    lines = [f"host overhead per engine step ({result['model']}; {result['device']}, "
             f"{result['dtype']}; best of {result['repeats']} windows of "
             f"{result['steps_per_window']} decode steps)",
             f"{'running':>8} {'ms/step':>9} {'us/seq':>8} {'cpu ms/step':>12}"]
    for n, ms in result["host_ms_per_step"].items():
        lines.append(f"{n:>8} {ms:>9.3f} {result['host_us_per_seq'][n]:>8.1f} "
                     f"{result['cpu_ms_per_step'][n]:>12.3f}")
    lines.append(f"machine: {result['machine']}")
    return "\n".join(lines)


def check_figures(result: dict[str, Any]) -> None:
    """Every figure is a positive finite number (an assert: a broken run is a bug)."""
    for n, ms in result["host_ms_per_step"].items():
        assert math.isfinite(ms) and ms > 0, f"host_ms_per_step[{n}] = {ms}"


def main(sizes: tuple[int, ...], device: str, dtype: str, json_path: str | None,
         steps: int = 20, repeats: int = 3, model: str | None = None) -> int:
    """Load only the tokenizer of `model` (default: the bundled one; no weights), run the
    sizes, print, save if asked."""
    from engine.models import loader

    dev = pick_device("cpu" if device == "auto" else device)
    torch_dtype, _ = pick_dtype(dtype, dev)
    tokenizer = loader.load_tokenizer(loader.hf_folder(loader.resolve_model(model)))
    result = run_host_bench(instant_loaded(tokenizer, dev, torch_dtype), sizes, steps, repeats)
    check_figures(result)
    print(format_host(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0
