"""A fleet of resources for one reliability test: its own kwok GPU nodes, its resources, and
the checks that the children add up (one each, no orphan, no duplicate event).

Each test gets nodes labelled and tainted with its namespace, and its resources select and
tolerate exactly those, so a test's pods never compete with another test's for GPUs.
"""

from __future__ import annotations

import copy
import json
import subprocess
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kwoknodes import node_manifests
from scenario import example
from vllm_dp_operator import constants as c

NODE_LABEL = "vllmdp.io/reliability"
# For the many-resource tests: no /health or Ray job API probes through the API server (kwok
# pods answer neither), so what loads the API server is the reconciles the faults cause.
QUIET = {"VLLMDP_HEALTH_PROBE": "off", "VLLMDP_PROBE_LAUNCHING_SECONDS": "60",
         "VLLMDP_PROBE_SERVING_SECONDS": "60"}
OWNED_KINDS = ("rayclusters", "services", "rayjobs")
GPUS_PER_NODE = 8


@contextmanager
def own_nodes(testbed: Any, ns: str, gpus: int) -> Iterator[None]:
    """kwok GPU nodes with at least `gpus` GPUs, only for the resources of namespace `ns`."""
    count = -(-gpus // GPUS_PER_NODE)
    nodes = node_manifests(count, GPUS_PER_NODE, 0, "NVIDIA-H100-80GB-HBM3", "p5.48xlarge")
    for i, node in enumerate(nodes):
        name = f"{ns}-g{i}"
        node["metadata"]["name"] = name
        node["metadata"]["labels"].update({"kubernetes.io/hostname": name, NODE_LABEL: ns})
        # A list of its own: node_manifests shares one taint list between its nodes.
        node["spec"]["taints"] = [*node["spec"]["taints"],
                                  {"key": NODE_LABEL, "value": ns, "effect": "NoSchedule"}]
    testbed.apply(nodes)
    try:
        yield
    finally:
        testbed.kubectl("delete", "node", "-l", f"{NODE_LABEL}={ns}", "--wait=false",
                        check=False)  # fmt: skip


def resource(ns: str, name: str, base: str = "dp4-tp2.yaml", **spec: Any) -> dict[str, Any]:
    """An example resource renamed into `ns`, placed on that namespace's own nodes."""
    doc = copy.deepcopy(example(base))
    doc["metadata"] = {"name": name, "namespace": ns}
    doc["spec"].update(spec)
    doc["spec"]["nodeSelector"] = {NODE_LABEL: ns}
    doc["spec"]["tolerations"] = [{"key": NODE_LABEL, "operator": "Equal", "value": ns,
                                   "effect": "NoSchedule"}]  # fmt: skip
    return doc


def small(ns: str, name: str) -> dict[str, Any]:
    """DP=2 on one GPU pod of 2 GPUs: the cheapest resource that still gets every child."""
    return resource(ns, name, dataParallel={"size": 2, "ranksPerNode": 2}, tensorParallelSize=1)


def get(testbed: Any, ns: str, kind: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = testbed.kubectl_json("-n", ns, "get", kind)["items"]
    return found


def _owner_uid(obj: dict[str, Any]) -> str | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("kind") == c.KIND and ref.get("controller"):
            return str(ref["uid"])
    return None


def audit(testbed: Any, ns: str) -> dict[str, Any]:
    """Count what each resource has, and list whatever breaks the one-each rule."""
    owners = {o["metadata"]["uid"]: o for o in get(testbed, ns, "vdp")}
    per: dict[str, Counter[str]] = {o["metadata"]["name"]: Counter() for o in owners.values()}
    orphans, extra = [], []
    for kind in OWNED_KINDS:
        for obj in get(testbed, ns, kind):
            labels = obj["metadata"].get("labels") or {}
            if labels.get(c.LABEL_MANAGED_BY) != c.MANAGER:
                continue  # KubeRay's own head Service
            uid = _owner_uid(obj)
            if uid is None or uid not in owners:
                orphans.append(f"{kind}/{obj['metadata']['name']} (owner {uid})")
                continue
            if obj["metadata"].get("deletionTimestamp") and kind == "rayjobs":
                continue  # a head job on its way out is not live
            per[owners[uid]["metadata"]["name"]][kind] += 1
    for name, counts in per.items():
        if counts["rayclusters"] != 1 or counts["services"] != 1 or counts["rayjobs"] > 1:
            extra.append(f"{name}: {dict(counts)}")
    return {"resources": len(owners), "orphans": orphans, "not_one_each": extra,
            "duplicate_events": duplicate_events(testbed, ns)}  # fmt: skip


def duplicate_events(testbed: Any, ns: str) -> list[str]:
    """Events on our resources told more than once: same object, reason and message."""
    told: Counter[tuple[str, str, str]] = Counter()
    for ev in get(testbed, ns, "events"):
        inv = ev.get("involvedObject") or {}
        if inv.get("kind") == c.KIND:
            told[(inv.get("name", ""), ev.get("reason", ""), ev.get("message", ""))] += \
                int(ev.get("count") or 1)  # fmt: skip
    return [f"{n} {r} x{k}: {m[:160]}" for (n, r, m), k in told.items() if k > 1]


def phases(testbed: Any, ns: str) -> Counter[str]:
    return Counter((o.get("status") or {}).get("phase") or "-" for o in get(testbed, ns, "vdp"))


def converged(testbed: Any, ns: str, count: int) -> bool:
    """Every resource Launching with a head job, and every one of them has one of each child."""
    owners = get(testbed, ns, "vdp")
    if len(owners) != count or not all(
        (o.get("status") or {}).get("phase") == c.PHASE_LAUNCHING
        and (o.get("status") or {}).get("headJob") for o in owners
    ):
        return False
    report = audit(testbed, ns)
    return not report["orphans"] and not report["not_one_each"]


def explain(testbed: Any, ns: str, operator: Any) -> str:
    """What a timed-out wait prints: phases, the audit and the operator's log."""
    try:
        state = json.dumps({"phases": phases(testbed, ns), "audit": audit(testbed, ns)},
                           indent=1)  # fmt: skip
    except AssertionError as exc:
        state = f"(could not read the state: {exc})"
    return f"{state}\noperator log:\n{operator.log_tail(8000)}"


@contextmanager
def watched(testbed: Any, ns: str, kind: str, out: Path) -> Iterator[list[dict[str, Any]]]:
    """Every watch event of `kind` in `ns` while the block runs, in order (the list fills
    when the block ends): each version the API server wrote, which no poll can promise."""
    events: list[dict[str, Any]] = []
    errors = out.with_suffix(".stderr")
    with out.open("w") as sink, errors.open("w") as err:
        proc = subprocess.Popen(
            [str(testbed.kubectl_path), f"--kubeconfig={testbed.kubeconfig}", "-n", ns, "get",
             kind, "--watch", "--output-watch-events", "-o", "json"],
            stdout=sink, stderr=err)  # fmt: skip
        try:
            yield events
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    text, decoder, at = out.read_text(), json.JSONDecoder(), 0
    try:
        while (at := _skip_space(text, at)) < len(text):
            event, at = decoder.raw_decode(text, at)
            events.append(event)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"the watch of {kind} wrote no event at {at} of {out}: {exc}; "
                             f"kubectl said: {errors.read_text()[-2000:]}") from None


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at
