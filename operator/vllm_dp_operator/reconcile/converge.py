"""The one level-triggered reconcile: observe children, converge them, compute status.

Children are the resource's by their labels and by the uid in their controller owner
reference: one that names another uid (left by a deleted resource of the same name, for the
garbage collector) is not adopted, not counted, and never changed or deleted here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from vllm_dp_operator import constants as c
from vllm_dp_operator.api import names
from vllm_dp_operator.api.models import RayAuth, VLLMDataParallelSpec
from vllm_dp_operator.api.validation import SpecError, validate
from vllm_dp_operator.config import Config
from vllm_dp_operator.controller.cache import controller_uid
from vllm_dp_operator.controller.kube import (
    ENDPOINTSLICE,
    NETWORKPOLICY,
    POD,
    RAYCLUSTER,
    RAYJOB,
    SECRET,
    SERVICE,
    WORKLOAD,
    AlreadyExists,
    Kube,
)
from vllm_dp_operator.engines.headjobs import HeadJobs, head_pod_of
from vllm_dp_operator.engines.prober import EngineProbes
from vllm_dp_operator.engines.ray_dashboard import RayJobs
from vllm_dp_operator.plan import Plan, build_plan
from vllm_dp_operator.reconcile import leaving, replicaset, surge
from vllm_dp_operator.reconcile.outcome import Outcome, Resource, StatusDoc
from vllm_dp_operator.reconcile.queueing import QueueState, queue_state
from vllm_dp_operator.reconcile.routing import Router, while_not_ready
from vllm_dp_operator.reconcile.status import (
    PodAsks,
    cluster_readiness,
    condition_status,
    explain_pending,
    explain_refused,
    waits_for_secret,
)
from vllm_dp_operator.reconcile.update import Mode
from vllm_dp_operator.render import build_raycluster, build_service
from vllm_dp_operator.render.headjob import job_hash
from vllm_dp_operator.render.meta import owner_reference
from vllm_dp_operator.render.networkpolicy import build_network_policy, wanted
from vllm_dp_operator.render.raycluster import cluster_hash
from vllm_dp_operator.render.raytoken import build_ray_token_secret
from vllm_dp_operator.render.scheduling import kueue_queue

__all__ = ["Outcome", "Resource", "reconcile"]


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


def _attempt(job: dict[str, Any]) -> int:
    return int(job["metadata"].get("labels", {}).get(c.LABEL_ATTEMPT, "0"))


def _label(obj: dict[str, Any], key: str) -> str | None:
    labels: dict[str, str] = obj["metadata"].get("labels") or {}
    return labels.get(key)


def _ours(objs: list[dict[str, Any]], uid: str | None) -> list[dict[str, Any]]:
    """The objects whose controller owner reference, if any, names this uid."""
    return [o for o in objs if controller_uid(o) in (None, uid)]


async def _create(kube: Kube, kind: Any, body: dict[str, Any]) -> None:
    # Already there means an earlier, interrupted reconcile made it: converge, don't duplicate.
    with contextlib.suppress(AlreadyExists):
        await kube.create(kind, body["metadata"]["namespace"], body)


async def _ensure_service(kube: Kube, desired: dict[str, Any], uid: str) -> None:
    meta = desired["metadata"]
    current = await kube.get(SERVICE, meta["namespace"], meta["name"])
    if current is None:
        await _create(kube, SERVICE, desired)
        return
    if not _ours([current], uid):
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
    kube: Kube, res: Resource, spec: VLLMDataParallelSpec, cfg: Config, owner: dict[str, Any]
) -> None:
    """Create or repair the policy in front of the Ray pods; delete ours when turned off."""
    name = names.network_policy(res.name)
    current = await kube.get(NETWORKPOLICY, res.namespace, name)
    if current is not None and not _ours([current], res.uid):
        return  # a deleted namesake's, until the garbage collector takes it
    if not wanted(spec, cfg.render.peers):
        if current is not None and not current["metadata"].get("deletionTimestamp"):
            await kube.delete(NETWORKPOLICY, res.namespace, name)
        return
    desired = build_network_policy(res.name, res.namespace, spec, cfg.render.peers, owner)
    if current is None:
        await _create(kube, NETWORKPOLICY, desired)
    elif current.get("spec") != desired["spec"]:
        # A merge patch replaces each list whole, so an edited rule goes back as rendered.
        await kube.patch(NETWORKPOLICY, res.namespace, name, {"spec": desired["spec"]})


async def _ensure_cluster(
    kube: Kube, desired: dict[str, Any], observed: list[dict[str, Any]], st: StatusDoc,
    queued: bool, suspend: bool, keep: frozenset[str] = frozenset(),
) -> dict[str, Any] | None:
    """Delete clusters of another shape, create the desired one; return it if it exists.

    In a Kueue queue (`queued`) Kueue owns the cluster's spec.suspend: it is never written
    here, and the resource's own suspend deletes the cluster instead, freeing its quota.
    """  # fmt: skip
    name, ns = desired["metadata"]["name"], desired["metadata"]["namespace"]
    current = None
    for cluster in observed:
        if cluster["metadata"]["name"] == name and not (queued and suspend):
            current = cluster
            continue
        if cluster["metadata"].get("deletionTimestamp") or cluster["metadata"]["name"] in keep:
            continue  # going already, or a Surge's serving generation (reconcile/update.py)
        await kube.delete(RAYCLUSTER, ns, cluster["metadata"]["name"])
        why = ("suspended, which frees its Kueue quota" if queued and suspend
               else f"the spec now needs {name}")  # fmt: skip
        st.event(c.EVENT_NORMAL, c.REASON_CLUSTER_RESHAPED,
                 f"Deleted RayCluster {cluster['metadata']['name']}: {why}")  # fmt: skip
    if queued and suspend:
        return None
    if current is None:
        await _create(kube, RAYCLUSTER, desired)
        st.event(c.EVENT_NORMAL, c.REASON_CLUSTER_CREATED, f"Created RayCluster {name}")
        return None
    want_suspend = desired["spec"]["suspend"]
    if not queued and bool((current.get("spec") or {}).get("suspend")) != want_suspend:
        await kube.patch(RAYCLUSTER, ns, name, {"spec": {"suspend": want_suspend}})
    return current


async def _drop_jobs_without_pods(
    kube: Kube, ns: str, jobs: list[dict[str, Any]], cluster_name: str, suspend: bool,
    keep: frozenset[str] = frozenset(),
) -> list[dict[str, Any]]:
    """Delete head jobs whose pods are going away (another cluster, or suspended); keep the rest.

    Their Ray jobs end with the pods, so there is nothing to stop first.
    """
    kept = []
    for job in jobs:
        if job["metadata"].get("deletionTimestamp"):
            continue
        if _label(job, c.LABEL_CLUSTER) == cluster_name and not suspend:
            kept.append(job)
            continue
        if _label(job, c.LABEL_CLUSTER) in keep:
            continue  # the serving generation's, left alone during a Surge
        await kube.delete(RAYJOB, ns, job["metadata"]["name"])
    return kept


def _refusal_is_new(res: Resource, message: str) -> bool:
    """Whether the status does not say this refusal yet: one Warning per refusal, not per
    reconcile (KubeRay retries the create, and writes its status, every few seconds)."""
    for cond in res.status.get("conditions") or []:
        if cond.get("type") == c.COND_CLUSTER_READY:
            return not (cond.get("reason") == c.REASON_PODS_REFUSED
                        and cond.get("message") == message)  # fmt: skip
    return True


async def _provisioning(
    kube: Kube, res: Resource, spec: VLLMDataParallelSpec, plan: Plan,
    cluster: dict[str, Any] | None, cluster_name: str, detail: str,
    token_secret: dict[str, Any] | None, st: StatusDoc,
) -> None:  # fmt: skip
    cluster_uid = cluster["metadata"].get("uid") if cluster else None
    pods = _ours(await kube.list(POD, res.namespace, f"{c.LABEL_RAY_CLUSTER}={cluster_name}"),
                 cluster_uid)  # fmt: skip
    if token_secret is not None and waits_for_secret(pods, token_secret["metadata"]["name"]):
        # The garbage collector took a deleted namesake's Secret after this resource found it
        # there: make it again (the token is the same), and the kubelet starts the container.
        await _create(kube, SECRET, token_secret)
    asks = PodAsks(gpus=plan.gpus_per_pod, gpu_resource=spec.gpu.resource_name,
                   cpu=spec.resources.cpu, head_cpu=plan.head_cpu,
                   memory=spec.resources.memory, head_memory=plan.head_memory)  # fmt: skip
    refused = explain_refused(cluster) if cluster else None
    pending = explain_pending(pods, asks)
    if refused is not None:
        reason, message = c.REASON_PODS_REFUSED, refused
        if _refusal_is_new(res, message):
            st.event(c.EVENT_WARNING, c.REASON_PODS_REFUSED, message)
    else:
        reason = c.REASON_PODS_PENDING if pending else c.REASON_WAITING_FOR_NODES
        message = pending or f"Waiting for Ray nodes of {cluster_name}: {detail}"
    st.cond(c.COND_CLUSTER_READY, False, reason, message)
    st.cond(c.COND_HEAD_JOB_RUNNING, False, c.REASON_WAITING_FOR_NODES,
            "The head job starts once the Ray head is ready and every worker pod runs")  # fmt: skip
    st.cond(c.COND_READY, False, c.REASON_WAITING_FOR_NODES, message)
    st.phase(c.PHASE_PROVISIONING, message)


def _queued(st: StatusDoc, state: QueueState) -> None:
    # No head job runs meanwhile: none failed, and none is launched into a suspended cluster.
    for type_ in (c.COND_CLUSTER_READY, c.COND_HEAD_JOB_RUNNING, c.COND_READY):
        st.cond(type_, False, state.reason, state.message)
    st.doc["headJob"] = None
    st.phase(state.phase, state.message)


async def reconcile(
    res: Resource, kube: Kube, probes: EngineProbes, ray_jobs: RayJobs, cfg: Config, now: datetime
) -> Outcome:
    """Bring the children in line with the spec and say where things stand."""
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
    clusters = _ours(await kube.list(RAYCLUSTER, ns, names.instance_selector(res.name, engine)),
                     res.uid)  # fmt: skip
    jobs = _ours(await kube.list(RAYJOB, ns, names.instance_selector(res.name, head_job)),
                 res.uid)  # fmt: skip
    st.doc.update(
        layout=_layout(plan),
        endpoint=None if spec.suspend else names.endpoint(res.name, ns, spec.service.port),
        selector=names.head_pods_selector(res.name),
    )
    # The policy goes first: the Ray pods are never up without it.
    await _ensure_network_policy(kube, res, spec, cfg, owner)
    if spec.suspend:
        await _withdraw_service(kube, res)
    else:
        await _ensure_service(kube, build_service(res.name, ns, spec, owner), res.uid)

    shape = cluster_hash(res.name, spec, plan, cfg.render)
    before = replicaset.previous(res.status)
    step = replicaset.decide(spec.replicas, _views(before, clusters, jobs))
    if step.chosen or step.added:
        st.event(c.EVENT_NORMAL, c.REASON_SCALED, _scaled(step, spec.replicas))
    entries = []
    for index in step.run:
        member = dataclasses.replace(res, status=before.get(index, {}), replica=index)
        mst = StatusDoc(member, now)
        mine = [cl for cl in clusters if names.replica_of(cl) == index]
        await _reconcile_member(member, kube, probes, ray_jobs, cfg, spec, plan, owner,
                                mine, [j for j in jobs if names.replica_of(j) == index],
                                mst)  # fmt: skip
        mst.settle_engines()
        st.merge(mst)
        routed = await _routed(kube, ns, res.name, index)
        updated = _updated(mst.doc, jobs, plan, mine, shape)
        entries.append(replicaset.entry(index, mst.doc, routed, updated))
    for index in step.leave:
        left = await leaving.leave(
            dataclasses.replace(res, status=before.get(index, {}), replica=index), kube,
            probes, ray_jobs, cfg, spec, plan, owner,
            [cl for cl in clusters if names.replica_of(cl) == index],
            [j for j in jobs if names.replica_of(j) == index], st)  # fmt: skip
        if left is not None:
            entries.append(left)
    _summarize(st, spec, entries)
    return st.outcome()


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


def _scaled(step: replicaset.SetStep, want: int) -> str:
    parts = []
    if step.added:
        parts.append(f"adding replica(s) {', '.join(map(str, step.added))}")
    if step.chosen:
        parts.append(f"removing replica(s) {', '.join(map(str, step.chosen))} (unrouted "
                     "first, then drained)")  # fmt: skip
    return f"Scaling to {want} replica(s): {'; '.join(parts)}"


async def _routed(kube: Kube, ns: str, name: str, index: int) -> bool:
    """Whether the EndpointSlice routes to a head pod of this replica now: read from the
    slice itself, which is what kube-proxy routes by."""
    current = await kube.get(ENDPOINTSLICE, ns, names.endpoint_slice(name))
    for endpoint in (current or {}).get("endpoints") or []:
        ref = endpoint.get("targetRef") or {}
        if not (endpoint.get("conditions") or {}).get("ready") or not ref.get("name"):
            continue
        pod = await kube.get(POD, ns, ref["name"])
        if pod is not None and names.replica_of(pod) == index:
            return True
    return False


def _updated(doc: dict[str, Any], jobs: list[dict[str, Any]], plan: Plan,
             clusters: list[dict[str, Any]], shape: str) -> bool:  # fmt: skip
    """Whether a replica runs what the spec asks for: no update under way, its cluster of the
    shape the spec asks for, and its current head job, if any, running the spec's plan."""
    if doc.get("update"):
        return False
    cluster = next((cl for cl in clusters if cl["metadata"]["name"] == doc.get("rayCluster")),
                   None)  # fmt: skip
    if cluster is None or _label(cluster, c.LABEL_CLUSTER_HASH) not in (None, shape):
        return False
    job = next((j for j in jobs if j["metadata"]["name"] == doc.get("headJob")), None)
    return job is None or _label(job, c.LABEL_JOB_HASH) == job_hash(plan,
                                                                   cluster["metadata"]["name"])


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


