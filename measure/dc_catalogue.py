"""What the Datacenter page's projections cover: the models aiconfigurator-core bundles
(read from its own config files, never downloaded) plus `measure.hardware`'s others for
the roofline alone, and the datacenter systems it has measured kernels for, with their
datasheet figures as its system files give them.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from importlib import resources

from measure import interconnect
from measure.hardware import GB, HardwareProfile, ModelProfile
from measure.hardware import MODELS as ROOFLINE_MODELS

GIB = 2**30


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


def quiet() -> None:
    """The package logs every fallback table it loads at WARNING; the page shows its own
    provenance instead."""
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)


@functools.cache
def bundled_config(aic_name: str) -> dict:
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
        cfg = bundled_config(aic)
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
