"""The operator-wide bound on resources that update at once (VLLMDP_MAX_CONCURRENT_UPDATES).

A resource takes a slot when the user asks its serving replicas for new engines (a spec
change, or a new `vllmdp.io/restartedAt`), records it in `status.rollout`, and gives it back
once its replicas run what was asked (or failed to). The rest wait, serving what they run,
with `UpdatePending` in their Updated condition: a fleet-wide change never replaces every
RayCluster at once. Who holds a slot is read from the cached statuses, so a restarted
operator, or a new leader, knows it without a write of its own; a slot given in this process
and not yet written is held here meanwhile.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from vllm_dp_operator.config import update_limit

Key = tuple[str, str]


class UpdateSlots:
    """Grants update slots: `limit` is VLLMDP_MAX_CONCURRENT_UPDATES (`N`, or `P%` of the
    resources), `holders` lists the resources whose status holds one, `fleet` counts them all."""

    def __init__(self, limit: str, holders: Callable[[], Iterable[Key]],
                 fleet: Callable[[], int]) -> None:  # fmt: skip
        self.count, self.fraction = update_limit(limit)
        self.holders, self.fleet = holders, fleet
        self.granted: set[Key] = set()

    def limit(self) -> int:
        """How many resources may update at once now (0: no bound)."""
        if self.fraction:
            return max(1, math.floor(self.fleet() * self.fraction))
        return self.count

    def held(self) -> set[Key]:
        """The resources that hold a slot: by their status, or granted here and not written."""
        return set(self.holders()) | self.granted

    def take(self, key: Key) -> bool:
        """Whether `key` may update now: it holds a slot already, or one is free (taken)."""
        held = self.held()
        limit = self.limit()
        if key in held:
            return True
        if limit and len(held) >= limit:
            return False
        self.granted.add(key)
        return True

    def written(self, key: Key) -> None:
        """Its status now says it (or that it gave the slot back): the cache tells from here."""
        self.granted.discard(key)
