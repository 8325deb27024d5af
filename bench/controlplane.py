"""Control-plane benchmark: the operator against direct writes and KubeRay, same API server.

P1   one suspended resource at a time: from a VLLMDataParallel's create returning to its
     NetworkPolicy and RayCluster seen on a watch (a suspended resource has no Service), vs.
     the same two creates issued directly (from the first create's start to both seen on the
     same watch).
P1b  a burst of N (200): total time from the burst's start to every child seen, the owners
     created by 8 writers, vs. the same N NetworkPolicy + RayCluster pairs created by 8
     writers.
     The floor's creates are sent as the operator's ServiceAccount, so the API server's
     priority and fairness treats them as it treats the operator's. A third mode, for context,
     writes each owner and then its pair directly, with the operator stopped.
P2   from a VLLMDataParallel create to its RayCluster seen, vs. KubeRay's own step: from a
     RayCluster create to its head pod seen.
P3   1,000 suspended resources in one namespace, created in steps (250, 500, 1,000): converge
     time per step; then at rest for 60 s: operator RSS, CPU and API requests (the operator's
     own FlowSchema); then a restart (the cache refills, every resource reconciled) and 60 s
     with a 60 s resync, which prices one resync reconcile.
P3 10k  the same at 10,000 (steps 2,500, 5,000, 10,000): converge time per step and per
     resource (linear growth: the per-resource time stays flat), RSS at rest and after a
     restart (the owner kind relisted by kopf, every resource reconciled once), API requests
     at rest. Its convergence is followed by light watches that keep a name and a moment per
     object, so the bench's own work stays flat as N grows.
P4   relaunch latency with backoff 0: from a head job's Failed status (seen on a watch; the
     benchmark writes it as KubeRay does, which on the test bed reaches no Ray dashboard) to
     the replacement head job seen.
Medians over rounds; both sides of each ratio in the same run. The last line printed is one
JSON object; the full results go to bench/results/<name>.json. Needs the test bed (started
through its CLI when none runs); starts and stops its own operator.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import aiohttp
from benchlib import (
    LEASES,
    REPO,
    STATE,
    BenchOperator,
    Testbed,
    audit_mark,
    audited,
    median,
    operator_requests,
    operator_requests_by_kind,
    pct,
)
from kubernetes_asyncio import client, config
from vllm_dp_operator import constants as c
from vllm_dp_operator.api.validation import validate
from vllm_dp_operator.config import Config, RenderOptions
from vllm_dp_operator.controller.kube import (
    NETWORKPOLICY,
    POD,
    RAYCLUSTER,
    RAYJOB,
    SERVICE,
    VDP,
    ApiKube,
)
from vllm_dp_operator.engines.jobstate import JobState, job_state
from vllm_dp_operator.plan import build_plan
from vllm_dp_operator.render import build_raycluster
from vllm_dp_operator.render.networkpolicy import build_network_policy
from watchlog import Seen, WatchLog

# Suspended: P1-P3 measure the operator and the API server, not kwok making pods.
SPEC = {"model": "bench/model", "dataParallel": {"size": 2, "ranksPerNode": 2}, "suspend": True}
RUNNING_SPEC = {**SPEC, "suspend": False}  # one GPU pod: the head
WRITERS = 8
#: P3 10k's settings. The resync is longer than the run (see p3_scale). The Lease's renew
#: deadline is 90 s, not 10 s: on this 2-core machine, during a burst of about 1,000 creates
#: a leader with the shipped 10 s failed to renew in time and exited (main's code too; see
#: docs/benchmarks.md), which ends the run. Renewals now run on a thread of their own
#: (controller/lease_thread.py); the 90 s stays until a 10k run shows the shipped 10 s holds.
P3_10K_SETTINGS = {"VLLMDP_RESYNC_SECONDS": "7200", "VLLMDP_LEASE_DURATION_SECONDS": "120",
                   "VLLMDP_RENEW_DEADLINE_SECONDS": "90"}  # fmt: skip


class Bench:
    """One run: the admin API client, the test bed, the operator under test."""

    def __init__(self, api: ApiKube, raw: client.ApiClient, tb: Testbed, op: BenchOperator,
                 as_operator: ApiKube) -> None:  # fmt: skip
        self.api, self.raw, self.tb, self.op = api, raw, tb, op
        #: The floor's writer: the operator's own ServiceAccount, so the API server's priority
        #: and fairness treats the floor's creates exactly as it treats the operator's.
        self.as_operator = as_operator

    def namespace(self, what: str) -> str:
        ns = f"bench-{what}-{uuid.uuid4().hex[:6]}"
        self.tb.kubectl("create", "namespace", ns)
        return ns

    def drop(self, ns: str) -> None:
        # Waited for, so that one scenario's garbage collection never overlaps the next.
        self.tb.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=900s")

    async def metrics(self) -> str:
        resp = await self.raw.call_api("/metrics", "GET", header_params={"Accept": "text/plain"},
                                       auth_settings=["BearerToken"], _preload_content=False)
        try:
            text: str = await resp.text()
            return text
        finally:
            resp.release()

    async def owner(self, ns: str, name: str, spec: dict[str, Any] = SPEC) -> None:
        await self.api.create(VDP, ns, {"apiVersion": f"{c.GROUP}/{c.VERSION}", "kind": c.KIND,
                                        "metadata": {"name": name, "namespace": ns},
                                        "spec": spec})  # fmt: skip

    @staticmethod
    def render_pair(ns: str, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The NetworkPolicy and RayCluster the operator would make for a suspended resource
        (which has no Service), rendered by its renderers."""
        model, opts = validate(name, SPEC), RenderOptions()
        policy = build_network_policy(name, ns, opts.peers, None)
        return policy, build_raycluster(name, ns, model, build_plan(model), opts, None)

    async def pair(self, ns: str, bodies: tuple[dict[str, Any], dict[str, Any]]) -> None:
        """The floor: the operator's two creates, issued directly (rendered beforehand), in
        its order (the policy first)."""
        await self.as_operator.create(NETWORKPOLICY, ns, bodies[0])
        await self.as_operator.create(RAYCLUSTER, ns, bodies[1])


