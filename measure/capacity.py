"""The seed's capacity arithmetic, live: users -> tokens/s needed -> replicas of a layout at
the batch that meets a TTFT and a TPOT target; and what a token costs, in dollars and in
joules, on that layout and on a local PC.

    connected users × active share × tokens/s each = tokens/s needed
    R replicas: each batches B = ceil(active / R) users; a token every
      TPOT = decode step(B) / (1 − prefill share), the prefill share being the time its
      arriving requests' prompts take (B × tokens/s each / output tokens × prefill)
    the fewest R with TPOT <= target (and <= 1 / tokens/s each), TTFT <= target

The search runs over `measure.projection`'s step times (the package's measured kernels),
not the package's own aggregated-serving search: a bisection over R, a few cached decode
steps, well under a millisecond.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from measure import hardware
from measure import projection as P

# On-demand price of one GPU for one hour, USD, and where it comes from.
GPU_HOUR_USD: dict[str, tuple[float, str]] = {
    "a100_sxm": (1.30, "Mercatus cloud GPU pricing guide, specialty clouds $1.10–1.50; "
                       "https://www.mercatus-ai.com/blog/cloud-gpu-pricing"),
    "h100_sxm": (3.00, "Mercatus cloud GPU pricing guide, specialty clouds $2.50–3.50; "
                       "https://www.mercatus-ai.com/blog/cloud-gpu-pricing"),
    "h200_sxm": (4.00, "Mercatus cloud GPU pricing guide, specialty clouds $3.50–4.50; "
                       "https://www.mercatus-ai.com/blog/cloud-gpu-pricing"),
    "b200_sxm": (4.50, "Ornn GPU rental benchmark, neocloud on-demand; "
                       "https://www.ornnai.com/research/nvidia-b200-vs-b300-why-use-one-instead-of-the-other"),
    "b300_sxm": (6.00, "Ornn GPU rental benchmark, neocloud on-demand $5.00–7.25; "
                       "https://www.ornnai.com/research/nvidia-b200-vs-b300-why-use-one-instead-of-the-other"),
    "gb200": (4.54, "Spheron on-demand, $9.08 per GB200 superchip of 2 GPUs; "
                    "https://www.spheron.network/blog/nvidia-h200-vs-b200-vs-gb200"),
    "gb300": (6.00, "no per-GPU GB300 rental price found: the B300's (Ornn, $5.00–7.25); "
                    "https://www.ornnai.com/research/nvidia-b200-vs-b300-why-use-one-instead-of-the-other"),
    "l40s": (1.86, "AWS g6e.xlarge (1× L40S) on-demand, us-east-1, as listed by Modal; "
                   "https://modal.com/blog/nvidia-l40s-price-article"),
    "rtx_pro_6000_server": (0.66, "packet.ai on-demand RTX PRO 6000; "
                                  "https://packet.ai/blog/gpu-pricing-models-compared"),
}

# Board (or package) power of the local devices the page compares, W, and the source.
LOCAL_POWER_W: dict[str, tuple[float, str]] = {
    "rtx4090": (450, "NVIDIA GeForce RTX 4090 specifications: total graphics power 450 W"),
    "m2_max": (145, "Apple, Mac Studio power consumption and thermal output (M2 Max, "
                    "maximum): 145 W; https://support.apple.com/en-us/102027"),
    "laptop_cpu": (28, "AMD Ryzen 7 7840U specifications: default TDP 28 W"),
}

@dataclass(frozen=True)
class Demand:
    """Who wants tokens: the seed's example is 1,000 connected, 200 active, 20 tokens/s."""

    connected: int = 1000
    active: int = 200
    tokens_per_s_each: float = 20.0
    prompt_tokens: int = 1024
    output_tokens: int = 512

    def __post_init__(self) -> None:
        if self.connected < 1:
            raise ValueError(f"connected must be >= 1, got {self.connected}")
        if not 0 <= self.active <= self.connected:
            raise ValueError(f"active must be in [0, connected={self.connected}], "
                             f"got {self.active}")
        if self.tokens_per_s_each <= 0:
            raise ValueError(f"tokens_per_s_each must be > 0, got {self.tokens_per_s_each}")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError("prompt_tokens and output_tokens must be >= 1")

    @property
    def tokens_per_s(self) -> float:
        """Total output tokens/s the active users need."""
        return self.active * self.tokens_per_s_each

    @property
    def context(self) -> int:
        """The mean context of a decode step: the prompt and half the answer."""
        return self.prompt_tokens + self.output_tokens // 2


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.05  # 20 tokens/s each

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError(f"ttft_s and tpot_s must be > 0, got {self.ttft_s}, {self.tpot_s}")


