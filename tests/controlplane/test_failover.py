"""Two operator processes and one Lease: the leader SIGKILLed in a burst, and a frozen leader.

Both processes run as shipped (leader election on, the chart's 15 s / 10 s / 2 s timings) and
share one Lease; a killed one is started again at once, as the kubelet restarts a container,
and becomes the standby. The resources are suspended, so what converges is the operator's own
work (status, RayCluster, NetworkPolicy; a suspended resource has no Service), not kwok making
pods. What each test reads, it reads from the API server: its own watch of the resources
(status never going backwards), the children and Events it lists at the end, and the API
server's audit log (the bed writes one for write requests, with each request's User-Agent,
which names the operator process).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client, config
from operator_proc import LEASE_NAMESPACE, OperatorProcess, install_crd
from vllm_dp_operator import constants as c
from vllm_dp_operator.controller.events import EVENT
from vllm_dp_operator.controller.kube import NETWORKPOLICY, RAYCLUSTER, VDP, ApiKube
from vllm_dp_operator.controller.lease import LEASE
from watchlog import WatchLog

pytestmark = pytest.mark.controlplane

SPEC = {"model": "ha/model", "dataParallel": {"size": 2, "ranksPerNode": 2}, "suspend": True}
BURST, ROUNDS, WRITERS = 50, 5, 8
#: Acceptance: a standby leads within this many seconds of the leader's death.
FAILOVER_BOUND = 20.0
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
# Probes and timings as the other scenarios; the Lease's timings stay the shipped ones.
HA_ENV = {"VLLMDP_HEALTH_PROBE": "off", "VLLMDP_PROBE_LAUNCHING_SECONDS": "3600",
          "VLLMDP_PROBE_SERVING_SECONDS": "3600"}


class Replicas:
    """Two operator processes electing one leader on a Lease of their own, watching only the
    test's namespace: another test's leftovers (a namespace still terminating) are not their
    work, and would make the moment of a freeze or a kill depend on them."""

    def __init__(self, testbed: Any, logs: Path, namespace: str) -> None:
        self.lease = f"vdp-ha-{os.urandom(4).hex()}"
        self.procs = [OperatorProcess(testbed.env(), logs / f"op-{i}.log", HA_ENV,
                                      lease_name=self.lease, pod_name=f"op-{i}")
                      for i in range(2)]  # fmt: skip
        for proc in self.procs:
            proc.namespace = namespace

    def __enter__(self) -> Replicas:
        for proc in self.procs:
            proc.start()
        return self

    def __exit__(self, *_: object) -> None:
        for proc in self.procs:
            if proc.proc is not None and proc.proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)  # a frozen one must hear the SIGTERM
            proc.stop()

    def by_identity(self, identity: str) -> OperatorProcess:
        (proc,) = [p for p in self.procs if p.proc is not None and p.identity() == identity]
        return proc

    def logs(self) -> str:
        return "\n".join(f"--- {p.log.name}\n{p.log_tail(4000)}" for p in self.procs)


async def _holder(api: ApiKube, lease: str) -> str:
    obj = await api.get(LEASE, LEASE_NAMESPACE, lease)
    return str(((obj or {}).get("spec") or {}).get("holderIdentity") or "")


async def _new_holder(api: ApiKube, lease: str, not_: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        holder = await _holder(api, lease)
        if holder and holder != not_:
            return holder
        await asyncio.sleep(0.1)
    raise AssertionError(f"no new Lease holder within {timeout}s (was {not_!r})")


async def _ready_standby(proc: OperatorProcess, timeout: float = 30) -> None:
    """Wait until /readyz answers 200 for a process that does not lead (synced, Lease API
    answering): what the chart's readiness probe asks of a standby."""
    deadline = time.monotonic() + timeout
    while True:
        code, body = await asyncio.to_thread(proc.readiness)
        if code == 200 and "standby" in body:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the standby is not ready: {code} {body}")
        await asyncio.sleep(0.5)


