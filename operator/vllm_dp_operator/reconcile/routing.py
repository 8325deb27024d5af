"""Routing: the API Service's EndpointSlice says whether the head pod takes requests.

The operator owns one EndpointSlice per resource (`render/endpointslice.py`) and writes no
pod. `headjobs.py` decides when a head job is routed (first success before routing; then only
its end, its head pod's loss, or N failed probes over T seconds take the route away); this
module turns that decision into the slice, and clears what an earlier version's
selector-based Service left behind.
"""

from __future__ import annotations

import contextlib
from typing import Any

from vllm_dp_operator import constants as c
from vllm_dp_operator.api import names
from vllm_dp_operator.api.models import VLLMDataParallelSpec
from vllm_dp_operator.controller.cache import controller_uid
from vllm_dp_operator.controller.kube import ENDPOINTS, ENDPOINTSLICE, POD, AlreadyExists, Kube
from vllm_dp_operator.engines.jobstate import JobState, job_state
from vllm_dp_operator.reconcile.status import pod_ready
from vllm_dp_operator.render import build_endpoint_slice

Obj = dict[str, Any]
#: The managed-by value of the slices the mirroring controller copies from an Endpoints object.
MIRRORING_MANAGER = "endpointslicemirroring-controller.k8s.io"


def api_port(cluster: Obj | None, default: int) -> int:
    """The port a generation's engines listen on: its RayCluster's `vllmdp.io/api-port`,
    written when it was rendered (a later spec may change spec.service.port; the cache keeps
    no pod template to read it from). `default` for a cluster rendered before the annotation,
    whose port is the spec's."""
    raw = (((cluster or {}).get("metadata") or {}).get("annotations") or {}).get(
        c.ANNOTATION_API_PORT)  # fmt: skip
    return int(raw) if raw and str(raw).isdigit() else default


def slice_port(current: Obj | None) -> int | None:
    """The API port a slice routes to, None without one."""
    for port in (current or {}).get("ports") or []:
        if port.get("name") == c.API_PORT_NAME and port.get("port"):
            return int(port["port"])
    return None


async def routed_port(kube: Kube, ns: str, name: str, uid: str, default: int) -> int:
    """The port the resource's slice routes to while one of its endpoints serves (the serving
    generation's), else `default`: what the Service's port follows."""
    current = await kube.get(ENDPOINTSLICE, ns, names.endpoint_slice(name))
    if current is None or controller_uid(current) != uid:
        return default
    serving = any(_live_endpoint(e) for e in current.get("endpoints") or [])
    return (slice_port(current) if serving else None) or default


def _live_endpoint(endpoint: Obj) -> bool:
    conditions = endpoint.get("conditions") or {}
    return bool(conditions.get("ready") or conditions.get("serving"))


def _slice_ready_for(current: Obj | None, pod_uid: str) -> bool:
    """Whether the slice routes to this pod now: its `serving`, which is `ready` except while
    its replica leaves (then ready is false and serving keeps the routing decision)."""
    for endpoint in (current or {}).get("endpoints") or []:
        if (endpoint.get("targetRef") or {}).get("uid") == pod_uid:
            conditions = endpoint.get("conditions") or {}
            return bool(conditions.get("serving", conditions.get("ready")))
    return False


def route_ready(routed: bool | None, head_pod: Obj | None, current: Obj | None) -> bool:
    """Whether the head pod's endpoint is ready: the routing decision, where None keeps what
    the slice says now, and never for a head pod that is gone, going or not Ready."""
    if head_pod is None or head_pod["metadata"].get("deletionTimestamp"):
        return False
    if not pod_ready(head_pod) or not (head_pod.get("status") or {}).get("podIP"):
        return False
    if routed is None:
        return _slice_ready_for(current, head_pod["metadata"].get("uid") or "")
    return routed


async def routed_pod(kube: Kube, ns: str, name: str, replica: int) -> Obj | None:
    """The head pod of this replica that the resource's EndpointSlice routes to now (a ready
    endpoint), read from the slice itself, which is what kube-proxy routes by; else None."""
    current = await kube.get(ENDPOINTSLICE, ns, names.endpoint_slice(name))
    for endpoint in (current or {}).get("endpoints") or []:
        ref = endpoint.get("targetRef") or {}
        if not (endpoint.get("conditions") or {}).get("ready") or not ref.get("name"):
            continue
        pod = await kube.get(POD, ns, ref["name"])
        if pod is not None and names.replica_of(pod) == replica:
            return pod
    return None


def while_not_ready(jobs: list[Obj]) -> bool | None:
    """The decision while the cluster is not ready (a worker lost, say): no evidence by itself,
    so keep the route (None) while the newest head job runs; its end or failure unroutes."""
    if jobs and job_state(jobs[-1]) in (JobState.PENDING, JobState.RUNNING):
        return None
    return False


def _shape(obj: Obj) -> tuple[Any, ...]:
    """What routing depends on in a slice; fields the API server may add are left out."""
    endpoints = [
        (tuple(e.get("addresses") or ()), bool((e.get("conditions") or {}).get("ready")),
         bool((e.get("conditions") or {}).get("serving")), (e.get("targetRef") or {}).get("uid"),
         e.get("nodeName"))
        for e in obj.get("endpoints") or []
    ]  # fmt: skip
    ports = [(p.get("name"), p.get("port"), p.get("protocol", "TCP"))
             for p in obj.get("ports") or []]  # fmt: skip
    meta = obj.get("metadata") or {}
    return (obj.get("addressType"), endpoints, ports, meta.get("ownerReferences"))


