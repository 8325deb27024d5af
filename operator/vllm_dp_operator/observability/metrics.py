"""The operator's Prometheus metrics, on a registry of its own (no global state).

Names follow controller-runtime's (`*_reconcile_total{result}`, `*_reconcile_errors_total`)
with our prefix, plus domain metrics. What counts, and why it is never counted twice:

- A head-job launch or failure is counted from the reconcile's outcome: a launch is the
  `HeadJobCreated`/`HeadJobRelaunched` event of a reconcile that created the RayJob, a failure
  the `HeadJobFailed`/`LaunchTimedOut` event of the reconcile that first saw it. Both are
  guarded by status fields the reconcile reads back (`launchAttempts`, `lastFailedJob`), laid
  over with the status changes not yet confirmed, so a re-run reconcile and an operator
  restart reading the persisted status count nothing again.
- Time to serving is observed when `servedJob` goes from unset to set: the resource's first
  Serving ever, measured from its creationTimestamp. A relaunch serving later is not a first.
- `vllmdp_resources{phase}` and the per-resource gauges are read from the owner cache at
  scrape time: what is, not what happened, so they are right after a restart too, and a
  deleted resource's series go with it.
- `vllmdp_watch_ready{kind}` and `vllmdp_watch_failures_total{kind,reason}` are read from the
  reflectors at scrape time, so they say what the watches do now.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_dp_operator import constants as c
from vllm_dp_operator.reconcile.outcome import Outcome
from vllm_dp_operator.reconcile.status import parse_rfc3339

RESULT_SUCCESS = "success"
RESULT_ERROR = "error"
RESULT_REQUEUE = "requeue"
RESULTS = (RESULT_SUCCESS, RESULT_ERROR, RESULT_REQUEUE)
PHASES = (c.PHASE_INVALID, c.PHASE_PROVISIONING, c.PHASE_LAUNCHING, c.PHASE_SERVING,
          c.PHASE_BACKOFF, c.PHASE_SUSPENDED, c.PHASE_QUEUED, c.PHASE_PREEMPTED)  # fmt: skip
#: A resource not reconciled yet has no phase.
PHASE_NONE = "None"
LAUNCH_REASONS = frozenset({c.REASON_JOB_CREATED, c.REASON_JOB_RELAUNCH})
FAILURE_REASONS = frozenset({c.REASON_JOB_FAILED, c.REASON_JOB_TIMED_OUT, c.REASON_JOB_HUNG})
# Reconciles take milliseconds (reads come from memory); a slow API server, seconds.
RECONCILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# Model load is tens of seconds to many minutes.
SERVING_BUCKETS = (10, 30, 60, 120, 300, 600, 900, 1200, 1800, 2700, 3600, 5400, 7200)

#: Every metric this module exports, name -> help (docs/observability.md lists the same).
NAMES = {
    "vllmdp_reconcile_total": "Reconciles by result: success, error (raised; retried with "
    "backoff) or requeue (asked to be reconciled again at a time-based step).",
    "vllmdp_reconcile_errors_total": "Reconciles that raised an error.",
    "vllmdp_reconcile_duration_seconds": "Time one reconcile took.",
    "vllmdp_resources": "VLLMDataParallel resources known to the operator, by phase.",
    "vllmdp_head_job_launches_total": "Head jobs (RayJobs) created, first launches and "
    "relaunches.",
    "vllmdp_head_job_failures_total": "Head jobs seen failed, ended or timed out, each once.",
    "vllmdp_time_to_serving_seconds": "From a resource's creation to its first Serving phase.",
    "vllmdp_resource_phase": "1 for each resource, labelled with its namespace, name and phase.",
    "vllmdp_resource_launch_attempts": "Head jobs created for a resource so far "
    "(status.launchAttempts).",
    "vllmdp_resource_consecutive_failures": "Head-job failures of a resource since it last "
    "served (status.consecutiveFailures).",
    "vllmdp_engine_requests_running": "Requests running on a DP rank of a Serving resource, at "
    "the operator's last read of its vLLM /metrics; labelled with namespace, name and rank.",
    "vllmdp_engine_requests_waiting": "Requests waiting on a DP rank, at the operator's last read.",
    "vllmdp_engine_kv_cache_usage": "KV-cache use of a DP rank, 0 to 1, at the operator's last "
    "read.",
    "vllmdp_lora_adapter_replicas": "Routed replicas whose engines serve a LoRA adapter of "
    "spec.lora (status.lora); labelled with namespace, name and adapter.",
    "vllmdp_lora_adapter_failed": "1 while a LoRA adapter's last load failed (its error is in "
    "status.lora and the LoRAReady condition), else 0.",
    "vllmdp_watch_ready": "1 while a child kind is listed and served (not refused with 404 or "
    "403), else 0; labelled with the kind, e.g. rayclusters.ray.io/v1.",
    "vllmdp_watch_failures_total": "Failed LISTs and WATCHes of a child kind, by reason: "
    "KindNotServed (404), WatchForbidden (403), ApiError, Unreachable.",
}


Key = tuple[str, str]
#: One replica of a resource: whose per-rank load a probe read.
LoadKey = tuple[str, str, int]


class ResourceCollector(Collector):
    """Gauges read at scrape time from a callback listing (namespace, name) and status."""

    def __init__(self, resources: Callable[[], Iterable[tuple[Key, Mapping[str, Any]]]]) -> None:
        self._resources = resources

    def collect(self) -> Iterator[Metric]:
        """Counts by phase (every known phase present, 0 when empty), and per resource its
        phase, head jobs created, failures since it last served, and its LoRA adapters."""
        phases: dict[str, int] = dict.fromkeys(PHASES, 0)
        phase = GaugeMetricFamily("vllmdp_resource_phase", NAMES["vllmdp_resource_phase"],
                                  labels=["namespace", "name", "phase"])  # fmt: skip
        launches = GaugeMetricFamily("vllmdp_resource_launch_attempts",
                                     NAMES["vllmdp_resource_launch_attempts"],
                                     labels=["namespace", "name"])  # fmt: skip
        failures = GaugeMetricFamily("vllmdp_resource_consecutive_failures",
                                     NAMES["vllmdp_resource_consecutive_failures"],
                                     labels=["namespace", "name"])  # fmt: skip
        served, failed = (GaugeMetricFamily(n, NAMES[n], labels=["namespace", "name", "adapter"])
                          for n in ("vllmdp_lora_adapter_replicas",
                                    "vllmdp_lora_adapter_failed"))  # fmt: skip
        for (ns, name), status in self._resources():
            now = str(status.get("phase") or PHASE_NONE)
            phases[now] = phases.get(now, 0) + 1
            phase.add_metric([ns, name, now], 1.0)
            launches.add_metric([ns, name], float(status.get("launchAttempts") or 0))
            failures.add_metric([ns, name], float(status.get("consecutiveFailures") or 0))
            for adapter in (status.get("lora") or {}).get("adapters") or []:
                labels = [ns, name, str(adapter.get("name"))]
                served.add_metric(labels, float(len(adapter.get("replicas") or [])))
                failed.add_metric(labels, 1.0 if adapter.get("error") else 0.0)
        counts = GaugeMetricFamily("vllmdp_resources", NAMES["vllmdp_resources"],
                                   labels=["phase"])  # fmt: skip
        for name, n in sorted(phases.items()):
            counts.add_metric([name], float(n))
        yield from (counts, phase, launches, failures, served, failed)


class EngineLoadCollector(Collector):
    """Per-rank load of the Serving resources, as the reconciles last read it from vLLM.

    Kept out of status (a write per probe, engines/load_summary.py); a resource's series go
    when it stops Serving or is deleted (only resources the owner cache lists are shown).
    """

    def __init__(
        self, loads: Mapping[LoadKey, Mapping[int, Any]],
        resources: Callable[[], Iterable[tuple[Key, Mapping[str, Any]]]],
    ) -> None:  # fmt: skip
        self._loads, self._resources = loads, resources

    def collect(self) -> Iterator[Metric]:
        """Three gauges per rank: running, waiting, KV-cache use."""
        labels = ["namespace", "name", "replica", "rank"]
        running, waiting, kv = (
            GaugeMetricFamily(n, NAMES[n], labels=labels)
            for n in ("vllmdp_engine_requests_running", "vllmdp_engine_requests_waiting",
                      "vllmdp_engine_kv_cache_usage")
        )  # fmt: skip
        known = {key for key, _status in self._resources()} if self._loads else set()
        for key, loads in list(self._loads.items()):
            if key[:2] not in known:
                continue
            for rank, load in sorted(loads.items()):
                at = [key[0], key[1], str(key[2]), str(rank)]
                running.add_metric(at, float(load.running))
                waiting.add_metric(at, float(load.waiting))
                kv.add_metric(at, float(load.kv_cache_usage))
        yield from (running, waiting, kv)


@dataclass(frozen=True)
class WatchState:
    """One child kind's watch, as the metrics show it."""

    kind: str
    ready: bool
    failures: Mapping[str, int]


