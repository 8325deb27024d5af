"""At rest the operator writes nothing, even while KubeRay keeps writing its RayClusters.

Every RayCluster event wakes its owner's reconcile, as it should: a write by KubeRay may be
news. A reconcile that finds nothing changed must then write nothing. A handful of suspended
resources converge, then KubeRay writes their clusters in one of two ways, and the test counts
the operator's writes in the API server's audit log (by its User-Agent, Lease excluded):
- `kuberay-late`: KubeRay frozen (SIGSTOP) while the resources converge, then thawed, so it
  writes each cluster's first status at rest, as at 10,000 resources, where it lagged by many
  minutes;
- `kuberay-rewrites`: the test plays KubeRay's rewrites of a converged cluster (a new
  `lastUpdateTime`, a state transition time, an annotation), three rounds.
Any write fails the test, printing it and the status keys that moved between two versions of
a resource (from the test's own watch). `VDP_AT_REST_N` sets how many resources (8).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client, config
from operator_proc import OperatorProcess
from scenario import run_operator
from vllm_dp_operator import constants as c
from vllm_dp_operator.controller.kube import RAYCLUSTER, VDP, ApiKube

sys.path.append(str(Path(__file__).resolve().parents[1] / "testbed"))
import faults

pytestmark = pytest.mark.controlplane

N = int(os.environ.get("VDP_AT_REST_N", "8"))
SPEC = {"model": "bench/model", "dataParallel": {"size": 2, "ranksPerNode": 2}, "suspend": True}
QUIET = {"VLLMDP_RESYNC_SECONDS": "3600", "VLLMDP_HEALTH_PROBE": "off"}
WRITE_VERBS = ("create", "update", "patch", "delete", "deletecollection")
#: Seconds of rest counted: long enough for every wake to have been reconciled and written.
REST = 30


@pytest.fixture(scope="module")
def rest_operator(testbed: Any, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[OperatorProcess]:  # fmt: skip
    yield from run_operator(testbed, tmp_path_factory, QUIET)


def _writes(testbed: Any, identity: str, since: datetime) -> list[str]:
    """The operator's writes since `since` in the audit log, one line each, Lease excluded."""
    out = []
    path = testbed.state_dir / "logs" / "audit.log"
    for line in path.read_text(errors="replace").splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        ref = ev.get("objectRef") or {}
        if (identity not in (ev.get("userAgent") or "") or ev.get("verb") not in WRITE_VERBS
                or ref.get("resource") == "leases"):  # fmt: skip
            continue
        at = datetime.fromisoformat(ev["requestReceivedTimestamp"].replace("Z", "+00:00"))
        if at >= since:
            out.append(f"{ev['requestReceivedTimestamp']} {ev['verb']} {ref.get('resource')}"
                       f"/{ref.get('subresource') or ''} {ref.get('name')}")
    return out


def _moved(a: dict[str, Any], b: dict[str, Any], path: str = "status") -> list[str]:
    """The paths whose values differ between two JSON documents."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += _moved(a.get(key), b.get(key), f"{path}.{key}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [p for i, (x, y) in enumerate(zip(a, b, strict=True))
                for p in _moved(x, y, f"{path}[{i}]")]  # fmt: skip
    return [] if a == b else [f"{path}: {a!r} -> {b!r}"]


class StatusWatch:
    """Every version of each resource's status in a namespace, from our own watch."""

    def __init__(self, raw: client.ApiClient, ns: str) -> None:
        self.raw, self.ns = raw, ns
        self.versions: dict[str, list[dict[str, Any]]] = {}
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> StatusWatch:
        self._task = asyncio.create_task(self._follow())
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _follow(self) -> None:
        resp = await self.raw.call_api(
            VDP.collection(self.ns), "GET", query_params=[("watch", "true")],
            header_params={"Accept": "application/json"}, auth_settings=["BearerToken"],
            _preload_content=False)  # fmt: skip
        try:
            async for line in resp.content:
                obj = json.loads(line).get("object") or {}
                name = (obj.get("metadata") or {}).get("name")
                if name:
                    self.versions.setdefault(name, []).append(obj.get("status") or {})
        finally:
            resp.release()

    def moves(self, since: dict[str, int]) -> list[str]:
        """What moved in each status after the first `since[name]` versions."""
        out = []
        for name, versions in sorted(self.versions.items()):
            for i in range(max(1, since.get(name, 0)), len(versions)):
                out += [f"{name}: {m}" for m in _moved(versions[i - 1], versions[i])]
        return out


async def _until(what: str, check: Any, timeout: float, log: OperatorProcess) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s\n{log.log_tail()}")
        await asyncio.sleep(0.5)


def _reconciles(op: OperatorProcess) -> int:
    return int(op.counters().get("reconciles", 0))


