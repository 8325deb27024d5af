"""Control-plane benchmark: N resources applied at once, time until their children exist.

Two measurements in one run, on the same API server, interleaved per round:
  operator  -- create N VLLMDataParallel objects in a burst (8 concurrent writers); per object,
               the time from the burst start to both its RayCluster and Service being seen
               on a watch (so the queueing of the burst itself counts, as a user sees it);
  floor     -- create the same N RayCluster + Service pairs directly (8 concurrent writers);
               per pair, the time from the burst start to both creates returning.
Reports medians over rounds of p50/p99, their ratio, and the operator's peak RSS (VmHWM).
Needs the test bed (`make testbed-up`); starts and stops its own operator process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client, config, watch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "controlplane"))

from operator_proc import OperatorProcess, install_crd  # noqa: E402
from vllm_dp_operator.config import RenderOptions  # noqa: E402
from vllm_dp_operator.plan import build_plan  # noqa: E402
from vllm_dp_operator.render import build_raycluster, build_service  # noqa: E402
from vllm_dp_operator.validation import validate  # noqa: E402

STATE = Path(os.environ.get("VLLMDP_TESTBED_DIR") or REPO / ".testbed").resolve()
# Suspended: the benchmark measures the operator, not KubeRay and kwok making N x 2 pods.
SPEC = {"model": "bench/model", "dataParallel": {"size": 2, "ranksPerNode": 1}, "suspend": True}


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


class Testbed:
    """Thin handle on the running test bed, for kubectl and the operator's environment."""

    def __init__(self) -> None:
        info = json.loads((STATE / "testbed.json").read_text())
        self.kubeconfig = STATE / "kubeconfig"
        self.bin_dir = Path(info["bin_dir"])

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> Any:
        import subprocess

        return subprocess.run([str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}",
                               *args], input=input, text=True, capture_output=True, check=check)


async def _watch_children(api: client.ApiClient, ns: str, seen: dict[str, dict[str, float]],
                          expected: int, done: asyncio.Event) -> None:  # fmt: skip
    async def follow(kind: str, lister: Any, **kw: Any) -> None:
        # The context manager releases the watch's HTTP response however the loop ends (the
        # other watch is cancelled when this one finishes), so no connection is left open.
        async with watch.Watch() as w:
            async for ev in w.stream(lister, **kw, timeout_seconds=600):
                obj = ev["object"]
                meta = obj["metadata"] if isinstance(obj, dict) else obj.metadata.to_dict()
                labels = meta.get("labels") or {}
                inst = labels.get("app.kubernetes.io/instance")
                if ev["type"] == "ADDED" and inst:
                    seen.setdefault(inst, {}).setdefault(kind, time.perf_counter())
                    if sum(len(v) == 2 for v in seen.values()) >= expected:
                        done.set()
                        return

    custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    tasks = [
        asyncio.create_task(follow("raycluster", custom.list_namespaced_custom_object,
                                   group="ray.io", version="v1", namespace=ns,
                                   plural="rayclusters")),
        asyncio.create_task(follow("service", core.list_namespaced_service, namespace=ns)),
    ]  # fmt: skip
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_operator_round(api: client.ApiClient, ns: str, n: int) -> list[float]:
    """Create n resources in a burst; latency from each create to both children seen."""
    custom = client.CustomObjectsApi(api)
    seen: dict[str, dict[str, float]] = {}
    done = asyncio.Event()
    watcher = asyncio.create_task(_watch_children(api, ns, seen, n, done))
    await asyncio.sleep(0.5)  # let both watches start
    created: dict[str, float] = {}
    sem = asyncio.Semaphore(8)
    start = time.perf_counter()

    async def create(i: int) -> None:
        name = f"b{i}"
        body = {"apiVersion": "vllmdp.io/v1alpha1", "kind": "VLLMDataParallel",
                "metadata": {"name": name, "namespace": ns}, "spec": SPEC}  # fmt: skip
        async with sem:
            await custom.create_namespaced_custom_object("vllmdp.io", "v1alpha1", ns,
                                                         "vllmdataparallels", body)  # fmt: skip
        created[name] = time.perf_counter()

    try:
        await asyncio.gather(*(create(i) for i in range(n)))
        await asyncio.wait_for(done.wait(), timeout=600)
    finally:
        # Wait for the cancelled watches to close their responses before the client goes.
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    return [max(seen[k].values()) - start for k in created]


async def run_floor_round(api: client.ApiClient, ns: str, n: int) -> list[float]:
    """The same children created directly: latency from burst start to both creates done."""
    custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    spec = validate("b0", SPEC)
    plan = build_plan(spec)
    sem = asyncio.Semaphore(8)
    start = time.perf_counter()
    out: list[float] = []

    async def create(i: int) -> None:
        name = f"f{i}"
        cluster = build_raycluster(name, ns, spec, plan, RenderOptions(), None)
        svc = build_service(name, ns, spec, cluster["metadata"]["name"], None)
        async with sem:
            await custom.create_namespaced_custom_object("ray.io", "v1", ns, "rayclusters",
                                                         cluster)  # fmt: skip
            await core.create_namespaced_service(ns, svc)
        out.append(time.perf_counter() - start)

    await asyncio.gather(*(create(i) for i in range(n)))
    return out


async def bench(n: int, rounds: int, tb: Testbed, op: OperatorProcess) -> dict[str, Any]:
    await config.load_kube_config(str(tb.kubeconfig))
    results: dict[str, list[dict[str, float]]] = {"operator": [], "floor": []}
    async with client.ApiClient() as api:
        for r in range(rounds):
            for mode in ("operator", "floor") if r % 2 == 0 else ("floor", "operator"):
                ns = f"bench-{mode}-{uuid.uuid4().hex[:6]}"
                tb.kubectl("create", "namespace", ns)
                runner = run_operator_round if mode == "operator" else run_floor_round
                lat = await runner(api, ns, n)
                results[mode].append({"p50": pct(lat, 0.5), "p99": pct(lat, 0.99),
                                      "max": max(lat)})  # fmt: skip
                print(f"round {r} {mode:8s} p50={pct(lat, 0.5) * 1000:7.1f} ms "
                      f"p99={pct(lat, 0.99) * 1000:7.1f} ms", flush=True)  # fmt: skip
                # Let the namespace go before the next round, so rounds don't overlap.
                tb.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=300s")
    summary: dict[str, Any] = {"n": n, "rounds": rounds}
    for mode, rows in results.items():
        for key in ("p50", "p99", "max"):
            summary[f"{mode}_{key}_ms"] = statistics.median(x[key] for x in rows) * 1000
    summary["ratio_p50"] = summary["operator_p50_ms"] / summary["floor_p50_ms"]
    summary["ratio_p99"] = summary["operator_p99_ms"] / summary["floor_p99_ms"]
    return summary


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args()
    tb = Testbed()
    install_crd(tb)
    # The default resync, as shipped: timer load is part of what a user's burst meets.
    op = OperatorProcess(tb.env(), STATE / "logs" / "bench-operator.log",
                         {"VLLMDP_RESYNC_SECONDS": "5"})  # fmt: skip
    op.start()
    try:
        summary = asyncio.run(bench(args.count, args.rounds, tb, op))
        assert op.proc is not None
        summary["operator_peak_rss_mib"] = peak_rss_mib(op.proc.pid)
    finally:
        op.stop()
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