def _labels_drift(current: Obj, desired: Obj) -> bool:
    have = current["metadata"].get("labels") or {}
    return any(have.get(k) != v for k, v in desired["metadata"]["labels"].items())


async def _others(kube: Kube, ns: str, current: Obj | None, replica: int,
                  mine: Obj | None) -> list[Obj]:  # fmt: skip
    """The other replicas' endpoints in the slice, as they stand. An endpoint whose pod is
    gone goes (whichever replica writes): its engines went with it."""
    kept = []
    for endpoint in (current or {}).get("endpoints") or []:
        ref = endpoint.get("targetRef") or {}
        if mine is not None and ref.get("uid") == mine["metadata"].get("uid"):
            continue  # this replica's own head pod, written anew
        pod = await kube.get(POD, ns, ref.get("name") or "") if ref.get("name") else None
        if pod is None or pod["metadata"].get("uid") != ref.get("uid"):
            continue
        if names.replica_of(pod) != replica:
            kept.append(endpoint)
    return kept


class Router:
    """Keeps one replica's endpoint in the resource's EndpointSlice in line with its routing
    decision; the other replicas' endpoints stay as they are."""

    def __init__(
        self, kube: Kube, name: str, namespace: str, uid: str, spec: VLLMDataParallelSpec,
        head_pod: Obj | None, owner: Obj, replica: int = 0, leaving: bool = False,
        port: int | None = None, going: bool = False,
    ) -> None:  # fmt: skip
        self.kube, self.name, self.ns, self.uid = kube, name, namespace, uid
        #: A pod of this replica's cluster is being deleted (a node drain's eviction, say):
        #: its engines go with it, so it is unrouted whatever the probes say.
        self.going = going
        self.spec, self.head_pod, self.owner = spec, head_pod, owner
        self.replica, self.leaving = replica, leaving
        #: The port this replica's generation listens on (`api_port`); None keeps the slice's.
        self.port = port
        #: Whether the last write left this replica's endpoint ready (None: nothing written),
        #: and serving (the routing decision; the same as ready unless the replica leaves).
        self.ready: bool | None = None
        self.serving: bool | None = None

    async def route(self, routed: bool | None) -> bool:
        """Write the slice for this decision (None: keep the current one); return ready."""
        slice_name = names.endpoint_slice(self.name)
        current = await self.kube.get(ENDPOINTSLICE, self.ns, slice_name)
        ready = route_ready(routed, self.head_pod, current) and not self.going
        others = await _others(self.kube, self.ns, current, self.replica, self.head_pod)
        now = slice_port(current)
        port = self.port or now or self.spec.service.port
        if now is not None and port != now and any(_live_endpoint(e) for e in others):
            # A slice has one port, and another replica serves on it: this one waits (unready)
            # until none does, and the port is never switched under a serving endpoint.
            port, ready = now, False
        self.serving, self.ready = ready, ready and not self.leaving
        desired = build_endpoint_slice(self.name, self.ns, self.spec, self.head_pod, ready,
                                       self.owner, others, self.leaving, port)  # fmt: skip
        ready = self.ready
        await self._drop_foreign()
        if current is None:
            with contextlib.suppress(AlreadyExists):  # an interrupted reconcile made it
                await self.kube.create(ENDPOINTSLICE, self.ns, desired)
            return ready
        if controller_uid(current) not in (None, self.uid):
            self.ready = False
            return False  # a deleted namesake's, until the garbage collector takes it
        if current.get("addressType") != desired["addressType"] and desired["endpoints"]:
            # addressType is immutable: a new slice, on the next reconcile (the delete wakes it).
            await self.kube.delete(ENDPOINTSLICE, self.ns, slice_name)
            self.ready = False
            return False
        if _shape(current) != _shape(desired) or _labels_drift(current, desired):
            meta = desired["metadata"]
            await self.kube.patch(ENDPOINTSLICE, self.ns, slice_name, {
                "metadata": {"labels": meta["labels"], "ownerReferences": meta["ownerReferences"]},
                "endpoints": desired["endpoints"], "ports": desired["ports"],
            })  # fmt: skip
        return ready

    async def _drop_foreign(self) -> None:
        """Delete slices of our Service that another manager wrote: the EndpointSlice
        controller's and the mirroring controller's, left from when the Service had a selector
        (neither removes them when a selector goes). kube-proxy would merge them with ours.

        A mirrored slice means the endpoints controller's last Endpoints object is still there:
        it goes first, or the mirroring controller would copy it again.
        """
        service = names.service(self.name)
        for other in await self.kube.list(ENDPOINTSLICE, self.ns,
                                          f"{c.LABEL_SERVICE_NAME}={service}"):  # fmt: skip
            labels = other["metadata"].get("labels") or {}
            if labels.get(c.LABEL_SLICE_MANAGED_BY) == c.SLICE_MANAGER:
                continue
            if other["metadata"].get("deletionTimestamp"):
                continue
            if labels.get(c.LABEL_SLICE_MANAGED_BY) == MIRRORING_MANAGER:
                await self.kube.delete(ENDPOINTS, self.ns, service)
            await self.kube.delete(ENDPOINTSLICE, self.ns, other["metadata"]["name"])
