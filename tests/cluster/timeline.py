"""A launch's timeline on the real-node bed, each step from its own witness.

- pods running: the containers' `startedAt` (whole seconds, the kubelet's);
- Ray joined: each live Ray node's `start_time_ms` in Ray's state API (the raylet's start);
- exec: the launcher's `stage=engine-starting` line, written as it starts `vllm serve`;
- healthy: its `stage=serving` line, at vLLM's first 200 on /health (polled every 0.25 s);
- routed: the moment a watch of the API Service's EndpointSlice saw its endpoint turn ready.

Between the join and the exec, the steps in between (`Launch.steps`): the last Ray pod's
Ready condition and the head job's creation (both whole seconds, the API server's), its
submission to Ray (the Ray job's `start_time`, which KubeRay's submit sets), then the
launcher's `connecting` and `preflight` lines.

Stage lines come from the head container's log, where the launcher reports for the operator
(vllm_dp_launcher.report); every clock is this host's (the bed's nodes share it).
"""

from __future__ import annotations

import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from vllm_dp_launcher.stages import (
    CONNECTING,
    ENGINE_STARTING,
    MARKER,
    PREFLIGHT,
    SERVING,
    parse_stage_lines,
)

__all__ = ["CONNECTING", "ENGINE_STARTING", "PREFLIGHT", "SERVING"]


@dataclass
class RouteWatch:
    """`kubectl get -w` of one EndpointSlice: when its endpoints' readiness changed."""

    argv: list[str]
    seen: list[tuple[float, str]] = field(default_factory=list)
    proc: subprocess.Popen[str] | None = None

    def start(self) -> RouteWatch:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.seen.append((time.time(), raw.strip()))

    def routed_after(self, after: float) -> float | None:
        """When the endpoint first turned ready after `after` (epoch seconds)."""
        was = None
        for at, state in self.seen:
            ready = "true" in state.split()
            if at >= after and ready and was is False:
                return at
            was = ready
        return None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


#: kube-proxy's minimum sync period (its default, which the bed keeps) plus the time to write
#: the rules: how long after an EndpointSlice change a node may still route the old way.
KUBE_PROXY_SYNC_S = 1.5
#: A watch line of each endpoint's readiness: `true false`.
READY = "{.endpoints[*].conditions.ready}"
#: A watch line of the endpoints' addresses, then their readiness in the same order:
#: `10.0.1.5 10.0.2.7|true false` (a `{range}` template ends `kubectl get --watch` after its
#: first line).
READY_BY_ADDRESS = "{.endpoints[*].addresses[0]}|{.endpoints[*].conditions.ready}"


def ready_addresses(state: str) -> set[str]:
    """The ready endpoints' addresses in one line of a READY_BY_ADDRESS watch (the operator
    writes `ready` on every endpoint, so the two lists line up)."""
    addresses, _, ready = state.partition("|")
    return {a for a, r in zip(addresses.split(), ready.split(), strict=False) if r == "true"}


def route_watch(kubectl: list[str], ns: str, name: str, fields: str = READY,
                kind: str = "endpointslices") -> RouteWatch:  # fmt: skip
    """Watch `name` (an EndpointSlice, or another `kind`), one line per change in the form of
    `fields` (a jsonpath); it may not exist yet: a field selector lists none then."""
    return RouteWatch([*kubectl, "get", kind, "-n", ns, "--watch",
                       f"--field-selector=metadata.name={name}", "-o",
                       f"jsonpath={fields}{{\"\\n\"}}"]).start()  # fmt: skip


def stage_times(log: str, job: str) -> dict[str, float]:
    """The first time of each stage the launcher of `job` reported, epoch seconds."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        if MARKER not in line:
            continue
        parsed = parse_stage_lines(line)
        if not parsed or parsed[0].fields.get("job") != job:
            continue
        logged = line[: line.index(" vllm-dp-launcher")].strip()
        at = datetime.strptime(logged, "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=UTC).timestamp()
        out.setdefault(parsed[0].name, at)
    return out


def stamp(value: str) -> float:
    """An API timestamp (`2026-12-03T09:10:11Z`) as epoch seconds."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def started_at(pods: list[dict[str, Any]]) -> float:
    """When the last of these pods' containers started (epoch seconds)."""
    times = []
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            started = ((cs.get("state") or {}).get("running") or {}).get("startedAt")
            if started:
                times.append(stamp(started))
    return max(times)


def ready_at(pods: list[dict[str, Any]]) -> float:
    """When the last of these pods turned Ready (epoch seconds, whole ones)."""
    return max(stamp(cond["lastTransitionTime"]) for pod in pods
               for cond in (pod.get("status") or {}).get("conditions") or []
               if cond.get("type") == "Ready" and cond.get("status") == "True")  # fmt: skip


