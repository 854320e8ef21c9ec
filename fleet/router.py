"""The router in front of the replicas: which ready replica takes each request.

- round robin: each in turn;
- least outstanding: the replica with the fewest requests running or queued;
- prefix aware: requests whose first blocks hash alike go to the replica that served that
  prefix last, as SGLang's cache-aware router and llm-d's prefix scorer do, unless it is
  busier than the least loaded replica by more than `imbalance` requests (then the least
  loaded one takes it, and the prefix moves there). The key is the engine's own chained
  block hash (`engine.kv_cache.hash_block`) of the prompt's first `PREFIX_BLOCKS` full
  blocks, so it is what the replica's prefix cache would look up.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_cache import hash_block
from fleet.replica import Replica, SimRequest

ROUTERS = ("round_robin", "least_outstanding", "prefix_aware")
PREFIX_BLOCKS = 4
DEFAULT_IMBALANCE = 8


def prefix_key(token_ids: list[int], block_size: int, blocks: int = PREFIX_BLOCKS) -> int | None:
    """The chained hash of the first `blocks` full blocks (fewer for a short prompt; None
    for a prompt shorter than one block)."""
    parent = None
    for i in range(min(blocks, len(token_ids) // block_size)):
        parent = hash_block(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
    return parent


class Router:
    """Picks a replica for each request by `policy` (one of `ROUTERS`)."""

    def __init__(self, policy: str = "least_outstanding",
                 imbalance: int = DEFAULT_IMBALANCE) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"router: one of {ROUTERS}, got {policy!r}")
        if imbalance < 0:
            raise ValueError(f"imbalance: must be >= 0, got {imbalance}")
        self.policy, self.imbalance = policy, imbalance
        self._next = 0
        self._owner: dict[int, int] = {}  # prefix key -> replica index

    def pick(self, ready: Sequence[Replica], sreq: SimRequest) -> Replica:
        assert ready, "the fleet always keeps a ready replica"
        if self.policy == "round_robin":
            r = ready[self._next % len(ready)]
            self._next += 1
            return r
        least = min(ready, key=lambda r: (r.outstanding, r.index))
        if self.policy == "least_outstanding":
            return least
        key = prefix_key(sreq.token_ids, least.layout.block_size)
        if key is None:
            return least
        owner = self._owner.get(key)
        for r in ready:
            if r.index == owner and r.outstanding <= least.outstanding + self.imbalance:
                return r
        self._owner[key] = least.index
        return least
