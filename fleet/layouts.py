"""A replica's layout: the model on which hardware, its KV pool, its batching limits, its
step costs, and what it costs to run (power, dollars), all the simulation needs of it.

Power and prices are assumptions the user can change (the page's controls); each default
says where it comes from."""

from __future__ import annotations

from dataclasses import dataclass, replace

from fleet.costs import LinearStepCost, RooflineStepCost, StepCost
from measure import hardware

GIB = 1024**3
DEFAULT_BLOCK_SIZE = 16
KV_MEMORY_SHARE = 0.9  # of device memory left after the weights (vLLM's gpu_memory_utilization)


@dataclass(frozen=True)
class Layout:
    """One replica: `gpus` devices running `model` with step times from `cost`."""

    name: str
    model: str | hardware.ModelProfile  # a measure.hardware key, or a model's shape
    cost: StepCost
    num_blocks: int
    weights_bytes: float
    gpus: int = 1
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_prefill_attention: int | None = 512 * 1024
    enable_prefix_caching: bool = True
    busy_watts: float = 700.0
    idle_watts: float = 100.0
    dollars_per_hour: float = 2.5  # per replica
    # an idle replica's first step starts this long after its latest arrival (the host
    # waking and scheduling), so that arrivals closer together than this share the step
    wake_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_blocks", "gpus", "block_size", "max_num_seqs",
                     "max_num_batched_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("weights_bytes", "busy_watts", "idle_watts", "dollars_per_hour",
                     "wake_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def capacity_tokens_per_s(self, context: int) -> float:
        """Decode tokens/s with every slot busy at `context` tokens each: the most this
        replica can produce."""
        n = self.max_num_seqs
        while n > 1 and n * context > self.pool_tokens:
            n -= 1
        return n / self.cost.step_seconds(n, 0, n, n * context)

    def with_costs(self, **changes: float) -> Layout:
        """The same layout with other power or prices (`busy_watts`, `dollars_per_hour`...)."""
        return replace(self, **changes)


THIS_MACHINE_BLOCKS = 2912  # the engine's default 1 GiB pool: bfloat16 SmolLM2, 16-token blocks
SMOLLM2_BF16_BYTES = 134_515_008 * 2


def this_machine(cost: StepCost, num_blocks: int = THIS_MACHINE_BLOCKS,
                 max_num_seqs: int = 64, wake_s: float = 0.0) -> Layout:
    """This CPU running the bundled SmolLM2-135M as the engine does by default, its step
    times `cost` (fitted to the live engine's steps). Power: an assumed 35 W for two
    server cores and their memory; price: an assumed 0.10 $/h for a 2-vCPU cloud VM."""
    return Layout("this machine", "smollm2-135m", cost, num_blocks, SMOLLM2_BF16_BYTES,
                  gpus=1, max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                  busy_watts=35.0, idle_watts=15.0, dollars_per_hour=0.10, wake_s=wake_s)


# The bench's decode-step fit on this kind of machine (docs/benchmarks.md): a stand-in
# until a live fit is made, so the page opens without loading the model.
THIS_MACHINE_COST = LinearStepCost(0.0095, 0.0009, 0.00055, 1.2e-6, "the bench's published fit")


def kv_blocks_for(model: str, hw: str, gpus: int, precision: str = "fp16",
                  block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Blocks of KV that fit beside the weights on `gpus` devices of `hw`."""
    h = hardware.get_hardware(hw)
    free = h.memory_bytes * gpus - hardware.weights_bytes(model, precision)
    if free <= 0:
        raise ValueError(f"layout: {model} in {precision} does not fit {gpus} x {h.name}")
    per_block = hardware.kv_bytes_per_token(model) * block_size
    return max(int(free * KV_MEMORY_SHARE // per_block), 1)


def roofline_layout(name: str, model: str, hw: str, gpus: int = 1, precision: str = "fp16",
                    max_num_seqs: int = 256, busy_watts: float = 700.0,
                    idle_watts: float = 100.0, dollars_per_gpu_hour: float = 2.5) -> Layout:
    """A datacenter replica priced by the roofline (`RooflineStepCost`). `gpus` > 1 runs
    tensor-parallel on one node: hardware "8xh100" is such a node as one device."""
    per_device = hardware.get_hardware(hw)
    devices = 1 if per_device.kind == "node" else gpus
    return Layout(name, model, RooflineStepCost(model, hw, precision),
                  kv_blocks_for(model, hw, devices, precision),
                  hardware.weights_bytes(model, precision), gpus=gpus,
                  max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
                  busy_watts=busy_watts * gpus, idle_watts=idle_watts * gpus,
                  dollars_per_hour=dollars_per_gpu_hour * gpus)


def builtin_layouts() -> dict[str, Layout]:
    """The layouts offered without a projection: this machine (the bench's fit) and two
    roofline GPU replicas. H100 SXM: 700 W board power (NVIDIA datasheet), ~100 W idle;
    2.5 $/GPU-hour, an assumed on-demand cloud price."""
    return {
        "this machine": this_machine(THIS_MACHINE_COST),
        "Llama-3-8B on 1×H100 (roofline)": roofline_layout(
            "Llama-3-8B on 1×H100 (roofline)", "llama-3-8b", "h100"),
        "Llama-3-70B on 8×H100 TP8 (roofline)": roofline_layout(
            "Llama-3-70B on 8×H100 TP8 (roofline)", "llama-3-70b", "8xh100", gpus=8),
    }