async def _reconcile_member(
    res: Resource, kube: Kube, probes: EngineProbes, ray_jobs: RayJobs, cfg: Config,
    spec: VLLMDataParallelSpec, plan: Plan, owner: dict[str, Any],
    clusters: list[dict[str, Any]], jobs: list[dict[str, Any]], st: StatusDoc,
) -> None:  # fmt: skip
    """One replica: a single DP group's reconcile, as a resource was before replicas."""
    ns = res.namespace
    desired = build_raycluster(res.name, ns, spec, plan, cfg.render, owner, res.replica)
    step = surge.decide_step(res, spec, plan, desired, clusters, jobs, st)
    clusters, jobs = await surge.apply_step(kube, ns, step, clusters, jobs, st)
    cluster_name = step.cluster
    if cluster_name != desired["metadata"]["name"]:
        # The same shape under another name: the serving cluster, or a Surge's second one.
        desired["metadata"]["name"] = cluster_name
    st.doc.update(rayCluster=cluster_name)
    if step.mode is Mode.HOLD:
        await surge.hold(kube, res, spec, owner, step.cluster, clusters, jobs, probes, cfg, st)
        return
    token_secret = None
    if spec.ray.auth == RayAuth.TOKEN:
        token = cfg.ray_tokens.token(ns, res.name)
        token_secret = build_ray_token_secret(res.name, ns, token, owner)
        if not any(cl["metadata"]["name"] == cluster_name for cl in clusters):
            # Before the cluster, whose pods read it; the operator never reads it back.
            await _create(kube, SECRET, token_secret)
    queue = kueue_queue(spec)
    cluster = await _ensure_cluster(kube, desired, clusters, st, queue is not None, spec.suspend,
                                    step.keep)  # fmt: skip
    # Kueue holds the cluster suspended until it admits it, and again when it evicts it.
    held = queue is not None and cluster is not None and bool(cluster["spec"].get("suspend"))
    cluster_uid = cluster["metadata"].get("uid") if cluster is not None else None
    head_pod = None
    if cluster is not None:
        head_pod = head_pod_of(_ours(await kube.list(POD, ns,
                                                     names.head_pod_selector(cluster_name)),
                                     cluster_uid))  # fmt: skip
    router = Router(kube, res.name, ns, res.uid, spec, head_pod, owner, res.replica)
    shadow = None
    if step.mode is Mode.CANDIDATE and step.record is not None:
        # The old generation keeps its route; the new one's flow routes into a shadow.
        old = await surge.router_of(kube, res, spec, owner, step.record["from"])
        await surge.keep_serving(old, res, spec, step.record["from"], clusters, jobs, probes,
                                 cfg, st)  # fmt: skip
        shadow = surge.Shadow()
    route = shadow.route if shadow is not None else router.route
    if (cluster is None or held) and not spec.suspend:
        # Unrouted before their head jobs are deleted: no new request meets a stopping engine.
        # (A suspended resource's slice went with its Service, above.)
        await route(False)

    # Attempts count every head job seen, pruned or terminating ones too: names never repeat.
    st.doc["launchAttempts"] = max([st.doc["launchAttempts"], *(_attempt(j) for j in jobs)])
    live = await _drop_jobs_without_pods(kube, ns, jobs, cluster_name, spec.suspend or held,
                                         step.keep)  # fmt: skip
    flow = await _converge_cluster(kube, probes, ray_jobs, cfg, res, spec, plan, cluster,
                                    cluster_name, head_pod, held, queue, live, token_secret,
                                    st, route, shadow is not None)  # fmt: skip
    if shadow is not None and step.record is not None:
        await surge.after_candidate(st, shadow, router, step.record, probes,
                                    flow.target if flow else None, flow.said if flow else None,
                                    cfg, plan, res.status.get("servedJob"),
                                    res.status.get("servedHeadPod"),
                                    spec.update.drain_seconds)  # fmt: skip


