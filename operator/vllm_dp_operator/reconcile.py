"""The one level-triggered reconcile: observe children, converge them, compute status."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from vllm_dp_operator import constants as c
from vllm_dp_operator import names
from vllm_dp_operator.config import Config
from vllm_dp_operator.kube import POD, RAYCLUSTER, RAYJOB, SERVICE, AlreadyExists, Kube
from vllm_dp_operator.models import VLLMDataParallelSpec
from vllm_dp_operator.plan import Plan, build_plan
from vllm_dp_operator.probe import HealthProbe
from vllm_dp_operator.render import build_head_job, build_raycluster, build_service
from vllm_dp_operator.render.headjob import job_hash
from vllm_dp_operator.render.meta import owner_reference
from vllm_dp_operator.status import (
    JobState,
    cluster_readiness,
    explain_pending,
    job_failure_detail,
    job_state,
    parse_rfc3339,
    rfc3339,
    set_condition,
)
from vllm_dp_operator.validation import SpecError, validate


@dataclass(frozen=True)
class Resource:
    """The parts of a VLLMDataParallel object the reconcile reads."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: Mapping[str, Any]
    status: Mapping[str, Any]

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Resource:
        """Build from a raw object as kopf or the API hands it over."""
        meta = body["metadata"]
        return cls(
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta["uid"],
            generation=int(meta.get("generation") or 0),
            spec=body.get("spec") or {},
            status=body.get("status") or {},
        )


@dataclass(frozen=True)
class Event:
    """An event to post on the resource."""

    type: str
    reason: str
    message: str


@dataclass
class Outcome:
    """The status to write and the events to post after one reconcile."""

    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    #: Seconds until something time-based happens (a backoff ending), else None.
    retry_after: float | None = None


class _Status:
    """Accumulates the status document; conditions flip through one helper."""

    def __init__(self, res: Resource, now: datetime) -> None:
        self.now = now
        self.generation = res.generation
        prev = res.status
        self.doc: dict[str, Any] = {
            "observedGeneration": res.generation,
            "conditions": list(prev.get("conditions") or []),
            "launchAttempts": int(prev.get("launchAttempts") or 0),
            "consecutiveFailures": int(prev.get("consecutiveFailures") or 0),
            "lastFailedJob": prev.get("lastFailedJob"),
            "lastFailureTime": prev.get("lastFailureTime"),
            "headJob": prev.get("headJob"),
        }
        self.events: list[Event] = []

    def cond(self, type_: str, ok: bool | None, reason: str, message: str) -> None:
        self.doc["conditions"] = set_condition(
            self.doc["conditions"], type_, ok, reason, message, self.generation, self.now
        )

    def phase(self, phase: str, message: str) -> None:
        self.doc["phase"] = phase
        self.doc["message"] = message

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append(Event(type_, reason, message))

    def outcome(self, retry_after: float | None = None) -> Outcome:
        return Outcome(self.doc, self.events, retry_after)


def _layout(plan: Plan) -> dict[str, Any]:
    return {
        "gpuPods": plan.gpu_pods,
        "gpusPerPod": plan.gpus_per_pod,
        "totalGpus": plan.total_gpus,
        "pods": [
            {"index": p.index, "role": p.role, "ranks": p.ranks_text(), "gpus": p.gpus}
            for p in plan.pods
        ],
    }


def _attempt(job: Mapping[str, Any]) -> int:
    return int(job["metadata"].get("labels", {}).get(c.LABEL_ATTEMPT, "0"))


def _label(obj: Mapping[str, Any], key: str) -> str | None:
    labels: dict[str, str] = obj["metadata"].get("labels") or {}
    return labels.get(key)


async def _create(kube: Kube, kind: Any, body: dict[str, Any]) -> None:
    # Already there means an earlier, interrupted reconcile made it: converge, don't duplicate.
    with contextlib.suppress(AlreadyExists):
        await kube.create(kind, body["metadata"]["namespace"], body)


async def _ensure_service(kube: Kube, desired: dict[str, Any]) -> None:
    meta = desired["metadata"]
    current = await kube.get(SERVICE, meta["namespace"], meta["name"])
    if current is None:
        await _create(kube, SERVICE, desired)
        return
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


