#!/usr/bin/env python3
"""P7b: the probes' own CPU in cluster-DNS mode, at the full cadence of N Serving resources.

`make bench-serving` runs in `apiserver-proxy` mode (the bed's host has no cluster DNS), where
the proxy's rate limit caps the probes at 20 GETs a second. In a cluster the chart's default
is cluster DNS, with no such cap: 1,000 resources ask /health and /metrics every 30 s, about
67 GETs a second. This measures what that costs the operator's probe machinery alone, in one
process: the operator's own `ProbePool`, `TransportProbe` and `ServiceDnsTransport`, and its
per-rank gauges (`OperatorMetrics.set_engine_loads`), against the engine test double
(`tests/doubles/engine_fleet.py`, 8 ranks, load moving) on 127.0.0.1. A resolver test double
stands in for cluster DNS and answers 127.0.0.1 for every Service name. Informers, the Lease
and the status writer are not in it (bench-serving measures them, with the probes).

Side by side in one run, the same pool alternates between variants (`--variants`, each
`<metrics seconds>:<keep-alive seconds>`): the shipped one first (`healthProbe.metricsSeconds`,
once a minute; idle connections kept 60 s, `PROBE_KEEPALIVE_SECONDS`), then the same without
kept connections (aiohttp's 15 s, shorter than the 30 s cadence: a new connection per probe),
then neither (/metrics with every /health), as before both. Each window follows a settle of
`--switch` seconds after the variant changed; the previous variant's connections are closed
then.

    python bench/probe_cost.py [--n 1000] [--rounds 3] [--window 60] [--variants 60:60,60:15,0:15]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from statistics import median
from typing import Any

from vllm_dp_operator.config import Config
from vllm_dp_operator.engines.probe import TransportProbe
from vllm_dp_operator.engines.prober import ProbePool, Target
from vllm_dp_operator.engines.transport import PROBE_KEEPALIVE_SECONDS, Answer, ServiceDnsTransport
from vllm_dp_operator.observability.metrics import OperatorMetrics

REPO = Path(__file__).resolve().parents[1]
DOUBLE = REPO / "tests" / "doubles" / "engine_fleet.py"
sys.path.insert(0, str(DOUBLE.parent))

from loopback_dns import LoopbackDns  # noqa: E402  (a test double, beside the engine double)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gets(port: int, since: float) -> tuple[int, int]:
    """The /health and the /metrics GETs the double served since `since` (epoch seconds)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/_double/stats?since={since}") as r:
        stats = json.load(r)
    return int(stats["health"]["gets"]), int(stats["metrics"]["gets"])


class Switch:
    """Sends through whichever of the variants' transports is current."""

    def __init__(self, transports: dict[float, ServiceDnsTransport]) -> None:
        self.transports = transports
        self.current = next(iter(transports.values()))

    async def use(self, keepalive: float) -> None:
        """Switch, closing the previous transport's connections."""
        if self.transports[keepalive] is not self.current:
            await self.current.close()
            self.current = self.transports[keepalive]

    async def request(self, method: str, namespace: str, service: str, port: int, path: str,
                      limit: int | None = None, headers: Any = None,
                      json_body: Any = None) -> Answer:  # fmt: skip
        return await self.current.request(method, namespace, service, port, path, limit,
                                          headers, json_body)  # fmt: skip

    async def close(self) -> None:
        for transport in self.transports.values():
            await transport.close()


def parse_variants(text: str) -> list[tuple[float, float]]:
    """`60:60,60:15` -> [(60.0, 60.0), (60.0, 15.0)]: (metrics seconds, keep-alive seconds)."""
    out = []
    for item in text.split(","):
        metrics, _, keep = item.partition(":")
        out.append((float(metrics), float(keep or PROBE_KEEPALIVE_SECONDS)))
    return out


def label(variant: tuple[float, float]) -> str:
    return f"metrics_seconds={variant[0]:g},keepalive_seconds={variant[1]:g}"


