"""Hardware and model profiles, and the one roofline cost model (`step_cost`) that every
projection of decode and prefill speed here, the sweep's roofline and the bench's floor use.

Units: bandwidths in decimal GB/s (vendors' convention), compute in dense bf16/fp16 TFLOPS,
memory capacities in GiB (a "24 GB" card holds 24 × 2**30 bytes), sizes reported in GB (1e9).
Every figure is an idealised ceiling: real engines reach a fraction of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from engine.memory.budget import GIB

if TYPE_CHECKING:
    from measure.calibrate import Calibration

GB = 1e9
PRECISIONS: dict[str, float] = {"fp16": 2.0, "int8": 1.0, "int4": 0.5}  # weight bytes per element
BIG_BATCH = 64
_T = TypeVar("_T")


@dataclass(frozen=True)
class HardwareProfile:
    """One device (or node): what bounds decode speed on it."""

    key: str
    name: str
    memory_gb: float  # usable for weights + KV, in GiB
    bandwidth_gbs: float
    peak_tflops: float  # bf16/fp16 dense
    offload_bandwidth_gbs: float  # link used for what does not fit in memory
    kind: str  # "cpu", "gpu", "apple", "node"
    source: str
    local: bool = True  # a PC one person owns, as opposed to datacenter hardware

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * GIB


@dataclass(frozen=True)
class ModelProfile:
    """Shape of one Llama-family model, as far as the roofline needs it."""

    key: str
    name: str
    params: int
    layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    context: int  # native context window
    vocab_size: int = 0
    tied_embeddings: bool = False  # the LM head reuses the embedding table

    def matmul_params(self, logits: bool = True) -> int:
        """Weights one token is multiplied by: every layer's, plus the LM head when its
        logits are needed (a prompt token's are not, but the last one's). The embedding
        table is only looked up."""
        table = self.vocab_size * self.hidden_size
        body = self.params - (table if self.tied_embeddings else 2 * table)
        return body + table if logits else body

    def streamed_params(self) -> int:
        """Weights a decode step reads in full: all but an untied embedding table."""
        return self.params - (0 if self.tied_embeddings else self.vocab_size * self.hidden_size)


_HW = [
    # 8-core Zen 4 laptop (Ryzen 7 7840U class), 32 GB dual-channel DDR5-5600: 2 ch × 8 B ×
    # 5600 MT/s = 89.6 GB/s; ~24 GB left after OS/apps. 8 cores × ~3 GHz × 64 bf16 FLOP/cycle
    # (AVX-512 BF16) ≈ 1.5 TFLOPS peak. Offload = NVMe Gen4 SSD (~7 GB/s sequential read).
    HardwareProfile("laptop_cpu", "Laptop CPU (DDR5-5600, 32 GB)", 24, 89.6, 1.5, 7.0, "cpu",
                    "JEDEC DDR5-5600 ×2 channels; AMD Ryzen 7 7840U datasheet"),
    # 16-core Zen 4 desktop (Ryzen 9 7950X), 64 GB dual-channel DDR5-5600, ~56 GB usable;
    # 16 × ~4.5 GHz × 64 ≈ 4.6 TFLOPS bf16 peak.
    HardwareProfile("desktop_cpu", "Desktop CPU (DDR5-5600, 64 GB)", 56, 89.6, 4.6, 7.0, "cpu",
                    "JEDEC DDR5-5600 ×2 channels; AMD Ryzen 9 7950X datasheet"),
    # AD107, 24 SMs at up to 2.37 GHz: the 4090's per-SM bf16 rate scaled ≈ 29 TFLOPS.
    # PCIe 4.0 ×8 to the host = 15.75 GB/s.
    HardwareProfile("rtx4060_laptop", "RTX 4060 Laptop 8 GB", 8, 256, 29, 15.75, "gpu",
                    "NVIDIA GeForce RTX 4060 Laptop GPU datasheet; Ada whitepaper"),
    # 165.2 TFLOPS bf16 dense (fp32 accumulate); PCIe 4.0 ×16 = 31.5 GB/s.
    HardwareProfile("rtx4090", "RTX 4090 24 GB", 24, 1008, 165, 31.5, "gpu",
                    "NVIDIA Ada GPU Architecture whitepaper (RTX 4090)"),
    # 64 GB option (96 GB exists); macOS lets the GPU wire ~75% of it (Metal's
    # recommendedMaxWorkingSetSize) → 48 GB. 38-core GPU ≈ 13.6 TFLOPS, fp16 at the fp32 rate.
    # Offload = internal SSD (~7 GB/s measured in reviews; Apple publishes none).
    HardwareProfile("m2_max", "Apple M2 Max (64 GB unified)", 48, 400, 13.6, 7.0, "apple",
                    "Apple MacBook Pro (M2 Max) tech specs"),
    # Host link of HGX H100/H200/B200: PCIe Gen5 ×16 = 63 GB/s per GPU.
    HardwareProfile("h100", "H100 SXM 80 GB", 80, 3350, 989, 63, "gpu",
                    "NVIDIA H100 Tensor Core GPU datasheet (SXM)", local=False),
    HardwareProfile("h200", "H200 141 GB", 141, 4800, 989, 63, "gpu",
                    "NVIDIA H200 Tensor Core GPU datasheet (SXM)", local=False),
    HardwareProfile("b200", "B200 180 GB", 180, 8000, 2250, 63, "gpu",
                    "NVIDIA HGX B200 datasheet (per GPU)", local=False),
    # 8×H100 SXM with tensor parallelism, idealised: memory, bandwidth, FLOPs and host links
    # all ×8, as if the NVLink all-reduces after every layer cost nothing (they cost 10-30%).
    HardwareProfile("8xh100", "8×H100 SXM node", 8 * 80, 8 * 3350, 8 * 989, 8 * 63, "node",
                    "NVIDIA DGX H100 datasheet (8× H100 SXM)", local=False),
]
HARDWARE: dict[str, HardwareProfile] = {h.key: h for h in _HW}

_MODELS = [  # parameter counts and vocabularies as in the Hugging Face checkpoints
    ModelProfile("smollm2-135m", "SmolLM2-135M", 134_515_008, 30, 576, 3, 64, 8192, 49152, True),
    ModelProfile("llama-2-7b", "Llama-2-7B", 6_738_415_616, 32, 4096, 32, 128, 4096, 32000),
    ModelProfile("llama-2-13b", "Llama-2-13B", 13_015_864_320, 40, 5120, 40, 128, 4096, 32000),
    ModelProfile("llama-3-8b", "Llama-3-8B", 8_030_261_248, 32, 4096, 8, 128, 8192, 128256),
    ModelProfile("llama-2-70b", "Llama-2-70B", 68_976_648_192, 80, 8192, 8, 128, 4096, 32000),
    ModelProfile("llama-3-70b", "Llama-3-70B", 70_553_706_496, 80, 8192, 8, 128, 8192, 128256),
    ModelProfile("llama-3.1-405b", "Llama-3.1-405B", 405_000_000_000, 126, 16384, 8, 128, 131072,
                 128256),
]
MODELS: dict[str, ModelProfile] = {m.key: m for m in _MODELS}


def _lookup(field: str, table: dict[str, _T], value: _T | str, cls: type[_T]) -> _T:
    if isinstance(value, str) and value not in table:
        raise ValueError(f"{field}: unknown profile {value!r} (known: {', '.join(table)})")
    result = table[value] if isinstance(value, str) else value
    if not isinstance(result, cls):
        raise ValueError(f"{field}: expected a {cls.__name__} or a key, got {value!r}")
    return result


def get_hardware(hw: HardwareProfile | str) -> HardwareProfile:
    """Resolve a hardware key (or pass a profile through)."""
    return _lookup("hardware", HARDWARE, hw, HardwareProfile)


def get_model(model: ModelProfile | str) -> ModelProfile:
    """Resolve a model key (or pass a profile through)."""
    return _lookup("model", MODELS, model, ModelProfile)


def _check(name: str, value: float, low: float, strict: bool = False) -> None:
    if (value <= low) if strict else (value < low):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {low:g}, got {value}")


def weights_bytes(model: ModelProfile | str, precision: str = "fp16") -> float:
    """Bytes of the weights at this precision."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: unknown {precision!r} (known: {', '.join(PRECISIONS)})")
    return get_model(model).params * PRECISIONS[precision]


