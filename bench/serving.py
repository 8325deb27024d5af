"""Serving benchmark (P7): the operator with N resources Serving while the engines' load moves,
then with 100 engines hung.

Each resource is DP=8 in one pod of 8 GPUs on the kwok bed (extra fake GPU nodes are added for
the run and removed after it); KubeRay makes its pods, the operator its head job. One engine
test double (tests/doubles/engine_fleet.py) runs in the bed's pod network and answers /health
and a vLLM 0.33 /metrics of 8 ranks (about 290 KiB) for every head pod IP; each engine's load is
redrawn at every read, and its level shifts now and then. The operator runs as shipped
(probes every 30 s while Serving, through the API server's service proxy, the only way to a
pod IP from outside the pod network).

Steady state, in windows of --window s (medians over --windows, spread min-max):
  operator CPU (% of one core), RSS; its API requests by FlowSchema: writes/s (creates,
  patches, deletes, Events; status writes counted apart), service-proxy requests/s (the
  probes as the API server sees them); the double's GETs/s and their service time
  (handler start to last byte handed to the kernel, p50/p99), and its level changes/s.
Hang: 100 engines answer nothing for 10 s; meanwhile a new resource is created every 2 s
  (in a namespace of its own) and timed from its create returning to its RayCluster and
  Service seen on a watch, against the same with no hang.
The last line printed is one JSON object; full results go to bench/results/<name>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime
from typing import Any

import yaml
from benchlib import (
    REPO,
    STATE,
    BenchOperator,
    Testbed,
    median,
    operator_requests_by_kind,
    pct,
    proxy_requests,
    spread,
)
from controlplane import Bench, children_done, writers
from kubernetes_asyncio import client, config
from vllm_dp_operator.controller.kube import RAYCLUSTER, RAYJOB, SERVICE, VDP, ApiKube
from watchlog import WatchLog

SPEC = {"model": "bench/model", "dataParallel": {"size": 8, "ranksPerNode": 8}}
DOUBLE = REPO / "tests" / "doubles" / "engine_fleet.py"
PORT = 8000
#: The double's control routes, at the address kwok gives every fake node (kwoknodes.NODE_IP),
#: which the bed routes into its pod network. (tests/testbed is not importable here: its
#: `controlplane` module shares a name with the benchmark's.)
CONTROL = f"http://10.0.0.1:{PORT}/_double"
PODS_PER_NODE = 100
NODE_PREFIX = "bench-serving-gpu"


def control(path: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{CONTROL}{path}", data=data, method="POST" if data else "GET",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def add_nodes(tb: Testbed, count: int) -> list[str]:
    """Fake GPU nodes for `count` one-pod resources, managed by the bed's kwok as its own are
    (the same annotation, labels and taint as tests/testbed/kwoknodes.py gives them)."""
    names = [f"{NODE_PREFIX}-{i}" for i in range(count // PODS_PER_NODE + 1)]
    res = {"cpu": "2000", "memory": "20Ti", "pods": str(PODS_PER_NODE + 10),
           "ephemeral-storage": "10Ti", "nvidia.com/gpu": str(PODS_PER_NODE * 8)}  # fmt: skip
    nodes = [{
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake",
                                                   "node.alpha.kubernetes.io/ttl": "0"},
                     "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                "kubernetes.io/arch": "amd64", "type": "kwok",
                                "nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": "8",
                                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                                "vllmdp.io/testbed-node": "gpu"}},
        "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present",
                             "effect": "NoSchedule"}]},
        "status": {"capacity": res, "allocatable": res},
    } for name in names]  # fmt: skip
    existing = set(tb.kubectl("get", "nodes", "-o", "name").stdout.split())
    new = [n for n in nodes if f"node/{n['metadata']['name']}" not in existing]
    if new:  # created with their status, as the bed creates its own
        tb.kubectl("create", "-f", "-", input=yaml.safe_dump_all(new))
    tb.kubectl("wait", "--for=condition=Ready", "--timeout=120s", *(f"node/{n}" for n in names))
    return names


def start_double(regime_seconds: float) -> subprocess.Popen[bytes]:
    net = json.loads((STATE / "pod_network.json").read_text())
    log = (STATE / "logs" / "engine-fleet.log").open("ab")
    proc = subprocess.Popen(["ip", "netns", "exec", net["netns"], sys.executable, str(DOUBLE),
                             "--port", str(PORT), "--ranks", "8",
                             "--regime-seconds", str(regime_seconds)],
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        try:
            control("/stats?since=0")
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the engine double did not start; see .testbed/logs") from None
            time.sleep(0.3)


async def drop(b: Bench, ns: str) -> None:
    """Delete a namespace and wait until it is gone.

    KubeRay's RayJob finalizer stops the Ray job through the dashboard before it lets go;
    from the bed's host KubeRay reaches no dashboard, so the bench lifts the finalizer once
    the deletion has begun (KubeRay adds none to an object being deleted).
    """
    b.tb.kubectl("delete", "namespace", ns, "--wait=false")
    jobs = await b.api.list(RAYJOB, ns, "")
    await writers(len(jobs), lambda i: b.api.patch(
        RAYJOB, ns, jobs[i]["metadata"]["name"], {"metadata": {"finalizers": None}}))
    b.tb.kubectl("wait", "--for=delete", f"namespace/{ns}", "--timeout=900s", check=False)


def phases(tb: Testbed, ns: str) -> dict[str, int]:
    out = tb.kubectl("get", VDP.plural, "-n", ns, "-o",
                     "jsonpath={range .items[*]}{.status.phase}{'\\n'}{end}").stdout  # fmt: skip
    counts: dict[str, int] = {}
    for phase in out.split("\n"):
        if phase:
            counts[phase] = counts.get(phase, 0) + 1
    return counts


async def converge(b: Bench, ns: str, n: int) -> float:
    start = time.perf_counter()
    await writers(n, lambda i: b.owner(ns, f"s{i}", SPEC))
    print(f"P7 {n} resources created in {time.perf_counter() - start:.0f} s", flush=True)
    last = 0.0
    while (counts := phases(b.tb, ns)).get("Serving", 0) < n:
        if time.perf_counter() - start > 3600:
            raise SystemExit(f"not all Serving after an hour: {counts}")
        if time.perf_counter() - last > 30:
            print(f"P7 converging: {counts}", flush=True)
            last = time.perf_counter()
        await asyncio.sleep(5)
    return time.perf_counter() - start


async def window(b: Bench, seconds: float) -> dict[str, float]:
    """One window of steady state: what the operator, the API server and the double saw."""
    text0, cpu0, t0 = await b.metrics(), b.op.cpu_seconds(), time.time()
    await asyncio.sleep(seconds)
    text1, cpu1 = await b.metrics(), b.op.cpu_seconds()
    st = control(f"/stats?since={t0}")
    took = st["now"] - t0
    req0, req1 = operator_requests_by_kind(text0), operator_requests_by_kind(text1)
    rate = {k: (req1[k] - req0[k]) / took for k in req0}
    rate["proxy"] = (proxy_requests(text1) - proxy_requests(text0)) / took
    service = st["health"]["service_ms"] + st["metrics"]["service_ms"]
    return {
        "seconds": took, "cpu_pct": (cpu1 - cpu0) / took * 100,
        "api_writes_per_s": rate["writes"] + rate["status"] + rate["leases"],
        "status_writes_per_s": rate["status"], "lease_writes_per_s": rate["leases"],
        "other_requests_per_s": rate["other"], "proxy_requests_per_s": rate["proxy"],
        "probe_gets_per_s": (st["health"]["gets"] + st["metrics"]["gets"]) / took,
        "health_gets_per_s": st["health"]["gets"] / took,
        "metrics_gets_per_s": st["metrics"]["gets"] / took,
        "probe_p50_ms": pct(service, 0.5) if service else 0.0,
        "probe_p99_ms": pct(service, 0.99) if service else 0.0,
        "metrics_p99_ms": pct(st["metrics"]["service_ms"], 0.99) if service else 0.0,
        "level_changes_per_s": st["level_changes"] / took,
        "rss_mib": b.op.memory_mib()["VmRSS"],
    }  # fmt: skip


async def new_resources(b: Bench, ns: str, log: WatchLog, tag: str, count: int,
                        every: float) -> list[float]:  # fmt: skip
    """Create `count` resources `every` s apart; each one's time to its children, in ms."""
    out = []
    for i in range(count):
        t_next = time.perf_counter() + every
        name = f"{tag}{i}"
        await b.owner(ns, name, SPEC)
        start = time.perf_counter()
        await log.wait_until(f"children of {name}",
                             lambda n=name: children_done(log, {n}) is not None, 120)  # fmt: skip
        done = children_done(log, {name})
        assert done is not None
        out.append((done[name] - start) * 1000)
        await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
    return out