def _instance(s: Seen) -> str | None:
    inst: str | None = (s.obj["metadata"].get("labels") or {}).get(c.LABEL_INSTANCE)
    return inst


def _added(log: WatchLog, kind: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in log.seen:
        if s.kind == kind and s.type == "ADDED" and (inst := _instance(s)):
            out.setdefault(inst, s.t)
    return out


#: The children a bench waits for: a running resource's RayCluster and Service; a suspended
#: one has no Service, and its NetworkPolicy stands in (P1, P1b: `SPEC` is suspended).
RUNNING_CHILDREN = (RAYCLUSTER, SERVICE)
SUSPENDED_CHILDREN = (NETWORKPOLICY, RAYCLUSTER)


def children_done(log: WatchLog, names: set[str],
                  kinds: tuple[Any, ...] = RUNNING_CHILDREN) -> dict[str, float] | None:
    """When each of `names` had every one of `kinds` (None until all have)."""
    seen = [_added(log, kind) for kind in kinds]
    if not all(names <= got.keys() for got in seen):
        return None
    return {n: max(got[n] for got in seen) for n in names}


async def writers(count: int, make: Callable[[int], Awaitable[None]]) -> None:
    """Run make(0..count-1) with WRITERS concurrent writers."""
    sem = asyncio.Semaphore(WRITERS)

    async def one(i: int) -> None:
        async with sem:
            await make(i)

    await asyncio.gather(*(one(i) for i in range(count)))


async def p1_unloaded(b: Bench, rounds: int, items: int) -> dict[str, Any]:
    rows = []
    for r in range(rounds):
        ns = b.namespace("p1")
        lat: dict[str, list[float]] = {"operator": [], "floor": []}
        async with WatchLog(b.api, ns, list(SUSPENDED_CHILDREN)) as log:
            for i in range(items):
                for mode in ("operator", "floor") if (i + r) % 2 == 0 else ("floor", "operator"):
                    name = f"{mode[0]}{i}"
                    if mode == "operator":
                        await b.owner(ns, name)
                        start = time.perf_counter()  # the object exists from here on
                    else:
                        bodies = b.render_pair(ns, name)
                        start = time.perf_counter()
                        await b.pair(ns, bodies)
                    await log.wait_until(f"children of {name}", lambda n=name: children_done(
                        log, {n}, SUSPENDED_CHILDREN) is not None, 30)  # fmt: skip
                    done = children_done(log, {name}, SUSPENDED_CHILDREN)
                    assert done is not None
                    lat[mode].append(done[name] - start)
                    await asyncio.sleep(0.3)  # the operator's status write and event settle
        b.drop(ns)
        row = {m: pct(v, 0.5) * 1000 for m, v in lat.items()}
        rows.append(row)
        print(f"P1 round {r}: operator p50 {row['operator']:.1f} ms, "
              f"floor p50 {row['floor']:.1f} ms", flush=True)  # fmt: skip
    op, floor = median(x["operator"] for x in rows), median(x["floor"] for x in rows)
    return {"rounds": rows, "operator_p50_ms": op, "floor_p50_ms": floor, "ratio_p50": op / floor}


async def _burst(b: Bench, mode: str, n: int) -> dict[str, float]:
    """One burst. operator: n owners; floor: n child pairs; owners+floor: each writer makes
    an owner then its pair, with the operator stopped (the user's writes plus the floor's)."""
    if mode == "owners+floor":
        b.op.stop()
    ns = b.namespace(f"p1b-{mode.replace('+', '-')}")
    async with WatchLog(b.api, ns, list(SUSPENDED_CHILDREN)) as log:
        names = {f"b{i}" for i in range(n)}
        pairs = [b.render_pair(ns, f"b{i}") for i in range(n)] if mode != "operator" else []
        cpu0 = b.op.cpu_seconds() if b.op.proc else 0.0
        start = time.perf_counter()

        async def owner_then_pair(i: int) -> None:
            await b.owner(ns, f"b{i}")
            await b.pair(ns, pairs[i])

        if mode == "operator":
            await writers(n, lambda i: b.owner(ns, f"b{i}"))
        elif mode == "floor":
            await writers(n, lambda i: b.pair(ns, pairs[i]))
        else:
            await writers(n, owner_then_pair)
        writes_done = time.perf_counter() - start
        await log.wait_until(f"all children ({mode})", lambda: children_done(
            log, names, SUSPENDED_CHILDREN) is not None, 600)  # fmt: skip
        done = children_done(log, names, SUSPENDED_CHILDREN)
        assert done is not None
        cpu = b.op.cpu_seconds() - cpu0 if b.op.proc else 0.0
    b.drop(ns)
    if mode == "owners+floor":
        b.op.start(**b.op.overrides)
    lat = [t - start for t in done.values()]
    # The bench's own creates (owners, or the floor's pairs) were all answered by writes_ms;
    # operator_cpu_s is what the operator process spent meanwhile (in either mode).
    return {"total_ms": max(lat) * 1000, "p50_ms": pct(lat, 0.5) * 1000,
            "p99_ms": pct(lat, 0.99) * 1000, "writes_ms": writes_done * 1000,
            "operator_cpu_s": cpu}  # fmt: skip


async def p1b_burst(b: Bench, rounds: int, n: int) -> dict[str, Any]:
    rows: list[dict[str, dict[str, float]]] = []
    for r in range(rounds):
        row = {}
        modes = ("operator", "floor", "owners+floor")
        for mode in modes if r % 2 == 0 else modes[::-1]:
            row[mode] = await _burst(b, mode, n)
            print(f"P1b round {r} {mode:12s} total {row[mode]['total_ms']:.0f} ms "
                  f"p50 {row[mode]['p50_ms']:.0f} ms, bench writes done at "
                  f"{row[mode]['writes_ms']:.0f} ms, operator CPU "
                  f"{row[mode]['operator_cpu_s']:.2f} s", flush=True)  # fmt: skip
        rows.append(row)
    out: dict[str, Any] = {"n": n, "rounds": rows}
    for mode in ("operator", "floor", "owners+floor"):
        for key in ("total_ms", "p50_ms", "p99_ms", "writes_ms", "operator_cpu_s"):
            out[f"{mode}_{key}"] = median(x[mode][key] for x in rows)
    out["ratio_total"] = out["operator_total_ms"] / out["floor_total_ms"]
    out["ratio_total_vs_owners_floor"] = out["operator_total_ms"] / out["owners+floor_total_ms"]
    out["ratio_p50"] = out["operator_p50_ms"] / out["floor_p50_ms"]
    return out


async def p2_kuberay(b: Bench, rounds: int) -> dict[str, Any]:
    ns = b.namespace("p2")
    ours, kuberay = [], []

    def head_pod(cluster: str) -> Callable[[Seen], bool]:
        return lambda s: (s.kind == POD and s.type == "ADDED"
                          and s.obj["metadata"]["labels"].get(c.LABEL_RAY_CLUSTER) == cluster
                          and s.obj["metadata"]["labels"].get(c.LABEL_RAY_NODE_TYPE) == "head")

    async with WatchLog(b.api, ns, [RAYCLUSTER, POD]) as log:
        for i in range(rounds):
            mark, start = len(log.seen), time.perf_counter()
            await b.owner(ns, f"o{i}")
            seen = await log.wait_for("our RayCluster", lambda s, n=f"o{i}": s.kind == RAYCLUSTER
                                      and _instance(s) == n, 30, since=mark)  # fmt: skip
            ours.append((seen.t - start) * 1000)
            model = validate(f"k{i}", RUNNING_SPEC)
            cluster = build_raycluster(f"k{i}", ns, model, build_plan(model), RenderOptions(),
                                       None)  # fmt: skip
            name = cluster["metadata"]["name"]
            mark, start = len(log.seen), time.perf_counter()
            await b.api.create(RAYCLUSTER, ns, cluster)
            seen = await log.wait_for("KubeRay's head pod", head_pod(name), 30, since=mark)
            kuberay.append((seen.t - start) * 1000)
            await b.api.delete(RAYCLUSTER, ns, name)
            print(f"P2 round {i}: ours {ours[-1]:.1f} ms, KubeRay {kuberay[-1]:.1f} ms",
                  flush=True)  # fmt: skip
            await asyncio.sleep(0.5)
    b.drop(ns)
    return {"ours_ms": median(ours), "kuberay_ms": median(kuberay), "ours_rounds_ms": ours,
            "kuberay_rounds_ms": kuberay}  # fmt: skip


async def p4_relaunch(b: Bench, rounds: int) -> dict[str, Any]:
    ns = b.namespace("p4")
    lat = []
    async with WatchLog(b.api, ns, [RAYJOB]) as log:
        await b.owner(ns, "relaunch", RUNNING_SPEC)
        job = await log.wait_for("the first head job", lambda s: s.type == "ADDED", 180)
        names = {job.name}
        for i in range(rounds):
            # The test bed's KubeRay never reaches a dashboard, so it never fails a head job by
            # itself: write the Failed status it writes when a Ray job fails.
            await b.api.patch_status(RAYJOB, ns, job.name, {
                "jobStatus": "FAILED", "jobDeploymentStatus": "Failed", "message": "bench"})
            failed = await log.wait_for(
                f"{job.name} failed", lambda s, n=job.name: s.name == n
                and job_state(s.obj) is JobState.FAILED, 60)  # fmt: skip
            job = await log.wait_for("the replacement", lambda s: s.type == "ADDED"
                                     and s.name not in names, 60)  # fmt: skip
            names.add(job.name)
            lat.append((job.t - failed.t) * 1000)
            print(f"P4 round {i}: relaunch {lat[-1]:.1f} ms after the failure", flush=True)
    b.drop(ns)
    return {"relaunch_ms": median(lat), "rounds_ms": lat}


#: Metadata only for children (their specs hold pod templates): what P3 needs is that one exists.
_META_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"


class Convergence:
    """When each P3 resource first had a phase, a RayCluster and a NetworkPolicy (suspended,
    it has no Service).

    Three watches of one namespace keep only a name and a moment per object (not the events),
    and a wait compares counts before it compares sets: the bench's own CPU and memory stay
    flat as N grows, so what the step measures is the operator. (`WatchLog` keeps every event
    and rescans it per event, which is quadratic at 10,000.)
    """

    def __init__(self, raw: client.ApiClient, namespaces: list[str]) -> None:
        # One namespace: watched alone. Several: watched across the cluster, and an object of
        # another namespace ignored (names are unique across them).
        self.raw, self.namespaces = raw, set(namespaces)
        self.scope = namespaces[0] if len(namespaces) == 1 else None
        self.first: dict[str, dict[str, float]] = {"phase": {}, "cluster": {}, "policy": {}}
        self._new = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Convergence:
        for what, kind in (("phase", VDP), ("cluster", RAYCLUSTER), ("policy", NETWORKPOLICY)):
            self._tasks.append(asyncio.create_task(self._follow(what, kind)))
        return self

    async def __aexit__(self, *_: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _follow(self, what: str, kind: Any) -> None:
        seen, rv = self.first[what], "0"
        accept = "application/json" if what == "phase" else _META_ONLY
        while True:
            resp = await self.raw.call_api(
                kind.collection(self.scope), "GET",
                query_params=[("watch", "true"), ("resourceVersion", rv),
                              ("allowWatchBookmarks", "true"), ("timeoutSeconds", "600")],
                header_params={"Accept": accept}, auth_settings=["BearerToken"],
                _preload_content=False, _request_timeout=aiohttp.ClientTimeout(sock_read=700))
            try:
                async for line in resp.content:
                    event = json.loads(line)
                    obj = event.get("object") or {}
                    meta = obj.get("metadata") or {}
                    rv = meta.get("resourceVersion") or rv
                    if event.get("type") == "ERROR":
                        rv = "0"  # a 410: start over; what was seen already keeps its moment
                    if event.get("type") not in ("ADDED", "MODIFIED"):
                        continue
                    if meta.get("namespace") not in self.namespaces:
                        continue
                    name = (meta["name"] if what == "phase"
                            else (meta.get("labels") or {}).get(c.LABEL_INSTANCE))
                    if name is None or name in seen:
                        continue
                    if what == "phase" and not (obj.get("status") or {}).get("phase"):
                        continue
                    seen[name] = time.perf_counter()
                    self._new.set()
            finally:
                resp.release()

    def done(self, names: set[str]) -> bool:
        """Whether every one of `names` has a phase, a RayCluster and a NetworkPolicy."""
        return all(len(d) >= len(names) and names <= d.keys() for d in self.first.values())

    async def wait(self, what: str, names: set[str], timeout: float) -> None:
        """Until `done(names)`; fail naming `what` and the counts after `timeout`."""
        deadline = time.monotonic() + timeout
        while not self.done(names):
            left = deadline - time.monotonic()
            if left <= 0:
                counts = {k: len(names & d.keys()) for k, d in self.first.items()}
                raise AssertionError(f"timed out after {timeout}s waiting for {what}: {counts}")
            self._new.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._new.wait(), timeout=min(left, 1.0))


async def _settle(b: Bench, quiet: float = 20, cap: float = 900) -> float:
    """Wait until the operator has reconciled nothing for `quiet` seconds; return the wait.

    After a step of P3, KubeRay goes on writing the new RayClusters' status for a while, and
    each write wakes the resource (as it should): that is not rest yet.
    """
    start = last_change = time.perf_counter()
    seen = b.op.health().get("reconciles", 0)
    while time.perf_counter() - last_change < quiet and time.perf_counter() - start < cap:
        await asyncio.sleep(1)
        now = b.op.health().get("reconciles", 0)
        if now != seen:
            seen, last_change = now, time.perf_counter()
    return time.perf_counter() - start


async def _restarted(b: Bench, n: int, start: float) -> tuple[float, float]:
    """Seconds from `start` until the restarted operator has reconciled `n` resources with
    none queued, and the longest it left /healthz unanswered meanwhile (its liveness probe's
    timeout is 5 s, and the chart allows three in a row). kopf keeps a probe's answer for
    10 s, so the first figure can be up to 10 s late."""
    answered = time.perf_counter()
    longest = 0.0
    while True:
        try:
            h = b.op.health()
        except (TimeoutError, OSError):  # a timed-out read, or the port not open yet
            longest = max(longest, time.perf_counter() - answered)
            await asyncio.sleep(0.5)
            continue
        longest, answered = max(longest, time.perf_counter() - answered), time.perf_counter()
        if h.get("reconciles", 0) >= n and not h.get("queued") and not h.get("in_flight"):
            return time.perf_counter() - start, longest
        await asyncio.sleep(0.5)


def _step_cpu(b: Bench) -> dict[str, float]:
    return {"operator": b.op.cpu_seconds(), "bench": time.process_time(), **b.tb.cpu_seconds()}


def _top(counts: dict[str, int], n: int = 12) -> dict[str, int]:
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:n])