def kv_bytes_per_token(model: ModelProfile | str, kv_bytes: float = 2.0) -> float:
    """K and V for one token over all layers: 2 × layers × kv_heads × head_dim × bytes."""
    _check("kv_bytes", kv_bytes, 0, strict=True)
    m = get_model(model)
    return 2 * m.layers * m.num_kv_heads * m.head_dim * kv_bytes


@dataclass(frozen=True)
class FitReport:
    """Whether weights + KV for `batch` sequences of `context` tokens fit device memory."""

    weights_bytes: float
    kv_bytes: float
    total_bytes: float
    memory_bytes: float
    fits: bool
    headroom_bytes: float  # negative when it does not fit


def fits(model: ModelProfile | str, precision: str, hw: HardwareProfile | str,
         context: int, batch: int = 1, kv_bytes: float = 2.0) -> FitReport:
    """Memory needed vs memory available."""
    _check("context", context, 0)
    _check("batch", batch, 1)
    mem, w = get_hardware(hw).memory_bytes, weights_bytes(model, precision)
    kv = context * batch * kv_bytes_per_token(model, kv_bytes)
    return FitReport(w, kv, w + kv, mem, w + kv <= mem, mem - w - kv)


@dataclass(frozen=True)
class StepCost:
    """One forward step by the roofline: what it reads and computes, and how long each takes."""

    seconds: float  # max(memory_s, compute_s)
    memory_s: float
    compute_s: float
    read_bytes: float  # streamed weights + KV read
    offloaded_bytes: float  # the part of it read over the offload link

    @property
    def bound(self) -> str:
        """"memory" | "compute" | "offload" (memory-bound, and part of it offloaded)."""
        if self.compute_s > self.memory_s:
            return "compute"
        return "offload" if self.offloaded_bytes > 0 else "memory"


