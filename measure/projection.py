"""Datacenter projections on measured kernel data: one serving layout (model, system,
engine, tensor × pipeline parallel, dtype) -> decode step and prefill time, where the time
goes, memory per GPU, the batch that fits, and energy.

The numbers come from `aiconfigurator-core` (NVIDIA Dynamo's modelling core): GEMM,
attention and NCCL kernels measured under TensorRT-LLM, vLLM and SGLang, summed over a
model's ops by its engine. It runs offline from its bundled data and only ever sees a model
name it bundles (any other name would make it download a config). Our roofline
(`measure.hardware.step_cost` plus `measure.interconnect`) is the "ideal" line beside it,
and the whole answer for a model the package lacks (`Estimate.source == "roofline"`).

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
import json
import logging
import math
import re
from dataclasses import dataclass, replace
from importlib import resources

from measure import interconnect
from measure.hardware import (
    GB,
    HARDWARE,
    HardwareProfile,
    ModelProfile,
    step_cost,
)
from measure.hardware import (
    MODELS as ROOFLINE_MODELS,
)

GIB = 2**30
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


# ---- what the package covers -------------------------------------------------------
@dataclass(frozen=True)
class DcModel:
    """A model as the projections need it; `aic_name` is the package's name (None: the
    package lacks it, and the roofline answers alone)."""

    key: str
    name: str
    aic_name: str | None
    profile: ModelProfile  # for the roofline
    num_heads: int

    @property
    def measured(self) -> bool:
        return self.aic_name is not None


@dataclass(frozen=True)
class DcSystem:
    """A datacenter GPU as aiconfigurator-core's system file describes it, per GPU."""

    key: str  # the package's system name
    name: str
    memory_bytes: float
    bandwidth_gbs: float
    bf16_tflops: float
    fp8_tflops: float | None  # None: no fp8 tensor cores
    power_w: float  # board power
    gpus_per_node: int
    link: str  # `measure.interconnect` key of the link between its GPUs in a node
    node_link: str  # ... and between nodes
    source: str

    def roofline_profile(self, gpus: int = 1, dtype: str = "bf16") -> HardwareProfile:
        """`gpus` of these as one `measure.hardware` profile, all figures × gpus."""
        tflops = self.fp8_tflops if dtype == "fp8" and self.fp8_tflops else self.bf16_tflops
        link = interconnect.LINKS[self.link]
        return HardwareProfile(f"{self.key}x{gpus}", f"{gpus}× {self.name}",
                               gpus * self.memory_bytes / GIB, gpus * self.bandwidth_gbs,
                               gpus * tflops, gpus * link.bandwidth_gbs, "gpu", self.source,
                               local=False)


# The package's bundled configs (model_configs/<org>--<name>_config.json) for dense models.
_MEASURED_MODELS = {
    "llama-3.1-8b": ("Llama-3.1-8B", "meta-llama/Meta-Llama-3.1-8B"),
    "qwen3-32b": ("Qwen3-32B", "Qwen/Qwen3-32B"),
    "llama-3.1-70b": ("Llama-3.1-70B", "meta-llama/Meta-Llama-3.1-70B"),
    "llama-3.1-405b": ("Llama-3.1-405B", "meta-llama/Meta-Llama-3.1-405B"),
}
# measure.hardware's models with a twin above (same shapes) are left out.
_TWINS = {"llama-3-8b", "llama-3-70b", "llama-3.1-405b"}

# name, datasheet; memory, bandwidth, FLOPs and power are read from the package's
# systems/<key>.yaml, which takes them from these datasheets.
_SYSTEMS = {
    "a100_sxm": ("A100 SXM 80 GB", "nvlink3", "ib_hdr",
                 "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80 GB); "
                 "https://www.nvidia.com/en-us/data-center/a100/"),
    "h100_sxm": ("H100 SXM 80 GB", "nvlink4", "ib_ndr",
                 "NVIDIA H100 Tensor Core GPU datasheet (SXM5); "
                 "https://www.nvidia.com/en-us/data-center/h100/"),
    "h200_sxm": ("H200 SXM 141 GB", "nvlink4", "ib_ndr",
                 "NVIDIA H200 Tensor Core GPU datasheet (SXM); "
                 "https://www.nvidia.com/en-us/data-center/h200/"),
    "b200_sxm": ("B200 180 GB", "nvlink5", "ib_xdr",
                 "NVIDIA HGX B200 datasheet (per GPU); "
                 "https://www.nvidia.com/en-us/data-center/hgx/"),
    "b300_sxm": ("B300 288 GB", "nvlink5", "ib_xdr",
                 "NVIDIA HGX B300 datasheet (per GPU); "
                 "https://www.nvidia.com/en-us/data-center/hgx/"),
    "gb200": ("GB200 NVL72 (per GPU)", "nvlink5", "nvlink5",
              "NVIDIA GB200 NVL72 datasheet; https://www.nvidia.com/en-us/data-center/gb200-nvl72/"),
    "gb300": ("GB300 NVL72 (per GPU)", "nvlink5", "nvlink5",
              "NVIDIA GB300 NVL72 datasheet; https://www.nvidia.com/en-us/data-center/gb300-nvl72/"),
    "l40s": ("L40S 48 GB (PCIe)", "pcie4", "ib_ndr",
             "NVIDIA L40S datasheet; https://www.nvidia.com/en-us/data-center/l40s/"),
    "rtx_pro_6000_server": ("RTX PRO 6000 Blackwell Server 96 GB (PCIe)", "pcie5", "ib_ndr",
                            "NVIDIA RTX PRO 6000 Blackwell Server Edition datasheet; "
                            "https://www.nvidia.com/en-us/data-center/rtx-pro-6000-blackwell-server-edition/"),
}