async def _ensure_cluster(
    kube: Kube, desired: dict[str, Any], observed: list[dict[str, Any]], st: _Status
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


async def _prune_jobs(
    kube: Kube, ns: str, jobs: list[dict[str, Any]], want_hash: str, suspend: bool, st: _Status
) -> list[dict[str, Any]]:
    """Delete head jobs that run something else (or any, when suspended); return the rest."""
    current = []
    for job in jobs:
        if job["metadata"].get("deletionTimestamp"):
            continue
        if _label(job, c.LABEL_JOB_HASH) == want_hash and not suspend:
            current.append(job)
            continue
        await kube.delete(RAYJOB, ns, job["metadata"]["name"])
        if not suspend:
            st.event(
                c.EVENT_NORMAL, c.REASON_ENGINE_CHANGED,
                f"Deleted head job {job['metadata']['name']}: what it runs has changed",
            )  # fmt: skip
    return current


async def _provisioning(
    kube: Kube, res: Resource, spec: VLLMDataParallelSpec, plan: Plan,
    cluster_name: str, detail: str, st: _Status,
) -> Outcome:  # fmt: skip
    pods = await kube.list(POD, res.namespace, f"{c.LABEL_RAY_CLUSTER}={cluster_name}")
    pending = explain_pending(pods, plan.gpus_per_pod, spec.gpu.resource_name)
    reason = c.REASON_PODS_PENDING if pending else c.REASON_WAITING_FOR_NODES
    message = pending or f"Waiting for Ray nodes of {cluster_name}: {detail}"
    st.cond(c.COND_CLUSTER_READY, False, reason, message)
    st.cond(c.COND_HEAD_JOB_RUNNING, False, c.REASON_WAITING_FOR_NODES,
            "The head job starts once every Ray node has joined")  # fmt: skip
    st.cond(c.COND_READY, False, c.REASON_WAITING_FOR_NODES, message)
    st.phase(c.PHASE_PROVISIONING, message)
    return st.outcome()


async def reconcile(
    res: Resource, kube: Kube, probe: HealthProbe, cfg: Config, now: datetime
) -> Outcome:
    """Bring the children in line with the spec and say where things stand."""
    st = _Status(res, now)
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
    clusters = await kube.list(RAYCLUSTER, ns, names.instance_selector(res.name, engine))
    jobs = await kube.list(RAYJOB, ns, names.instance_selector(res.name, head_job))
    await _ensure_service(kube, build_service(res.name, ns, spec, cluster_name, owner))
    cluster = await _ensure_cluster(kube, desired, clusters, st)

    # Attempts count every head job seen, pruned or terminating ones too: names never repeat.
    st.doc["launchAttempts"] = max([st.doc["launchAttempts"], *(_attempt(j) for j in jobs)])
    current_jobs = await _prune_jobs(kube, ns, jobs, job_hash(plan, cluster_name), spec.suspend, st)
    if spec.suspend:
        message = f"Suspended: RayCluster {cluster_name} scaled to no pods, head job stopped"
        for type_ in (c.COND_CLUSTER_READY, c.COND_HEAD_JOB_RUNNING, c.COND_READY):
            st.cond(type_, False, c.REASON_SUSPENDED, message)
        st.doc["headJob"] = None
        st.phase(c.PHASE_SUSPENDED, message)
        return st.outcome()

    if cluster is None:
        return await _provisioning(kube, res, spec, plan, cluster_name, "just created", st)
    readiness = cluster_readiness(cluster, plan.worker_pods)
    if not readiness.ready:
        return await _provisioning(kube, res, spec, plan, cluster_name, readiness.message, st)
    st.cond(c.COND_CLUSTER_READY, True, c.REASON_CLUSTER_READY,
            f"RayCluster {cluster_name}: {readiness.message}")  # fmt: skip
    return await _converge_head_job(kube, res, spec, plan, cluster_name, current_jobs, probe,
                                    cfg, st)  # fmt: skip


async def _converge_head_job(
    kube: Kube, res: Resource, spec: VLLMDataParallelSpec, plan: Plan, cluster_name: str,
    jobs: list[dict[str, Any]], probe: HealthProbe, cfg: Config, st: _Status,
) -> Outcome:  # fmt: skip
    ns = res.namespace
    jobs.sort(key=_attempt)
    latest = jobs[-1] if jobs else None
    next_attempt = st.doc["launchAttempts"] + 1

    if latest is None or job_state(latest) in (JobState.FAILED, JobState.ENDED):
        if latest is not None:
            wait = _record_failure(latest, cfg, st)
            if wait > 0:
                return st.outcome(retry_after=wait)
        for old in jobs[:-1]:
            await kube.delete(RAYJOB, ns, old["metadata"]["name"])
        body = build_head_job(res.name, ns, spec, plan, cfg.render, cluster_name, next_attempt,
                              owner_reference(res.name, res.uid))  # fmt: skip
        await _create(kube, RAYJOB, body)
        job_name = body["metadata"]["name"]
        reason = c.REASON_JOB_RELAUNCH if latest is not None else c.REASON_JOB_CREATED
        st.event(c.EVENT_NORMAL, reason, f"Created head job {job_name} on {cluster_name}")
        st.doc.update(headJob=job_name, launchAttempts=next_attempt)
        message = f"Head job {job_name} submitted; waiting for vLLM to load {plan.model}"
        st.cond(c.COND_HEAD_JOB_RUNNING, False, c.REASON_JOB_PENDING, message)
        st.cond(c.COND_READY, False, c.REASON_JOB_PENDING, message)
        st.phase(c.PHASE_LAUNCHING, message)
        return st.outcome()

    job_name = latest["metadata"]["name"]
    st.doc["headJob"] = job_name
    running = job_state(latest) is JobState.RUNNING
    st.cond(c.COND_HEAD_JOB_RUNNING, running,
            c.REASON_JOB_RUNNING if running else c.REASON_JOB_PENDING,
            f"Head job {job_name}: {job_failure_detail(latest)}")  # fmt: skip
    health = await probe.check(ns, names.service(res.name), spec.service.port)
    if health.ok:
        if res.status.get("phase") != c.PHASE_SERVING:
            st.event(c.EVENT_NORMAL, c.REASON_HEALTHY, f"vLLM answers /health: {health.detail}")
        for old in jobs[:-1]:
            await kube.delete(RAYJOB, ns, old["metadata"]["name"])
        st.doc["consecutiveFailures"] = 0
        st.cond(c.COND_READY, True, c.REASON_HEALTHY, health.detail)
        st.phase(c.PHASE_SERVING, f"Serving {plan.model} with DP={plan.data_parallel_size}")
        return st.outcome()
    message = f"Head job {job_name} is starting vLLM; /health not answering yet ({health.detail})"
    st.cond(c.COND_READY, False, c.REASON_NOT_HEALTHY, message)
    st.phase(c.PHASE_LAUNCHING, message)
    return st.outcome()


def _record_failure(job: Mapping[str, Any], cfg: Config, st: _Status) -> float:
    """Count a newly seen failure once; return seconds left to wait before relaunching."""
    name = job["metadata"]["name"]
    detail = job_failure_detail(job)
    if st.doc["lastFailedJob"] != name:
        st.doc["consecutiveFailures"] += 1
        st.doc["lastFailedJob"] = name
        st.doc["lastFailureTime"] = rfc3339(st.now)
        st.event(c.EVENT_WARNING, c.REASON_JOB_FAILED,
                 f"Head job {name} ended ({detail}); failure {st.doc['consecutiveFailures']} "
                 "in a row")  # fmt: skip
    failed_at = parse_rfc3339(st.doc["lastFailureTime"]) or st.now
    delay = cfg.backoff(st.doc["consecutiveFailures"])
    left = delay - (st.now - failed_at).total_seconds()
    if left <= 0:
        return 0.0
    message = (
        f"Head job {name} ended ({detail}); relaunching in {left:.0f}s "
        f"(failure {st.doc['consecutiveFailures']} in a row, backoff {delay:.0f}s)"
    )
    st.cond(c.COND_HEAD_JOB_RUNNING, False, c.REASON_JOB_FAILED, message)
    st.cond(c.COND_READY, False, c.REASON_JOB_BACKOFF, message)
    st.phase(c.PHASE_BACKOFF, message)
    return left
