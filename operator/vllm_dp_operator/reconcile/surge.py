"""A Surge update's I/O around the pure steps of `update.py`: which generation serves, the
old generation kept routed on evidence only, and the switch of the API Service.

While an update runs, the reconcile's flow (`converge.py`, `engines/headjobs.py`) works on the
new generation with a `Shadow` in place of the router: it decides as always, but nothing it
decides reaches the EndpointSlice. The old generation is left as it is: its head job is never
stopped here, and its route goes only on evidence that it is gone (its head job ended or
failed, its head pod gone or not Ready, its probes failing past the threshold: the probe pool
keeps it in a slot of its own beside the new generation's), as the data plane's rule says.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from vllm_dp_launcher.stages import ANSWERED

from vllm_dp_operator import constants as c
from vllm_dp_operator.api import names
from vllm_dp_operator.api.models import UpdateStrategy, VLLMDataParallelSpec
from vllm_dp_operator.config import Config
from vllm_dp_operator.controller.kube import POD, RAYCLUSTER, RAYJOB, Kube
from vllm_dp_operator.engines.headjobs import (
    HeadJobs,
    adapters_settled,
    head_pod_of,
    probed_gone,
)
from vllm_dp_operator.engines.jobstate import JobState, job_state
from vllm_dp_operator.engines.prober import EngineProbes, Target
from vllm_dp_operator.engines.ray_dashboard import RayJobs
from vllm_dp_operator.engines.transport import PROBES_OFF
from vllm_dp_operator.plan import Plan, lora_adapters
from vllm_dp_operator.reconcile.outcome import Resource, StatusDoc
from vllm_dp_operator.reconcile.routing import Router, api_port, routed_pod, while_not_ready
from vllm_dp_operator.reconcile.status import condition_status
from vllm_dp_operator.reconcile.update import (
    DRAINING,
    HOLD_FOR_SLOT,
    HOLD_FOR_TURN,
    STARTING,
    Decision,
    Draining,
    Generation,
    Wanted,
    decide,
    switched,
)
from vllm_dp_operator.render.headjob import job_hash

Obj = dict[str, Any]


def _labels(obj: Obj) -> dict[str, str]:
    labels: dict[str, str] = obj["metadata"].get("labels") or {}
    return labels


def _live(objs: list[Obj]) -> list[Obj]:
    return [o for o in objs if not o["metadata"].get("deletionTimestamp")]


def shape_of(cluster: Obj, rendered_name: str, rendered_shape: str) -> str:
    """A cluster's shape hash: its label, or for one made before the label, its name's."""
    shape = _labels(cluster).get(c.LABEL_CLUSTER_HASH)
    if shape:
        return shape
    return rendered_shape if cluster["metadata"]["name"] == rendered_name else ""


def legacy_accepted(res: Resource) -> str | None:
    """What a cluster made before the `vllmdp.io/accepted` annotation was accepted for: the
    generation the last reconcile saw, unless an update was under way or pending then."""
    if not res.seen_generation or res.status.get("update"):
        return None
    if condition_status(res.status.get("conditions") or [], c.COND_UPDATED) == "False":
        return None
    return f"{res.seen_generation}/"


def accepted_of(cluster: Obj, legacy: str | None) -> str | None:
    """The resource's `<generation>/<restartedAt>` a cluster was accepted for."""
    annotations: dict[str, str] = cluster["metadata"].get("annotations") or {}
    return annotations.get(c.ANNOTATION_ACCEPTED, legacy)