async def _at_rest(b: Bench, seconds: float) -> dict[str, float]:
    text = await b.metrics()
    cpu0, req0 = b.op.cpu_seconds(), operator_requests(text)
    lease0 = operator_requests(text, LEASES)
    audit0 = audit_mark()
    if req0 == 0:
        raise RuntimeError("the operator's FlowSchema has counted no request: API figures void")
    health0 = b.op.health()
    rec0, refl0 = health0.get("reconciles", 0), health0.get("reflectors") or {}
    by_kind0 = operator_requests_by_kind(text)
    await asyncio.sleep(seconds)
    text = await b.metrics()
    cpu1, req1 = b.op.cpu_seconds(), operator_requests(text)
    lease = operator_requests(text, LEASES) - lease0
    writes = audited(audit0)
    health1 = b.op.health()
    rec1, refl1 = health1.get("reconciles", 0), health1.get("reflectors") or {}
    by_kind = {k: v - by_kind0.get(k, 0.0) for k, v in operator_requests_by_kind(text).items()}
    # Which requests, if any: per FlowSchema (reads fall in "other"), and the reflectors' own.
    reflectors = {kind: {k: n - refl0.get(kind, {}).get(k, 0) for k, n in row.items()}
                  for kind, row in refl1.items()}  # fmt: skip
    return {"cpu_pct": (cpu1 - cpu0) / seconds * 100, "api_rps": (req1 - req0) / seconds,
            "requests_by_schema": by_kind,
            # Whether the bed was at rest too (every client's writes in the window), and the
            # operator's own requests by verb and resource.
            "audited": _top(writes, 20),
            "reflector_requests": {k: v for k, v in reflectors.items() if any(v.values())},
            "api_requests": req1 - req0, "lease_requests": lease,
            "api_rps_without_lease": (req1 - req0 - lease) / seconds,
            "requests_before": req0, "cpu_s": cpu1 - cpu0,
            "reconciles": rec1 - rec0, "seconds": seconds}


