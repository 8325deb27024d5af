"""A replica that leaves (scale-down): unrouted first, drained, its head job stopped for
real, then its RayCluster deleted. Each reconcile takes one step; its status entry says where
it is (`leaving`: when it started), so a new leader goes on from there.

Its endpoint stays in the slice as `ready: false, terminating: true` (kube-proxy sends it no
new connection while another endpoint is ready) until its cluster goes. The drain ends when
its engines report no request running or waiting in a /metrics read taken after the unroute,
or after spec.update.drainSeconds. Then its head jobs are stopped through the Ray job API and
their end confirmed (vLLM's own shutdown: SIGTERM, then SIGKILL after
spec.launch.drainSeconds), as before a relaunch, and only then is the cluster deleted.
"""

from __future__ import annotations

from typing import Any

from vllm_dp_operator import constants as c
from vllm_dp_operator.api import names
from vllm_dp_operator.api.models import VLLMDataParallelSpec
from vllm_dp_operator.config import Config
from vllm_dp_operator.controller.kube import POD, RAYCLUSTER, Kube
from vllm_dp_operator.engines.headjobs import HeadJobs, head_pod_of
from vllm_dp_operator.engines.prober import EngineProbes, Target
from vllm_dp_operator.engines.ray_dashboard import RayJobs
from vllm_dp_operator.plan import Plan
from vllm_dp_operator.reconcile import replicaset
from vllm_dp_operator.reconcile.outcome import Resource, StatusDoc
from vllm_dp_operator.reconcile.routing import Router
from vllm_dp_operator.reconcile.status import rfc3339
from vllm_dp_operator.reconcile.surge import served_route, served_target, token_of
from vllm_dp_operator.reconcile.update import drain_over

Obj = dict[str, Any]


def _live(objs: list[Obj]) -> list[Obj]:
    return [o for o in objs if not o["metadata"].get("deletionTimestamp")]


def _drain_reading(probes: EngineProbes, target: Target) -> tuple[int | None, float | None]:
    """Its requests running or waiting, and seconds since its last client request."""
    reading = probes.reading(target)
    return (None, None) if reading is None else (reading.in_flight(), reading.idle)


async def leave(
    res: Resource, kube: Kube, probes: EngineProbes, ray_jobs: RayJobs, cfg: Config,
    spec: VLLMDataParallelSpec, plan: Plan, owner: Obj, clusters: list[Obj], jobs: list[Obj],
    st: StatusDoc,
) -> dict[str, Any] | None:  # fmt: skip
    """One step of a leaving replica (`res.replica`); its status entry, None once it is gone."""
    ns, prev, now = res.namespace, res.status, st.now
    mst = StatusDoc(res, now)
    live_clusters, live_jobs = _live(clusters), _live(jobs)
    # A suspended resource has no slice (it went with the Service), and nothing to drain.
    routes = not spec.suspend
    if not live_clusters and not live_jobs:
        # Gone: its endpoint goes from the slice (the pods may outlive the cluster a moment).
        if routes:
            await Router(kube, res.name, ns, res.uid, spec, None, owner,
                         res.replica).route(False)  # fmt: skip
        st.merge(mst)
        return None
    since = prev.get("leaving") or rfc3339(now)
    names_live = [cl["metadata"]["name"] for cl in live_clusters]
    cluster = prev.get("rayCluster") if prev.get("rayCluster") in names_live else (
        names_live[0] if names_live else None)  # fmt: skip
    head_pod = None
    if cluster is not None:
        head_pod = head_pod_of(await kube.list(POD, ns, names.head_pod_selector(cluster)))
    router = Router(kube, res.name, ns, res.uid, spec, head_pod, owner, res.replica,
                    leaving=True)  # fmt: skip
    decision = (served_route(res, spec, cluster, clusters, jobs, probes, cfg, mst, head_pod,
                             draining=True)
                if cluster is not None and routes else False)  # fmt: skip
    if routes:
        await router.route(decision)
    if not prev.get("leaving"):
        st.event(c.EVENT_NORMAL, c.REASON_REPLICA_DRAINING,
                 f"Replica {res.replica} ({cluster or 'no RayCluster'}) leaves: unrouted, "
                 f"draining for at most {spec.update.drain_seconds}s")  # fmt: skip
    over, why = True, "it was not serving"
    # Drained while its endpoint still says serving (kept-alive connections may still use it):
    # that is the routing decision, read back from the slice on each step.
    if router.serving and router.head_pod is not None:
        target = served_target(res, spec, cluster or "", clusters, head_pod, draining=True,
                               token=token_of(cfg, res, clusters, cluster or ""))  # fmt: skip
        running, idle = _drain_reading(probes, target)
        over, why = drain_over(since, spec.update.drain_seconds, running, now, idle)
    if not over:
        mst.recheck(spec.update.drain_seconds + 1)
        return _entry(res, mst, st, since, f"Leaving: {why}")
    flow = HeadJobs(kube, probes, ray_jobs, cfg, res, spec, plan, cluster or "", head_pod, mst,
                    router.route, token=token_of(cfg, res, clusters, cluster or ""))  # fmt: skip
    waiting = await flow.retire_all(live_jobs, f"replica {res.replica} leaves ({why})")
    if waiting:
        return _entry(res, mst, st, since, f"Leaving: {'; '.join(waiting)}")
    if routes:
        await Router(kube, res.name, ns, res.uid, spec, None, owner, res.replica).route(False)
    for name in names_live:
        await kube.delete(RAYCLUSTER, ns, name)
        st.event(c.EVENT_NORMAL, c.REASON_REPLICA_REMOVED,
                 f"Replica {res.replica} left: deleted RayCluster {name} ({why}; its head "
                 "jobs stopped)")  # fmt: skip
    return _entry(res, mst, st, since, f"Leaving: deleting RayCluster(s) {', '.join(names_live)}")


def _entry(res: Resource, mst: StatusDoc, st: StatusDoc, since: str, message: str
           ) -> dict[str, Any]:  # fmt: skip
    mst.phase(c.PHASE_DRAINING, message)
    for type_ in (c.COND_READY, c.COND_HEAD_JOB_RUNNING):
        mst.cond(type_, False, c.REASON_REPLICA_DRAINING, message)
    mst.settle_engines()
    st.merge(mst)
    return replicaset.entry(res.replica, mst.doc, False, False, since)
