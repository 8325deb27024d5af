"""What the operator's caches hold per resource at rest, offline: no test bed, no kopf.

Builds the objects one suspended resource has (the resource with the status its reconcile
wrote, its RayCluster, Service, EndpointSlice and NetworkPolicy, rendered and reconciled by the
operator's own code against the unit tier's fake cluster), gives each a fresh name, uid and
resourceVersion as the API server would, parses each from JSON as a watch does, and stores N
of each in an `ObjectCache`. Prints the traced bytes per resource, per kind, and the same with
interning off (`--no-intern`), as one JSON line. The control-plane benchmark's P3 10k measures
the whole process (kopf included); this says where the cache's share goes.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "unit"))

from vllm_dp_operator.controller import cache as cache_module  # noqa: E402
from vllm_dp_operator.controller.kube import (  # noqa: E402
    ENDPOINTSLICE,
    NETWORKPOLICY,
    RAYCLUSTER,
    SERVICE,
    VDP,
    Kind,
)
from world import World, spec  # noqa: E402

KINDS = (VDP, RAYCLUSTER, SERVICE, ENDPOINTSLICE, NETWORKPOLICY)
#: What the API server adds to every object: managedFields (slimmed away) and server fields.
MANAGED = [{"manager": "vllm-dp-operator", "operation": "Update", "apiVersion": "v1",
            "time": "2026-12-01T17:21:32Z", "fieldsType": "FieldsV1",
            "fieldsV1": {"f:metadata": {"f:labels": {"f:app.kubernetes.io/instance": {}}}}}]


async def templates() -> dict[Kind, dict[str, Any]]:
    """One suspended resource's objects, as the API server would hold them."""
    world = World(spec(suspend=True, dataParallel={"size": 2, "ranksPerNode": 2}))
    await world.step()
    await world.step()
    owner = {"apiVersion": "vllmdp.io/v1alpha1", "kind": "VLLMDataParallel",
             "metadata": {"name": "demo", "namespace": "default", "uid": world.uid,
                          "generation": 1},
             "spec": world.spec, "status": world.status}  # fmt: skip
    out: dict[Kind, dict[str, Any]] = {VDP: owner}
    for kind in KINDS[1:]:
        objs = world.kube.named(kind)
        if objs:
            out[kind] = objs[0]
    for obj in out.values():
        meta = obj["metadata"]
        meta.setdefault("creationTimestamp", "2026-12-01T17:21:32Z")
        meta["managedFields"] = MANAGED
    return out


def fresh(template: dict[str, Any], i: int) -> tuple[dict[str, Any], str]:
    """The template as a watch would parse it for resource i: its own strings throughout."""
    text = json.dumps(template).replace("demo", f"s{i}").replace("uid-demo", str(uuid.uuid4()))
    obj = json.loads(text)
    obj["metadata"]["uid"] = obj["metadata"].get("uid") or str(uuid.uuid4())
    obj["metadata"]["resourceVersion"] = str(100000 + i * 7)
    return obj, text


def measure(n: int, objs: dict[Kind, dict[str, Any]]) -> dict[str, Any]:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    cache = cache_module.ObjectCache(KINDS)
    per_kind: dict[str, float] = {}
    for kind, template in objs.items():
        before = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            raw, _ = fresh(template, i)
            cache.upsert(kind, raw)
            del raw
        gc.collect()
        per_kind[kind.plural] = (tracemalloc.get_traced_memory()[0] - before) / n
    total = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return {"n": n, "total_mib": total / 2**20, "bytes_per_resource": total / n,
            "bytes_per_object_by_kind": per_kind}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=10000)
    parser.add_argument("--no-intern", action="store_true", help="the cache without interning")
    args = parser.parse_args()
    if args.no_intern:
        cache_module.compact = cache_module.json_copy  # the same copy, strings as parsed
    objs = asyncio.run(templates())
    print(json.dumps({"intern": not args.no_intern, **measure(args.n, objs)}))


if __name__ == "__main__":
    main()