async def hang_rounds(b: Bench, rounds: int, hung: int, hang_s: float, gap: float,
                      cleanup: bool) -> dict[str, Any]:  # fmt: skip
    new_ns = b.namespace("p7-new")
    rows = []
    async with WatchLog(b.api, new_ns, [RAYCLUSTER, SERVICE]) as log:
        for r in range(rounds):
            calm = await new_resources(b, new_ns, log, f"c{r}-", 4, 2.0)
            # The engines probed next: a hang that met no probe would measure nothing. Probes
            # of resources that started together stay bunched: wait for enough to be due.
            waited = time.perf_counter()
            while (control(f"/due?within={hang_s}")["due"] < hung
                   and time.perf_counter() - waited < 40):  # fmt: skip
                await asyncio.sleep(1)
            t0 = time.time()
            targets = control("/hang", {"count": hung, "seconds": hang_s})["addresses"]
            await asyncio.sleep(1.0)
            during = await new_resources(b, new_ns, log, f"h{r}-", int((hang_s - 1) // 2), 2.0)
            await asyncio.sleep(max(0.0, t0 + hang_s - time.time()))
            st = control(f"/stats?since={t0}")
            row = {"calm_ms": calm, "hang_ms": during, "hung_gets": st["held"],
                   "targets": len(targets)}  # fmt: skip
            rows.append(row)
            print(f"P7 hang round {r}: new resource to children {median(during):.0f} ms "
                  f"(max {max(during):.0f}) while {len(targets)} engines hang "
                  f"({row['hung_gets']} GETs held); {median(calm):.0f} ms before", flush=True)
            await asyncio.sleep(gap)  # the hung engines' probes pass again
    if cleanup:
        await drop(b, new_ns)
    hang = [x for row in rows for x in row["hang_ms"]]
    calm = [x for row in rows for x in row["calm_ms"]]
    return {"rounds": rows, "hang_children_ms": median(hang), "hang_children_max_ms": max(hang),
            "calm_children_ms": median(calm), "calm_children_max_ms": max(calm),
            "hung_engines": hung, "hang_seconds": hang_s}  # fmt: skip


async def _sample_rss(b: Bench, out: list[float]) -> None:
    """The operator's RSS every second, into `out`, until cancelled."""
    while True:
        out.append(b.op.memory_mib()["VmRSS"])
        await asyncio.sleep(1)


async def flood_rounds(b: Bench, rounds: int, flood_s: float, count: int, gap: float,
                       cleanup: bool) -> dict[str, Any]:  # fmt: skip
    """Issue 39's hostile /metrics with everything else running: every engine answers 4 MiB
    of made-up ranks for `flood_s` s. New resources are timed to their children (P1's
    measure) before and during, and the operator's RSS and CPU are read in both."""
    new_ns = b.namespace("p8-new")
    rows = []
    async with WatchLog(b.api, new_ns, [RAYCLUSTER, SERVICE]) as log:
        for r in range(rounds):
            cpu0, t0 = b.op.cpu_seconds(), time.perf_counter()
            calm = await new_resources(b, new_ns, log, f"c{r}-", count, 2.0)
            calm_cpu = (b.op.cpu_seconds() - cpu0) / (time.perf_counter() - t0) * 100
            calm_rss = b.op.memory_mib()["VmRSS"]
            started = time.time()
            size = control("/flood", {"seconds": flood_s})["bytes"]
            # Under way once the operator has read a few: the shipped cadence reads each
            # engine's /metrics once a minute, spread over the minute.
            waited = time.perf_counter()
            while (control(f"/stats?since={started}")["flooded"] < 5
                   and time.perf_counter() - waited < 90):  # fmt: skip
                await asyncio.sleep(1)
            rss: list[float] = []
            cpu0, t0 = b.op.cpu_seconds(), time.perf_counter()
            sampler = asyncio.create_task(_sample_rss(b, rss))
            try:
                during = await new_resources(b, new_ns, log, f"f{r}-", count, 2.0)
                left = started + flood_s - time.time()
                await asyncio.sleep(max(0.0, left - 1))
            finally:
                sampler.cancel()
            flood_cpu = (b.op.cpu_seconds() - cpu0) / (time.perf_counter() - t0) * 100
            st = control(f"/stats?since={started}")
            row = {"calm_ms": calm, "flood_ms": during, "calm_rss_mib": calm_rss,
                   "flood_rss_max_mib": max(rss), "calm_cpu_pct": calm_cpu,
                   "flood_cpu_pct": flood_cpu, "flooded_gets": st["flooded"],
                   "body_bytes": size}  # fmt: skip
            rows.append(row)
            print(f"P8 flood round {r}: new resource to children {median(during):.0f} ms "
                  f"(max {max(during):.0f}) while {st['flooded']} /metrics reads of "
                  f"{size / 2**20:.1f} MiB came; {median(calm):.0f} ms before; RSS "
                  f"{calm_rss:.0f} -> max {max(rss):.0f} MiB; CPU {calm_cpu:.1f} -> "
                  f"{flood_cpu:.1f} %", flush=True)  # fmt: skip
            await asyncio.sleep(gap)
    if cleanup:
        await drop(b, new_ns)
    flood = [x for row in rows for x in row["flood_ms"]]
    calm = [x for row in rows for x in row["calm_ms"]]
    return {"rounds": rows, "flood_children_ms": median(flood),
            "flood_children_max_ms": max(flood), "calm_children_ms": median(calm),
            "calm_children_max_ms": max(calm),
            "flood_rss_max_mib": max(row["flood_rss_max_mib"] for row in rows),
            "calm_rss_mib": median(row["calm_rss_mib"] for row in rows),
            "flooded_gets": sum(row["flooded_gets"] for row in rows)}  # fmt: skip


async def run(args: argparse.Namespace, tb: Testbed, op: BenchOperator) -> dict[str, Any]:
    await config.load_kube_config(str(tb.kubeconfig))
    out: dict[str, Any] = {"started": datetime.now(UTC).isoformat(timespec="seconds"),
                           "n": args.n, "settings": dict(op.settings)}  # fmt: skip
    async with client.ApiClient() as raw:
        b = Bench(ApiKube(raw), raw, tb, op, ApiKube(raw))
        ns = b.namespace("p7")
        try:
            out["converge_seconds"] = await converge(b, ns, args.n)
            print(f"P7 {args.n} Serving after {out['converge_seconds']:.0f} s; settling "
                  f"{args.settle:.0f} s", flush=True)
            await asyncio.sleep(args.settle)
            rows = []
            for w in range(args.windows):
                rows.append(await window(b, args.window))
                print(f"P7 window {w}: " + ", ".join(f"{k} {v:.3g}" for k, v in rows[-1].items()),
                      flush=True)  # fmt: skip
            out["windows"] = rows
            out["steady"] = {k: median(r[k] for r in rows) for k in rows[0]}
            out["spread"] = {k: spread([r[k] for r in rows]) for k in rows[0]}
            # Kept should a later step fail: the steady state took the longest to reach.
            partial = REPO / "bench" / "results" / f"{args.name}.partial.json"
            partial.write_text(json.dumps(out, indent=2) + "\n")
            if args.hang_rounds:
                out["hang"] = await hang_rounds(b, args.hang_rounds, args.hung,
                                                args.hang_seconds, args.gap,
                                                not args.no_cleanup)  # fmt: skip
            if args.flood_rounds:
                out["flood"] = await flood_rounds(b, args.flood_rounds, args.flood_seconds,
                                                  args.flood_count, args.gap,
                                                  not args.no_cleanup)  # fmt: skip
        finally:
            if not args.no_cleanup:
                await drop(b, ns)
    return out


def markdown(s: dict[str, Any]) -> str:
    st, sp, h, f = s["steady"], s["spread"], s.get("hang"), s.get("flood")

    def row(label: str, key: str, unit: str, goal: str, fmt: str = ".2f") -> str:
        lo, hi = sp[key]
        return (f"| {label} | {st[key]:{fmt}} {unit} | {lo:{fmt}} to {hi:{fmt}} | {goal} |")

    rows = [
        f"| Figure (N={s['n']}) | Median | Spread (windows) | Goal |", "| --- | --- | --- | --- |",
        row("P7 operator CPU", "cpu_pct", "%", "<= 5 %"),
        row("P7 API writes", "api_writes_per_s", "/s", "<= 1 /s", ".3f"),
        row("P7 of which status writes", "status_writes_per_s", "/s", "reported", ".3f"),
        row("P7 of which Lease renewals", "lease_writes_per_s", "/s", "reported", ".3f"),
        row("P7 probe GETs at the engines", "probe_gets_per_s", "/s", "reported", ".1f"),
        row("P7 service-proxy requests", "proxy_requests_per_s", "/s", "reported", ".1f"),
        row("P7 probe service time p99 (engine side)", "probe_p99_ms", "ms", "reported"),
        row("P7 engine level changes", "level_changes_per_s", "/s", "context", ".3f"),
        row("P7 RSS", "rss_mib", "MiB", "reported", ".0f"),
    ]  # fmt: skip
    if h:
        rows += [
            f"| P7 new resource to children, {h['hung_engines']} engines hung "
            f"{h['hang_seconds']:.0f} s | {h['hang_children_ms']:.0f} ms | max "
            f"{h['hang_children_max_ms']:.0f} ms | <= 1,000 ms |",
            f"| P7 new resource to children, none hung | {h['calm_children_ms']:.0f} ms | max "
            f"{h['calm_children_max_ms']:.0f} ms | context |",
        ]  # fmt: skip
    if f:
        rows += [
            f"| P8 new resource to children, every engine's /metrics 4 MiB of made-up ranks | "
            f"{f['flood_children_ms']:.0f} ms | max {f['flood_children_max_ms']:.0f} ms | "
            f"unchanged |",
            f"| P8 new resource to children, before | {f['calm_children_ms']:.0f} ms | max "
            f"{f['calm_children_max_ms']:.0f} ms | context |",
            f"| P8 RSS before / most during | {f['calm_rss_mib']:.0f} MiB | "
            f"{f['flood_rss_max_mib']:.0f} MiB | bounded |",
        ]  # fmt: skip
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="resources Serving")
    parser.add_argument("--quick", action="store_true",
                        help="50 resources, 2 windows of 40 s, 1 hang round (development)")
    parser.add_argument("--window", type=float, default=60, help="seconds per window")
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--settle", type=float, default=40,
                        help="seconds after all are Serving before the first window")
    parser.add_argument("--hung", type=int, default=100, help="engines hung at once")
    parser.add_argument("--hang-seconds", type=float, default=10)
    parser.add_argument("--hang-rounds", type=int, default=3)
    parser.add_argument("--gap", type=float, default=40, help="seconds between hang rounds")
    parser.add_argument("--flood-rounds", type=int, default=0,
                        help="rounds of a hostile 4 MiB /metrics from every engine (P8)")
    parser.add_argument("--flood-seconds", type=float, default=150)
    parser.add_argument("--flood-count", type=int, default=8,
                        help="new resources timed before and during each flood")
    parser.add_argument("--regime-seconds", type=float, default=1800,
                        help="mean time between an engine's load level shifts")
    parser.add_argument("--name", default="serving", help="bench/results/<name>.json")
    parser.add_argument("--no-cleanup", action="store_true",
                        help="leave the namespaces and nodes, for a bed discarded after the run "
                        "(deleting 1,000 resources takes minutes)")
    args = parser.parse_args()
    if args.quick:
        args.n, args.window, args.windows, args.hang_rounds, args.hung = 50, 40, 2, 1, 20
        args.name = f"{args.name}-quick"
    tb = Testbed()
    tb.ensure_up()
    if not (STATE / "pod_network.json").exists():
        tb.down()
        raise SystemExit("the test bed has no pod network: it needs root and iproute2, and "
                         "the pod CIDR routed to no other test bed (`testbed.py up` says why)")
    op = BenchOperator(tb, STATE / "logs" / "bench-operator.log")
    op.setup(probe="apiserver-proxy")
    nodes: list[str] = []
    double = None
    try:
        nodes = add_nodes(tb, args.n + 20)
        double = start_double(args.regime_seconds)
        op.start()
        summary = asyncio.run(run(args, tb, op))
    finally:
        op.teardown()
        if double is not None:
            double.terminate()
            double.wait(timeout=10)
        if nodes and not args.no_cleanup:
            tb.kubectl("delete", "node", *nodes, "--ignore-not-found", check=False)
        tb.down()
    results = REPO / "bench" / "results" / f"{args.name}.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(summary, indent=2) + "\n")
    print(markdown(summary), flush=True)
    st = summary["steady"]
    line = {"p7_n": args.n, "p7_cpu_pct": st["cpu_pct"],
            "p7_api_writes_per_s": st["api_writes_per_s"], "p7_probe_p99_ms": st["probe_p99_ms"],
            "p7_probe_gets_per_s": st["probe_gets_per_s"],
            "p7_status_writes_per_s": st["status_writes_per_s"], "p7_rss_mib": st["rss_mib"],
            "p7_converge_s": summary["converge_seconds"]}  # fmt: skip
    if h := summary.get("hang"):
        line.update(p7_hang_children_ms=h["hang_children_ms"],
                    p7_hang_children_max_ms=h["hang_children_max_ms"],
                    p7_calm_children_ms=h["calm_children_ms"])  # fmt: skip
    if f := summary.get("flood"):
        line.update(p8_flood_children_ms=f["flood_children_ms"],
                    p8_flood_children_max_ms=f["flood_children_max_ms"],
                    p8_calm_children_ms=f["calm_children_ms"],
                    p8_calm_rss_mib=f["calm_rss_mib"], p8_flood_rss_max_mib=f["flood_rss_max_mib"],
                    p8_flooded_gets=f["flooded_gets"])  # fmt: skip
    line = {k: round(v, 3) if isinstance(v, float) else v for k, v in line.items()}
    line["results"] = str(results.relative_to(REPO))
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
