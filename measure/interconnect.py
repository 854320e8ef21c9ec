"""What it costs to move activations between GPUs: a tensor-parallel all-reduce, a
pipeline-parallel hop, and the pipeline bubble, on the links a datacenter and a PC have.

    tensor parallel (TP=4), one layer:          pipeline parallel (PP=2):
    GPU0 GPU1 GPU2 GPU3   each holds 1/4 of      [layers 0..39] --hop--> [layers 40..79]
      \\    \\   /    /     every matrix; after    stage 0                 stage 1
       ring all-reduce    attention and after
       of B×hidden        the MLP they sum
                          their partial outputs

Ring all-reduce over p GPUs: 2(p−1) steps, each sending 1/p of the message to the next
GPU, so every GPU sends and receives 2(p−1)/p × message bytes. Engines pipeline those
steps (and use one-shot kernels for small messages), so the latency is paid about once:

    t_allreduce = 2(p−1)/p × bytes / link bandwidth  +  per-hop latency
    t_hop       = bytes / link bandwidth + per-hop latency
    bubble      = (p−1) / (m + p−1)   for p stages and m micro-batches

Bandwidths are per GPU and per direction, in decimal GB/s. These are ideal figures:
`measure.projection` checks them against the package's measured NCCL kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
US = 1e-6


@dataclass(frozen=True)
class Link:
    """One interconnect, per GPU: its bandwidth each way and the latency of one hop."""

    key: str
    name: str
    bandwidth_gbs: float  # per GPU, per direction
    latency_us: float  # one hop: one step of a ring, or one pipeline send
    scope: str  # "node" (GPUs in one box) | "cluster" (between boxes)
    source: str

    def __post_init__(self) -> None:
        if self.bandwidth_gbs <= 0 or self.latency_us < 0:
            raise ValueError(f"link {self.key}: bandwidth must be > 0 and latency >= 0")


_LINKS = [
    # 12 NVLink 3 links × 50 GB/s = 600 GB/s per GPU, both directions together.
    Link("nvlink3", "NVLink 3 (600 GB/s)", 300, 2.5, "node",
         "NVIDIA A100 Tensor Core GPU datasheet: NVLink 600 GB/s; "
         "https://www.nvidia.com/en-us/data-center/a100/"),
    # 18 NVLink 4 links × 50 GB/s = 900 GB/s per GPU, both directions together.
    # Per-hop latency: just under the fastest all-reduce of a tiny message in the package's
    # measured data (TensorRT-LLM's kernel on 2 GPUs, systems/data/h100_sxm/comm/trtllm:
    # 2.6 µs), so the formula stays a floor.
    Link("nvlink4", "NVLink 4 (900 GB/s)", 450, 2.5, "node",
         "NVIDIA H100 Tensor Core GPU datasheet: NVLink 900 GB/s; "
         "https://www.nvidia.com/en-us/data-center/h100/"),
    # 18 NVLink 5 links × 100 GB/s = 1.8 TB/s per GPU, both directions together.
    Link("nvlink5", "NVLink 5 (1.8 TB/s)", 900, 2.5, "node",
         "NVIDIA Blackwell (HGX B200) datasheet: NVLink 1.8 TB/s; "
         "https://www.nvidia.com/en-us/data-center/hgx/"),
    # 16 GT/s × 16 lanes × 128/130 encoding / 8 bits = 31.5 GB/s each way. GPUs that talk
    # over PCIe go through the CPU's root complex or a switch: the package's measured
    # all-reduce of a tiny message over 2 PCIe GPUs (L40S, RTX PRO 6000) takes 8 µs.
    Link("pcie4", "PCIe 4.0 ×16 (31.5 GB/s)", 31.5, 5.0, "node",
         "PCI-SIG PCI Express Base Specification 4.0 (16 GT/s per lane)"),
    # 32 GT/s per lane: 63 GB/s each way.
    Link("pcie5", "PCIe 5.0 ×16 (63 GB/s)", 63, 5.0, "node",
         "PCI-SIG PCI Express Base Specification 5.0 (32 GT/s per lane)"),
    # One 200 Gb/s ConnectX-6 NIC per GPU (DGX A100: 8 of them) = 25 GB/s each way.
    Link("ib_hdr", "InfiniBand HDR (200 Gb/s per GPU)", 25, 10.0, "cluster",
         "NVIDIA DGX A100 datasheet: 8× ConnectX-6 200 Gb/s HDR; "
         "https://www.nvidia.com/en-us/data-center/dgx-a100/"),
    # One 400 Gb/s ConnectX-7 NIC per GPU (DGX H100: 8 of them) = 50 GB/s each way.
    # A hop crosses NIC, switch and NIC: aiconfigurator-core's system files use 10 µs
    # (systems/h100_sxm.yaml p2p_latency).
    Link("ib_ndr", "InfiniBand NDR (400 Gb/s per GPU)", 50, 10.0, "cluster",
         "NVIDIA DGX H100 datasheet: 8× ConnectX-7 400 Gb/s; NVIDIA Quantum-2 NDR; "
         "https://www.nvidia.com/en-us/data-center/dgx-h100/"),
    # 800 Gb/s ConnectX-8 SuperNIC per GPU = 100 GB/s each way.
    Link("ib_xdr", "InfiniBand XDR (800 Gb/s per GPU)", 100, 10.0, "cluster",
         "NVIDIA Quantum-X800 InfiniBand / ConnectX-8 SuperNIC (800 Gb/s); "
         "https://www.nvidia.com/en-us/networking/products/infiniband/quantum-x800/"),
]
LINKS: dict[str, Link] = {link.key: link for link in _LINKS}


def get_link(link: Link | str) -> Link:
    """Resolve a link key (or pass a Link through)."""
    if isinstance(link, Link):
        return link
    if link not in LINKS:
        raise ValueError(f"link: unknown {link!r} (known: {', '.join(LINKS)})")
    return LINKS[link]


def _check(name: str, value: float, low: float) -> None:
    if value < low:
        raise ValueError(f"{name} must be >= {low:g}, got {value}")


def ring_allreduce_seconds(message_bytes: float, gpus: int, link: Link | str) -> float:
    """One ring all-reduce of `message_bytes` over `gpus` GPUs (0 for one GPU)."""
    _check("message_bytes", message_bytes, 0)
    _check("gpus", gpus, 1)
    if gpus == 1:
        return 0.0
    lk = get_link(link)
    return 2 * (gpus - 1) / gpus * message_bytes / (lk.bandwidth_gbs * GB) + lk.latency_us * US


def activation_bytes(tokens: int, hidden_size: int, bytes_per_element: float = 2.0) -> float:
    """The activations one all-reduce or pipeline hop moves: tokens × hidden × bytes."""
    _check("tokens", tokens, 0)
    _check("hidden_size", hidden_size, 1)
    return tokens * hidden_size * bytes_per_element


def tensor_parallel_seconds(tokens: int, hidden_size: int, layers: int, tp: int,
                            link: Link | str, bytes_per_element: float = 2.0) -> float:
    """The all-reduces of one forward step: two per layer (after attention, after the MLP),
    each over `tokens` × `hidden_size` activations."""
    _check("layers", layers, 1)
    one = ring_allreduce_seconds(activation_bytes(tokens, hidden_size, bytes_per_element),
                                 tp, link)
    return 2 * layers * one


def pipeline_hop_seconds(message_bytes: float, link: Link | str) -> float:
    """One pipeline stage handing its activations to the next."""
    _check("message_bytes", message_bytes, 0)
    lk = get_link(link)
    return message_bytes / (lk.bandwidth_gbs * GB) + lk.latency_us * US


def pipeline_seconds(tokens: int, hidden_size: int, pp: int, link: Link | str,
                     bytes_per_element: float = 2.0) -> float:
    """The pp − 1 hops one forward pass makes through `pp` stages."""
    _check("pp", pp, 1)
    hop = pipeline_hop_seconds(activation_bytes(tokens, hidden_size, bytes_per_element), link)
    return (pp - 1) * hop


def pipeline_bubble(stages: int, micro_batches: int) -> float:
    """Share of a pipeline's time its stages sit idle filling and draining it:
    (p − 1) / (m + p − 1) for p stages and m micro-batches."""
    _check("stages", stages, 1)
    _check("micro_batches", micro_batches, 1)
    return (stages - 1) / (micro_batches + stages - 1)