def serving_generation(
    status: dict[str, Any], clusters: list[Obj], jobs: list[Obj], rendered_name: str,
    rendered_shape: str, legacy: str | None = None,
) -> Generation | None:  # fmt: skip
    """The generation that served last and still runs: its head job live, its cluster there."""
    name = status.get("servedJob")
    if not name or name == status.get("lastFailedJob"):
        return None
    job = next((j for j in _live(jobs) if j["metadata"]["name"] == name), None)
    if job is None or job_state(job) not in (JobState.PENDING, JobState.RUNNING):
        return None
    cluster_name = _labels(job).get(c.LABEL_CLUSTER)
    cluster = next((cl for cl in _live(clusters) if cl["metadata"]["name"] == cluster_name), None)
    if cluster is None or cluster_name is None:
        return None
    return Generation(cluster_name, shape_of(cluster, rendered_name, rendered_shape),
                      _labels(job).get(c.LABEL_JOB_HASH) or "",
                      accepted_of(cluster, legacy))  # fmt: skip


class Shadow:
    """Stands in for the router while the new generation comes up: records the decision."""

    def __init__(self) -> None:
        self.asked = False

    async def route(self, routed: bool | None) -> bool:
        """Remember whether the flow would route; route nothing."""
        self.asked = bool(routed)
        return False


async def keep_serving(
    router: Router, res: Resource, spec: VLLMDataParallelSpec, cluster: str,
    clusters: list[Obj], jobs: list[Obj], probes: EngineProbes, cfg: Config, st: StatusDoc,
) -> bool:  # fmt: skip
    """The old generation's route while a new one starts: see `served_route`."""
    return await router.route(served_route(res, spec, cluster, clusters, jobs, probes, cfg, st,
                                           router.head_pod))  # fmt: skip


def token_of(cfg: Config, res: Resource, clusters: list[Obj], cluster: str) -> str | None:
    """The Ray token of the resource's live RayCluster `cluster` (engines/ray_auth.py)."""
    obj = next((cl for cl in clusters if cl["metadata"]["name"] == cluster), None)
    return cfg.ray_tokens.of_cluster(res.namespace, res.name, res.uid, obj)


def served_target(res: Resource, spec: VLLMDataParallelSpec, cluster: str, clusters: list[Obj],
                  head: Obj | None, draining: bool = False, job: str | None = None,
                  token: str | None = None) -> Target:  # fmt: skip
    """The serving generation's probe target on its head pod `head`: the same as the flow's
    while it served (engines/headjobs.py), so its answers so far count on with no fresh start;
    `draining`, a fresh one for a generation that drains (its first /metrics read comes after
    the unroute); `job`, its head job where that is not status.servedJob (a Surge's old one);
    `token`, the Ray token its adapters are synced with (spec.lora)."""
    obj = next((cl for cl in clusters if cl["metadata"]["name"] == cluster), None)
    job = job if job is not None else str(res.status.get("servedJob") or "")
    return Target(res.namespace, res.name, names.head_service(cluster),
                  api_port(obj, spec.service.port), job,
                  None, spec.api_key_secret_ref is not None, res.replica, draining,
                  ranks=spec.data_parallel.size,
                  head=(head or {}).get("metadata", {}).get("uid") or "",
                  adapters=lora_adapters(spec), token=token)  # fmt: skip


def served_route(
    res: Resource, spec: VLLMDataParallelSpec, cluster: str, clusters: list[Obj],
    jobs: list[Obj], probes: EngineProbes, cfg: Config, st: StatusDoc, head: Obj | None,
    draining: bool = False,
) -> bool | None:  # fmt: skip
    """The serving generation's route, decided on evidence only: False once its head job ended
    or its head pod is gone or not Ready, or its /health failed in a row past the threshold
    (failures over a minimum time: a hung engine); True while it answers; else None (no
    change). It stays probed in the pool's serving slot, a new generation in its own."""
    served = res.status.get("servedJob")
    live = [j for j in _live(jobs) if j["metadata"]["name"] == served
            and _labels(j).get(c.LABEL_CLUSTER) == cluster]  # fmt: skip
    decision = while_not_ready(live)
    if decision is not None or not served or cfg.health_probe == PROBES_OFF:
        return decision
    health = probes.health(served_target(res, spec, cluster, clusters, head, draining,
                                         token=token_of(cfg, res, clusters, cluster)))  # fmt: skip
    if health.ok:
        return True
    return False if probed_gone(health, cfg, st.now) else None


