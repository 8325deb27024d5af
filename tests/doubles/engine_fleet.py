#!/usr/bin/env python3
"""Test double for a fleet of vLLM API servers: one process answers for every pod IP.

Run inside the test bed's pod network namespace (`ip netns exec <ns> ...`), where it listens on
0.0.0.0:--port and so answers for every simulated pod IP; each local address a request arrives
on is one engine (a Ray head running `vllm serve` with --ranks DP ranks). Never shipped.

    GET  /health               200, empty (vLLM once its engines are up)
    GET  /metrics              vLLM 0.33's exposition for --ranks engines: per-rank gauges,
                               counters and histograms, about 300 KiB for 8 ranks, like the real one
    GET  /_double/stats?since=T  counts and service times of the GETs above since T (epoch s),
                               and how often an engine's load level changed
    POST /_double/hang         {"addresses": [...], "seconds": S}: those engines accept requests
                               but answer nothing for S seconds (a hung engine); or {"count": K,
                               "seconds": S}: up to K engines whose next /health is due within
                               those S s, soonest first (from the interval between their last
                               two), so that the hang meets the probes it is meant to meet
    GET  /_double/due?within=S  how many engines' next /health is due within S s
    POST /_double/flood        {"seconds": S}: for S seconds every engine's /metrics is a
                               tenant's hostile one, 4 MiB and more of made-up ranks (issue 39)

The load moves all the time: every /metrics read draws new per-rank gauges within the engine's
current regime (idle, busy or saturated, the levels the operator's status.load tells apart), and
the regime itself changes after an exponential time of mean --regime-seconds, as traffic shifts.
Counters and histograms grow. The service time is measured here, from the handler's start to
the last byte handed to the kernel; it is the engine's side of a probe only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

MODEL = "Qwen/Qwen2.5-7B-Instruct"
IDLE, BUSY, SATURATED = "Idle", "Busy", "Saturated"
#: How often each regime is drawn when an engine's traffic shifts.
REGIME_WEIGHTS = {IDLE: 0.1, BUSY: 0.7, SATURATED: 0.2}
#: Histograms of vLLM 0.33's engine metrics (name, help, bucket bounds), as its loggers declare.
_LAT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0)  # fmt: skip
_REQ = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
        240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_TOK = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 32768)
_ITER = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
HISTOGRAMS = (
    ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", _ITER),
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", _TOK),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.", _TOK),
    ("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested "
     "generation tokens.", _TOK),
    ("vllm:request_params_n", "Histogram of the n request parameter.", (1, 2, 5, 10, 20)),
    ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", _TOK),
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _LAT),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL),
    ("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds "
     "per request.", _ITL),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _REQ),
    ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
     _REQ),
    ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for "
     "request.", _REQ),
    ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for "
     "request.", _REQ),
    ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
     _REQ),
    ("vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed during "
     "prefill (excluding cached tokens).", _TOK),
)  # fmt: skip
COUNTERS = (
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
    ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "Number of generation tokens processed."),
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    ("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."),
)
FINISHED = ("stop", "length", "abort", "error", "repetition")
#: Distinct histogram blocks kept; engines share them (the operator reads none of it).
BLOCKS = 16


@dataclass
class RankLoad:
    """One DP rank's three gauges, as the operator reads them."""

    running: int
    waiting: int
    kv: float


def draw_loads(regime: str, ranks: int, rng: random.Random) -> list[RankLoad]:
    """Fresh per-rank gauges within a regime; the level they make is always that regime's."""
    if regime == IDLE:
        return [RankLoad(0, 0, round(rng.uniform(0.0, 0.02), 4)) for _ in range(ranks)]
    if regime == BUSY:
        return [RankLoad(rng.randint(1, 48), 0, round(rng.uniform(0.05, 0.85), 4))
                for _ in range(ranks)]  # fmt: skip
    loads = [RankLoad(rng.randint(32, 64), rng.randint(0, 16), round(rng.uniform(0.6, 0.99), 4))
             for _ in range(ranks)]  # fmt: skip
    hot = rng.randrange(ranks)
    loads[hot].waiting = max(1, loads[hot].waiting)  # at least one rank queues: saturated
    return loads


def level_of(loads: list[RankLoad]) -> str:
    """The level these gauges make by the operator's rules (waiting or KV >= 0.9: saturated)."""
    if any(r.waiting > 0 or r.kv >= 0.9 for r in loads):
        return SATURATED
    return BUSY if any(r.running > 0 for r in loads) else IDLE