def step_cost(model: ModelProfile | str, precision: str, hw: HardwareProfile | str,
              tokens: int, logits: int, kv_tokens: int, kv_bytes: float = 2.0,
              efficiency: float = 1.0) -> StepCost:
    """The one roofline cost model: the time of a step computing `tokens` tokens, `logits` of
    them with logits (each decode token, each prompt's last), over `kv_tokens` of KV cache.

        memory  = (streamed weights + KV read) / bandwidth   (the part past device memory
                  at the offload link's bandwidth)
        compute = 2 × matmul params × tokens / (peak FLOP/s × efficiency)
        step    = max(memory, compute)

    Streamed weights: all but an untied embedding table (looked up, not multiplied); matmul
    params: the LM head only for tokens whose logits are needed (`ModelProfile`). Attention
    FLOPs and every overhead are left out: it is a ceiling.
    """
    _check("tokens", tokens, 1)
    _check("kv_tokens", kv_tokens, 0)
    if not 0 <= logits <= tokens:
        raise ValueError(f"logits must be in [0, tokens={tokens}], got {logits}")
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    m, h = get_model(model), get_hardware(hw)
    weights = weights_bytes(m, precision)  # all of them reside, an untied table included
    kv = kv_tokens * kv_bytes_per_token(m, kv_bytes)
    read = m.streamed_params() * PRECISIONS[precision] + kv
    held = weights + kv
    offloaded = min(read, max(0.0, held - h.memory_bytes))  # assume the table stays resident
    memory_s = (read - offloaded) / (h.bandwidth_gbs * GB) + offloaded / (
        h.offload_bandwidth_gbs * GB)
    flops = 2 * (logits * m.matmul_params() + (tokens - logits) * m.matmul_params(logits=False))
    compute_s = flops / (h.peak_tflops * 1e12 * efficiency)
    return StepCost(max(memory_s, compute_s), memory_s, compute_s, read, offloaded)


