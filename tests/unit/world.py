"""A faked world for reconcile tests: the Kube seam, /health and the Ray job API as test doubles.

FakeKube stands in for the API server, FakeProbe for vLLM's /health and FakeRayJobs for the
Ray dashboard's job API; World plays KubeRay (cluster readiness, head pods, RayJob status).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from fake_kube import FakeKube
from vllm_dp_operator import constants as c
from vllm_dp_operator.config import Config
from vllm_dp_operator.controller.kube import ENDPOINTSLICE, POD, RAYCLUSTER, RAYJOB
from vllm_dp_operator.engines.engine_metrics import parse_engine_loads
from vllm_dp_operator.engines.launch_reports import Launch
from vllm_dp_operator.engines.probe import EngineReading, ProbeResult
from vllm_dp_operator.engines.prober import NOT_PROBED, Target
from vllm_dp_operator.engines.ray_dashboard import NOT_FOUND, UNKNOWN, RayJobLookup, StopResult
from vllm_dp_operator.reconcile.converge import Outcome, Resource, reconcile

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CFG = Config(backoff_base_seconds=10, backoff_cap_seconds=40, stop_confirm_seconds=20)


class FakeProbe:
    """Test double for the probe pool: each ask is one probe, answering what the test sets,
    with the failures in a row counted as the pool counts them."""

    def __init__(self, clock: Callable[[], datetime] = lambda: T0) -> None:
        self.ok = False
        self.calls: list[str] = []
        self.metric_calls: list[str] = []
        #: What /metrics answers: exposition text, or None for a failed read.
        self.metrics: str | None = ""
        self.nudged: list[tuple[str, str]] = []
        #: What each head job's launcher reported last, as the test sets it.
        self.stages: dict[str, str] = {}
        self.followed: list[str] = []
        #: The stage each head job's log is followed until.
        self.followed_until: dict[str, str] = {}
        self._clock = clock
        self._last = NOT_PROBED
        #: Head Services whose /health fails whatever `ok` says (a new generation that hangs).
        self.down: set[str] = set()
        self._down: dict[str, tuple[int, datetime]] = {}  # failures in a row, since
        #: What a one-token completion answers (a Surge's new generation is asked one).
        self.completes = True
        self.completion_calls: list[str] = []
        #: The serving check each of those asked (servecheck.py).
        self.checks: list[str] = []
        #: Answer NOT_PROBED the first time a target is asked about, as the pool does for a
        #: target it does not hold yet (a new head job, a new head pod).
        self.fresh = False
        self._seen: set[Target] = set()

    def health(self, target: Target) -> ProbeResult:
        self.calls.append(f"{target.service}:{target.port}")
        if self.fresh and target not in self._seen:
            # As the pool does: a target it has not held is registered and unprobed yet.
            self._seen.add(target)
            return NOT_PROBED
        if target.service in self.down:
            failures, since = self._down.get(target.service, (0, self._clock()))
            self._down[target.service] = (failures + 1, since)
            return ProbeResult(False, f"probe {target.service}:{target.port} ok=False",
                               failures + 1, since)  # fmt: skip
        if self.ok:
            self._last = ProbeResult(True, f"probe {target.service}:{target.port} ok=True")
        else:
            failures = self._last.failures + 1 if not self._last.ok else 1
            since = (self._last.failing_since if failures > 1 and self._last.failing_since
                     else self._clock())  # fmt: skip
            self._last = ProbeResult(False, f"probe {target.service}:{target.port} ok=False",
                                     failures, since)  # fmt: skip
        return self._last

    def reading(self, target: Target) -> EngineReading | None:
        self.metric_calls.append(f"{target.service}:{target.port}")
        if self.metrics is None:
            return EngineReading(None, f"GET {target.service}:{target.port}/metrics: HTTP 500")
        return EngineReading(parse_engine_loads(self.metrics),
                             f"GET {target.service}:{target.port}/metrics")  # fmt: skip

    def completion(self, target: Target) -> ProbeResult | None:
        if target.complete_model is None or target.service in self.down:
            return None
        self.completion_calls.append(f"{target.service}:{target.complete_model}")
        self.checks.append(target.complete_check)
        return ProbeResult(self.completes, f"POST {target.service}/v1/completions")

    def nudge(self, key: tuple[str, str]) -> None:
        self.nudged.append(key)

    def reported(self, launch: Launch) -> str | None:
        self.followed.append(launch.job)
        self.followed_until[launch.job] = launch.until
        return self.stages.get(launch.job)


class FakeRayJobs:
    """Test double for the Ray dashboard's job API: one head, jobs by submission id."""

    def __init__(self) -> None:
        self.jobs: dict[str, str] = {}  # submission id -> Ray job status
        self.reachable = True
        self.stops: list[str] = []
        # Like Ray with RAY_AUTH_MODE=token: when set, a call without it is refused.
        self.required_token: str | None = None
        self.tokens: list[str | None] = []  # the token each call carried
        self.replaced_token: str | None = None  # a token Secret someone else replaced

    def _refused(self, token: str | None) -> str | None:
        self.tokens.append(token)
        required = self.replaced_token or self.required_token
        if required is None or token == required:
            return None
        return "dashboard: HTTP 401" if token is None else "dashboard: HTTP 403"

    async def lookup(
        self, namespace: str, cluster: str, submission_id: str, token: str | None
    ) -> RayJobLookup:
        if not self.reachable:
            return RayJobLookup(UNKNOWN, "dashboard: connection refused")
        if (refused := self._refused(token)) is not None:
            return RayJobLookup(UNKNOWN, refused)
        state = self.jobs.get(submission_id, NOT_FOUND)
        return RayJobLookup(state, f"dashboard: {submission_id} {state}")

    async def stop(
        self, namespace: str, cluster: str, submission_id: str, token: str | None
    ) -> StopResult:
        if not self.reachable:
            return StopResult(False, "dashboard: connection refused")
        if (refused := self._refused(token)) is not None:
            return StopResult(False, refused)
        self.stops.append(submission_id)
        return StopResult(submission_id in self.jobs, f"dashboard: stop {submission_id}")