def _kv(key: str, value: str) -> str:
    return f'{key}="{value}",'


def _labels(rank: int, extra: str = "") -> str:
    return f'engine="{rank}",{extra}model_name="{MODEL}"'


def hostile_exposition(size: int = 4 * 1024 * 1024 + 4096) -> bytes:
    """A tenant's /metrics of made-up ranks, `size` bytes or a line more: the three gauge
    families the operator reads, each naming rank after rank far beyond any DP size."""
    lines, total, rank = [], 0, 0
    while total < size:
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc"):  # fmt: skip
            line = f'{name}{{engine="{rank}",model_name="{MODEL}"}} 1.0\n'
            lines.append(line)
            total += len(line)
        rank += 1
    return "".join(lines).encode()


def render_gauges(loads: list[RankLoad]) -> str:
    """The gauge families the operator reads, one series per rank, in vLLM's format."""
    out = []
    for name, help_, get in (
        ("vllm:num_requests_running", "Number of requests in model execution batches.",
         lambda r: f"{float(r.running)}"),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
         lambda r: f"{float(r.waiting)}"),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
         lambda r: f"{r.kv}"),
    ):  # fmt: skip
        out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge"]
        out += [f"{name}{{{_labels(i)}}} {get(r)}" for i, r in enumerate(loads)]
    return "\n".join(out) + "\n"


def render_block(ranks: int, served: float, rng: random.Random) -> str:
    """Everything else vLLM 0.33 reports for `ranks` engines that have served about `served`
    requests each: sleep state, counters (with their _created), histograms, and the API
    server's own process and HTTP series."""
    out = [
        "# HELP python_gc_objects_collected_total Objects collected during gc",
        "# TYPE python_gc_objects_collected_total counter",
        *(f'python_gc_objects_collected_total{{generation="{g}"}} {rng.randint(1000, 90000)}.0'
          for g in range(3)),
        "# HELP process_resident_memory_bytes Resident memory size in bytes.",
        "# TYPE process_resident_memory_bytes gauge",
        f"process_resident_memory_bytes {rng.uniform(2e9, 3e9):.6e}",
        "# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping.",
        "# TYPE vllm:engine_sleep_state gauge",
    ]  # fmt: skip
    for r in range(ranks):
        for state, v in (("awake", 1.0), ("weights_offloaded", 0.0), ("discard_all", 0.0)):
            out.append(f"vllm:engine_sleep_state{{{_labels(r, _kv('sleep_state', state))}}} {v}")
    for name, help_ in COUNTERS:
        out += [f"# HELP {name}_total {help_}", f"# TYPE {name}_total counter"]
        out += [f"{name}_total{{{_labels(r)}}} {served * rng.uniform(50, 900):.1f}"
                for r in range(ranks)]  # fmt: skip
        out += [f"# HELP {name}_created {help_}", f"# TYPE {name}_created gauge"]
        out += [f"{name}_created{{{_labels(r)}}} 1.7648e+09" for r in range(ranks)]
    out += ["# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter"]  # fmt: skip
    for r in range(ranks):
        for reason in FINISHED:
            share = {"stop": 0.8, "length": 0.18}.get(reason, 0.005)
            out.append(f"vllm:request_success_total{{{_labels(r, _kv('finished_reason', reason))}}}"
                       f" {round(served * share)}.0")  # fmt: skip
    for name, help_, bounds in HISTOGRAMS:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        for r in range(ranks):
            count = round(served * rng.uniform(0.9, 1.1))
            mid = rng.randrange(len(bounds))
            for i, le in enumerate(bounds):  # cumulative, all in by a few buckets past mid
                cum = round(count * min(1.0, ((i + 1) / (mid + 3)) ** 2))
                out.append(f"{name}_bucket{{{_labels(r, _kv('le', str(float(le))))}}} {cum}.0")
            out.append(f"{name}_bucket{{{_labels(r, _kv('le', '+Inf'))}}} {count}.0")
            out.append(f"{name}_count{{{_labels(r)}}} {count}.0")
            out.append(f"{name}_sum{{{_labels(r)}}} {count * bounds[mid]:.4f}")
        out += [f"# HELP {name.removesuffix('_total')}_created {help_}",
                f"# TYPE {name.removesuffix('_total')}_created gauge"]  # fmt: skip
        out += [f"{name.removesuffix('_total')}_created{{{_labels(r)}}} 1.7648e+09"
                for r in range(ranks)]  # fmt: skip
    out += ["# HELP http_requests_total Total number of requests by method, status and handler.",
            "# TYPE http_requests_total counter"]  # fmt: skip
    for handler in ("/v1/chat/completions", "/v1/completions", "/health", "/metrics"):
        out.append(f'http_requests_total{{handler="{handler}",method="POST",status="2xx"}} '
                   f"{served * ranks:.1f}")  # fmt: skip
    out += ["# HELP http_request_duration_highr_seconds Latency with many buckets.",
            "# TYPE http_request_duration_highr_seconds histogram"]  # fmt: skip
    for le in (*_LAT, "+Inf"):
        out.append(f'http_request_duration_highr_seconds_bucket{{le="{le}"}} {served * ranks:.1f}')
    return "\n".join(out) + "\n"