async def _quiet(op: OperatorProcess, seconds: float = 12) -> None:
    """Until no reconcile ran for `seconds` (longer than any probe period here), by the
    controller's reconcile counter, read fresh from /debug/controller."""
    seen, last = _reconciles(op), time.monotonic()
    while time.monotonic() - last < seconds:
        await asyncio.sleep(0.5)
        now = _reconciles(op)
        if now != seen:
            seen, last = now, time.monotonic()


async def _kuberay_writes(api: ApiKube, ns: str, clusters: list[str], round_: int) -> None:
    """Play KubeRay's rewrites of a converged cluster's status: stamps that move, no news."""
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for name in clusters:
        await api.patch(RAYCLUSTER, ns, name,
                        {"metadata": {"annotations": {"test.vllmdp.io/touch": str(round_)}}})
        await api.patch_status(RAYCLUSTER, ns, name, {
            "lastUpdateTime": stamp, "observedGeneration": round_,
            "stateTransitionTimes": {"suspended": stamp}})  # fmt: skip


async def _create(api: ApiKube, ns: str, op: OperatorProcess) -> None:
    """N suspended resources, created 8 at a time, until every one says Suspended."""

    async def make(i: int) -> None:
        await api.create(VDP, ns, {"apiVersion": f"{c.GROUP}/{c.VERSION}", "kind": c.KIND,
                                   "metadata": {"name": f"s{i}", "namespace": ns},
                                   "spec": SPEC})  # fmt: skip

    for start in range(0, N, 8):
        await asyncio.gather(*(make(i) for i in range(start, min(N, start + 8))))

    async def suspended() -> bool:
        items = await api.list(VDP, ns, "")
        return len(items) == N and all((o.get("status") or {}).get("phase")
                                       == c.PHASE_SUSPENDED for o in items)  # fmt: skip

    await _until(f"{N} resources Suspended", suspended, 600, op)
    await _quiet(op)


async def _clusters_written(api: ApiKube, ns: str) -> bool:
    """Whether KubeRay has written a state into every RayCluster's status."""
    items = await api.list(RAYCLUSTER, ns, "")
    return len(items) == N and all((o.get("status") or {}).get("state") for o in items)


async def _scenario(testbed: Any, op: OperatorProcess, ns: str,
                    late_kuberay: bool) -> tuple[list[str], list[str]]:  # fmt: skip
    await config.load_kube_config(str(testbed.kubeconfig))
    async with client.ApiClient() as raw:
        api = ApiKube(raw)
        if late_kuberay:
            # As at 10,000 resources, where KubeRay wrote each cluster's first status many
            # minutes after the operator had converged it: every one of those writes wakes a
            # resource at rest.
            with faults.frozen(testbed.state_dir, "kuberay-operator"):
                await _create(api, ns, op)
                assert not await _clusters_written(api, ns)
                watch = await StatusWatch(raw, ns).__aenter__()
                await asyncio.sleep(1)  # the watch's ADDED events: the versions to compare with
                base = {k: len(v) for k, v in watch.versions.items()}
                since = datetime.now(UTC).replace(microsecond=0)
            await _until("KubeRay's status on every RayCluster",
                         lambda: _clusters_written(api, ns), 300, op)  # fmt: skip
        else:
            await _create(api, ns, op)
            clusters = [o["metadata"]["name"] for o in await api.list(RAYCLUSTER, ns, "")]
            assert len(clusters) == N, clusters
            watch = await StatusWatch(raw, ns).__aenter__()
            await asyncio.sleep(1)
            base = {k: len(v) for k, v in watch.versions.items()}
            since = datetime.now(UTC).replace(microsecond=0)
            for round_ in range(1, 4):
                await _kuberay_writes(api, ns, clusters, round_)
                await asyncio.sleep(REST / 3)
        try:
            await _quiet(op)
            await asyncio.sleep(2)  # an audit line is written after its answer
            return _writes(testbed, op.identity(), since), watch.moves(base)
        finally:
            await watch.__aexit__()


@pytest.mark.parametrize("late_kuberay", [True, False], ids=["kuberay-late", "kuberay-rewrites"])
def test_suspended_resources_at_rest_write_nothing_when_kuberay_writes(
    testbed: Any, rest_operator: OperatorProcess, testbed_namespace: str, late_kuberay: bool
) -> None:
    writes, moves = asyncio.run(_scenario(testbed, rest_operator, testbed_namespace,
                                          late_kuberay))  # fmt: skip
    assert not writes, (f"the operator wrote {len(writes)} times at rest:\n"
                        + "\n".join(writes[:40]) + "\nstatus keys that moved:\n"
                        + "\n".join(moves[:60]))  # fmt: skip
