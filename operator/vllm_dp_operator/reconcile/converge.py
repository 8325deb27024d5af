"""The one level-triggered reconcile: observe children, converge them, compute status.

Children are the resource's by their labels and by the uid in their controller owner
reference: one that names another uid (left by a deleted resource of the same name, for the
garbage collector) is not adopted, not counted, and never changed or deleted here.
"""

from __future__ import annotations

import contextlib
from datetime import datetime
from typing import Any

from vllm_dp_operator import constants as c
from vllm_dp_operator.api import names
from vllm_dp_operator.api.models import VLLMDataParallelSpec
from vllm_dp_operator.api.validation import SpecError, validate
from vllm_dp_operator.config import Config
from vllm_dp_operator.controller.cache import controller_uid
from vllm_dp_operator.controller.kube import (
    NETWORKPOLICY,
    POD,
    RAYCLUSTER,
    RAYJOB,
    SERVICE,
    AlreadyExists,
    Kube,
)
from vllm_dp_operator.engines.headjobs import HeadJobs, head_pod_of
from vllm_dp_operator.engines.probe import HealthProbe
from vllm_dp_operator.engines.ray_dashboard import RayJobs
from vllm_dp_operator.plan import Plan, build_plan
from vllm_dp_operator.reconcile.outcome import Outcome, Resource, StatusDoc
from vllm_dp_operator.reconcile.status import PodAsks, cluster_readiness, explain_pending
from vllm_dp_operator.render import build_raycluster, build_service
from vllm_dp_operator.render.meta import owner_reference
from vllm_dp_operator.render.networkpolicy import build_network_policy, wanted

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
        spec.get("selector") != want["selector"]
        or ports != want_ports
        or spec.get("type") != want["type"]
        or any(
            (current["metadata"].get("annotations") or {}).get(k) != v
            for k, v in (meta.get("annotations") or {}).items()
        )
    )
    if drift:
        patch = {"metadata": {"annotations": meta.get("annotations") or {}}, "spec": want}
        await kube.patch(SERVICE, meta["namespace"], meta["name"], patch)


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
    kube: Kube, desired: dict[str, Any], observed: list[dict[str, Any]], st: StatusDoc
) -> dict[str, Any] | None:
    """Delete clusters of another shape, create the desired one; return it if it exists."""
    name, ns = desired["metadata"]["name"], desired["metadata"]["namespace"]
    current = None
    for cluster in observed:
        if cluster["metadata"]["name"] == name:
            current = cluster
            continue
        if cluster["metadata"].get("deletionTimestamp"):
            continue
        await kube.delete(RAYCLUSTER, ns, cluster["metadata"]["name"])
        st.event(
            c.EVENT_NORMAL, c.REASON_CLUSTER_RESHAPED,
            f"Deleted RayCluster {cluster['metadata']['name']}: the spec now needs {name}",
        )  # fmt: skip
    if current is None:
        await _create(kube, RAYCLUSTER, desired)
        st.event(c.EVENT_NORMAL, c.REASON_CLUSTER_CREATED, f"Created RayCluster {name}")
        return None
    want_suspend = desired["spec"]["suspend"]
    if bool((current.get("spec") or {}).get("suspend")) != want_suspend:
        await kube.patch(RAYCLUSTER, ns, name, {"spec": {"suspend": want_suspend}})
    return current


