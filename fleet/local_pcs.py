"""The same users each on a PC of their own: how many PCs, how fast each answers, what
each token costs in energy. Speeds are `measure.hardware`'s roofline ceilings for batch 1
(one user per PC); power is each device's published board or package power while busy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fleet.trace import TraceRequest
from measure import hardware

# device key -> (watts while generating, where the figure comes from)
LOCAL_POWER: dict[str, tuple[float, str]] = {
    "laptop_cpu": (28.0, "AMD Ryzen 7 7840U default TDP 28 W"),
    "desktop_cpu": (170.0, "AMD Ryzen 9 7950X TDP 170 W"),
    "rtx4060_laptop": (115.0, "RTX 4060 Laptop GPU, up to 115 W (NVIDIA)"),
    "rtx4090": (450.0, "RTX 4090 total graphics power 450 W (NVIDIA)"),
    "m2_max": (60.0, "M2 Max package power under load, assumed (Apple publishes none)"),
}


@dataclass(frozen=True)
class LocalFleet:
    """Every user on their own PC."""

    device: str
    device_name: str
    pcs: int
    per_user_tokens_per_s: float
    joules_per_token: float
    watts: float
    bound: str
    power_source: str

    def as_dict(self) -> dict[str, float | int | str]:
        return dict(self.__dict__)


def busy_at_peak(requests: Sequence[TraceRequest], tokens_per_s: float) -> int:
    """Requests answering at once at the busiest moment, were each answered from its
    arrival on a PC of its own at `tokens_per_s` (for a trace of requests without users:
    the PCs its users would need, whatever the fleet beside them did)."""
    if not tokens_per_s > 0:
        raise ValueError(f"tokens_per_s: must be > 0, got {tokens_per_s}")
    edges = sorted([(r.arrival, 1) for r in requests]
                   + [(r.arrival + r.output_tokens / tokens_per_s, -1) for r in requests])
    busy = peak = 0
    for _, step in edges:  # at a tie an end sorts first: back to back is one PC
        busy += step
        peak = max(peak, busy)
    return peak


def local_fleet(model: str | hardware.ModelProfile, device: str, users: int, context: int,
                precision: str = "fp16") -> LocalFleet:
    """`users` PCs of `device` each running `model` for one user at `context` tokens."""
    if device not in LOCAL_POWER:
        raise ValueError(f"device: one of {list(LOCAL_POWER)}, got {device!r}")
    if users < 1:
        raise ValueError(f"users: must be >= 1, got {users}")
    hw = hardware.get_hardware(device)
    p = hardware.decode_tokens_per_s(model, precision, hw, 1, context)
    watts, source = LOCAL_POWER[device]
    return LocalFleet(device, hw.name, users, p.per_user, watts / p.per_user, watts, p.bound,
                      source)