def _quiet() -> None:
    """The package logs every fallback table it loads at WARNING; the page shows its own
    provenance instead."""
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)


@functools.cache
def _bundled_config(aic_name: str) -> dict:
    """A bundled model's config.json, read from the package's files (no download)."""
    from aiconfigurator_core.sdk import common

    if aic_name not in common.DefaultHFModels:
        raise ValueError(f"model: {aic_name!r} is not bundled with aiconfigurator-core")
    path = resources.files("aiconfigurator_core") / "model_configs" / (
        aic_name.replace("/", "--") + "_config.json")
    return json.loads(path.read_text(encoding="utf-8"))


def profile_from_config(key: str, name: str, cfg: dict) -> ModelProfile:
    """A roofline `ModelProfile` from a Hugging Face config.json of a dense decoder:
    parameters counted from its shapes (embeddings, attention, gated MLP, norms, LM head)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads",
                                                           cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or h // heads
    vocab, inter = cfg["vocab_size"], cfg["intermediate_size"]
    tied = bool(cfg.get("tie_word_embeddings", False))
    attention = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
    per_layer = attention + 3 * h * inter + 2 * h
    params = layers * per_layer + h + vocab * h * (1 if tied else 2)
    return ModelProfile(key, name, params, layers, h, kv_heads, head_dim,
                        cfg.get("max_position_embeddings", 0), vocab, tied)


@functools.cache
def models() -> dict[str, DcModel]:
    """Every model the page offers: the package's dense models, then `measure.hardware`'s
    others (roofline only)."""
    out: dict[str, DcModel] = {}
    for key, (name, aic) in _MEASURED_MODELS.items():
        cfg = _bundled_config(aic)
        out[key] = DcModel(key, name, aic, profile_from_config(key, name, cfg),
                           cfg["num_attention_heads"])
    for key, m in ROOFLINE_MODELS.items():
        if key not in _TWINS:
            out[key] = DcModel(key, m.name, None, m, m.hidden_size // m.head_dim)
    return dict(sorted(out.items(), key=lambda kv: kv[1].profile.params))


@functools.cache
def systems() -> dict[str, DcSystem]:
    """The package's datacenter systems with measured data, figures from its system files."""
    from aiconfigurator_core.sdk import perf_database

    out = {}
    for key, (name, link, node_link, source) in _SYSTEMS.items():
        spec = perf_database.load_system_spec(key)
        gpu, node = spec["gpu"], spec["node"]
        fp8 = gpu.get("fp8_tc_flops")
        out[key] = DcSystem(key, name, float(gpu["mem_capacity"]), gpu["mem_bw"] / GB,
                            gpu["bfloat16_tc_flops"] / 1e12, fp8 / 1e12 if fp8 else None,
                            float(gpu["power"]), int(node["num_gpus_per_node"]), link,
                            node_link, f"{source} (figures as in aiconfigurator-core "
                            f"systems/{key}.yaml)")
    return out


def get_model(key: str) -> DcModel:
    if key not in models():
        raise ValueError(f"model: unknown {key!r} (known: {', '.join(models())})")
    return models()[key]


def get_system(key: str) -> DcSystem:
    if key not in systems():
        raise ValueError(f"system: unknown {key!r} (known: {', '.join(systems())})")
    return systems()[key]


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
    return ""


def _base(layout: Layout) -> Layout:
    """The layout on its system's own link (what the package measured)."""
    return replace(layout, link=None)


@functools.cache
def _handle(layout: Layout):
    """The package's compiled engine for this layout (cached: compiling takes 0.2-2 s)."""
    from aiconfigurator_core.sdk import EngineHandle

    _quiet()
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

    _quiet()
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
    return _handle(layout).predict_decode_latency(b, max(context, 1)) / 1e3


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
    return (f"Measured kernels: aiconfigurator-core's {BACKENDS[layout.backend]} "
            f"{_backend_version(layout.system, layout.backend)} data for "
            f"{get_system(layout.system).name}{via}.")


def local_profiles() -> list[HardwareProfile]:
    """The PCs the page compares against, from `measure.hardware` (roofline only)."""
    return [HARDWARE[k] for k in ("rtx4090", "m2_max", "laptop_cpu")]