async def p3_scale(b: Bench, sizes: list[int], rest: float, resync_window: bool = True,
                   namespaces: int = 1, converge_only: bool = False) -> dict[str, Any]:
    """Steps of suspended resources in one namespace (or `namespaces`, dealt round-robin); at
    rest; a restart.

    `resync_window`: after the restart, price one resync reconcile with 60 s of a 60 s resync
    (at 10,000 that window is a reconcile storm of its own: P3 10k skips it and reports the
    restart's own figures instead). `converge_only`: the steps alone (P3 steps).
    """
    if not resync_window:
        # At 10,000 the default 600 s resync (about 17 reconciles a second) begins before the
        # last step is created, and the operator is never at rest: its price per resource is
        # P3's `cpu_ms_per_resync_reconcile`. Here the safety net is pushed past the run.
        b.op.stop()
        b.op.start(**{**b.op.overrides, **P3_10K_SETTINGS})
    nss = [b.namespace("p3")] if namespaces == 1 else [
        b.namespace(f"p3n{j}") for j in range(namespaces)]
    steps = []
    async with Convergence(b.raw, nss) as conv:
        done_before = 0
        for size in sizes:
            names = {f"s{i}" for i in range(size)}
            cpu0 = _step_cpu(b)
            start = time.perf_counter()
            def create(i: int, d: int = done_before) -> Awaitable[None]:
                return b.owner(nss[(d + i) % len(nss)], f"s{d + i}")

            await writers(size - done_before, create)
            writes = time.perf_counter() - start
            await conv.wait(f"{size} resources converged", names, 3600)
            took = time.perf_counter() - start
            added = size - done_before
            # Where a step's time went as N grows: CPU per resource of the operator and of the
            # bed's components in the step (2 cores: their sum bounds the step from below).
            cpu_ms = {k: round((v - cpu0.get(k, 0.0)) / added * 1000, 1)
                      for k, v in _step_cpu(b).items()}  # fmt: skip
            steps.append({"n": size, "added": added, "seconds": took,
                          "per_resource_ms": took / added * 1000, "cpu_ms_per_resource": cpu_ms,
                          "writes_seconds": writes, "rss_mib": b.op.memory_mib()["VmRSS"]})
            print(f"P3 {size}: {size - done_before} more converged in {took:.1f} s "
                  f"({steps[-1]['per_resource_ms']:.0f} ms each; the bench's creates done at "
                  f"{writes:.1f} s), RSS {steps[-1]['rss_mib']:.0f} MiB, CPU ms per resource "
                  f"{cpu_ms}", flush=True)
            done_before = size
    if converge_only:
        _drop_all(b, nss, wait=not b.tb.started_here)
        return {"steps": steps, "namespaces": len(nss)}
    mark = audit_mark()
    # At 10,000 KubeRay (one reconcile at a time) writes the new clusters' status for many
    # minutes after the last step; the bed is at rest only once it is done.
    settle = await _settle(b, cap=900 if resync_window else 1800)
    settle_writes = _top(audited(mark))
    print(f"P3 settled {settle:.0f} s after converging; writes meanwhile: {settle_writes}",
          flush=True)  # fmt: skip
    rest_default = await _at_rest(b, rest)
    memory = b.op.memory_mib()
    print(f"P3 at rest: {rest_default}, memory {memory}", flush=True)
    # Restart: kopf relists the owner kind, the reflectors relist the children, and every
    # resource is reconciled once from the filled cache.
    b.op.stop()
    start = time.perf_counter()
    b.op.start(**({"VLLMDP_RESYNC_SECONDS": "60"} if resync_window else b.op.overrides))
    n = sizes[-1]
    restart_s, unanswered = await _restarted(b, n, start)
    print(f"P3 restarted: {n} resources reconciled in {restart_s:.1f} s; /healthz's longest "
          f"wait for an answer meanwhile {unanswered:.1f} s", flush=True)  # fmt: skip
    out: dict[str, Any] = {
        "steps": steps, "settle_seconds": settle, "settle_writes_by_user": settle_writes,
        "rss_mib": memory["VmRSS"], "peak_rss_mib": memory["VmHWM"],
        "idle_cpu_pct": rest_default["cpu_pct"], "api_rps": rest_default["api_rps"],
        "at_rest": rest_default, "restart_seconds": restart_s,
        "restart_healthz_unanswered_s": unanswered,
    }  # fmt: skip
    if resync_window:
        await asyncio.sleep(5)
        rest_resync = await _at_rest(b, rest)
        print(f"P3 restart {restart_s:.1f} s; with a 60 s resync: {rest_resync}", flush=True)
        # Each resource is reconciled once in the 60 s window with a 60 s resync: its CPU
        # over its reconciles prices one resync reconcile (an upper bound: idle CPU is in it).
        per_reconcile = rest_resync["cpu_s"] / max(1, rest_resync["reconciles"])
        out["with_60s_resync"] = rest_resync
        out["cpu_ms_per_resync_reconcile"] = per_reconcile * 1000
        out["idle_cpu_pct_with_default_resync"] = (
            rest_default["cpu_pct"] + n / Config().resync_seconds * per_reconcile * 100)
    else:
        await _settle(b)
        after = await _at_rest(b, rest)
        restarted = b.op.memory_mib()
        print(f"P3 restart {restart_s:.1f} s; then at rest: {after}, memory {restarted}",
              flush=True)  # fmt: skip
        out["after_restart"] = {**after, "rss_mib": restarted["VmRSS"],
                                "peak_rss_mib": restarted["VmHWM"]}  # fmt: skip
    # At 10,000 the garbage collector takes many minutes over the namespace: a test bed this
    # run started goes down with it, so nothing waits for that.
    if b.tb.started_here and not resync_window:
        b.op.stop()
    _drop_all(b, nss, wait=not (b.tb.started_here and not resync_window))
    return out