async def _create(api: ApiKube, ns: str, names: list[str], created: list[str],
                  at: tuple[int, Callable[[], None]] | None = None) -> None:  # fmt: skip
    """Create the resources with WRITERS concurrent writers; call `at[1]` right after the
    `at[0]`-th create returned (on a local API server a whole burst takes well under 1 s, so
    a poll from outside would only see it done)."""
    sem = asyncio.Semaphore(WRITERS)

    async def one(name: str) -> None:
        async with sem:
            await api.create(VDP, ns, {"apiVersion": f"{c.GROUP}/{c.VERSION}", "kind": c.KIND,
                                       "metadata": {"name": name}, "spec": SPEC})  # fmt: skip
            created.append(name)
            if at is not None and len(created) == at[0]:
                at[1]()

    await asyncio.gather(*(one(n) for n in names))


class Converged:
    """Which resources have a phase, a RayCluster and a NetworkPolicy, read off a watch log as
    it grows (each event looked at once)."""

    def __init__(self, log: WatchLog) -> None:
        self.log, self._seen = log, 0
        self.phased: set[str] = set()
        self.children: dict[Any, set[str]] = {RAYCLUSTER: set(), NETWORKPOLICY: set()}

    def __call__(self, names: set[str]) -> bool:
        for s in self.log.seen[self._seen:]:
            if s.kind == VDP and (s.obj.get("status") or {}).get("phase"):
                self.phased.add(s.name)
            elif s.kind in self.children and s.type == "ADDED":
                labels = s.obj["metadata"].get("labels") or {}
                self.children[s.kind].add(labels.get(c.LABEL_INSTANCE, ""))
        self._seen = len(self.log.seen)
        return names <= self.phased and all(names <= got for got in self.children.values())


def _status_went_backwards(log: WatchLog) -> list[str]:
    """Resources whose phase came back after it had changed, or whose observedGeneration or
    a condition's lastTransitionTime decreased, as seen on the watch."""
    phases: dict[str, list[str]] = defaultdict(list)
    last_gen: dict[str, int] = {}
    last_flip: dict[tuple[str, str], str] = {}
    bad = []
    for s in log.seen:
        if s.kind != VDP or s.type == "DELETED":
            continue
        st = s.obj.get("status") or {}
        if (phase := st.get("phase")) and (not phases[s.name] or phases[s.name][-1] != phase):
            if phase in phases[s.name]:
                bad.append(f"{s.name}: phase {phases[s.name]} then {phase} again")
            phases[s.name].append(phase)
        gen = int(st.get("observedGeneration") or 0)
        if gen < last_gen.get(s.name, 0):
            bad.append(f"{s.name}: observedGeneration {last_gen[s.name]} -> {gen}")
        last_gen[s.name] = max(gen, last_gen.get(s.name, 0))
        for cond in st.get("conditions") or []:
            key, flip = (s.name, cond["type"]), cond.get("lastTransitionTime") or ""
            if flip < last_flip.get(key, ""):
                bad.append(f"{s.name}: {cond['type']} lastTransitionTime went back to {flip}")
            last_flip[key] = max(flip, last_flip.get(key, ""))
    return bad


async def _duplicates(api: ApiKube, ns: str, log: WatchLog) -> dict[str, Any]:
    """Children per resource (listed, and ADDED on the watch) and Events posted twice."""
    out: dict[str, Any] = {}
    def ours(obj: dict[str, Any]) -> tuple[str, str] | None:
        # KubeRay's own objects (a head Service per RayCluster) are not the operator's. By
        # name: a resource has two NetworkPolicies, each made once.
        meta = obj["metadata"]
        labels = meta.get("labels") or {}
        return (labels.get(c.LABEL_INSTANCE, ""), meta["name"]) \
            if labels.get(c.LABEL_MANAGED_BY) == c.MANAGER else None  # fmt: skip

    for kind in (RAYCLUSTER, NETWORKPOLICY):
        listed = Counter(ours(o) for o in await api.list(kind, ns, ""))
        added = Counter(ours(s.obj) for s in log.seen if s.kind == kind and s.type == "ADDED")
        counts = listed + added
        counts.pop(None, None)
        out[kind.plural] = {n: k for n, k in counts.items() if k != 2}
        out[f"{kind.plural}_count"] = len(counts)
    events = Counter((e["involvedObject"].get("uid"), e["reason"], e["message"])
                     for e in await api.list(EVENT, ns, ""))  # fmt: skip
    out["events"] = [k for k, n in events.items() if n > 1]
    out["event_count"] = sum(events.values())
    return out


