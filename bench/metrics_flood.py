#!/usr/bin/env python3
"""P8: one tenant's hostile /metrics against the operator's probe machinery (issue 39, item 4).

An engine's /metrics is the tenant's: it can name any `engine="N"` and be megabytes long. The
operator reads at most `VLLMDP_ENGINE_METRICS_MAX_BYTES` (4 MiB), parses off the event loop,
and keeps only the planned ranks (those below the DP size). This measures what 50 resources
whose engines all answer a 4 MiB exposition of about 76,000 ranks cost, side by side with the
same 50 answering an honest one (8 ranks), in one process: the operator's own `ProbePool`,
`TransportProbe` and `ServiceDnsTransport`, and its per-rank gauges, against two engine test
doubles on 127.0.0.1 (a resolver test double answers 127.0.0.1 for every Service name).

Windows alternate (honest, hostile, honest, ...). Per window: the process's RSS at its end,
its CPU, the /metrics reads done, and the event loop's lag (a 50 ms ticker's overshoot: what
every reconcile and every other probe waits behind), as median, P99 and maximum.

    python bench/metrics_flood.py [--n 50] [--rounds 2] [--window 60] [--metrics-seconds 0]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from statistics import median
from typing import Any

from vllm_dp_operator.config import Config
from vllm_dp_operator.engines.probe import TransportProbe
from vllm_dp_operator.engines.prober import ProbePool, Target
from vllm_dp_operator.engines.transport import ServiceDnsTransport
from vllm_dp_operator.observability.metrics import OperatorMetrics

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "doubles"))

from loopback_dns import LoopbackDns  # noqa: E402  (a test double)

#: The DP size every resource plans: ranks at or above it are dropped.
DP_SIZE = 8
MIB = 1024 * 1024


def exposition(hostile: bool) -> bytes:
    """An honest exposition of DP_SIZE ranks, or a hostile one of 4 MiB of made-up ranks."""
    lines = []
    ranks = range(DP_SIZE) if not hostile else range(10**6)
    size = 0
    for rank in ranks:
        for name, value in (("vllm:num_requests_running", 1), ("vllm:num_requests_waiting", 0)):
            line = f'{name}{{engine="{rank}",model_name="m"}} {value}\n'
            lines.append(line)
            size += len(line)
        if hostile and size >= 4 * MIB:
            break
    return "".join(lines).encode()


def serve(port: int, hostile: bool) -> None:
    """The engine double: /health 200, /metrics the exposition (a threaded server)."""
    body = exposition(hostile)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            out = body if self.path.startswith("/metrics") else b"ok"
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: object) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # a probe that gives up mid-answer (its size cap) resets the connection

    Server(("127.0.0.1", port), Handler).serve_forever()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def ticker(lags: list[float], stop: asyncio.Event, period: float = 0.05) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        t = loop.time()
        await asyncio.sleep(period)
        lags.append(max(0.0, loop.time() - t - period) * 1000)


async def run(args: argparse.Namespace, ports: dict[str, int]) -> dict[str, Any]:
    cfg = replace(Config(), probe_serving_seconds=args.serving_seconds)
    transport = ServiceDnsTransport(cfg.health_timeout_seconds, resolver=LoopbackDns())
    metrics = OperatorMetrics(lambda: (), lambda: ())
    pool = ProbePool(TransportProbe(transport, cfg.engine_metrics_max_bytes), lambda _k: None,
                     concurrency=cfg.probe_concurrency,
                     launching_seconds=cfg.probe_launching_seconds,
                     serving_seconds=cfg.probe_serving_seconds,
                     metrics_seconds=args.metrics_seconds,
                     on_loads=metrics.set_engine_loads)  # fmt: skip
    tasks = pool.start()
    rows: dict[str, list[dict[str, float]]] = {"honest": [], "hostile": []}
    for _ in range(args.rounds):
        for kind in ("honest", "hostile"):
            targets = [Target(f"ns{i}", f"vdp{i}", f"vdp{i}-head-svc", ports[kind],
                              f"vdp{i}-job-{kind}", ranks=DP_SIZE) for i in range(args.n)]
            for t in targets:  # a new head job per resource: its entry takes the slot
                pool.health(t)
            await asyncio.sleep(args.settle)
            kept = sum(len((pool.reading(t) or _NONE).loads or {}) for t in targets)
            lags: list[float] = []
            stop = asyncio.Event()
            tick = asyncio.create_task(ticker(lags, stop))
            cpu0, wall0 = time.process_time(), time.monotonic()
            read0 = sum(1 for t in targets if pool.reading(t) is not None)
            await asyncio.sleep(args.window)
            stop.set()
            await tick
            cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
            lags.sort()
            rows[kind].append({
                "rss_mib": rss_mib(), "cpu_pct": 100 * cpu / wall,
                "loop_lag_ms_p50": median(lags), "loop_lag_ms_p99": lags[int(len(lags) * 0.99)],
                "loop_lag_ms_max": lags[-1], "ranks_kept": kept, "targets_read": read0})
            print(f"P8 window, {kind}: " + ", ".join(f"{k} {v:.4g}"
                                                     for k, v in rows[kind][-1].items()),
                  flush=True)  # fmt: skip
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await transport.close()
    return {"n": args.n, "dp_size": DP_SIZE, "metrics_seconds": args.metrics_seconds,
            "serving_seconds": args.serving_seconds,
            "hostile_bytes": len(exposition(True)), "windows": rows,
            "steady": {kind: {k: median(w[k] for w in r) for k in r[0]}
                       for kind, r in rows.items()}}  # fmt: skip


class _Nothing:
    loads: dict[int, Any] | None = None


_NONE = _Nothing()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50, help="resources Serving")
    parser.add_argument("--rounds", type=int, default=2, help="windows per kind")
    parser.add_argument("--window", type=float, default=60, help="seconds per window")
    parser.add_argument("--settle", type=float, default=15,
                        help="seconds after the targets change, before the window")
    parser.add_argument("--serving-seconds", type=float, default=Config().probe_serving_seconds,
                        help="the /health probe period while Serving")
    parser.add_argument("--metrics-seconds", type=float, default=0,
                        help="/metrics cadence (0: with every probe, the worst case)")
    parser.add_argument("--serve", nargs=2, metavar=("PORT", "KIND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(int(args.serve[0]), args.serve[1] == "hostile")
        return
    ports = {"honest": free_port(), "hostile": free_port()}
    doubles = [subprocess.Popen([sys.executable, __file__, "--serve", str(port), kind])
               for kind, port in ports.items()]  # fmt: skip
    try:
        for port in ports.values():
            for _ in range(100):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                    break
                except OSError:
                    time.sleep(0.1)
        out = asyncio.run(run(args, ports))
    finally:
        for double in doubles:
            double.terminate()
            double.wait(timeout=10)
    results = REPO / "bench" / "results" / "metrics-flood.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(out, indent=2) + "\n")
    honest, hostile = out["steady"]["honest"], out["steady"]["hostile"]
    line = {"p8_n": args.n, "p8_hostile_mib": round(out["hostile_bytes"] / MIB, 2),
            **{f"p8_{kind}_{k}": round(v, 3) for kind, st in (("honest", honest),
                                                              ("hostile", hostile))
               for k, v in st.items()},
            "p8_loop_lag_p99_ratio": round(hostile["loop_lag_ms_p99"]
                                           / max(honest["loop_lag_ms_p99"], 0.001), 2)}
    print(json.dumps({**line, "results": str(results.relative_to(REPO))}))


if __name__ == "__main__":
    main()