@dataclass
class Engine:
    """One engine's traffic regime and when it next shifts."""

    regime: str
    until: float
    rng: random.Random
    hang_until: float = 0.0
    #: The last two /health GETs' times (0: none yet).
    health_at: tuple[float, float] = (0.0, 0.0)

    def next_health(self, default_period: float = 30.0) -> float:
        """When the next /health GET is expected: one more interval like the last one."""
        prev, last = self.health_at
        return last + (last - prev if prev else default_period)


@dataclass
class Fleet:
    """Every engine seen so far, the shared histogram blocks, and a log of served GETs."""

    ranks: int
    regime_seconds: float
    started: float = field(default_factory=time.time)
    engines: dict[str, Engine] = field(default_factory=dict)
    blocks: list[str] = field(default_factory=list)
    #: (time, "health" | "metrics", service ms, hung) per GET; the last 30 minutes.
    log: collections.deque[tuple[float, str, float, bool]] = field(
        default_factory=lambda: collections.deque(maxlen=200_000))
    #: Arrival times of the GETs a hang held (counted on arrival, whatever became of them).
    held: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=200_000))
    #: Until when every /metrics is the hostile one (POST /_double/flood), and that body.
    flood_until: float = 0.0
    flood_body: bytes = b""
    #: Times of the /metrics GETs answered with the hostile body.
    flooded: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=200_000))
    #: Times at which an engine's regime changed.
    shifts: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=200_000))

    def engine(self, address: str, now: float) -> Engine:
        eng = self.engines.get(address)
        if eng is None:
            rng = random.Random(zlib.crc32(address.encode()))
            eng = Engine(self._draw(rng), now + rng.expovariate(1 / self.regime_seconds), rng)
            self.engines[address] = eng
        while now >= eng.until:  # traffic shifted since the last read
            new = self._draw(eng.rng)
            if new != eng.regime:
                self.shifts.append(eng.until)
            eng.regime = new
            eng.until += eng.rng.expovariate(1 / self.regime_seconds)
        return eng

    @staticmethod
    def _draw(rng: random.Random) -> str:
        return rng.choices(list(REGIME_WEIGHTS), weights=list(REGIME_WEIGHTS.values()))[0]

    def block(self, address: str) -> str:
        return self.blocks[zlib.crc32(address.encode()) % len(self.blocks)]

    def refresh_block(self, i: int) -> None:
        served = 1000 + (time.time() - self.started) * 5
        block = render_block(self.ranks, served, random.Random(i * 7919 + int(served)))
        if i < len(self.blocks):
            self.blocks[i] = block
        else:
            self.blocks.append(block)

    def stats(self, since: float) -> dict[str, Any]:
        rows = [row for row in self.log if row[0] >= since]
        out: dict[str, Any] = {
            "now": time.time(), "since": since, "engines": len(self.engines),
            "level_changes": sum(1 for t in self.shifts if t >= since),
            "held": sum(1 for t in self.held if t >= since),
            "flooded": sum(1 for t in self.flooded if t >= since)}  # fmt: skip
        for kind in ("health", "metrics"):
            mine = [r for r in rows if r[1] == kind]
            out[kind] = {"gets": len(mine), "hung": sum(1 for r in mine if r[3]),
                         "service_ms": [round(r[2], 3) for r in mine if not r[3]]}  # fmt: skip
        return out