async def _kill_in_bursts(testbed: Any, ns: str, pair: Replicas) -> list[float]:
    await config.load_kube_config(str(testbed.kubeconfig))
    failovers: list[float] = []
    async with client.ApiClient() as raw:
        api = ApiKube(raw)
        holder = await _new_holder(api, pair.lease, "", 60)
        async with WatchLog(api, ns, [VDP, RAYCLUSTER, NETWORKPOLICY]) as log:
            converged = Converged(log)
            everyone: set[str] = set()
            for r in range(ROUNDS):
                leader = pair.by_identity(holder)
                (standby,) = [p for p in pair.procs if p is not leader]
                await _ready_standby(standby)
                names = [f"r{r}-{i:02d}" for i in range(BURST)]
                created: list[str] = []
                killed: list[tuple[float, int]] = []

                def kill(leader: OperatorProcess = leader, killed: list[Any] = killed,
                         created: list[str] = created) -> None:  # fmt: skip
                    os.kill(leader.pid, signal.SIGKILL)
                    killed.append((time.monotonic(), len(created)))

                burst = asyncio.create_task(_create(api, ns, names, created, (BURST // 3, kill)))
                while not killed:
                    await asyncio.sleep(0.01)
                killed_at, at_count = killed[0]
                await asyncio.to_thread(leader.kill)  # reap it
                holder = await _new_holder(api, pair.lease, holder, FAILOVER_BOUND + 10)
                failovers.append(time.monotonic() - killed_at)
                print(f"round {r}: killed the leader after {at_count} creates; a standby "
                      f"led {failovers[-1]:.1f}s later", flush=True)  # fmt: skip
                # The kubelet restarts it: the next round's standby.
                await asyncio.to_thread(leader.start)
                await burst
                everyone.update(names)
                await log.wait_until(f"round {r}: all {len(everyone)} resources converged",
                                     lambda e=everyone: converged(e), 120)  # type: ignore[misc]
            await asyncio.sleep(3)  # late writes of anyone would show now
            dup = await _duplicates(api, ns, log)
            back = _status_went_backwards(log)
    assert not dup["rayclusters"] and not dup["networkpolicies"], dup
    assert dup["rayclusters_count"] == ROUNDS * BURST, dup
    assert dup["networkpolicies_count"] == 2 * ROUNDS * BURST, dup
    assert not dup["events"], f"Events posted twice: {dup['events']}"
    assert dup["event_count"] > 0, "no Events at all: the check would prove nothing"
    assert not back, back
    return failovers


def test_sigkill_the_leader_in_bursts_of_50(testbed: Any, testbed_namespace: str,
                                             tmp_path: Path) -> None:  # fmt: skip
    install_crd(testbed)
    with Replicas(testbed, tmp_path, testbed_namespace) as pair:
        try:
            failovers = asyncio.run(_kill_in_bursts(testbed, testbed_namespace, pair))
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{pair.logs()}") from exc
    p50, worst = statistics.median(failovers), max(failovers)
    print(f"failover over {ROUNDS} SIGKILLs: p50 {p50:.1f}s, max {worst:.1f}s "
          f"({', '.join(f'{f:.1f}' for f in failovers)})", flush=True)  # fmt: skip
    assert worst < FAILOVER_BOUND, failovers


# ---------------------------------------------------------------------------- frozen leader


def _audit_writes(testbed: Any, identity: str) -> list[dict[str, Any]]:
    path = testbed.state_dir / "logs" / "audit.log"
    if not path.exists():
        pytest.fail(f"{path} missing: the test bed predates its audit policy; restart it "
                    "(`python tests/testbed/testbed.py down`)", pytrace=False)  # fmt: skip
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if identity in (ev.get("userAgent") or "") and ev.get("verb") in WRITE_VERBS:
            out.append(ev)
    return out


def _at(ev: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(ev["requestReceivedTimestamp"])


def _what(ev: dict[str, Any]) -> str:
    ref = ev.get("objectRef") or {}
    code = (ev.get("responseStatus") or {}).get("code")
    return (f"{ev['requestReceivedTimestamp']} {ev['verb']} {ref.get('resource')}"
            f"/{ref.get('subresource') or ''} {ref.get('namespace')}/{ref.get('name')} -> {code}")


async def _freeze(testbed: Any, ns: str, pair: Replicas) -> tuple[str, str]:
    await config.load_kube_config(str(testbed.kubeconfig))
    async with client.ApiClient() as raw:
        api = ApiKube(raw)
        old = await _new_holder(api, pair.lease, "", 60)
        frozen = pair.by_identity(old)
        async with WatchLog(api, ns, [VDP, RAYCLUSTER, NETWORKPOLICY]) as log:
            converged = Converged(log)
            first = [f"a{i}" for i in range(10)]
            await _create(api, ns, first, [])
            await log.wait_until("the first 10 converged", lambda: converged(set(first)),
                                 60)  # fmt: skip
            os.kill(frozen.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            second = [f"b{i}" for i in range(10)]
            await _create(api, ns, second, [])  # work for whoever leads next
            new = await _new_holder(api, pair.lease, old, FAILOVER_BOUND + 10)
            await log.wait_until("the next 10 converged under the new leader",
                                 lambda: converged(set(first + second)), 60)  # fmt: skip
            await asyncio.sleep(max(0.0, 30 - (time.monotonic() - stopped)))
            os.kill(frozen.pid, signal.SIGCONT)
            third = [f"c{i}" for i in range(10)]
            await _create(api, ns, third, [])  # more work, while the old process wakes up
            await log.wait_until("the last 10 converged", lambda: converged(
                set(first + second + third)), 60)  # fmt: skip
        assert frozen.proc is not None
        rc = await asyncio.to_thread(frozen.proc.wait, 30)
        assert rc == 1, f"the woken leader exited {rc}"
        assert "Leader election lost" in frozen.log_tail(20000), frozen.log_tail()
        await asyncio.sleep(2)
    return old, new


def test_a_frozen_leader_makes_no_write_after_the_new_leader_writes(
    testbed: Any, testbed_namespace: str, tmp_path: Path
) -> None:
    install_crd(testbed)
    with Replicas(testbed, tmp_path, testbed_namespace) as pair:
        try:
            old, new = asyncio.run(_freeze(testbed, testbed_namespace, pair))
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{pair.logs()}") from exc
    # Every attempt of the old process counts, refused ones too; of the new one, what it wrote.
    old_writes = _audit_writes(testbed, old)
    new_writes = [e for e in _audit_writes(testbed, new)
                  if (e.get("responseStatus") or {}).get("code", 500) < 400]  # fmt: skip
    assert old_writes, "no audited write by the first leader: the audit check sees nothing"
    assert new_writes, "no audited write by the new leader"
    first_new = min(_at(e) for e in new_writes)
    late = [_what(e) for e in old_writes if _at(e) >= first_new]
    assert not late, "the old leader wrote after the new leader's first write:\n" + "\n".join(
        late)
    # The new leader's first write is its takeover of the Lease.
    (takeover,) = [e for e in new_writes if _at(e) == first_new]
    assert (takeover["objectRef"]["resource"], takeover["verb"]) == ("leases", "update"), \
        _what(takeover)  # fmt: skip
    print(f"old leader: {len(old_writes)} writes, the last at "
          f"{max(_at(e) for e in old_writes).isoformat()}; new leader's first at "
          f"{first_new.isoformat()}", flush=True)  # fmt: skip