async def run(args: argparse.Namespace, port: int) -> dict[str, Any]:
    cfg = Config()
    variants = parse_variants(args.variants)
    transport = Switch({keep: ServiceDnsTransport(cfg.health_timeout_seconds,
                                                  resolver=LoopbackDns(), keepalive=keep)
                        for _, keep in variants})  # fmt: skip
    await transport.use(variants[0][1])
    metrics = OperatorMetrics(lambda: (), lambda: ())
    wakes = 0

    def wake(_key: tuple[str, str]) -> None:
        nonlocal wakes
        wakes += 1

    pool = ProbePool(TransportProbe(transport), wake, concurrency=cfg.probe_concurrency,
                     launching_seconds=cfg.probe_launching_seconds,
                     serving_seconds=cfg.probe_serving_seconds, metrics_seconds=variants[0][0],
                     on_loads=metrics.set_engine_loads)  # fmt: skip
    tasks = pool.start()
    # Registered over one serving period, so the probes are spread as in a steady state
    # rather than all due at once.
    for i in range(args.n):
        pool.health(Target(f"ns{i}", f"vdp{i}", f"vdp{i}-head-svc", port, f"vdp{i}-job"))
        await asyncio.sleep(cfg.probe_serving_seconds / args.n)
    rows: dict[tuple[float, float], list[dict[str, float]]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            pool.metrics_seconds = v[0]
            await transport.use(v[1])
            await asyncio.sleep(args.switch)
            cpu0, wall0, t0, wakes0 = time.process_time(), time.monotonic(), time.time(), wakes
            await asyncio.sleep(args.window)
            cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
            health, reads = await asyncio.to_thread(gets, port, t0)
            rows[v].append({"cpu_pct": 100 * cpu / wall, "gets_per_s": (health + reads) / wall,
                            "metrics_reads_per_s": reads / wall,
                            "cpu_ms_per_get": 1000 * cpu / max(health + reads, 1),
                            "wakes_per_s": (wakes - wakes0) / wall})  # fmt: skip
            print(f"P7b window, {label(v)}: "
                  + ", ".join(f"{k} {x:.3g}" for k, x in rows[v][-1].items()), flush=True)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await transport.close()
    return {"n": args.n, "variants": {
        label(v): {
            "windows": r, "steady": {k: median(w[k] for w in r) for k in r[0]},
            "spread": {k: [min(w[k] for w in r), max(w[k] for w in r)] for k in r[0]}}
        for v, r in rows.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="resources Serving")
    parser.add_argument("--rounds", type=int, default=3, help="windows per cadence")
    parser.add_argument("--window", type=float, default=60, help="seconds per window")
    parser.add_argument("--switch", type=float, default=40,
                        help="seconds between a change of cadence and its window")
    every = f"{Config().probe_metrics_seconds:g}"
    parser.add_argument("--variants",
                        default=f"{every}:{PROBE_KEEPALIVE_SECONDS:g},{every}:15,0:15",
                        help="<metrics seconds>:<keep-alive seconds>,...: the shipped one first")
    args = parser.parse_args()
    port = free_port()
    double = subprocess.Popen([sys.executable, str(DOUBLE), "--host", "127.0.0.1",
                               "--port", str(port)], env={**os.environ})  # fmt: skip
    try:
        for _ in range(100):
            try:
                gets(port, time.time())
                break
            except OSError:
                time.sleep(0.1)
        out = asyncio.run(run(args, port))
    finally:
        double.terminate()
        double.wait(timeout=10)
    results = REPO / "bench" / "results" / "probe-cost.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(out, indent=2) + "\n")
    shipped, *others = out["variants"].values()
    st = shipped["steady"]
    line = {"p7b_n": args.n, "p7b_probe_cpu_pct": round(st["cpu_pct"], 3),
            "p7b_gets_per_s": round(st["gets_per_s"], 2),
            "p7b_metrics_reads_per_s": round(st["metrics_reads_per_s"], 2),
            "p7b_cpu_ms_per_get": round(st["cpu_ms_per_get"], 3)}
    if others:
        # Every variant's median, and the shipped one's ratio to the last (as before).
        line["p7b_cpu_pct_by_variant"] = {
            name: round(v["steady"]["cpu_pct"], 3) for name, v in out["variants"].items()}
        line["p7b_cpu_ratio"] = round(st["cpu_pct"] / others[-1]["steady"]["cpu_pct"], 3)
    print(json.dumps({**line, "results": str(results.relative_to(REPO))}))


if __name__ == "__main__":
    main()
