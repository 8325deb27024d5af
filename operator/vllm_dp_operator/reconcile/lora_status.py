"""spec.lora's adapters across the replicas: status.lora, the LoRAReady condition, and which
adapters failed anew (a Warning Event each). Pure: from the replicas' status entries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_dp_operator import constants as c
from vllm_dp_operator.api.models import VLLMDataParallelSpec


@dataclass(frozen=True)
class LoraSummary:
    """What the resource's status shows of its adapters."""

    status: dict[str, Any]
    #: The LoRAReady condition: (ok, reason, message).
    condition: tuple[bool, str, str]
    #: Adapters with an error the last status did not show, and the error.
    new_failures: dict[str, str] = field(default_factory=dict)


def replica_lora(loaded: frozenset[str], failed: Mapping[str, str], detail: str
                 ) -> dict[str, Any]:  # fmt: skip
    """A replica's `lora` entry from its last sync."""
    out: dict[str, Any] = {"loaded": sorted(loaded),
                           "failed": [{"name": n, "error": e} for n, e in sorted(failed.items())]}
    if detail:
        out["detail"] = detail
    return out


def summarize(spec: VLLMDataParallelSpec, entries: Sequence[Mapping[str, Any]],
              previous: Mapping[str, Any] | None) -> LoraSummary | None:  # fmt: skip
    """status.lora from the routed replicas' entries; None without spec.lora."""
    if spec.lora is None:
        return None
    routed = [e for e in entries if e.get("routed") and not e.get("leaving")]
    adapters, failures = [], {}
    for a in spec.lora.adapters:
        on = sorted(int(e["index"]) for e in routed
                    if a.name in ((e.get("lora") or {}).get("loaded") or []))  # fmt: skip
        error = next((f["error"] for e in routed for f in (e.get("lora") or {}).get("failed") or []
                      if f.get("name") == a.name), None)  # fmt: skip
        item: dict[str, Any] = {"name": a.name, "replicas": on}
        if error is not None:
            item["error"] = error
            failures[a.name] = error
        adapters.append(item)
    everywhere = [a for a in adapters if routed and len(a["replicas"]) == len(routed)]
    status = {"adapters": adapters, "ready": f"{len(everywhere)}/{len(adapters)}"}
    before = {a.get("name"): a.get("error") for a in (previous or {}).get("adapters") or []}
    new = {n: e for n, e in failures.items() if before.get(n) != e}
    if failures:
        named = "; ".join(f"{n}: {e}" for n, e in failures.items())
        cond = (False, c.REASON_ADAPTER_FAILED,
                f"{len(failures)} adapter(s) did not load, the others serve: {named}")
    elif not routed:
        cond = (False, c.REASON_ADAPTERS_LOADING, "No replica is routed yet")
    elif len(everywhere) < len(adapters):
        waiting = [a["name"] for a in adapters if a not in everywhere]
        cond = (False, c.REASON_ADAPTERS_LOADING,
                f"Loading on the routed replicas: {', '.join(waiting)}")
    else:
        cond = (True, c.REASON_ADAPTERS_LOADED,
                f"{len(adapters)} adapter(s) served by all {len(routed)} routed replica(s)")
    return LoraSummary(status, cond, new)