def completion_ok(probes: EngineProbes, target: Target | None) -> tuple[bool, str]:
    """Whether the new generation answered one completion through its own head Service."""
    if target is None:
        return False, "its head job has not been probed yet"
    answer = probes.completion(target)
    if answer is None:
        return False, "no completion asked yet (it follows the first /health 200)"
    if answer.ok and not adapters_settled(probes, target):
        return False, "its LoRA adapters are being loaded"
    return answer.ok, answer.detail


async def switch(
    st: StatusDoc, router: Router, record: dict[str, Any], model: str, dp: int,
    drain_seconds: int,
) -> None:  # fmt: skip
    """Route to the new generation's head and start the old one's drain. This reconcile asks
    for the next wake (the status write that records the switch is the operator's own, and
    wakes nothing)."""
    await router.route(True)
    new, old = record["to"], record["from"]
    st.doc["update"] = switched(record, st.now)
    head = router.head_pod
    st.doc.update(servedJob=st.doc.get("headJob"), consecutiveFailures=0, rayCluster=new,
                  servedHeadPod=head["metadata"]["uid"] if head else None)  # fmt: skip
    st.event(
        c.EVENT_NORMAL,
        c.REASON_UPDATE_SWITCHED,
        f"The API Service routes to RayCluster {new} (head job {st.doc.get('headJob')}), "
        f"which answered /health and one completion; {old} drains, then is deleted",
    )
    message = f"Serving {model} with DP={dp} from RayCluster {new}; {old} drains"
    st.cond(c.COND_READY, True, c.REASON_HEALTHY, message)
    st.phase(c.PHASE_SERVING, message)
    # Soon, not at the drain's end: the next reconcile registers the old head's probe of its
    # own, whose first call tells it to close kept-alive connections (engines/drain.py), and
    # from then on the probe pool wakes the resource as the old head drains.
    st.recheck(min(drain_seconds + 1, c.DRAIN_PROBE_SECONDS))


def overlay_starting(st: StatusDoc, record: dict[str, Any], served_job: str | None,
                     why: str, served_head: str | None = None,
                     routed: bool = True) -> None:  # fmt: skip
    """While the new generation comes up, the resource still serves from the old one (and
    the old one's head pod stays the one it served on: the new flow may have said otherwise),
    as long as the slice still routes to it (`routed`); Ready says what the slice says."""
    new, old = record["to"], record["from"]
    detail = st.doc.get("message") or ""
    st.doc.update(rayCluster=old, headJob=served_job, servedJob=served_job,
                  servedHeadPod=served_head)  # fmt: skip
    if routed:
        message = f"Serving from RayCluster {old}; {_updating_to(new)}{detail} ({why})"
        st.cond(c.COND_READY, True, c.REASON_UPDATE_IN_PROGRESS, message)
        st.phase(c.PHASE_SERVING, message)
        return
    message = (f"RayCluster {old} no longer serves (its head job or head pod is gone, or its "
               f"engine stopped answering); {_updating_to(new)}{detail} ({why})")  # fmt: skip
    st.cond(c.COND_READY, False, c.REASON_NOT_HEALTHY, message)
    st.phase(c.PHASE_LAUNCHING, message)


def overlay_hold(st: StatusDoc, cluster: str, served_job: str | None, routed: bool,
                 why: str) -> None:  # fmt: skip
    """The old generation serves on; nothing new starts (a failed target, or a drain)."""
    st.doc.update(rayCluster=cluster, headJob=served_job)
    if routed:
        st.phase(c.PHASE_SERVING, f"Serving from RayCluster {cluster}; {why}")
    else:
        message = f"RayCluster {cluster} no longer serves (its head job or head pod is gone)"
        st.cond(c.COND_READY, False, c.REASON_NOT_HEALTHY, message)
        st.phase(c.PHASE_LAUNCHING, message)