def created_at(obj: dict[str, Any]) -> float:
    """An object's creationTimestamp (epoch seconds, whole ones)."""
    return stamp(obj["metadata"]["creationTimestamp"])


def last_join(nodes: list[dict[str, Any]]) -> float:
    """When the last live Ray node started (Ray's state API, epoch seconds)."""
    return max(n["start_time_ms"] / 1000 for n in nodes if n.get("state") == "ALIVE")


@dataclass
class Launch:
    """One launch's steps, epoch seconds (None where the step did not happen in it)."""

    label: str
    applied: float
    pods_running: float | None
    joined: float | None
    exec_: float
    healthy: float
    #: None where the route did not move on the health (a Surge waits for a completion).
    routed: float | None
    #: Steps between the join and the exec, in order: name -> epoch seconds.
    steps: dict[str, float] = field(default_factory=dict)

    def steps_row(self) -> str:
        """The join-to-exec steps, each from the one before (`-` without a join)."""
        if self.joined is None:
            return f"| {self.label} |" + " - |" * (len(STEPS) + 1)
        cells, at = [], self.joined
        for name in STEPS:
            step = self.steps.get(name)
            cells.append("-" if step is None else f"{(step - at) * 1000:.0f} ms")
            at = step if step is not None else at
        cells.append(f"{(self.exec_ - at) * 1000:.0f} ms")
        return f"| {self.label} | " + " | ".join(cells) + " |"

    def row(self) -> str:
        def d(a: float | None, b: float | None) -> str:
            return "-" if a is None or b is None else f"{(b - a) * 1000:.0f} ms"
        return (f"| {self.label} | {d(self.applied, self.pods_running)} | "
                f"{d(self.pods_running, self.joined)} | {d(self.joined, self.exec_)} | "
                f"{d(self.exec_, self.healthy)} | {d(self.healthy, self.routed)} |")

    @property
    def join_to_exec_ms(self) -> float | None:
        return None if self.joined is None else (self.exec_ - self.joined) * 1000

    @property
    def health_to_routed_ms(self) -> float | None:
        return None if self.routed is None else (self.routed - self.healthy) * 1000


HEADER = ("| launch | apply → pods running | → Ray joined | → exec | → first healthy | "
          "→ routed |\n|---|---|---|---|---|---|")


#: The steps between the last join and the exec, in the order they happen.
SUBMITTED = "submitted to Ray"
STEPS = ("pods Ready", "head job created", SUBMITTED, CONNECTING, PREFLIGHT)
STEPS_HEADER = ("| launch | join → pods Ready (s) | → head job created (s) | → submitted to Ray "
                "| → launcher connecting | → preflight | → exec |\n|---|---|---|---|---|---|---|")


#: The steps a floor is measured by hand for (test_p5_floor_of_each_step_by_hand), with the
#: span of a launch each one bounds from below.
FLOOR_STEPS = (("pods running", "apply → pods running", "applied", "pods_running"),
               ("Ray joined", "pods running → Ray joined", "pods_running", "joined"),
               ("first healthy", "exec → first healthy", "exec_", "healthy"))  # fmt: skip


def floors_table(launches: list[Launch], by_hand: dict[str, float]) -> str:
    """Per step: the launches' times (ms) and the floor measured by hand beside them."""
    rows = ["| step | launches (ms) | floor by hand (ms) |", "|---|---|---|"]
    for key, label, start, end in FLOOR_STEPS:
        spans = [(b - a) * 1000 for la in launches
                 if (a := getattr(la, start)) is not None and (b := getattr(la, end)) is not None]
        floor = by_hand.get(key)
        rows.append(f"| {label} | {', '.join(f'{x:.0f}' for x in spans) or '-'} | "
                    f"{'-' if floor is None else f'{floor:.0f}'} |")
    return "\n".join(rows)


def summary(launches: list[Launch]) -> dict[str, Any]:
    """The p5 keys: medians over the launches that had each step."""
    joins = [x for la in launches if (x := la.join_to_exec_ms) is not None]
    routed = [x for la in launches if (x := la.health_to_routed_ms) is not None]
    return {
        "p5_join_to_exec_ms": round(statistics.median(joins)) if joins else None,
        "p5_join_to_exec_samples": [round(x) for x in joins],
        "p5_health_to_routed_ms": round(statistics.median(routed)) if routed else None,
        "p5_health_to_routed_samples": [round(x) for x in routed],
    }