def launch_plan(job: dict[str, Any]) -> dict[str, Any]:
    """The launch plan a head job carries (base64 JSON after --plan-b64)."""
    argv = job["spec"]["entrypoint"].split()
    plan: dict[str, Any] = json.loads(base64.b64decode(argv[argv.index("--plan-b64") + 1]))
    return plan


def spec(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "dataParallel": {"size": 8, "ranksPerNode": 4},
    }
    base.update(over)
    return base


class World:
    """A resource, its status as kopf would persist it, and the faked cluster around it."""

    def __init__(self, raw_spec: dict[str, Any] | None = None) -> None:
        self.now = T0
        self.kube = FakeKube(clock=lambda: self.now)
        self.probe = FakeProbe(clock=lambda: self.now)
        self.cfg = CFG
        self.ray = FakeRayJobs()
        self.spec = raw_spec or spec()
        self.status: dict[str, Any] = {}
        self.generation = 1
        self.uid = "uid-demo"
        self.events: list[tuple[str, str, str]] = []
        #: metadata.annotations[vllmdp.io/restartedAt]
        self.restarted_at = ""
        #: The operator-wide update slots (converge.Slots), or None for no bound.
        self.slots: Any = None

    async def step(self, advance: float = 0.0) -> Outcome:
        self.now += timedelta(seconds=advance)
        res = Resource("demo", "default", self.uid, self.generation, self.spec, self.status,
                       restarted_at=self.restarted_at,
                       seen_generation=int(self.status.get("observedGeneration") or 0))
        # Play Ray: a token-authenticated cluster's dashboard refuses calls without its token.
        auth = (self.spec.get("ray") or {}).get("auth", "token")
        self.ray.required_token = CFG.ray_tokens.token("default", "demo", self.uid) \
            if auth == "token" else None  # fmt: skip
        out = await reconcile(res, self.kube, self.probe, self.ray, self.cfg, self.now,
                              self.slots)
        self.status = {k: v for k, v in out.status.items() if v is not None}
        self.events += [(e.type, e.reason, e.message) for e in out.events]
        return out

    def update(self, raw_spec: dict[str, Any]) -> None:
        self.spec = raw_spec
        self.generation += 1

    def clusters(self) -> list[dict[str, Any]]:
        return self.kube.named(RAYCLUSTER)

    def jobs(self) -> list[dict[str, Any]]:
        return self.kube.named(RAYJOB)

    def job_names(self) -> list[str]:
        return [j["metadata"]["name"] for j in self.jobs()]

    def cluster_ready(self) -> None:
        """Play KubeRay: every cluster ready, with a head pod."""
        for cluster in self.clusters():
            name = cluster["metadata"]["name"]
            groups = cluster["spec"]["workerGroupSpecs"]
            workers = groups[0]["replicas"] if groups else 0
            self.kube.set_status(RAYCLUSTER, "default", name, {
                "state": "ready",
                "readyWorkerReplicas": workers,
                "conditions": [
                    {"type": "HeadPodReady", "status": "True"},
                    {"type": "RayClusterProvisioned", "status": "True"},
                ],
            })  # fmt: skip
            if not self.head_pod(name):
                self.new_head_pod(name)

    def new_head_pod(self, cluster: str, index: int = 0) -> None:
        # KubeRay gives a pod its template's labels, and its own.
        obj = self.kube.objects.get((RAYCLUSTER, "default", cluster)) or {}
        template = ((obj.get("spec") or {}).get("headGroupSpec") or {}).get("template") or {}
        labels = {**(template.get("metadata") or {}).get("labels", {}),
                  c.LABEL_RAY_CLUSTER: cluster, c.LABEL_RAY_NODE_TYPE: "head"}  # fmt: skip
        self.kube.objects[(POD, "default", f"{cluster}-head-{index}")] = {
            "metadata": {"name": f"{cluster}-head-{index}", "uid": f"uid-head-{cluster}-{index}",
                         "labels": labels},
            "spec": {"nodeName": "node-a"},
            "status": {"phase": "Running",
                       "podIP": f"10.0.{len(self.kube.named(POD))}.{10 + index}",
                       "conditions": [{"type": "Ready", "status": "True"}],
                       "containerStatuses": [{"name": c.HEAD_CONTAINER, "state": {
                           "running": {"startedAt": "2026-01-01T00:00:00Z"}}}]},
        }  # fmt: skip

    def head_pod(self, cluster: str | None = None) -> dict[str, Any] | None:
        cluster = cluster or self.status["rayCluster"]
        pods = [p for p in self.kube.named(POD)
                if p["metadata"]["labels"].get(c.LABEL_RAY_CLUSTER) == cluster]  # fmt: skip
        return pods[0] if pods else None

    def endpoint_slice(self) -> dict[str, Any] | None:
        return self.kube.objects.get((ENDPOINTSLICE, "default", "demo-api"))

    def routed(self) -> bool:
        """Whether the API Service's EndpointSlice routes to the current head pod."""
        eps = self.endpoint_slice()
        pod = self.head_pod()
        if eps is None or pod is None:
            return False
        return any(e["conditions"]["ready"] and e["targetRef"]["uid"] == pod["metadata"]["uid"]
                   and e["addresses"] == [pod["status"]["podIP"]]
                   for e in eps["endpoints"])  # fmt: skip

    def pod_writes(self) -> list[tuple[str, str, str]]:
        return [w for w in self.kube.writes if w[1] == "pods"]

    def job_status(self, name: str, **status: str) -> None:
        self.kube.set_status(RAYJOB, "default", name, status)

    def run(self, name: str) -> None:
        """Play KubeRay and Ray: the head job's Ray job runs."""
        self.ray.jobs[name] = "RUNNING"
        self.job_status(name, jobStatus="RUNNING", jobDeploymentStatus="Running", jobId=name)

    def reasons(self) -> list[str]:
        return [r for _, r, _ in self.events]


async def launched(raw: dict[str, Any] | None = None) -> World:
    """A world whose cluster is ready and whose first head job has been created."""
    w = World(raw)
    await w.step()
    w.cluster_ready()
    await w.step()
    assert w.job_names() == ["demo-j00001"]
    return w


async def serving(raw: dict[str, Any] | None = None) -> World:
    w = await launched(raw)
    w.run("demo-j00001")
    w.probe.ok = True
    await w.step()
    assert w.status["phase"] == c.PHASE_SERVING
    return w