def _drop_all(b: Bench, namespaces: list[str], wait: bool) -> None:
    """Delete P3's namespaces; waited for unless the bed goes down with the run anyway (at
    10,000 the garbage collector takes many minutes over them)."""
    if wait:
        for ns in namespaces:
            b.drop(ns)
    else:
        b.tb.kubectl("delete", "namespace", *namespaces, "--wait=false")


def markdown(s: dict[str, Any]) -> str:
    p1, p1b, p2, p3, p4 = (s.get(k) for k in ("p1", "p1b", "p2", "p3", "p4"))
    p3k = s.get("p3_10k")
    rows = ["| Figure | Ours | Floor / KubeRay | Ratio | Goal |", "| --- | --- | --- | --- | --- |"]
    if p1:
        rows.append(f"| P1 one at a time, p50 | {p1['operator_p50_ms']:.1f} ms | "
                    f"{p1['floor_p50_ms']:.1f} ms | {p1['ratio_p50']:.2f} | <= 1.2 |")
    if p1b:
        rows.append(f"| P1b burst of {p1b['n']}, total | {p1b['operator_total_ms']:.0f} ms | "
                    f"{p1b['floor_total_ms']:.0f} ms | {p1b['ratio_total']:.2f} | <= 1.5 |")
        rows.append(f"| P1b vs. owners + children written directly | "
                    f"{p1b['operator_total_ms']:.0f} ms | {p1b['owners+floor_total_ms']:.0f} ms | "
                    f"{p1b['ratio_total_vs_owners_floor']:.2f} | context |")
    if p2:
        rows.append(f"| P2 create to first child | {p2['ours_ms']:.1f} ms | "
                    f"{p2['kuberay_ms']:.1f} ms | {p2['ours_ms'] / p2['kuberay_ms']:.2f} | <= 1 |")
    if p3:
        for st in p3["steps"]:
            rows.append(f"| P3 converge to N={st['n']} (+{st['added']}) | {st['seconds']:.1f} s "
                        f"({st['per_resource_ms']:.0f} ms each) | | | reported |")
        rows += [f"| P3 RSS at N={p3['steps'][-1]['n']} | {p3['rss_mib']:.0f} MiB "
                 f"(peak {p3['peak_rss_mib']:.0f}) | | | <= 160 MiB |",
                 f"| P3 idle CPU, 60 s | {p3['idle_cpu_pct']:.2f} % "
                 f"({p3['idle_cpu_pct_with_default_resync']:.2f} % with resync) | | | <= 1 % |",
                 f"| P3 API requests at rest | {p3['api_rps']:.3f} /s | | | <= 1 /s |"]
    if p3s := s.get("p3_steps"):
        for st in p3s["steps"]:
            cpu = st["cpu_ms_per_resource"]
            rows.append(f"| P3 steps, {p3s['namespaces']} namespace(s), converge to "
                        f"N={st['n']:,} (+{st['added']:,}) | {st['seconds']:.0f} s "
                        f"({st['per_resource_ms']:.0f} ms each; CPU ms each: {cpu}) | | | "
                        "linear |")
    if p3k:
        for st in p3k["steps"]:
            rows.append(f"| P3 10k converge to N={st['n']:,} (+{st['added']:,}) | "
                        f"{st['seconds']:.0f} s ({st['per_resource_ms']:.0f} ms each) | | | "
                        "linear |")
        after = p3k["after_restart"]
        rows += [f"| P3 10k RSS at rest, N={p3k['steps'][-1]['n']:,} | {p3k['rss_mib']:.0f} MiB "
                 f"(peak {p3k['peak_rss_mib']:.0f}) | | | <= 400 MiB |",
                 f"| P3 10k RSS after a restart | {after['rss_mib']:.0f} MiB (peak "
                 f"{after['peak_rss_mib']:.0f}; restart {p3k['restart_seconds']:.0f} s) | | | "
                 "<= 400 MiB |",
                 f"| P3 10k idle CPU, {p3k['at_rest']['seconds']:.0f} s | "
                 f"{p3k['idle_cpu_pct']:.2f} % | | | reported |",
                 f"| P3 10k API requests at rest | {p3k['api_rps']:.3f} /s, "
                 f"{p3k['at_rest']['api_rps_without_lease']:.3f} /s without the Lease "
                 f"({after['api_rps']:.3f} and {after['api_rps_without_lease']:.3f} /s after "
                 "the restart) | | | 0 /s |"]
    if p4:
        rows.append(f"| P4 relaunch, backoff 0 | {p4['relaunch_ms']:.0f} ms | | | <= 2000 ms |")
    return "\n".join(rows)