@dataclass(frozen=True)
class CapacityPlan:
    """Replicas of one layout that serve a demand within an SLO (`ok` False: none can)."""

    layout: P.Layout
    ok: bool
    reason: str  # one line when not ok
    batch: int = 0  # users per replica
    tpot_s: float = 0.0  # the decode step stretched by the prefills between steps
    ttft_s: float = 0.0
    replica_tokens_per_s: float = 0.0  # batch / TPOT
    replicas: int = 0
    prefill_share: float = 0.0  # of a replica's time, spent on the prefills of arrivals

    @property
    def gpus(self) -> int:
        return self.replicas * self.layout.gpus


def _serve(layout: P.Layout, demand: Demand, replicas: int, prefill: float
           ) -> tuple[int, float, float, float]:
    """(batch, TPOT, decode step, prefill share) of one of `replicas` replicas sharing the
    active users: each holds ceil(active / replicas) of them in its batch, and spends
    arrivals × prefill of its time on their prompts, which stretches every token."""
    batch = math.ceil(demand.active / replicas)
    step = P.decode_step_seconds(layout, batch, demand.context)
    arrivals = batch * demand.tokens_per_s_each / demand.output_tokens  # requests/s
    share = arrivals * prefill
    tpot = step / (1 - share) if share < 1 else math.inf
    return batch, tpot, step, share


def plan(layout: P.Layout, demand: Demand, slo: Slo) -> CapacityPlan:
    """The fewest replicas of `layout` whose users all get a token every TPOT target (and
    at least their tokens/s) and a first token within the TTFT target.

    Each replica's batch is its share of the active users; more replicas mean smaller,
    faster steps, so the fewest that meet both targets is found by bisection."""
    verdict = P.check(layout, demand.context, 1)
    if not verdict.ok:
        return CapacityPlan(layout, False, verdict.reason)
    if demand.active == 0:
        return CapacityPlan(layout, True, "")
    tpot_target = min(slo.tpot_s, 1 / demand.tokens_per_s_each)
    fits = P.max_batch(layout, demand.context)
    prefill = P.prefill_seconds(layout, demand.prompt_tokens)

    def meets(replicas: int) -> bool:
        batch, tpot, step, _ = _serve(layout, demand, replicas, prefill)
        return batch <= fits and tpot <= tpot_target and prefill + step <= slo.ttft_s

    if not meets(demand.active):  # one user per replica is the best there is
        _, tpot1, step1, _ = _serve(layout, demand, demand.active, prefill)
        return CapacityPlan(layout, False, (
            f"No batch meets the targets: even at batch 1 a token takes {tpot1 * 1e3:,.1f} ms "
            f"(target {tpot_target * 1e3:,.0f} ms) and TTFT is {prefill + step1:,.2f} s "
            f"(target {slo.ttft_s:g} s)."))
    low, high = 1, demand.active  # meets(high); find the least
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if meets(mid) else (mid + 1, high)
    batch, tpot, step, share = _serve(layout, demand, low, prefill)
    return CapacityPlan(layout, True, "", batch, tpot, prefill + step, batch / tpot, low,
                        share)


def cost_per_million_tokens(usd_per_gpu_hour: float, gpus: int, tokens_per_s: float) -> float:
    """Dollars per million output tokens of `gpus` GPUs producing `tokens_per_s`."""
    if usd_per_gpu_hour < 0 or gpus < 1 or tokens_per_s <= 0:
        raise ValueError("need usd_per_gpu_hour >= 0, gpus >= 1, tokens_per_s > 0")
    return usd_per_gpu_hour * gpus / 3600 / tokens_per_s * 1e6


def energy_per_token_j(power_w: float, step_s: float, tokens_per_step: int) -> float:
    """Board power × step time ÷ tokens the step yields, in joules."""
    if power_w < 0 or step_s <= 0 or tokens_per_step < 1:
        raise ValueError("need power_w >= 0, step_s > 0, tokens_per_step >= 1")
    return power_w * step_s / tokens_per_step


@dataclass(frozen=True)
class LocalPlan:
    """The same users on their own PCs: one PC each, one request at a time (batch 1)."""

    hardware: hardware.HardwareProfile
    pcs: int
    tokens_per_s_each: float
    meets_rate: bool
    bound: str
    energy_per_token_j: float
    note: str


def local_plan(model: hardware.ModelProfile, hw_key: str, demand: Demand,
               precision: str = "fp16") -> LocalPlan:
    """Every connected user owns a PC; each decodes at batch 1 by the roofline."""
    hw = hardware.get_hardware(hw_key)
    p = hardware.decode_tokens_per_s(model, precision, hw, 1, demand.context)
    watts = LOCAL_POWER_W[hw_key][0]
    return LocalPlan(hw, demand.connected, p.per_user, p.per_user >= demand.tokens_per_s_each,
                     p.bound, energy_per_token_j(watts, p.step_seconds, 1), p.note)
