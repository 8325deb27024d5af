"""A child kind the API server does not serve (404) or lets the operator read (403).

Before, the reflectors retried for ever, silently: the cache never synced, no worker ran, and
no resource got a status or an Event. Now the operator says what is wrong (log once per
cause, readiness, metrics, and a condition on each resource), and recovers by itself once the
cause is fixed. The controller runs over the FakeApi double, with real reflectors, queue and
workers; its retry cap is shortened so recoveries come within the tests' deadlines.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from fake_api import FakeApi
from kubernetes_asyncio.client.exceptions import ApiException
from vllm_dp_operator import constants as c
from vllm_dp_operator.config import Config
from vllm_dp_operator.controller import informer
from vllm_dp_operator.controller.kube import (
    CRD,
    POD,
    RAYCLUSTER,
    RAYJOB,
    SERVICE,
    VDP,
    WORKLOAD,
    Kind,
)
from vllm_dp_operator.controller.manager import Controller
from vllm_dp_operator.controller.watch_health import diagnose
from vllm_dp_operator.reconcile.outcome import Event
from world import FakeProbe, FakeRayJobs

HOUR = 3600.0
CFG = Config(resync_seconds=HOUR, probe_launching_seconds=HOUR, probe_serving_seconds=HOUR,
             workers=2)  # fmt: skip
KEY = ("default", "demo")
SPEC = {"model": "m", "dataParallel": {"size": 4, "ranksPerNode": 2}}
NOT_SERVED = "rayclusters.ray.io/v1 is not served by the API server: is KubeRay installed"


def forbidden(verb: str, resource: str) -> ApiException:
    """A 403 as the API server answers it, with its Status body."""
    message = (f'{resource} is forbidden: User "system:serviceaccount:ops:vdp" cannot {verb} '
               f'resource "{resource}" in API group "" at the cluster scope')  # fmt: skip
    exc = ApiException(status=403, reason="Forbidden")
    exc.body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                           "message": message, "reason": "Forbidden", "code": 403})  # fmt: skip
    return exc


class RefusingApi(FakeApi):
    """A FakeApi that refuses the kinds in `refused` with their status (404 or 403), as an API
    server does without KubeRay's CRDs, or without an RBAC grant."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: dict[Kind, int] = {}
        #: Refused for WATCH only (an RBAC role granting list but not watch).
        self.refused_watch: dict[Kind, int] = {}

    def _refuse(self, kind: Kind, verb: str) -> None:
        status = self.refused.get(kind) or (self.refused_watch.get(kind) if verb == "watch"
                                            else None)  # fmt: skip
        if status == 403:
            raise forbidden(verb, kind.plural)
        if status is not None:
            raise ApiException(status=status, reason="Not Found")

    async def list_page(self, kind: Kind, namespace: str | None, selector: str, limit: int,
                        cont: str | None, fields: str = "") -> dict[str, Any]:  # fmt: skip
        self.calls[f"list {kind.plural}"] += 1
        self._refuse(kind, "list")
        return await super().list_page(kind, namespace, selector, limit, cont, fields)

    async def watch(self, kind: Kind, namespace: str | None, selector: str,
                    resource_version: str, timeout_seconds: int, fields: str = "",
                    ) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
        self.calls[f"watch {kind.plural}"] += 1
        self._refuse(kind, "watch")
        async for event in super().watch(kind, namespace, selector, resource_version,
                                         timeout_seconds, fields):  # fmt: skip
            yield event

    async def create(self, kind: Kind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self._refuse(kind, "create")
        return await super().create(kind, namespace, body)


class Bed:
    """A RefusingApi, one VLLMDataParallel, and a controller over them."""

    def __init__(self) -> None:
        self.api = RefusingApi()
        self.events: list[Event] = []
        self.ctl = Controller(self.api, CFG, FakeProbe(), FakeRayJobs(),
                              post_event=lambda _t, e: self.events.append(e))

    def add_owner(self) -> None:
        self.api.put(VDP, {"apiVersion": f"{c.GROUP}/{c.VERSION}", "kind": c.KIND,
                           "metadata": {"name": "demo", "generation": 1}, "spec": SPEC})
        self.ctl.owner_event("ADDED", copy.deepcopy(self.api.objects[(VDP, *KEY)]))

    def status(self) -> dict[str, Any]:
        st: dict[str, Any] = self.api.objects[(VDP, *KEY)].get("status") or {}
        return st

    def condition(self) -> dict[str, Any] | None:
        found = [x for x in self.status().get("conditions") or []
                 if x["type"] == c.COND_CHILDREN_WATCHED]  # fmt: skip
        return found[0] if found else None

    def watch_ready(self, kind: str) -> float | None:
        return self.ctl.metrics.registry.get_sample_value("vllmdp_watch_ready", {"kind": kind})

    def failures(self, kind: str, reason: str) -> float | None:
        return self.ctl.metrics.registry.get_sample_value(
            "vllmdp_watch_failures_total", {"kind": kind, "reason": reason})

    async def until(self, what: str, check: Callable[[], Any], timeout: float = 3.0) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not check():
            if loop.time() - start > timeout:
                raise AssertionError(f"{what}: not within {timeout}s; status {self.status()}; "
                                     f"ready {self.ctl.ready()}")  # fmt: skip
            await asyncio.sleep(0.005)


@pytest.fixture(autouse=True)
def short_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(informer, "RETRY_CAP_SECONDS", 0.2)
    monkeypatch.setattr(informer, "REFUSED_AFTER_SECONDS", 0.3)
    monkeypatch.setattr(informer, "WATCH_WORKS_SECONDS", 0.3)


@pytest.fixture
async def bed() -> AsyncIterator[Bed]:
    b = Bed()
    yield b
    await b.ctl.stop()


async def test_kuberay_missing_at_start_is_said_everywhere_then_recovers(
    bed: Bed, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vllm_dp_operator")
    bed.api.refused = {RAYCLUSTER: 404, RAYJOB: 404}
    bed.ctl.start()
    bed.add_owner()

    await bed.until("the condition naming the missing kind", lambda: bed.condition())
    cond = bed.condition()
    assert cond is not None
    assert (cond["status"], cond["reason"]) == ("False", c.REASON_KIND_NOT_SERVED)
    assert NOT_SERVED in cond["message"] and "rayjobs.ray.io/v1" in cond["message"]
    assert cond["message"] == bed.status()["message"]
    assert cond["message"].endswith("ray.io/v1? It retries by itself and reconciles as soon as "
                                    "it can read every kind it manages.")  # fmt: skip
    assert [(e.type, e.reason) for e in bed.events] == [(c.EVENT_WARNING,
                                                         c.REASON_KIND_NOT_SERVED)]
    ready, why = bed.ctl.ready()
    assert not ready and NOT_SERVED in why
    assert bed.watch_ready("rayclusters.ray.io/v1") == 0
    assert bed.watch_ready("pods/v1") == 1
    # Liveness answers (a restart would not help); readiness, in the counters, says no.
    assert bed.ctl.health() == {"alive": True}
    assert bed.ctl.counters()["ready"] is False
    assert not bed.api.named(SERVICE), "nothing decided while a child kind is unknown"

    # Retries go on (a LIST each), but each cause is logged once.
    await bed.until("several retries", lambda: bed.api.calls["list rayclusters"] >= 4)
    assert (bed.failures("rayclusters.ray.io/v1", c.REASON_KIND_NOT_SERVED) or 0) >= 3
    warned = [r for r in caplog.records if r.levelno == logging.WARNING
              and "rayclusters.ray.io/v1 is not served" in r.getMessage()]  # fmt: skip
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert len(bed.events) == 1, "one Warning per cause, not per retry"

    bed.api.refused = {RAYCLUSTER: 404}  # one cause gone: said, with no new Warning
    await bed.until("the message without rayjobs",
                    lambda: "rayjobs" not in (bed.condition() or {}).get("message", "rayjobs"))
    assert len(bed.events) == 1 and not bed.api.named(SERVICE)

    bed.api.refused = {}  # KubeRay installed: no restart
    await bed.until("the children", lambda: bed.api.named(RAYCLUSTER) and bed.api.named(SERVICE))
    await bed.until("the condition back to True",
                    lambda: (bed.condition() or {}).get("status") == "True")  # fmt: skip
    assert bed.status()["phase"] == c.PHASE_PROVISIONING
    assert bed.ctl.ready() == (True, "synced; every watched kind is served")
    assert bed.watch_ready("rayclusters.ray.io/v1") == 1
    assert any("listed again" in r.getMessage() for r in caplog.records)


async def test_rbac_missing_names_the_verb_and_the_resource(bed: Bed) -> None:
    bed.api.refused = {POD: 403}
    bed.ctl.start()
    bed.add_owner()
    await bed.until("the condition", lambda: bed.condition())
    cond = bed.condition()
    assert cond is not None and cond["reason"] == c.REASON_WATCH_FORBIDDEN
    assert "RBAC forbids the operator to list pods in all namespaces" in cond["message"]
    assert 'cannot list resource "pods"' in cond["message"]  # the API server's own words
    assert not bed.ctl.ready()[0]
    assert bed.watch_ready("pods/v1") == 0


async def test_watch_refused_but_list_allowed_is_said_and_recovers_by_watching(
    bed: Bed, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vllm_dp_operator")
    bed.api.refused_watch = {RAYJOB: 403}
    bed.ctl.start()
    bed.add_owner()
    await bed.until("the condition", lambda: bed.condition())
    cond = bed.condition()
    assert cond is not None and cond["reason"] == c.REASON_WATCH_FORBIDDEN
    assert "RBAC forbids the operator to watch rayjobs.ray.io" in cond["message"]
    lists = bed.api.calls["list rayjobs"]
    await asyncio.sleep(1.0)  # retries (0.2 s apart) retry the watch, not the list
    assert bed.api.calls["list rayjobs"] == lists
    assert sum("forbids" in r.getMessage() for r in caplog.records) == 1

    bed.api.refused_watch = {}
    await bed.until("watched again", lambda: (bed.condition() or {}).get("status") == "True")
    assert bed.ctl.ready()[0] and bed.api.named(RAYCLUSTER)
    assert any("watching again" in r.getMessage() for r in caplog.records)


async def test_a_kind_removed_while_running_blocks_then_recovers(bed: Bed) -> None:
    bed.ctl.start()
    bed.add_owner()
    await bed.until("the RayCluster", lambda: bed.api.named(RAYCLUSTER))
    await bed.until("Provisioning", lambda: bed.status().get("phase") == c.PHASE_PROVISIONING)
    assert bed.condition() is None, "never told otherwise: no condition"

    bed.api.refused = {RAYCLUSTER: 404}  # the CRD deleted: its watch ends, and is refused
    bed.api.end_watches()
    await bed.until("the condition", lambda: bed.condition())
    assert bed.status()["phase"] == c.PHASE_PROVISIONING, "the phase is not guessed"
    assert not bed.ctl.ready()[0]

    bed.api.refused = {}
    await bed.until("watched again", lambda: (bed.condition() or {}).get("status") == "True")
    assert bed.ctl.ready()[0]
    assert bed.status()["message"].startswith("Waiting for Ray nodes")


async def test_a_slow_first_list_says_nothing_on_resources(bed: Bed) -> None:
    gate = asyncio.Event()
    listed = bed.api.list_page

    async def slow(*args: Any, **kwargs: Any) -> dict[str, Any]:
        await gate.wait()
        return await listed(*args, **kwargs)

    bed.api.list_page = slow  # type: ignore[method-assign]
    bed.ctl.start()
    bed.add_owner()
    await asyncio.sleep(0.2)
    assert bed.status() == {} and not bed.api.named(SERVICE)
    ready, why = bed.ctl.ready()
    assert not ready and why.startswith("waiting for the first LIST of rayclusters.ray.io/v1")
    gate.set()
    await bed.until("the first reconcile", lambda: bed.status().get("phase"))
    assert bed.condition() is None


async def test_a_short_404_as_an_api_server_starts_tells_no_resource(
    bed: Bed, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(informer, "REFUSED_AFTER_SECONDS", 1.5)
    bed.ctl.start()
    bed.add_owner()
    await bed.until("Provisioning", lambda: bed.status().get("phase") == c.PHASE_PROVISIONING)
    bed.api.refused = {RAYCLUSTER: 404}  # restarted, its CRDs not loaded yet
    bed.api.end_watches()
    await bed.until("a refused LIST", lambda: bed.api.calls["list rayclusters"] >= 3)
    (clusters,) = [r for r in bed.ctl.reflectors if r.kind == RAYCLUSTER]
    assert clusters.problem is not None and clusters.refused is None
    assert bed.ctl.ready()[0], "a blip shorter than REFUSED_AFTER_SECONDS is no refusal"
    bed.api.refused = {}
    await bed.until("listed again", lambda: clusters.problem is None)
    assert bed.condition() is None
    assert not [e for e in bed.events if e.type == c.EVENT_WARNING]
    assert bed.watch_ready("rayclusters.ray.io/v1") == 1


def test_diagnose_names_the_kind_and_the_cause() -> None:
    missing = diagnose(RAYJOB, "list", None, ApiException(status=404, reason="Not Found"))
    assert missing.blocks and missing.reason == c.REASON_KIND_NOT_SERVED
    assert missing.message == ("rayjobs.ray.io/v1 is not served by the API server: is KubeRay "
                               "installed, with CRDs that serve ray.io/v1?")  # fmt: skip
    core = diagnose(SERVICE, "list", "ns1", ApiException(status=404, reason="Not Found"))
    assert core.message == "services/v1 is not served by the API server"
    denied = diagnose(RAYCLUSTER, "watch", "ns1", forbidden("watch", "rayclusters"))
    assert denied.blocks and denied.message.startswith(
        "RBAC forbids the operator to watch rayclusters.ray.io in namespace ns1: grant its "
        "ServiceAccount list and watch on rayclusters.ray.io")  # fmt: skip
    down = diagnose(POD, "watch", None, aiohttp.ClientConnectionError("connection refused"))
    assert not down.blocks and down.message == (
        "watch pods/v1: ClientConnectionError connection refused")
    busy = diagnose(POD, "list", None, ApiException(status=503, reason="Service Unavailable"))
    assert not busy.blocks and busy.message == "list pods/v1: HTTP 503 Service Unavailable"


@pytest.mark.parametrize("status", [404, 403])
async def test_kueue_absent_or_unreadable_blocks_nothing(bed: Bed, status: int) -> None:
    # Kueue's Workloads are optional: without them a resource is served as before.
    bed.api.refused = {WORKLOAD: status}
    bed.ctl.start()
    bed.add_owner()
    await bed.until("the children", lambda: bed.api.named(RAYCLUSTER) and bed.api.named(SERVICE))
    assert bed.condition() is None and bed.ctl.ready()[0]
    assert bed.watch_ready("workloads.kueue.x-k8s.io/v1beta2") == 1  # nothing waits on it
    reason = c.REASON_KIND_NOT_SERVED if status == 404 else c.REASON_WATCH_FORBIDDEN
    assert (bed.failures("workloads.kueue.x-k8s.io/v1beta2", reason) or 0) >= 1
    assert bed.watch_ready("rayclusters.ray.io/v1") == 1


def kueue_crd(established: bool = True, served: bool = True) -> dict[str, Any]:
    """Kueue's Workload CRD as the API server shows it."""
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": "workloads.kueue.x-k8s.io"},
            "spec": {"group": "kueue.x-k8s.io", "versions": [
                {"name": "v1beta1", "served": True}, {"name": "v1beta2", "served": served}]},
            "status": {"conditions": [{"type": "Established",
                                       "status": "True" if established else "False"}]}}


async def test_kueue_installed_later_is_listed_at_once_and_asked_for_nothing_meanwhile(
    bed: Bed, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # Absent, the Workloads' reflector used to LIST every 60 s: the one request at rest that a
    # timer made. Now it waits on a watch of Kueue's CRD, and lists when the CRD serves.
    monkeypatch.setattr(informer, "OPTIONAL_RETRY_SECONDS", HOUR)  # a poll would never come
    bed.api.refused = {WORKLOAD: 404}
    bed.ctl.start()
    bed.add_owner()
    await bed.until("the children", lambda: bed.api.named(RAYCLUSTER))
    await bed.until("the CRD watched", lambda: bed.api.streams[CRD] == 1)
    asked = bed.api.calls["list workloads"]
    assert asked >= 1 and bed.ctl.ready()[0]
    # Another CRD, and Kueue's before it is Established or serves v1beta2: still absent.
    bed.api.put(CRD, {**kueue_crd(), "metadata": {"name": "rayclusters.ray.io"}}, namespace="")
    bed.api.put(CRD, kueue_crd(established=False), namespace="")
    bed.api.put(CRD, {**kueue_crd(served=False), "metadata": {
        "name": "workloads.kueue.x-k8s.io", "resourceVersion": "1"}}, namespace="")
    await asyncio.sleep(0.3)
    assert bed.api.calls["list workloads"] == asked and not bed.ctl.kueue.served.is_set()
    assert bed.api.calls["list customresourcedefinitions"] == 1  # one LIST, then the watch
    bed.api.refused = {}  # Kueue installed: its CRD serves, and the Workloads are listed
    bed.api.put(CRD, kueue_crd(), namespace="")
    await bed.until("the Workloads listed", lambda: bed.ctl.reflectors[-1].lists == 1, 5.0)
    assert bed.ctl.kueue.served.is_set()
    # Uninstalled again: the CRD's deletion is seen, and the reflector waits on it again.
    await bed.api.delete(CRD, "", "workloads.kueue.x-k8s.io")
    await bed.until("the CRD's deletion seen", lambda: not bed.ctl.kueue.served.is_set())


async def test_a_crd_that_cannot_be_read_falls_back_to_asking_every_minute(bed: Bed) -> None:
    bed.api.refused = {WORKLOAD: 404, CRD: 403}
    bed.ctl.start()
    await bed.until("the CRD's refusal", lambda: bed.ctl.kueue.blind.is_set())
    assert await asyncio.wait_for(bed.ctl.kueue.until_served(), 1) is False
    assert bed.ctl.counters()["reflectors"]["customresourcedefinitions"]["watches"] == 0
