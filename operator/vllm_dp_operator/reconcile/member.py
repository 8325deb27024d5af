"""One replica's reconcile: a single DP group, as a resource was before replicas.

Its RayCluster, its head jobs and its endpoint in the resource's EndpointSlice, converged from
what the cache holds; its status is the replica's entry. Children are the resource's by their
labels and by the uid in their controller owner reference: one that names another uid (left
by a deleted resource of the same name, for the garbage collector) is not adopted, not
counted, and never changed or deleted here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from vllm_dp_operator import constants as c
from vllm_dp_operator.api import names
from vllm_dp_operator.api.models import RayAuth, UpdateStrategy, VLLMDataParallelSpec
from vllm_dp_operator.config import Config
from vllm_dp_operator.controller.cache import controller_uid
from vllm_dp_operator.controller.kube import (
    POD,
    RAYCLUSTER,
    RAYJOB,
    SECRET,
    WORKLOAD,
    AlreadyExists,
    Kube,
)
from vllm_dp_operator.engines.headjobs import HeadJobs, head_pod_of
from vllm_dp_operator.engines.prober import EngineProbes
from vllm_dp_operator.engines.ray_dashboard import RayJobs
from vllm_dp_operator.plan import Plan
from vllm_dp_operator.reconcile import surge
from vllm_dp_operator.reconcile.outcome import Resource, StatusDoc
from vllm_dp_operator.reconcile.queueing import QueueState, queue_state
from vllm_dp_operator.reconcile.routing import Router, api_port, while_not_ready
from vllm_dp_operator.reconcile.status import (
    PodAsks,
    cluster_readiness,
    explain_pending,
    explain_refused,
    waits_for_secret,
)
from vllm_dp_operator.reconcile.update import Mode
from vllm_dp_operator.render import build_raycluster
from vllm_dp_operator.render.raytoken import build_ray_token_secret
from vllm_dp_operator.render.scheduling import kueue_queue


def _attempt(job: dict[str, Any]) -> int:
    return int(job["metadata"].get("labels", {}).get(c.LABEL_ATTEMPT, "0"))


def label_of(obj: dict[str, Any], key: str) -> str | None:
    labels: dict[str, str] = obj["metadata"].get("labels") or {}
    return labels.get(key)


def ours(objs: list[dict[str, Any]], uid: str | None) -> list[dict[str, Any]]:
    """The objects whose controller owner reference, if any, names this uid."""
    return [o for o in objs if controller_uid(o) in (None, uid)]


async def create_child(kube: Kube, kind: Any, body: dict[str, Any]) -> None:
    # Already there means an earlier, interrupted reconcile made it: converge, don't duplicate.
    with contextlib.suppress(AlreadyExists):
        await kube.create(kind, body["metadata"]["namespace"], body)


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
        await create_child(kube, RAYCLUSTER, desired)
        st.event(c.EVENT_NORMAL, c.REASON_CLUSTER_CREATED, f"Created RayCluster {name}")
        return None
    want_suspend = desired["spec"]["suspend"]
    if not queued and bool((current.get("spec") or {}).get("suspend")) != want_suspend:
        await kube.patch(RAYCLUSTER, ns, name, {"spec": {"suspend": want_suspend}})
    return current


async def _accept(kube: Kube, clusters: list[dict[str, Any]], name: str, asked: str) -> None:
    """Record on the serving cluster that it runs what the resource asks now
    (`vllmdp.io/accepted`): later renders of the operator's own (a new default, a new
    release) then replace nothing (reconcile/update.py)."""
    for cluster in clusters:
        meta = cluster["metadata"]
        if meta["name"] == name and (meta.get("annotations") or {}).get(
                c.ANNOTATION_ACCEPTED) != asked and not meta.get("deletionTimestamp"):
            await kube.patch(RAYCLUSTER, meta["namespace"], name,
                             {"metadata": {"annotations": {c.ANNOTATION_ACCEPTED: asked}}})


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
        if label_of(job, c.LABEL_CLUSTER) == cluster_name and not suspend:
            kept.append(job)
            continue
        if label_of(job, c.LABEL_CLUSTER) in keep:
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
    pods = ours(await kube.list(POD, res.namespace, f"{c.LABEL_RAY_CLUSTER}={cluster_name}"),
                 cluster_uid)  # fmt: skip
    if token_secret is not None and waits_for_secret(pods, token_secret["metadata"]["name"]):
        # The garbage collector took a deleted namesake's Secret after this resource found it
        # there: make it again (the token is the same), and the kubelet starts the container.
        await create_child(kube, SECRET, token_secret)
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


async def reconcile_replica(
    res: Resource, kube: Kube, probes: EngineProbes, ray_jobs: RayJobs, cfg: Config,
    spec: VLLMDataParallelSpec, plan: Plan, owner: dict[str, Any],
    clusters: list[dict[str, Any]], jobs: list[dict[str, Any]], st: StatusDoc,
    turn: str | None = None,
) -> None:  # fmt: skip
    """One replica: a single DP group's reconcile, as a resource was before replicas. `turn`:
    how a rolling update across replicas has it update now (replicaset.rollout)."""
    ns = res.namespace
    desired = build_raycluster(res.name, ns, spec, plan, cfg.render, owner, res.replica,
                               res.asked, res.restarted_at,
                               cfg.ray_tokens.secret_name(ns, res.name, res.uid))  # fmt: skip
    res = await surge.recover_switch(kube, res, jobs, st.now)
    if res.status.get("update") != st.doc.get("update"):
        st.doc.update({k: res.status.get(k) for k in (
            "update", "servedJob", "headJob", "servedHeadPod", "rayCluster")})
    old_state = await surge.drained_state(kube, res, spec, clusters, jobs, probes, cfg)
    step = surge.decide_step(res, spec, plan, desired, clusters, jobs, st, turn, old_state)
    if step.stop is not None:
        await surge.stop_drained(kube, res, spec, plan, step.stop, clusters, jobs, probes,
                                 ray_jobs, cfg, st)  # fmt: skip
    clusters, jobs = await surge.apply_step(kube, ns, step, clusters, jobs, st)
    if step.accept:
        await _accept(kube, clusters, step.cluster, res.asked)
    cluster_name = step.cluster
    if cluster_name != desired["metadata"]["name"]:
        # The same shape under another name: the serving cluster, or a Surge's second one.
        desired["metadata"]["name"] = cluster_name
    st.doc.update(rayCluster=cluster_name)
    if step.mode is Mode.HOLD:
        await surge.hold(kube, res, spec, owner, step.cluster, clusters, jobs, probes, cfg, st,
                         turn)  # fmt: skip
        return
    token_secret = None
    if spec.ray.auth == RayAuth.TOKEN:
        token_secret = build_ray_token_secret(
            res.name, ns, desired["spec"]["authOptions"]["secretName"],
            cfg.ray_tokens.token(ns, res.name, res.uid), owner)  # fmt: skip
        if not any(cl["metadata"]["name"] == cluster_name for cl in clusters):
            # Before the cluster, whose pods read it; the operator never reads it back.
            await create_child(kube, SECRET, token_secret)
    queue = kueue_queue(spec)
    cluster = await _ensure_cluster(kube, desired, clusters, st, queue is not None, spec.suspend,
                                    step.keep)  # fmt: skip
    # Kueue holds the cluster suspended until it admits it, and again when it evicts it.
    held = queue is not None and cluster is not None and bool(cluster["spec"].get("suspend"))
    cluster_uid = cluster["metadata"].get("uid") if cluster is not None else None
    head_pod, going = None, False
    if cluster is not None:
        pods = ours(await kube.list(POD, ns, names.cluster_pods_selector(cluster_name)),
                    cluster_uid)  # fmt: skip
        head_pod = head_pod_of(p for p in pods if label_of(p, c.LABEL_RAY_NODE_TYPE) == "head")
        # A pod of it being deleted by someone else (a node drain evicts it): the replica's
        # engines go with it, so it is unrouted now (its pod's preStop drains the head).
        going = any(p["metadata"].get("deletionTimestamp") for p in pods)
    router = Router(kube, res.name, ns, res.uid, spec, head_pod, owner, res.replica,
                    port=api_port(cluster, spec.service.port), going=going)  # fmt: skip
    shadow, old_routed = None, True
    if step.mode is Mode.CANDIDATE and step.record is not None:
        # The old generation keeps its route; the new one's flow routes into a shadow.
        old = await surge.router_of(kube, res, spec, owner, step.record["from"], clusters)
        old_routed = await surge.keep_serving(old, res, spec, step.record["from"], clusters,
                                              jobs, probes, cfg, st)  # fmt: skip
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
    # A rolling update's turn: its head job is stopped once drained, while the others serve.
    flow = await _converge_cluster(kube, probes, ray_jobs, cfg, res, spec, plan, cluster,
                                    cluster_name, head_pod, held, queue, live, token_secret,
                                    st, route, shadow is not None, step.keep_job,
                                    drain_first=turn == UpdateStrategy.RECREATE)  # fmt: skip
    if shadow is not None and step.record is not None:
        await surge.after_candidate(st, shadow, router, step.record, probes,
                                    flow.target if flow else None, flow.said if flow else None,
                                    cfg, plan, res.status.get("servedJob"),
                                    res.status.get("servedHeadPod"),
                                    spec.update.drain_seconds, old_routed)  # fmt: skip


async def _converge_cluster(
    kube: Kube, probes: EngineProbes, ray_jobs: RayJobs, cfg: Config, res: Resource,
    spec: VLLMDataParallelSpec, plan: Plan, cluster: dict[str, Any] | None, cluster_name: str,
    head_pod: dict[str, Any] | None, held: bool, queue: str | None, live: list[dict[str, Any]],
    token_secret: dict[str, Any] | None, st: StatusDoc,
    route: Callable[[bool | None], Awaitable[bool]], complete: bool, keep_job: str | None,
    drain_first: bool = False,
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
                    route, complete, keep_job,
                    token=cfg.ray_tokens.of_cluster(res.namespace, res.name, res.uid,
                                                    cluster), drain_first=drain_first)  # fmt: skip
    await flow.converge(live)
    return flow
