"""The one level-triggered reconcile of a resource: validate, converge what the resource has
once (its NetworkPolicy, Service, and the set of replicas), run each replica's own reconcile
(`member.py`), and say where things stand.

The set is decided in `replicaset.py` (pure); a leaving replica is taken out in `leaving.py`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol

from vllm_dp_operator import constants as c
from vllm_dp_operator.api import names
from vllm_dp_operator.api.models import UpdateStrategy, VLLMDataParallelSpec, resolve_count
from vllm_dp_operator.api.validation import SpecError, validate
from vllm_dp_operator.config import Config
from vllm_dp_operator.controller.cache import controller_uid
from vllm_dp_operator.controller.kube import (
    ENDPOINTSLICE,
    NETWORKPOLICY,
    RAYCLUSTER,
    RAYJOB,
    SERVICE,
    Kube,
)
from vllm_dp_operator.engines.prober import EngineProbes
from vllm_dp_operator.engines.ray_dashboard import RayJobs
from vllm_dp_operator.plan import Plan, build_plan
from vllm_dp_operator.reconcile import (
    disruption,
    leaving,
    lora_status,
    member,
    replicaset,
    surge,
)
from vllm_dp_operator.reconcile.member import create_child, label_of, ours
from vllm_dp_operator.reconcile.outcome import Outcome, Resource, StatusDoc
from vllm_dp_operator.reconcile.routing import api_port, routed_pod, routed_port
from vllm_dp_operator.reconcile.status import condition_status, rfc3339
from vllm_dp_operator.reconcile.update import HOLD_FOR_SLOT
from vllm_dp_operator.render import build_service
from vllm_dp_operator.render.headjob import job_hash
from vllm_dp_operator.render.meta import owner_reference
from vllm_dp_operator.render.networkpolicy import build_network_policies, wanted
from vllm_dp_operator.render.raycluster import cluster_hash

__all__ = ["Outcome", "Resource", "reconcile"]

#: How often a resource that waits for an update slot asks again.
SLOT_RECHECK_SECONDS = 10.0


def _layout(plan: Plan) -> dict[str, Any]:
    return {
        "gpuPods": plan.gpu_pods,
        "gpusPerPod": plan.gpus_per_pod,
        "totalGpus": plan.total_gpus,
        "apiServers": plan.api_servers,
        "pods": [
            {"index": p.index, "role": p.role, "ranks": p.ranks_text(), "gpus": p.gpus}
            for p in plan.pods
        ],
    }


async def _ensure_service(kube: Kube, desired: dict[str, Any], uid: str) -> None:
    meta = desired["metadata"]
    current = await kube.get(SERVICE, meta["namespace"], meta["name"])
    if current is None:
        await create_child(kube, SERVICE, desired)
        return
    if not ours([current], uid):
        return  # a deleted namesake's, until the garbage collector takes it
    spec = current.get("spec") or {}
    ports = [(p.get("port"), p.get("targetPort")) for p in spec.get("ports") or []]
    want = desired["spec"]
    want_ports = [(p["port"], p["targetPort"]) for p in want["ports"]]
    drift = (
        # Versions before the EndpointSlice routing selected the head pod by a label; the
        # selector goes (merge patch: null removes it), and routing's slice takes over.
        spec.get("selector") is not None
        or ports != want_ports
        or spec.get("type") != want["type"]
        or any(
            (current["metadata"].get("annotations") or {}).get(k) != v
            for k, v in (meta.get("annotations") or {}).items()
        )
    )
    if drift:
        patch = {"metadata": {"annotations": meta.get("annotations") or {}},
                 "spec": {**want, "selector": None}}  # fmt: skip
        await kube.patch(SERVICE, meta["namespace"], meta["name"], patch)


async def _withdraw_service(kube: Kube, res: Resource) -> None:
    """A suspended resource holds no Service: its cluster IP goes back to the Service range
    (a /20 has 4,096), kube-proxy drops its rules on every node, and the API server's
    allocator, whose cost grows with the addresses in use, is not asked for one. The slice
    goes first, so no request is routed while the Service goes. Only ours is deleted."""
    for kind, name in ((ENDPOINTSLICE, names.endpoint_slice(res.name)),
                       (SERVICE, names.service(res.name))):  # fmt: skip
        current = await kube.get(kind, res.namespace, name)
        if (current is not None and controller_uid(current) == res.uid
                and not current["metadata"].get("deletionTimestamp")):
            await kube.delete(kind, res.namespace, name)


async def _ensure_network_policy(
    kube: Kube, res: Resource, spec: VLLMDataParallelSpec, cfg: Config, owner: dict[str, Any],
    clusters: list[dict[str, Any]],
) -> None:  # fmt: skip
    """Create or repair the policies in front of the Ray pods, the API port's first; delete
    ours when turned off. The API port is open on every port a live generation listens on."""
    on = wanted(spec, cfg.render.peers)
    ports = tuple(api_port(cl, spec.service.port) for cl in clusters
                  if not cl["metadata"].get("deletionTimestamp"))  # fmt: skip
    desired = (build_network_policies(res.name, res.namespace, spec, cfg.render.peers, owner,
                                      ports) if on else [])  # fmt: skip
    by_name = {d["metadata"]["name"]: d for d in desired}
    for name in (names.api_network_policy(res.name), names.network_policy(res.name),
                 names.egress_network_policy(res.name)):  # fmt: skip
        current = await kube.get(NETWORKPOLICY, res.namespace, name)
        if current is not None and not ours([current], res.uid):
            continue  # a deleted namesake's, until the garbage collector takes it
        want = by_name.get(name)
        if want is None:
            if current is not None and not current["metadata"].get("deletionTimestamp"):
                await kube.delete(NETWORKPOLICY, res.namespace, name)
        elif current is None:
            await create_child(kube, NETWORKPOLICY, want)
        elif current.get("spec") != want["spec"] and not (
                name == names.api_network_policy(res.name)
                and _only_closes(current["spec"], want["spec"])):  # fmt: skip
            # A merge patch replaces each list whole, so an edited rule goes back as rendered.
            await kube.patch(NETWORKPOLICY, res.namespace, name, {"spec": want["spec"]})


def _only_closes(have: dict[str, Any], want: dict[str, Any]) -> bool:
    """Whether `want` differs from `have` only by closing ports (an old generation's API port
    after a Surge that changed spec.service.port). Such a port stays open until the policy
    changes for another reason: nothing listens on it, and an edit of a policy is not free.
    The enforcer on the real-node bed applied one by rebuilding the selected pods' rules, and
    new connections to the new head were dropped for a moment (4 requests, 7 s after a
    Surge's switch on real vLLM, as the old cluster went)."""
    rules_have, rules_want = have.get("ingress") or [], want.get("ingress") or []
    rest_have = {k: v for k, v in have.items() if k != "ingress"}
    if rest_have != {k: v for k, v in want.items() if k != "ingress"}:
        return False
    if len(rules_have) != len(rules_want):
        return False
    for old, new in zip(rules_have, rules_want, strict=True):
        if old.get("from") != new.get("from"):
            return False
        old_ports = {json.dumps(p, sort_keys=True) for p in old.get("ports") or []}
        new_ports = {json.dumps(p, sort_keys=True) for p in new.get("ports") or []}
        if not new_ports or not new_ports <= old_ports:
            return False
    return True


class Slots(Protocol):
    """The operator-wide update slots (controller/update_slots.py)."""

    def take(self, key: tuple[str, str]) -> bool:
        """Whether this resource may update now (a slot held already, or one taken)."""
        ...


async def reconcile(
    res: Resource, kube: Kube, probes: EngineProbes, ray_jobs: RayJobs, cfg: Config,
    now: datetime, slots: Slots | None = None,
) -> Outcome:  # fmt: skip
    """Bring the children in line with the spec and say where things stand. `slots`: the
    operator-wide bound on resources that update at once (None: no bound)."""
    st = StatusDoc(res, now)
    try:
        spec = validate(res.name, res.spec)
    except SpecError as err:
        was_invalid = res.status.get("phase") == c.PHASE_INVALID
        st.cond(c.COND_SPEC_VALID, False, c.REASON_INVALID_SPEC, str(err))
        st.phase(c.PHASE_INVALID, str(err))
        if not was_invalid:
            st.event(c.EVENT_WARNING, c.REASON_INVALID_SPEC, str(err))
        return st.outcome()
    st.cond(c.COND_SPEC_VALID, True, c.REASON_VALID, "The spec passes every rule")

    plan = build_plan(spec)
    owner = owner_reference(res.name, res.uid)
    ns = res.namespace
    engine, head_job = c.COMPONENT_ENGINE, c.COMPONENT_HEAD_JOB
    clusters = ours(await kube.list(RAYCLUSTER, ns, names.instance_selector(res.name, engine)),
                     res.uid)  # fmt: skip
    jobs = ours(await kube.list(RAYJOB, ns, names.instance_selector(res.name, head_job)),
                 res.uid)  # fmt: skip
    # The Service's port: the serving generation's, which a Surge that changes
    # spec.service.port moves at its switch; the old port serves until then.
    front = await routed_port(kube, ns, res.name, res.uid, spec.service.port)
    st.doc.update(
        layout=_layout(plan),
        endpoint=None if spec.suspend else names.endpoint(res.name, ns, front),
        selector=names.head_pods_selector(res.name),
    )
    # The policy goes first: the Ray pods are never up without it.
    await _ensure_network_policy(kube, res, spec, cfg, owner, clusters)
    if spec.suspend:
        await _withdraw_service(kube, res)
    else:
        await _ensure_service(kube, build_service(res.name, ns, spec, owner, front), res.uid)

    shape = cluster_hash(res.name, spec, plan, cfg.render, res.restarted_at,
                         cfg.ray_tokens.secret_name(ns, res.name, res.uid))  # fmt: skip
    before = replicaset.previous(res.status)
    step = replicaset.decide(spec.replicas, _views(before, clusters, jobs))
    if step.chosen or step.added:
        st.event(c.EVENT_NORMAL, c.REASON_SCALED, _scaled(step, spec.replicas))

    def outdated(index: int) -> bool:
        prev = before.get(index, {})
        legacy = surge.legacy_accepted(dataclasses.replace(res, status=prev))
        return not _updated(prev, _of(jobs, index), plan, _of(clusters, index), shape,
                            res.asked, legacy)  # fmt: skip

    turns = _claim(res, spec, st, slots, step.run, before, outdated) \
        or _turns(spec, step.run, before, outdated)  # fmt: skip
    entries = []
    for index in step.run:
        one = dataclasses.replace(res, status=before.get(index, {}), replica=index)
        mst = StatusDoc(one, now)
        mine = _of(clusters, index)
        await member.reconcile_replica(one, kube, probes, ray_jobs, cfg, spec, plan, owner,
                                       mine, _of(jobs, index), mst, turns.get(index))
        mst.settle_engines()
        st.merge(mst)
        routed = await _routed(kube, ns, res.name, index)
        updated = _updated(mst.doc, jobs, plan, mine, shape, res.asked,
                           surge.legacy_accepted(one))  # fmt: skip
        entries.append(replicaset.entry(index, mst.doc, routed, updated))
    for index in step.leave:
        left = await leaving.leave(
            dataclasses.replace(res, status=before.get(index, {}), replica=index), kube,
            probes, ray_jobs, cfg, spec, plan, owner, _of(clusters, index), _of(jobs, index),
            st)  # fmt: skip
        if left is not None:
            entries.append(left)
    if not spec.suspend and (moved := await routed_port(kube, ns, res.name, res.uid,
                                                       spec.service.port)) != front:
        # A replica switched the slice's port (a Surge's switch): the Service follows at once.
        await _ensure_service(kube, build_service(res.name, ns, spec, owner, moved), res.uid)
        st.doc["endpoint"] = names.endpoint(res.name, ns, moved)
    _summarize(st, spec, entries)
    await disruption.ensure_budget(kube, res, spec, plan, owner, st.doc["readyReplicas"])
    if st.doc.get("rollout") and all(replicaset.settled(e) for e in entries
                                     if not e.get("leaving")):  # fmt: skip
        st.doc["rollout"] = None  # its slot goes back
    return st.outcome()


def _claim(
    res: Resource, spec: VLLMDataParallelSpec, st: StatusDoc, slots: Slots | None,
    run: list[int], before: dict[int, dict[str, Any]], outdated: Callable[[int], bool],
) -> dict[int, str]:  # fmt: skip
    """An update slot for a resource whose serving replicas the user asks to update; without
    one, those replicas hold (update.HOLD_FOR_SLOT) and serve what they run. A replica that
    does not serve updates without a slot: there is nothing to keep up."""
    st.doc["rollout"] = held = res.status.get("rollout")
    if slots is None or spec.suspend:
        return {}
    asking = [i for i in run if before.get(i, {}).get("routed") and outdated(i)]
    if not asking:
        return {}
    surging = any((before.get(i, {}).get("update") or {}).get("phase") for i in run)
    if held or slots.take((res.namespace, res.name)) or surging:
        if not held:
            st.doc["rollout"] = {"startedAt": rfc3339(st.now), "asked": res.asked}
        return {}
    st.recheck(SLOT_RECHECK_SECONDS)  # nothing wakes it when another resource's slot frees
    return {i: HOLD_FOR_SLOT for i in asking}


def _of(objs: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """The children of one replica."""
    return [o for o in objs if names.replica_of(o) == index]


def _views(before: dict[int, dict[str, Any]], clusters: list[dict[str, Any]],
           jobs: list[dict[str, Any]]) -> dict[int, replicaset.ReplicaView]:  # fmt: skip
    """Every replica that exists: by its children, or by its status entry (it may not have
    made a child yet, or be waiting for its backoff's end)."""
    indices = {names.replica_of(o) for o in (*clusters, *jobs)
               if not o["metadata"].get("deletionTimestamp")}  # fmt: skip
    indices |= set(before)
    views = {}
    for index in sorted(i for i in indices if i >= 0):
        prev = before.get(index, {})
        views[index] = replicaset.ReplicaView(
            index, bool(prev.get("routed") or (prev.get("phase") == c.PHASE_SERVING)),
            int(prev.get("consecutiveFailures") or 0) > 0, prev.get("leaving"))  # fmt: skip
    return views


def _turns(spec: VLLMDataParallelSpec, run: list[int], before: dict[int, dict[str, Any]],
           outdated: Callable[[int], bool]) -> dict[int, str]:  # fmt: skip
    """Under RollingUpdate, the strategy each outdated replica updates by now (or holds by),
    from what each last reconcile wrote: replicaset.rollout decides."""
    if spec.update.strategy != UpdateStrategy.ROLLING_UPDATE or spec.suspend:
        return {}
    turns = []
    for index in run:
        prev = before.get(index, {})
        surging = (prev.get("update") or {}).get("phase") is not None
        turns.append(replicaset.Turn(index, outdated(index), bool(prev.get("routed")),
                                     surging))  # fmt: skip
    down = resolve_count(spec.update.max_unavailable, spec.replicas, round_up=False)
    surge = resolve_count(spec.update.max_surge, spec.replicas, round_up=True)
    # As a Deployment: percentages that both come to 0 still let one replica at a time go.
    return replicaset.rollout(spec.replicas, turns, down if down or surge else 1, surge)


def _scaled(step: replicaset.SetStep, want: int) -> str:
    parts = []
    if step.added:
        parts.append(f"adding replica(s) {', '.join(map(str, step.added))}")
    if step.chosen:
        parts.append(f"removing replica(s) {', '.join(map(str, step.chosen))} (unrouted "
                     "first, then drained)")  # fmt: skip
    return f"Scaling to {want} replica(s): {'; '.join(parts)}"


async def _routed(kube: Kube, ns: str, name: str, index: int) -> bool:
    """Whether the EndpointSlice routes to a head pod of this replica now."""
    return await routed_pod(kube, ns, name, index) is not None


def _updated(doc: dict[str, Any], jobs: list[dict[str, Any]], plan: Plan,
             clusters: list[dict[str, Any]], shape: str, asked: str = "",
             legacy: str | None = None) -> bool:  # fmt: skip
    """Whether a replica runs what the spec asks for: no update under way, and its cluster
    accepted for what the resource asks now (the operator's own render may differ), or of the
    shape the spec asks for with its current head job, if any, running the spec's plan."""
    if doc.get("update"):
        return False
    cluster = next((cl for cl in clusters if cl["metadata"]["name"] == doc.get("rayCluster")),
                   None)  # fmt: skip
    if cluster is not None and asked and surge.accepted_of(cluster, legacy) == asked:
        return True
    if cluster is None or label_of(cluster, c.LABEL_CLUSTER_HASH) not in (None, shape):
        return False
    job = next((j for j in jobs if j["metadata"]["name"] == doc.get("headJob")), None)
    return job is None or label_of(job, c.LABEL_JOB_HASH) == job_hash(plan,
                                                                   cluster["metadata"]["name"])


def _adapters(st: StatusDoc, spec: VLLMDataParallelSpec, entries: list[dict[str, Any]]
              ) -> None:  # fmt: skip
    """status.lora, LoRAReady, and a Warning per adapter that failed anew."""
    lora = lora_status.summarize(spec, entries, st.prev.get("lora"))
    if lora is None:
        st.doc["lora"] = None
        st.doc["conditions"] = [cond for cond in st.doc["conditions"]
                                if cond.get("type") != c.COND_LORA_READY]  # fmt: skip
        return
    st.doc["lora"] = lora.status
    st.cond(c.COND_LORA_READY, *lora.condition)
    for name, error in lora.new_failures.items():
        st.event(c.EVENT_WARNING, c.REASON_ADAPTER_FAILED,
                 f"LoRA adapter {name} did not load (the base model and the other adapters "
                 f"serve on): {error}")  # fmt: skip


def _summarize(st: StatusDoc, spec: VLLMDataParallelSpec, entries: list[dict[str, Any]]) -> None:
    """The resource's status from its replicas': counts, Available and Degraded, and its
    first replica's fields and conditions where a single-group resource had them."""
    staying = [e for e in entries if not e.get("leaving")]
    ready = sum(1 for e in staying if e.get("routed"))
    st.doc.update(replicaStatuses=entries, replicas=len(entries), readyReplicas=ready,
                  updatedReplicas=sum(1 for e in staying if e.get("updated")),
                  ready=f"{ready}/{spec.replicas}")  # fmt: skip
    available, degraded = replicaset.availability(spec.replicas, entries)
    st.cond(c.COND_AVAILABLE, *available)
    was = condition_status(st.prev.get("conditions") or [], c.COND_DEGRADED)
    st.cond(c.COND_DEGRADED, *degraded)
    if degraded[0] and was != "True" and len(staying) > 1:
        st.event(c.EVENT_WARNING, c.REASON_REPLICA_DEGRADED, degraded[2])
    _adapters(st, spec, entries)
    first = replicaset.representative(entries)
    if first is None:
        for key in replicaset.MIRRORED:
            st.doc[key] = None
        for type_ in (c.COND_CLUSTER_READY, c.COND_HEAD_JOB_RUNNING, c.COND_READY):
            st.cond(type_, False, c.REASON_SCALED_TO_ZERO, available[2])
        message = available[2] if spec.replicas == 0 else "Replicas are leaving"
        st.phase(c.PHASE_SCALED_TO_ZERO if spec.replicas == 0 else c.PHASE_PROVISIONING,
                 message)  # fmt: skip
        return
    for key in replicaset.MIRRORED:
        st.doc[key] = first.get(key)
    for cond in first.get("conditions") or []:
        if cond.get("type") in replicaset.MIRRORED_CONDITIONS:
            ok = {"True": True, "False": False}.get(str(cond.get("status")))
            st.cond(cond["type"], ok, cond.get("reason") or "", cond.get("message") or "")
    message = first.get("message") or ""
    if len(entries) > 1 or spec.replicas != 1:
        message = f"{ready}/{spec.replicas} replicas serve; replica {first['index']}: {message}"
    st.phase(first.get("phase") or c.PHASE_PROVISIONING, message)