def _updating_to(new: str) -> str:
    """overlay_starting's message up to the new generation's own (read back by last_seen)."""
    return f"updating to {new}: "


def _last_seen(status: dict[str, Any]) -> str:
    """What the new generation's flow last said: overlay_starting's message, from its part."""
    new = (status.get("update") or {}).get("to")
    if not new:
        return ""
    _, sep, detail = str(status.get("message") or "").partition(_updating_to(str(new)))
    return detail if sep else ""


async def recover_switch(kube: Kube, res: Resource, jobs: list[Obj], now: datetime
                         ) -> Resource:  # fmt: skip
    """The resource as the switch left it, where the slice shows a switch its status does not
    (the leader died between the slice's patch and the status write). The slice is what
    kube-proxy routes by: the successor goes on draining the old generation, never unroutes
    the new head to route the old one again."""
    record = res.status.get("update") or {}
    if record.get("phase") != STARTING:
        return res
    pod = await routed_pod(kube, res.namespace, res.name, res.replica)
    if pod is None or _labels(pod).get(c.LABEL_RAY_CLUSTER) != record.get("to"):
        return res
    new_jobs = [j for j in _live(jobs) if _labels(j).get(c.LABEL_CLUSTER) == record["to"]]
    if not new_jobs:
        return res
    served = max(new_jobs, key=lambda j: int(_labels(j).get(c.LABEL_ATTEMPT) or 0))
    status = {**res.status, "update": switched(record, now),
              "servedJob": served["metadata"]["name"], "headJob": served["metadata"]["name"],
              "servedHeadPod": pod["metadata"].get("uid"), "rayCluster": record["to"]}
    return dataclasses.replace(res, status=status)


async def drained_state(
    kube: Kube, res: Resource, spec: VLLMDataParallelSpec, clusters: list[Obj],
    jobs: list[Obj], probes: EngineProbes, cfg: Config,
) -> Draining | None:  # fmt: skip
    """While a Surge's old generation drains: its engines' requests and its last client
    request's age, read by a probe target of its own (so the first /metrics read comes after
    the switch, and its head is told to close kept-alive connections: engines/drain.py), and
    whether a head job of it still runs. None when no generation drains."""
    record = res.status.get("update") or {}
    if record.get("phase") != DRAINING:
        return None
    old = str(record["from"])
    left = [j for j in _live(jobs) if _labels(j).get(c.LABEL_CLUSTER) == old]
    if not left:
        return Draining(None, False)
    head = head_pod_of(await kube.list(POD, res.namespace, names.head_pod_selector(old)))
    if head is None:
        return Draining(0, True)  # nothing runs there to drain
    reading = probes.reading(served_target(res, spec, old, clusters, head, draining=True,
                                           job=left[-1]["metadata"]["name"],
                                           token=token_of(cfg, res, clusters, old)))  # fmt: skip
    if reading is None:
        return Draining(None, True)
    return Draining(reading.in_flight(), True, reading.idle)


async def stop_drained(
    kube: Kube, res: Resource, spec: VLLMDataParallelSpec, plan: Plan, cluster: str,
    clusters: list[Obj], jobs: list[Obj], probes: EngineProbes, ray_jobs: RayJobs, cfg: Config,
    st: StatusDoc,
) -> None:  # fmt: skip
    """One step towards stopping a drained generation's head jobs through the Ray job API
    (vLLM's own shutdown, confirmed) before its cluster is deleted; it is no longer routed."""
    head = head_pod_of(await kube.list(POD, res.namespace, names.head_pod_selector(cluster)))
    flow = HeadJobs(kube, probes, ray_jobs, cfg, res, spec, plan, cluster, head, st,
                    Shadow().route, token=token_of(cfg, res, clusters, cluster))  # fmt: skip
    left = [j for j in _live(jobs) if _labels(j).get(c.LABEL_CLUSTER) == cluster]
    await flow.retire_all(left, f"RayCluster {cluster} drained after its update's switch")