async def _drop_jobs_without_pods(
    kube: Kube, ns: str, jobs: list[dict[str, Any]], cluster_name: str, suspend: bool
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
        await kube.delete(RAYJOB, ns, job["metadata"]["name"])
    return kept


async def _provisioning(
    kube: Kube, res: Resource, spec: VLLMDataParallelSpec, plan: Plan,
    cluster_name: str, cluster_uid: str | None, detail: str, st: StatusDoc,
) -> Outcome:  # fmt: skip
    pods = _ours(await kube.list(POD, res.namespace, f"{c.LABEL_RAY_CLUSTER}={cluster_name}"),
                 cluster_uid)  # fmt: skip
    asks = PodAsks(gpus=plan.gpus_per_pod, gpu_resource=spec.gpu.resource_name,
                   cpu=spec.resources.cpu, head_cpu=plan.head_cpu,
                   memory=spec.resources.memory, head_memory=plan.head_memory)  # fmt: skip
    pending = explain_pending(pods, asks)
    reason = c.REASON_PODS_PENDING if pending else c.REASON_WAITING_FOR_NODES
    message = pending or f"Waiting for Ray nodes of {cluster_name}: {detail}"
    st.cond(c.COND_CLUSTER_READY, False, reason, message)
    st.cond(c.COND_HEAD_JOB_RUNNING, False, c.REASON_WAITING_FOR_NODES,
            "The head job starts once every Ray node has joined")  # fmt: skip
    st.cond(c.COND_READY, False, c.REASON_WAITING_FOR_NODES, message)
    st.phase(c.PHASE_PROVISIONING, message)
    return st.outcome()


async def reconcile(
    res: Resource, kube: Kube, probe: HealthProbe, ray_jobs: RayJobs, cfg: Config, now: datetime
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
    desired = build_raycluster(res.name, res.namespace, spec, plan, cfg.render, owner)
    cluster_name = desired["metadata"]["name"]
    st.doc.update(
        layout=_layout(plan),
        rayCluster=cluster_name,
        endpoint=names.endpoint(res.name, res.namespace, spec.service.port),
    )
    ns = res.namespace
    engine, head_job = c.COMPONENT_ENGINE, c.COMPONENT_HEAD_JOB
    clusters = _ours(await kube.list(RAYCLUSTER, ns, names.instance_selector(res.name, engine)),
                     res.uid)  # fmt: skip
    jobs = _ours(await kube.list(RAYJOB, ns, names.instance_selector(res.name, head_job)),
                 res.uid)  # fmt: skip
    # The policy goes first: the Ray pods are never up without it.
    await _ensure_network_policy(kube, res, spec, cfg, owner)
    await _ensure_service(kube, build_service(res.name, ns, spec, cluster_name, owner), res.uid)
    cluster = await _ensure_cluster(kube, desired, clusters, st)

    # Attempts count every head job seen, pruned or terminating ones too: names never repeat.
    st.doc["launchAttempts"] = max([st.doc["launchAttempts"], *(_attempt(j) for j in jobs)])
    live = await _drop_jobs_without_pods(kube, ns, jobs, cluster_name, spec.suspend)
    if spec.suspend:
        message = f"Suspended: RayCluster {cluster_name} scaled to no pods, head job stopped"
        for type_ in (c.COND_CLUSTER_READY, c.COND_HEAD_JOB_RUNNING, c.COND_READY):
            st.cond(type_, False, c.REASON_SUSPENDED, message)
        st.doc["headJob"] = None
        st.phase(c.PHASE_SUSPENDED, message)
        return st.outcome()

    if cluster is None:
        return await _provisioning(kube, res, spec, plan, cluster_name, None, "just created", st)
    cluster_uid = cluster["metadata"].get("uid")
    head_pod = head_pod_of(_ours(await kube.list(POD, ns, names.head_pod_selector(cluster_name)),
                                 cluster_uid))  # fmt: skip
    readiness = cluster_readiness(cluster, plan.worker_pods, head_pod)
    if not readiness.ready:
        return await _provisioning(kube, res, spec, plan, cluster_name, cluster_uid,
                                   readiness.message, st)  # fmt: skip
    st.cond(c.COND_CLUSTER_READY, True, c.REASON_CLUSTER_READY,
            f"RayCluster {cluster_name}: {readiness.message}")  # fmt: skip
    live.sort(key=_attempt)
    flow = HeadJobs(kube, probe, ray_jobs, cfg, res, spec, plan, cluster_name, head_pod, st)
    await flow.converge(live)
    return st.outcome()