def decode_step_seconds(model: ModelProfile | str, precision: str, hw: HardwareProfile | str,
                        batch: int = 1, context: int = 0, kv_bytes: float = 2.0) -> float:
    """One decode step of `batch` sequences of `context` tokens (`step_cost`)."""
    return decode_tokens_per_s(model, precision, hw, batch, context, kv_bytes).step_seconds


@dataclass(frozen=True)
class DecodeProjection:
    """Roofline decode speed: tokens/s per user and in total, and what bounds it."""

    batch: int
    step_seconds: float
    per_user: float
    total: float
    bound: str  # "memory" | "compute" | "offload"
    note: str


def decode_tokens_per_s(model: ModelProfile | str, precision: str, hw: HardwareProfile | str,
                        batch: int = 1, context: int = 0, kv_bytes: float = 2.0
                        ) -> DecodeProjection:
    """Decode speed at this batch and context (`step_cost`: one token per sequence, each
    with logits, over batch × context tokens of KV), the bound and a one-line explanation."""
    _check("context", context, 0)
    _check("batch", batch, 1)
    h = get_hardware(hw)
    cost = step_cost(model, precision, h, batch, batch, batch * context, kv_bytes)
    read_gb = cost.read_bytes / GB
    if cost.bound == "offload":
        note = (f"does not fit {h.memory_gb:g} GB: {cost.offloaded_bytes / GB:.1f} of "
                f"{read_gb:.1f} GB stream over the {h.offload_bandwidth_gbs:g} GB/s offload "
                "link every step")
    elif cost.bound == "memory":
        note = f"memory-bound: each step reads {read_gb:.2f} GB at {h.bandwidth_gbs:g} GB/s"
    else:
        note = (f"compute-bound: batch {batch} is above B* ≈ {compute_bound_batch(h):.0f} "
                f"for {h.peak_tflops:g} TFLOPS")
    step = cost.seconds
    return DecodeProjection(batch, step, 1 / step, batch / step, cost.bound, note)


def prefill_seconds(model: ModelProfile | str, precision: str, hw: HardwareProfile | str,
                    prompt_tokens: int, efficiency: float = 0.5) -> float:
    """One step computing the whole prompt, logits for its last token only (`step_cost`,
    compute at `efficiency` of peak); at least one read of the weights."""
    _check("prompt_tokens", prompt_tokens, 1)
    return step_cost(model, precision, hw, prompt_tokens, 1, prompt_tokens,
                     efficiency=efficiency).seconds


def compute_bound_batch(hw: HardwareProfile | str) -> float:
    """B* = peak FLOP/s / bandwidth (bytes/s): the batch where fp16 decode turns compute-bound."""
    h = get_hardware(hw)
    return h.peak_tflops * 1e12 / (h.bandwidth_gbs * GB)


def response_seconds(model: ModelProfile | str, precision: str, hw: HardwareProfile | str,
                     prompt_tokens: int, output_tokens: int, batch: int = 1) -> float:
    """Prefill + output tokens at the per-user decode speed (at the mean decode context)."""
    _check("output_tokens", output_tokens, 1)
    context = prompt_tokens + output_tokens // 2
    per_user = decode_tokens_per_s(model, precision, hw, batch, context).per_user
    return prefill_seconds(model, precision, hw, prompt_tokens) + output_tokens / per_user


def seconds_for_tokens(tokens: float, tokens_per_s: float) -> float:
    """How long `tokens` take at `tokens_per_s`."""
    _check("tokens", tokens, 0)
    _check("tokens_per_s", tokens_per_s, 0, strict=True)
    return tokens / tokens_per_s


def aggregate_tokens_per_s(users: int, tokens_per_s_each: float) -> float:
    """Total throughput of `users` each receiving `tokens_per_s_each`."""
    _check("users", users, 1)
    _check("tokens_per_s_each", tokens_per_s_each, 0)
    return users * tokens_per_s_each