def decide_step(
    res: Resource, spec: VLLMDataParallelSpec, plan: Plan, desired: Obj, clusters: list[Obj],
    jobs: list[Obj], st: StatusDoc, turn: str | None = None, old_state: Draining | None = None,
) -> Decision:  # fmt: skip
    """This reconcile's step (update.decide), its record and condition written to the status.
    `turn`: the strategy a rolling update across replicas gives this replica now (Recreate,
    Surge, or update.HOLD_FOR_TURN), in place of spec.update.strategy."""
    rendered = desired["metadata"]["name"]
    shape = desired["metadata"]["labels"][c.LABEL_CLUSTER_HASH]
    # Suspending stops the engines whatever the strategy: nothing to keep serving.
    strategy = UpdateStrategy.RECREATE if spec.suspend else (turn or spec.update.strategy)
    engines = names.content_hash(plan.launch_spec())
    want = Wanted(
        strategy=strategy, shape=shape, cluster=rendered,
        surge_cluster=names.raycluster(res.name, names.content_hash([shape, engines]),
                                       res.replica),
        job_hash=lambda cluster: job_hash(plan, cluster),
        deadline_seconds=spec.launch.timeout_seconds, drain_seconds=spec.update.drain_seconds,
        asked=res.asked,
    )  # fmt: skip
    status = dict(res.status)
    legacy = legacy_accepted(res)
    serving = serving_generation(status, clusters, jobs, rendered, shape, legacy)
    live = {cl["metadata"]["name"]: shape_of(cl, rendered, shape) for cl in _live(clusters)}
    accepted = {cl["metadata"]["name"]: accepted_of(cl, legacy) for cl in _live(clusters)}
    # A failed update says what its generation last did (the message the previous reconcile
    # wrote while it came up: its head job failing, its /health unanswered).
    step = decide(want, serving, live, status.get("update"), status.get("failedUpdate"), st.now,
                  _last_seen(status), accepted, old_state)  # fmt: skip
    st.doc.update(update=step.record, failedUpdate=step.failed)
    for type_, reason, message in step.events:
        st.event(type_, reason, message)
    known = condition_status(st.doc["conditions"], c.COND_UPDATED) is not None
    rolling = spec.update.strategy == UpdateStrategy.ROLLING_UPDATE
    if step.updated is not None and (strategy in (UpdateStrategy.SURGE, HOLD_FOR_SLOT)
                                     or rolling or known):
        st.cond(c.COND_UPDATED, *step.updated)
    if step.recheck is not None:
        st.recheck(step.recheck)
    return step


async def apply_step(
    kube: Kube, ns: str, step: Decision, clusters: list[Obj], jobs: list[Obj], st: StatusDoc
) -> tuple[list[Obj], list[Obj]]:
    """Delete what the step gives up (a failed or superseded new generation, a drained old
    one) with its head jobs; return the clusters and head jobs left."""
    gone = {name for name, _ in step.delete}
    for name, why in step.delete:
        if any(cl["metadata"]["name"] == name for cl in _live(clusters)):
            await kube.delete(RAYCLUSTER, ns, name)
            st.event(c.EVENT_NORMAL, c.REASON_CLUSTER_RESHAPED, f"Deleted RayCluster {name}: "
                     f"{why}")  # fmt: skip
        for job in _live(jobs):
            if _labels(job).get(c.LABEL_CLUSTER) == name:
                await kube.delete(RAYJOB, ns, job["metadata"]["name"])
    return (
        [cl for cl in clusters if cl["metadata"]["name"] not in gone],
        [j for j in jobs if _labels(j).get(c.LABEL_CLUSTER) not in gone],
    )