async def _converge_cluster(
    kube: Kube, probes: EngineProbes, ray_jobs: RayJobs, cfg: Config, res: Resource,
    spec: VLLMDataParallelSpec, plan: Plan, cluster: dict[str, Any] | None, cluster_name: str,
    head_pod: dict[str, Any] | None, held: bool, queue: str | None, live: list[dict[str, Any]],
    token_secret: dict[str, Any] | None, st: StatusDoc,
    route: Callable[[bool | None], Awaitable[bool]], complete: bool,
) -> HeadJobs | None:  # fmt: skip
    """One generation: queued, suspended, provisioning, or its head jobs on a ready cluster."""
    ns = res.namespace
    if held and not spec.suspend:
        assert cluster is not None and queue is not None
        workloads = await kube.list(WORKLOAD, ns, f"{c.LABEL_KUEUE_JOB_UID}="
                                    f"{cluster['metadata'].get('uid')}")  # fmt: skip
        _queued(st, queue_state(cluster_name, queue, next(iter(workloads), None)))
        return None
    if queue is not None and cluster is None and not spec.suspend:
        _queued(st, queue_state(cluster_name, queue, None))  # just created
        return None
    if spec.suspend:
        message = (f"Suspended: RayCluster {cluster_name} deleted, its quota in LocalQueue "
                   f"{queue} freed; resuming queues it again" if queue is not None
                   else f"Suspended: RayCluster {cluster_name} scaled to no pods, head job "
                   "stopped")  # fmt: skip
        for type_ in (c.COND_CLUSTER_READY, c.COND_HEAD_JOB_RUNNING, c.COND_READY):
            st.cond(type_, False, c.REASON_SUSPENDED, message)
        st.doc["headJob"] = None
        st.phase(c.PHASE_SUSPENDED, message)
        return None

    if cluster is None:
        await _provisioning(kube, res, spec, plan, None, cluster_name, "just created",
                            token_secret, st)  # fmt: skip
        return None
    readiness = cluster_readiness(cluster, plan.worker_pods, head_pod)
    live.sort(key=_attempt)
    if not readiness.ready:
        # Not ready is no evidence that the engine is gone: the route stays while the head job
        # runs, unless the head pod itself is gone or not Ready (routing.route_ready).
        await route(while_not_ready(live))
        await _provisioning(kube, res, spec, plan, cluster, cluster_name, readiness.message,
                            token_secret, st)  # fmt: skip
        return None
    st.cond(c.COND_CLUSTER_READY, True, c.REASON_CLUSTER_READY,
            f"RayCluster {cluster_name}: {readiness.message}")  # fmt: skip
    flow = HeadJobs(kube, probes, ray_jobs, cfg, res, spec, plan, cluster_name, head_pod, st,
                    route, complete)  # fmt: skip
    await flow.converge(live)
    return flow