async def run(args: argparse.Namespace, tb: Testbed, op: BenchOperator) -> dict[str, Any]:
    await config.load_kube_config(str(tb.kubeconfig))
    sa_config = client.Configuration()
    await config.load_kube_config(str(op.kubeconfig), client_configuration=sa_config)
    out: dict[str, Any] = {"started": datetime.now(UTC).isoformat(timespec="seconds")}
    async with client.ApiClient() as raw, client.ApiClient(sa_config) as sa_raw:
        b = Bench(ApiKube(raw), raw, tb, op, ApiKube(sa_raw))
        out["settings"] = dict(op.settings)
        only = set(args.only.split(","))
        if "p2" in only:
            out["p2"] = await p2_kuberay(b, args.rounds_p2)
        if "p1" in only:
            out["p1"] = await p1_unloaded(b, args.rounds, args.items)
        if "p1b" in only:
            out["p1b"] = await p1b_burst(b, args.rounds, args.burst)
        if "p4" in only:
            out["p4"] = await p4_relaunch(b, args.rounds)
        if "p3" in only:
            out["p3"] = await p3_scale(b, [int(x) for x in args.sizes.split(",")], args.rest)
        if "p3_steps" in only:
            out["p3_steps"] = await p3_scale(b, [int(x) for x in args.sizes_steps.split(",")],
                                             args.rest, namespaces=args.p3_namespaces,
                                             converge_only=True)  # fmt: skip
        if "p3_10k" in only:
            out["p3_10k"] = await p3_scale(b, [int(x) for x in args.sizes_10k.split(",")],
                                           args.rest, resync_window=False)  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of P1, P1b and P4")
    parser.add_argument("--rounds-p2", type=int, default=5)
    parser.add_argument("--items", type=int, default=10, help="resources per P1 round")
    parser.add_argument("--burst", type=int, default=200, help="P1b burst size")
    parser.add_argument("--sizes", default="250,500,1000", help="P3 steps")
    parser.add_argument("--sizes-10k", default="2500,5000,10000", help="P3 10k steps")
    parser.add_argument("--sizes-steps", default="1000,2000,4000", help="P3 steps' steps")
    parser.add_argument("--p3-namespaces", type=int, default=1,
                        help="P3 steps: namespaces the resources are dealt over")
    parser.add_argument("--rest", type=float, default=60, help="P3 seconds at rest")
    parser.add_argument("--only", default="p1,p1b,p2,p3,p4",
                        help="parts to run; p3_10k (about 40 minutes) and p3_steps (converging "
                        "alone, in --p3-namespaces) only when named")
    parser.add_argument("--name", default="controlplane", help="bench/results/<name>.json")
    args = parser.parse_args()
    tb = Testbed()
    tb.ensure_up()
    op = BenchOperator(tb, STATE / "logs" / "bench-operator.log")
    op.setup()
    try:
        # P4 asks for backoff 0. No Ray dashboard runs on the test bed, so no stop can ever be
        # confirmed there: no confirmation wait either (on a real cluster the relaunch also
        # waits for the old Ray job's stop, at most its drain plus this setting).
        op.start(VLLMDP_BACKOFF_BASE_SECONDS="0", VLLMDP_STOP_CONFIRM_SECONDS="0")
        summary = asyncio.run(run(args, tb, op))
    finally:
        op.teardown()
        tb.down()
    results = REPO / "bench" / "results" / f"{args.name}.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(summary, indent=2) + "\n")
    print(markdown(summary), flush=True)
    keys = {"p1_ratio_p50": ("p1", "ratio_p50"), "p1b_ratio_total": ("p1b", "ratio_total"),
            "p2_ours_ms": ("p2", "ours_ms"), "p2_kuberay_ms": ("p2", "kuberay_ms"),
            "p3_rss_mib": ("p3", "rss_mib"), "p3_idle_cpu_pct": ("p3", "idle_cpu_pct"),
            "p3_api_rps": ("p3", "api_rps"), "p4_relaunch_ms": ("p4", "relaunch_ms")}  # fmt: skip
    line = {k: round(summary[a][b], 3) if a in summary else None for k, (a, b) in keys.items()}
    if "p3" in summary:
        line["p3_idle_cpu_pct_with_resync"] = round(
            summary["p3"]["idle_cpu_pct_with_default_resync"], 3)
        steps = summary["p3"]["steps"]
        line["p3_converge_s"] = {str(st["n"]): round(st["seconds"], 1) for st in steps}
    if "p3_steps" in summary:
        line["p3_steps_namespaces"] = summary["p3_steps"]["namespaces"]
        line["p3_steps_per_resource_ms"] = {str(st["n"]): round(st["per_resource_ms"], 1)
                                            for st in summary["p3_steps"]["steps"]}  # fmt: skip
    if "p3_10k" in summary:
        p3k = summary["p3_10k"]
        line["p3_10k_rss_mib"] = round(max(p3k["rss_mib"], p3k["after_restart"]["rss_mib"]), 1)
        line["p3_10k_converge_s"] = {str(st["n"]): round(st["seconds"], 1)
                                     for st in p3k["steps"]}  # fmt: skip
        line["p3_10k_per_resource_ms"] = {str(st["n"]): round(st["per_resource_ms"], 1)
                                          for st in p3k["steps"]}  # fmt: skip
        line["p3_10k_api_rps"] = round(max(p3k["api_rps"], p3k["after_restart"]["api_rps"]), 3)
        line["p3_10k_api_rps_without_lease"] = round(max(
            p3k["at_rest"]["api_rps_without_lease"],
            p3k["after_restart"]["api_rps_without_lease"]), 3)  # fmt: skip
    line["results"] = str(results.relative_to(REPO))
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