def max_batch(model: ModelProfile | str, precision: str, hw: HardwareProfile | str,
              context: int, kv_bytes: float = 2.0) -> int:
    """Most sequences of `context` tokens whose KV fits beside the weights (0: none fit)."""
    _check("context", context, 1)
    report = fits(model, precision, hw, context, 1, kv_bytes)
    free = report.memory_bytes - report.weights_bytes
    return max(0, int(free // (context * kv_bytes_per_token(model, kv_bytes))))


def local_difficulty(fit_keys: list[str]) -> str:
    """One word on how hard a model is to run locally, from the hardware it fits."""
    fit = [HARDWARE[k] for k in fit_keys if k in HARDWARE]
    if "rtx4060_laptop" in fit_keys:
        return "easy"  # fits an 8 GB laptop GPU
    if any(h.local and h.kind in ("gpu", "apple") for h in fit):
        return "needs a big GPU"
    if any(h.local for h in fit):
        return "CPU RAM only (slow)"
    return "datacenter only" if fit else "beyond one node"


def model_size_table(precision: str = "fp16", context: int = 4096) -> list[dict]:
    """Per model: weight size and the reference hardware holding it (+ KV of `context`)."""
    rows = []
    for m in MODELS.values():
        fit_keys = [k for k in HARDWARE if fits(m, precision, k, context).fits]
        rows.append({
            "model": m.name, "key": m.key, "params": m.params, "precision": precision,
            "weights_gb": weights_bytes(m, precision) / GB,
            "fp16_weights_gb": weights_bytes(m, "fp16") / GB,
            "fits_on": [HARDWARE[k].name for k in fit_keys],
            "difficulty": local_difficulty(fit_keys),
        })
    return rows


def local_vs_datacenter_table(model_key: str, precision: str = "fp16", context: int = 2048,
                              big_batch: int = BIG_BATCH) -> list[dict]:
    """Per hardware: batch-1 tokens/s per user; total at `big_batch` (None if it won't fit)."""
    rows = []
    for h in HARDWARE.values():
        one = decode_tokens_per_s(model_key, precision, h, 1, context)
        big_fits = fits(model_key, precision, h, context, big_batch).fits
        big = decode_tokens_per_s(model_key, precision, h, big_batch, context) if big_fits else None
        rows.append({
            "hardware": h.name, "key": h.key, "kind": h.kind, "local": h.local,
            "fits": fits(model_key, precision, h, context).fits,
            "tokens_per_s_user": one.per_user, "bound": one.bound,
            "big_batch": big_batch, "total_tokens_per_s_big_batch": big.total if big else None,
            "bound_big_batch": big.bound if big else None,
            "max_batch": max_batch(model_key, precision, h, context), "source": h.source,
        })
    return rows


def this_machine_profile(calibration: Calibration) -> HardwareProfile:
    """A profile for the machine the app runs on, from measured bandwidth and FLOP/s."""
    c = calibration
    offload = c.offload_bandwidth_gbs or 2.0  # CPU: spill to disk; assume a plain SSD
    kind = "gpu" if c.device.startswith("cuda") else "cpu"
    return HardwareProfile("this_machine", f"This machine ({c.device_name})", c.memory_available_gb,
                           c.bandwidth_gbs, c.tflops, offload, kind,
                           "measured by measure.calibrate")


@dataclass(frozen=True)
class Emulation:
    """Projected speed of a (device, model) pair that local tokens are paced to."""

    device_profile: str
    model_profile: str
    precision: str = "fp16"

    def __post_init__(self) -> None:
        get_hardware(self.device_profile)  # raises ValueError naming the field
        get_model(self.model_profile)
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"precision: unknown {self.precision!r} (known: {', '.join(PRECISIONS)})")

    @property
    def label(self) -> str:
        hw = get_hardware(self.device_profile)
        model = get_model(self.model_profile)
        return f"emulated: {model.name} {self.precision} on {hw.name} (projected)"

    def decode_seconds(self, context: int) -> float:
        proj = decode_tokens_per_s(
            self.model_profile, self.precision, self.device_profile, batch=1, context=context)
        return 1.0 / proj.per_user

    def prefill_seconds(self, prompt_tokens: int) -> float:
        return prefill_seconds(
            self.model_profile, self.precision, self.device_profile, prompt_tokens)