async def router_of(
    kube: Kube, res: Resource, spec: VLLMDataParallelSpec, owner: Obj, cluster: str,
    clusters: list[Obj],
) -> Router:  # fmt: skip
    """A router for one generation's head pod (the one that serves during a Surge), on the
    port it listens on."""
    pods = await kube.list(POD, res.namespace, names.head_pod_selector(cluster))
    obj = next((cl for cl in clusters if cl["metadata"]["name"] == cluster), None)
    return Router(kube, res.name, res.namespace, res.uid, spec, head_pod_of(pods), owner,
                  res.replica, port=api_port(obj, spec.service.port))  # fmt: skip


async def hold(
    kube: Kube, res: Resource, spec: VLLMDataParallelSpec, owner: Obj, cluster: str,
    clusters: list[Obj], jobs: list[Obj], probes: EngineProbes, cfg: Config, st: StatusDoc,
    turn: str | None = None,
) -> None:  # fmt: skip
    """The serving generation serves on, untouched; nothing new starts (update.Mode.HOLD).

    A hold lasts until the next spec change, so the old head stays probed: a hung engine
    loses its route by the usual threshold (failures in a row over a minimum time)."""
    served = res.status.get("servedJob")
    router = await router_of(kube, res, spec, owner, cluster, clusters)
    routed = await router.route(served_route(res, spec, cluster, clusters, jobs, probes, cfg,
                                             st, router.head_pod))  # fmt: skip
    record = st.doc.get("update")
    why = (f"the spec's change waits until {record['from']} has drained" if record
           else "it waits for its turn in the rolling update across replicas"
           if turn == HOLD_FOR_TURN
           else "it waits for one of the operator's update slots (other resources update now)"
           if turn == HOLD_FOR_SLOT
           else f"the update to job hash {st.doc.get('failedUpdate')} did not serve by its "
           "deadline (status.failedUpdate); a new spec change tries again")  # fmt: skip
    overlay_hold(st, cluster, served, routed, why)


def launcher_answered(said: str | None, target: Target | None, cfg: Config) -> tuple[bool, str]:
    """Whether the launcher's own completion, sent in the new head pod, answered 200. Needed
    where the operator's cannot prove generation: the engines want an API key, which only the
    pod holds (the operator's completion then gets vLLM's 401), or probes are off (it sends
    none). Elsewhere the operator's own completion suffices."""
    keyed = target is not None and target.complete_keyed
    if not keyed and cfg.health_probe != PROBES_OFF:
        return True, "not needed"
    if said == ANSWERED:
        return True, "the launcher's own completion in the pod answered 200"
    return False, (f"waiting for the launcher's own completion in the pod (stage "
                   f"{ANSWERED}; its last stage: {said or 'none seen'})")  # fmt: skip


async def after_candidate(
    st: StatusDoc, shadow: Shadow, router: Router, record: dict[str, Any],
    probes: EngineProbes, target: Target | None, said: str | None, cfg: Config, plan: Plan,
    served: str | None, served_head: str | None, drain_seconds: int, old_routed: bool = True,
) -> None:  # fmt: skip
    """Switch to the new generation once it serves; else say that the old one still does.
    Serving: /health (or, probes off, the launcher's report of it), one completion through
    its own head Service, and where that cannot prove generation, the launcher's own."""
    if not shadow.asked:
        overlay_starting(st, record, served, "not serving yet", served_head, old_routed)
        return
    ok, why = True, "healthProbe.mode off: no completion from the operator"
    if cfg.health_probe != PROBES_OFF:
        ok, why = completion_ok(probes, target)
    if ok:
        ok, why = launcher_answered(said, target, cfg)
    if ok:
        await switch(st, router, record, plan.model, plan.data_parallel_size, drain_seconds)
        return
    overlay_starting(st, record, served, f"/health answers; one completion: {why}",
                     served_head, old_routed)  # fmt: skip
