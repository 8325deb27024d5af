"""Every status key the reconcile writes is in the CRD's status schema.

The API server prunes fields its structural schema does not know. A key the operator writes
but the schema lacks never reaches the cache, so the next reconcile finds it changed again
and patches status once more: a no-op PATCH per reconcile, per probe while Serving (found by
`make bench-serving`: `layout.apiServers`, about one write per resource every 30 s).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_dp_operator.api.crd import build_crd
from world import World, serving, spec

SAMPLE = (Path(__file__).parent / "data" / "vllm-0.33-dp2-metrics.txt").read_text()


def _status_schema() -> dict[str, Any]:
    schema: dict[str, Any] = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return dict(schema["properties"]["status"])


def pruned(value: Any, schema: dict[str, Any], path: str = "status") -> list[str]:
    """The paths in `value` that the API server would prune under `schema`."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, dict) and "properties" in schema:
        out = []
        for key, item in value.items():
            if key not in schema["properties"]:
                out.append(f"{path}.{key}")
            else:
                out += pruned(item, schema["properties"][key], f"{path}.{key}")
        return out
    if isinstance(value, list) and "items" in schema:
        return [p for i, item in enumerate(value)
                for p in pruned(item, schema["items"], f"{path}[{i}]")]  # fmt: skip
    return []


def test_the_pruning_check_sees_an_unknown_key() -> None:
    assert pruned({"layout": {"gpuPods": 1, "nope": 2}}, _status_schema()) == [
        "status.layout.nope"]


async def test_a_launching_and_a_serving_status_survive_pruning_whole() -> None:
    w = World(spec(dataParallel={"size": 2, "ranksPerNode": 1}))
    await w.step()
    w.cluster_ready()
    await w.step()
    assert pruned(w.status, _status_schema()) == []  # Launching
    w = await serving(spec(dataParallel={"size": 2, "ranksPerNode": 1}))
    w.probe.metrics = SAMPLE
    await w.step(5)
    assert w.status["phase"] == "Serving" and w.status.get("load")
    assert pruned(w.status, _status_schema()) == []