def due_first(engines: dict[str, Engine], now: float, within: float, count: int) -> list[str]:
    """Up to `count` engines whose next /health is due within `within` s, soonest first."""
    probed = [(eng.next_health(), addr) for addr, eng in engines.items() if eng.health_at[1]]
    return [a for t, a in sorted(probed) if now <= t <= now + within][:count]


def make_app(fleet: Fleet) -> web.Application:
    """The routes above, over one Fleet."""

    async def serve(request: web.Request, kind: str) -> web.StreamResponse:
        start = time.perf_counter()
        now = time.time()
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        address = str(sock[0]) if sock else "?"
        eng = fleet.engine(address, now)
        hung = eng.hang_until > now
        if hung:
            fleet.held.append(now)
        if kind == "health":
            eng.health_at = (eng.health_at[1], now)
        try:  # counted also when the caller gave up on a hung engine and went away
            if hung:
                await asyncio.sleep(eng.hang_until - now)
            if kind == "metrics" and fleet.flood_until > now:
                fleet.flooded.append(now)
                body = fleet.flood_body
            elif kind == "metrics":
                loads = draw_loads(eng.regime, fleet.ranks, eng.rng)
                body = (fleet.block(address) + render_gauges(loads)).encode()
            else:
                body = b""
            resp = web.StreamResponse(status=200, headers={
                "Content-Type": "text/plain; version=0.0.4; charset=utf-8"})  # fmt: skip
            resp.content_length = len(body)
            await resp.prepare(request)
            await resp.write(body)
            await resp.write_eof()
        finally:
            fleet.log.append((now, kind, (time.perf_counter() - start) * 1000, hung))
        return resp

    async def health(request: web.Request) -> web.StreamResponse:
        return await serve(request, "health")

    async def metrics(request: web.Request) -> web.StreamResponse:
        return await serve(request, "metrics")

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(fleet.stats(float(request.query.get("since", "0"))))

    async def due(request: web.Request) -> web.Response:
        within = float(request.query.get("within", "10"))
        return web.json_response({"due": len(due_first(fleet.engines, time.time(), within,
                                                       len(fleet.engines)))})  # fmt: skip

    async def hang(request: web.Request) -> web.Response:
        doc = await request.json()
        now = time.time()
        seconds = float(doc["seconds"])
        until = now + seconds
        addresses = doc.get("addresses") or due_first(fleet.engines, now, seconds,
                                                      int(doc["count"]))  # fmt: skip
        for address in addresses:
            fleet.engine(address, now).hang_until = until
        return web.json_response({"addresses": addresses, "until": until})

    async def flood(request: web.Request) -> web.Response:
        doc = await request.json()
        if not fleet.flood_body:
            fleet.flood_body = hostile_exposition()
        fleet.flood_until = time.time() + float(doc["seconds"])
        return web.json_response({"until": fleet.flood_until, "bytes": len(fleet.flood_body)})

    async def refresher(app: web.Application) -> Any:
        for i in range(BLOCKS):
            fleet.refresh_block(i)

        async def loop() -> None:
            i = 0
            while True:  # one block a second: the counters and histograms keep growing
                await asyncio.sleep(1)
                fleet.refresh_block(i % BLOCKS)
                i += 1

        task = asyncio.create_task(loop())
        yield
        task.cancel()

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/_double/stats", stats)
    app.router.add_post("/_double/hang", hang)
    app.router.add_get("/_double/due", due)
    app.router.add_post("/_double/flood", flood)
    app.cleanup_ctx.append(refresher)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="0.0.0.0",
                        help="address to listen on (127.0.0.1 outside the bed's namespace)")
    parser.add_argument("--ranks", type=int, default=8, help="DP ranks each engine reports")
    parser.add_argument("--regime-seconds", type=float, default=1800,
                        help="mean time between an engine's traffic shifts")  # fmt: skip
    args = parser.parse_args()
    fleet = Fleet(args.ranks, args.regime_seconds)
    # Idle connections are kept as vLLM's API server keeps them when the launcher starts it
    # (vllm_dp_launcher.command.KEEP_ALIVE_SECONDS).
    web.run_app(make_app(fleet), host=args.host, port=args.port, print=None,
                access_log=None, backlog=4096, keepalive_timeout=75.0)  # fmt: skip


if __name__ == "__main__":
    main()
