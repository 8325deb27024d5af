"""The engine test doubles answer /metrics as vLLM 0.33 does, so the operator's parser reads
every rank from them (the control-plane tier's health_server.py; the ray and kind tiers'
tests/doubles/vllm). Each runs as a loopback process for a moment."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vllm_dp_operator.engines.engine_metrics import EngineLoad, parse_engine_loads

DOUBLES = Path(__file__).resolve().parents[1] / "doubles"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def _serving(*argv: str, port: int) -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    yield resp.read().decode()
                    return
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_health_server_double_reports_each_rank() -> None:
    port = _port()
    with _serving(str(DOUBLES / "health_server.py"), "--port", str(port), "--ranks", "3",
                  port=port) as text:  # fmt: skip
        assert parse_engine_loads(text) == {
            r: EngineLoad(r, running=r + 1, waiting=r, kv_cache_usage=(r + 1) / 10)
            for r in range(3)
        }
        assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf"' in text


def test_vllm_double_reports_every_rank_of_its_dp_size() -> None:
    port = _port()
    with _serving(str(DOUBLES / "vllm"), "serve", "m", "--port", str(port),
                  "--data-parallel-size", "4", port=port) as text:  # fmt: skip
        assert parse_engine_loads(text) == {r: EngineLoad(r, 0, 0, 0.0) for r in range(4)}