class WatchCollector(Collector):
    """The reflectors' state, read at scrape time from a callback."""

    def __init__(self, watches: Callable[[], Iterable[WatchState]]) -> None:
        self._watches = watches

    def collect(self) -> Iterator[Metric]:
        """vllmdp_watch_ready per kind, and the failed attempts per kind and reason."""
        ready = GaugeMetricFamily("vllmdp_watch_ready", NAMES["vllmdp_watch_ready"],
                                  labels=["kind"])  # fmt: skip
        failures = CounterMetricFamily("vllmdp_watch_failures",
                                       NAMES["vllmdp_watch_failures_total"],
                                       labels=["kind", "reason"])  # fmt: skip
        for watch in self._watches():
            ready.add_metric([watch.kind], 1.0 if watch.ready else 0.0)
            for reason, n in sorted(watch.failures.items()):
                failures.add_metric([watch.kind, reason], float(n))
        yield from (ready, failures)


class OperatorMetrics:
    """The operator's metrics, each on this object's own registry."""

    def __init__(
        self, resources: Callable[[], Iterable[tuple[Key, Mapping[str, Any]]]] | None = None,
        watches: Callable[[], Iterable[WatchState]] | None = None,
    ) -> None:  # fmt: skip
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.reconciles = Counter("vllmdp_reconcile", NAMES["vllmdp_reconcile_total"],
                                  ["result"], registry=reg)  # fmt: skip
        for result in RESULTS:
            self.reconciles.labels(result)  # present at 0 before the first reconcile
        self.errors = Counter("vllmdp_reconcile_errors", NAMES["vllmdp_reconcile_errors_total"],
                              registry=reg)  # fmt: skip
        self.duration = Histogram("vllmdp_reconcile_duration_seconds",
                                  NAMES["vllmdp_reconcile_duration_seconds"],
                                  buckets=RECONCILE_BUCKETS, registry=reg)  # fmt: skip
        self.launches = Counter("vllmdp_head_job_launches",
                                NAMES["vllmdp_head_job_launches_total"], registry=reg)
        self.failures = Counter("vllmdp_head_job_failures",
                                NAMES["vllmdp_head_job_failures_total"], registry=reg)
        self.time_to_serving = Histogram("vllmdp_time_to_serving_seconds",
                                         NAMES["vllmdp_time_to_serving_seconds"],
                                         buckets=SERVING_BUCKETS, registry=reg)  # fmt: skip
        reg.register(ResourceCollector(resources or list))
        reg.register(WatchCollector(watches or list))
        #: Per-rank load by resource, from the probe pool's latest /metrics reads.
        self._engine_loads: dict[LoadKey, Mapping[int, Any]] = {}
        reg.register(EngineLoadCollector(self._engine_loads, resources or list))

    def set_engine_loads(self, key: LoadKey, loads: Mapping[int, Any] | None) -> None:
        """Keep the per-rank load of one replica that the probe pool read last; None once it
        probes that replica no more (it neither launches nor serves, or is gone)."""
        if loads is not None:
            self._engine_loads[key] = dict(loads)
        else:
            self._engine_loads.pop(key, None)

    def forget(self, key: Key) -> None:
        """A deleted resource's load goes with it."""
        for load_key in [k for k in self._engine_loads if k[:2] == key]:
            self._engine_loads.pop(load_key, None)

    def reconciled(self, result: str, seconds: float) -> None:
        """Count one reconcile and its duration."""
        self.reconciles.labels(result).inc()
        if result == RESULT_ERROR:
            self.errors.inc()
        self.duration.observe(seconds)

    def observe(self, before: Mapping[str, object], outcome: Outcome,
                created: str | None, now: datetime) -> None:  # fmt: skip
        """Count what one reconcile did, from the status it read and the outcome it made."""
        reasons = [e.reason for e in outcome.events]
        self.launches.inc(sum(r in LAUNCH_REASONS for r in reasons))
        self.failures.inc(sum(r in FAILURE_REASONS for r in reasons))
        first_serving = not before.get("servedJob") and outcome.status.get("servedJob")
        born = parse_rfc3339(created)
        if first_serving and born is not None:
            self.time_to_serving.observe(max(0.0, (now - born).total_seconds()))


def result_of(outcome: Outcome | None) -> str:
    """A reconcile that returned: requeue when it asked for a time-based step, else success."""
    if outcome is not None and outcome.retry_after is not None:
        return RESULT_REQUEUE
    return RESULT_SUCCESS
