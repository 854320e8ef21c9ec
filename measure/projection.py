"""Datacenter projections on measured kernel data: one serving layout (model, system,
engine, tensor × pipeline parallel, dtype) -> decode step and prefill time, where the time
goes, memory per GPU, the batch that fits, and energy.

The numbers come from `aiconfigurator-core` (NVIDIA Dynamo's modelling core): GEMM,
attention and NCCL kernels measured under TensorRT-LLM, vLLM and SGLang, summed over a
model's ops by its engine. It runs offline from its bundled data and only ever sees a model
name it bundles (any other name would make it download a config). Our roofline
(`measure.hardware.step_cost` plus `measure.interconnect`) is the "ideal" line beside it,
and the whole answer for a model the package lacks (`StepTime.source == "roofline"`).
What it covers is `measure.dc_catalogue`.

    Layout(model, system, backend, tp, pp, dtype, link)
      -> check()                         fits? or a one-line reason it cannot run
      -> decode_step(batch, context)     StepTime: seconds, GEMM / attention / comm / other
      -> prefill(tokens)                 StepTime of one prompt
      -> memory()                        weights + KV per GPU, KV capacity of a replica
      -> ideal_decode_step(...)          the roofline of the same layout

A pipeline-parallel replica keeps up to `pp` micro-batches in flight: every sequence of a
batch B advances one token in one pass of a micro-batch of ceil(B / min(B, pp)) through
all stages, which is what `decode_step` reports. Handles are compiled once per layout.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, replace

from measure import interconnect
from measure.dc_catalogue import GIB, get_model, get_system, quiet
from measure.dc_catalogue import DcModel as DcModel  # re-exported: part of this interface
from measure.dc_catalogue import DcSystem as DcSystem
from measure.dc_catalogue import models as models
from measure.dc_catalogue import profile_from_config as profile_from_config
from measure.dc_catalogue import systems as systems
from measure.hardware import GB, step_cost

TP_SIZES = (1, 2, 4, 8)
PP_SIZES = (1, 2, 4)
DTYPES = ("bf16", "fp8")
BACKENDS = {"trtllm": "TensorRT-LLM", "vllm": "vLLM", "sglang": "SGLang"}
DEFAULT_BLOCK_SIZE = 16  # tokens per KV block, vLLM's default
# Share of GPU memory the engine may use: vLLM's gpu_memory_utilization default (of the
# total); TensorRT-LLM's free_gpu_memory_fraction default (of what the weights leave).
MEMORY_FRACTION = 0.9
_FRACTION_KIND = {"trtllm": "of_free", "vllm": "of_total", "sglang": "of_total"}
PREFILL_EFFICIENCY = 0.5  # the roofline's prefill: compute at half of peak (measure.hardware)
_COMM_OP = re.compile(r"_ar(_\d+)?$|p2p")


# ---- a layout ----------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """One replica: a model on `tp × pp` GPUs of one system, served by one engine.

    `link` is None for the system's own interconnect (measured); a `measure.interconnect`
    key puts the step's communication on that link instead: as the package measured it on
    the system that uses that link (`MEASURED_ON`), else by the ring formula. The rest of
    the step stays as measured on `system`."""

    model: str
    system: str
    backend: str = "trtllm"
    tp: int = 1
    pp: int = 1
    dtype: str = "bf16"
    link: str | None = None

    def __post_init__(self) -> None:
        get_model(self.model)
        get_system(self.system)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: unknown {self.backend!r} (known: {', '.join(BACKENDS)})")
        if self.tp not in TP_SIZES:
            raise ValueError(f"tp must be one of {TP_SIZES}, got {self.tp}")
        if self.pp not in PP_SIZES:
            raise ValueError(f"pp must be one of {PP_SIZES}, got {self.pp}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: unknown {self.dtype!r} (known: {', '.join(DTYPES)})")
        if self.link is not None:
            interconnect.get_link(self.link)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / get_system(self.system).gpus_per_node)

    @property
    def tp_link(self) -> str:
        """The link the all-reduces run on."""
        return self.link or get_system(self.system).link

    @property
    def measured(self) -> bool:
        """Whether the package answers (else the roofline alone)."""
        return get_model(self.model).measured

    def label(self) -> str:
        s = get_system(self.system)
        link = "" if self.link is None else f" over {interconnect.LINKS[self.link].name}"
        return (f"{get_model(self.model).name} {self.dtype} on {self.gpus}× {s.name} "
                f"(TP={self.tp}, PP={self.pp}{link}, {BACKENDS[self.backend]})")


@dataclass(frozen=True)
class Feasibility:
    ok: bool
    reason: str  # one line; "" when ok


@dataclass(frozen=True)
class StepTime:
    """One step (a decode step of a batch, or a prompt's prefill) and where it goes."""

    seconds: float
    gemm_s: float
    attention_s: float
    communication_s: float
    other_s: float  # norms, activations, embedding
    source: str  # "measured" | "roofline"

    @property
    def communication_share(self) -> float:
        return self.communication_s / self.seconds if self.seconds else 0.0

    def parts(self) -> dict[str, float]:
        return {"GEMM": self.gemm_s, "attention": self.attention_s,
                "communication": self.communication_s, "other": self.other_s}


@dataclass(frozen=True)
class MemoryPerGpu:
    """Memory of one GPU of the replica; `kv_tokens` is the replica's KV capacity (every
    GPU holds its share of every token's KV)."""

    capacity_bytes: float
    weights_bytes: float
    other_bytes: float  # activations, runtime, NCCL buffers
    kv_bytes: float  # what is left for KV cache
    kv_bytes_per_token: float  # per GPU
    kv_tokens: int
    source: str  # "measured" | "roofline"

    @property
    def fits(self) -> bool:
        return self.kv_tokens > 0


def _aic_kwargs(layout: Layout) -> dict:
    kw: dict = {"tp_size": layout.tp, "pp_size": layout.pp}
    if layout.dtype == "fp8":
        kw |= {"gemm_quant_mode": "fp8", "kvcache_quant_mode": "fp8"}
    return kw


def _structural(layout: Layout) -> str:
    """Why this layout cannot exist at all ("" if it can)."""
    m, s = get_model(layout.model), get_system(layout.system)
    if layout.dtype == "fp8" and s.fp8_tflops is None:
        return f"{s.name} has no fp8 tensor cores: serve it in bf16."
    if m.num_heads % layout.tp:
        return (f"{m.name}'s {m.num_heads} attention heads do not split evenly over "
                f"TP={layout.tp} GPUs.")
    if m.profile.layers % layout.pp:
        return (f"{m.name}'s {m.profile.layers} layers do not split into {layout.pp} equal "
                f"pipeline stages.")
    return _missing_data(_base(layout)) if m.measured else ""


@functools.cache
def _missing_data(layout: Layout) -> str:
    """Why the package cannot answer for this layout ("" if it can): it has no measured
    kernels for some op (e.g. SGLang's fp8-KV context attention on Hopper). Probed once per
    layout with one decode step and one prefill."""
    from aiconfigurator_core.sdk.errors import (
        InterpolationDataNotAvailableError,
        PerfDataNotAvailableError,
    )

    handle = _handle(_base(layout))
    try:
        handle.decode_step_per_op(1, 1024, 2)
        handle.run_static_per_op(batch_size=1, isl=1024, osl=1)
    except (PerfDataNotAvailableError, InterpolationDataNotAvailableError) as e:
        what = str(e).removeprefix("perf database error: ").split(" for ")[0]
        return (f"aiconfigurator-core has no measured data for {BACKENDS[layout.backend]} "
                f"{layout.dtype} on {get_system(layout.system).name} ({what}): pick "
                "another engine or dtype.")
    return ""


def _base(layout: Layout) -> Layout:
    """The layout on its system's own link (what the package measured)."""
    return replace(layout, link=None)


@functools.cache
def _handle(layout: Layout):
    """The package's compiled engine for this layout (cached: compiling takes 0.2-2 s)."""
    from aiconfigurator_core.sdk import EngineHandle

    quiet()
    m = get_model(layout.model)
    assert m.aic_name is not None, layout
    return EngineHandle.compile(m.aic_name, layout.system, layout.backend, **_aic_kwargs(layout))


@functools.cache
def _backend_version(system: str, backend: str) -> str:
    from aiconfigurator_core.sdk import perf_database

    return perf_database.resolve_query_version(system, backend, "current")


# ---- memory ------------------------------------------------------------------------
def _kv_bytes_per_token_per_gpu(layout: Layout) -> float:
    p = get_model(layout.model).profile
    kv_heads = max(1, p.num_kv_heads // layout.tp)  # fewer KV heads than GPUs: replicated
    kv_bytes = 1.0 if layout.dtype == "fp8" else 2.0
    return 2 * (p.layers // layout.pp) * kv_heads * p.head_dim * kv_bytes


def _weights_per_gpu(layout: Layout) -> float:
    bytes_per = 1.0 if layout.dtype == "fp8" else 2.0
    return get_model(layout.model).profile.params * bytes_per / layout.gpus


@functools.cache
def memory(layout: Layout) -> MemoryPerGpu:
    """Weights and KV cache per GPU, and the replica's KV capacity in tokens (the engine
    may use `MEMORY_FRACTION` of the GPU). Measured layouts ask the package's memory model;
    the others count weights and KV bytes."""
    layout = _base(layout)
    s = get_system(layout.system)
    if not layout.measured or _structural(layout):
        return _roofline_memory(layout)
    from aiconfigurator_core.sdk import estimate_kv_cache

    quiet()
    try:
        r = estimate_kv_cache(
            get_model(layout.model).aic_name, layout.system, layout.backend,
            _backend_version(layout.system, layout.backend), max_num_tokens=8192,
            max_batch_size=512, memory_fraction_kind=_FRACTION_KIND[layout.backend],
            memory_fraction_value=MEMORY_FRACTION, **_aic_kwargs(layout))
    except ValueError as e:
        if "no KV budget" not in str(e):
            raise
        fallback = _roofline_memory(layout)
        return replace(fallback, kv_bytes=0.0, kv_tokens=0, source="measured")
    parts = r["memory_breakdown"]
    other = sum(v for k, v in parts.items() if k != "weights_bytes")
    return MemoryPerGpu(s.memory_bytes, float(parts["weights_bytes"]), float(other),
                        float(r["total_kv_size_bytes"]), float(r["kv_size_per_token_bytes"]),
                        int(r["total_kv_size_tokens"]), "measured")


def _roofline_memory(layout: Layout) -> MemoryPerGpu:
    s = get_system(layout.system)
    weights = _weights_per_gpu(layout)
    per_token = _kv_bytes_per_token_per_gpu(layout)
    kv = max(0.0, s.memory_bytes * MEMORY_FRACTION - weights)
    return MemoryPerGpu(s.memory_bytes, weights, 0.0, kv, per_token, int(kv // per_token),
                        "roofline")


def check(layout: Layout, context: int = 0, batch: int = 1) -> Feasibility:
    """Whether the layout can serve `batch` sequences of `context` tokens, with a one-line
    reason when it cannot (heads or layers that do not split, weights that do not fit,
    KV cache that does not fit)."""
    why = _structural(layout)
    if why:
        return Feasibility(False, why)
    mem = memory(layout)
    s, m = get_system(layout.system), get_model(layout.model)
    if not mem.fits:
        return Feasibility(False, (
            f"Does not fit: {m.name} {layout.dtype} needs {mem.weights_bytes / GIB:,.1f} GiB "
            f"of weights per GPU on {layout.gpus} GPU{'s' * (layout.gpus > 1)}, and "
            f"{s.name} has {s.memory_bytes / GIB:,.0f} GiB."))
    need = batch * max(context, 1)
    if need > mem.kv_tokens:
        return Feasibility(False, (
            f"KV cache does not fit: {batch} × {context:,} tokens need {need:,}, and this "
            f"replica holds {mem.kv_tokens:,}."))
    return Feasibility(True, "")


def max_batch(layout: Layout, context: int) -> int:
    """Most sequences of `context` tokens whose KV fits the replica (0: none)."""
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    if _structural(layout):
        return 0
    return memory(layout).kv_tokens // context


def kv_capacity_tokens(layout: Layout) -> int:
    """Tokens of KV cache one replica holds (0 when it cannot run)."""
    return 0 if _structural(layout) else memory(layout).kv_tokens


def kv_capacity_blocks(layout: Layout, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """`kv_capacity_tokens` in whole blocks of `block_size` tokens."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return kv_capacity_tokens(layout) // block_size


def gpus_per_replica(layout: Layout) -> int:
    return layout.gpus


def weights_bytes(layout: Layout) -> float:
    """All the replica's weights (every GPU's share together)."""
    return memory(layout).weights_bytes * layout.gpus


def power_per_gpu_w(layout: Layout) -> float:
    """Board power of one GPU (its datasheet's maximum)."""
    return get_system(layout.system).power_w


# ---- time --------------------------------------------------------------------------
def _require(layout: Layout) -> None:
    why = _structural(layout)
    if why:
        raise ValueError(f"{layout.label()}: {why}")


def _micro_batch(layout: Layout, batch: int) -> int:
    return math.ceil(batch / min(batch, layout.pp))


def _split(ops: list[tuple[str, float, float, str]], source: str) -> StepTime:
    parts = {"gemm": 0.0, "attention": 0.0, "comm": 0.0, "other": 0.0}
    for name, ms, _energy, _src in ops:
        kind = ("comm" if _COMM_OP.search(name) else "gemm" if "gemm" in name
                else "attention" if "attention" in name else "other")
        parts[kind] += ms / 1e3
    return StepTime(sum(parts.values()), parts["gemm"], parts["attention"], parts["comm"],
                    parts["other"], source)


# Where the package measured all-reduces over each link: the system whose GPUs use it.
MEASURED_ON = {"nvlink3": "a100_sxm", "nvlink4": "h100_sxm", "nvlink5": "b200_sxm",
               "pcie4": "l40s", "pcie5": "rtx_pro_6000_server"}


def link_twin(layout: Layout) -> Layout | None:
    """The same layout on the system whose measured all-reduces run over `layout.link`
    (None: the package measured none there, or the twin cannot run this dtype)."""
    if layout.link not in MEASURED_ON:
        return None
    twin = Layout(layout.model, MEASURED_ON[layout.link], layout.backend, layout.tp,
                  layout.pp, layout.dtype)
    return None if _structural(twin) or not twin.measured else twin


def _relink(step: StepTime, layout: Layout, tokens: int, twin: StepTime | None) -> StepTime:
    """The step with its communication moved onto `layout.link`: as the package measured
    it on that link's system (`twin`), else by the ring formula and pipeline hops."""
    if layout.link is None:
        return step
    if twin is not None:
        comm = twin.communication_s
    else:
        p = get_model(layout.model).profile
        comm = interconnect.tensor_parallel_seconds(tokens, p.hidden_size, p.layers,
                                                    layout.tp, layout.link)
        comm += _pp_seconds(layout, tokens)
    return replace(step, seconds=step.seconds - step.communication_s + comm,
                   communication_s=comm)


def _check_step(batch: int, context: int) -> None:
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}")


@functools.lru_cache(maxsize=65536)
def decode_step(layout: Layout, batch: int, context: int) -> StepTime:
    """One decode step: every one of `batch` sequences of `context` tokens gains a token."""
    _check_step(batch, context)
    _require(layout)
    if not layout.measured:
        return ideal_decode_step(layout, batch, context)
    b = _micro_batch(layout, batch)
    ops = _handle(_base(layout)).decode_step_per_op(b, max(context, 1), 2)
    twin = link_twin(layout)
    return _relink(_split(ops, "measured"), layout, b,
                   decode_step(twin, batch, context) if twin else None)


@functools.lru_cache(maxsize=65536)
def decode_step_seconds(layout: Layout, batch: int, context: int) -> float:
    """`decode_step(...).seconds`, without the per-op breakdown (faster)."""
    _check_step(batch, context)
    _require(layout)
    if not layout.measured or layout.link is not None:
        return decode_step(layout, batch, context).seconds
    b = _micro_batch(layout, batch)
    # the same step `decode_step` sums op by op (the package's predict_decode_latency
    # differs from it in the fifth digit)
    return _handle(layout).decode_step_latency(b, max(context, 1), 2) / 1e3


@functools.lru_cache(maxsize=16384)
def prefill(layout: Layout, tokens: int, prompts: int = 1) -> StepTime:
    """Prefill of `prompts` prompts of `tokens` // `prompts` tokens each, in one step."""
    if tokens < 1 or prompts < 1 or prompts > tokens:
        raise ValueError(f"need 1 <= prompts <= tokens, got tokens={tokens}, prompts={prompts}")
    _require(layout)
    if not layout.measured:
        return ideal_prefill(layout, tokens)
    ctx, _gen = _handle(_base(layout)).run_static_per_op(
        batch_size=prompts, isl=tokens // prompts, osl=1)
    twin = link_twin(layout)
    return _relink(_split(ctx, "measured"), layout, tokens,
                   prefill(twin, tokens, prompts) if twin else None)


@functools.lru_cache(maxsize=16384)
def prefill_seconds(layout: Layout, tokens: int, prompts: int = 1) -> float:
    """`prefill(...).seconds`, without the breakdown (faster)."""
    if tokens < 1 or prompts < 1 or prompts > tokens:
        raise ValueError(f"need 1 <= prompts <= tokens, got tokens={tokens}, prompts={prompts}")
    _require(layout)
    if not layout.measured or layout.link is not None:
        return prefill(layout, tokens, prompts).seconds
    return _handle(layout).predict_prefill_latency(prompts, tokens // prompts) / 1e3


def energy_per_step_j(layout: Layout, batch: int, context: int) -> float:
    """Energy of one decode step of the replica: board power × GPUs × step time (the
    package's kernels carry no energy for dense models, so it is the board's maximum)."""
    return power_per_gpu_w(layout) * layout.gpus * decode_step_seconds(layout, batch, context)


def energy_per_token_j(layout: Layout, batch: int, context: int) -> float:
    return energy_per_step_j(layout, batch, context) / batch


def measured_allreduce_seconds(system: str, tp: int, tokens: int,
                               backend: str = "trtllm") -> float:
    """One all-reduce of `tokens` × 8192 bf16 activations over `tp` GPUs as the package
    measured it: its per-layer all-reduce op of Llama-3.1-70B's decode step (hidden 8192),
    over the model's layers. For checking `measure.interconnect` against measurement."""
    layout = Layout("llama-3.1-70b", system, backend, tp=tp)
    ops = dict((name, ms) for name, ms, _e, _s in
               _handle(layout).decode_step_per_op(tokens, 2048, 2))
    return ops["generation_ar_1"] / 1e3 / get_model(layout.model).profile.layers


# ---- the ideal line: our roofline plus the ring formula ------------------------------
def _precision(layout: Layout) -> tuple[str, float]:
    return ("int8", 1.0) if layout.dtype == "fp8" else ("fp16", 2.0)


def _pp_seconds(layout: Layout, tokens: int) -> float:
    s, p = get_system(layout.system), get_model(layout.model).profile
    link = s.link if layout.gpus <= s.gpus_per_node else s.node_link
    return interconnect.pipeline_seconds(tokens, p.hidden_size, layout.pp, link)


def _ideal(layout: Layout, tokens: int, logits: int, kv_tokens: int,
           efficiency: float) -> StepTime:
    s, p = get_system(layout.system), get_model(layout.model).profile
    precision, kv_bytes = _precision(layout)
    # A token passes every stage in turn: the pipeline's time is that of its TP group
    # holding the whole model. Nothing is offloaded: whether it fits is `check`'s answer.
    group = replace(s.roofline_profile(layout.tp, layout.dtype), memory_gb=math.inf)
    cost = step_cost(p, precision, group, tokens, logits, kv_tokens, kv_bytes, efficiency)
    kv_s = kv_tokens * 2 * p.layers * p.num_kv_heads * p.head_dim * kv_bytes / (
        group.bandwidth_gbs * GB)
    attention = kv_s if cost.bound != "compute" else 0.0
    comm = interconnect.tensor_parallel_seconds(tokens, p.hidden_size, p.layers, layout.tp,
                                                layout.tp_link)
    comm += _pp_seconds(layout, tokens)
    return StepTime(cost.seconds + comm, cost.seconds - attention, attention, comm, 0.0,
                    "roofline")


def ideal_decode_step(layout: Layout, batch: int, context: int) -> StepTime:
    """The roofline of the decode step (`measure.hardware.step_cost` on the TP group, plus
    the ring all-reduces and pipeline hops of `measure.interconnect`)."""
    _check_step(batch, context)
    b = _micro_batch(layout, batch)
    return _ideal(layout, b, b, b * context, 1.0)


def ideal_prefill(layout: Layout, tokens: int) -> StepTime:
    """The roofline of one prompt's prefill (compute at `PREFILL_EFFICIENCY` of peak)."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    return _ideal(layout, tokens, 1, tokens, PREFILL_EFFICIENCY)


def source_note(layout: Layout) -> str:
    """One line on where the layout's numbers come from."""
    m = get_model(layout.model)
    if not m.measured:
        return (f"{m.name} is not in aiconfigurator-core's bundled models: every number "
                "here is our roofline (datasheet bandwidth and FLOPs, ring all-reduces), "
                "a ceiling real engines reach a fraction of.")
    twin = link_twin(layout)
    if layout.link is None:
        via = ""
    elif twin is not None:
        via = (f"; its communication as measured on {get_system(twin.system).name} GPUs, "
               f"which talk over {interconnect.LINKS[layout.link].name}")
    else:
        via = (f"; its communication moved onto {interconnect.LINKS[layout.link].name} by "
               "the ring formula (no measured data there)")
    s = get_system(layout.system)
    return (f"Measured kernels: aiconfigurator-core's {BACKENDS[layout.backend]} "
            f"{_backend_version(layout.system, layout.backend)} data for {s.name}, whose GPUs "
            f"talk over {interconnect.LINKS[s.link].name}{via}.")
