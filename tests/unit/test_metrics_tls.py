"""The metrics server over TLS (observability/metrics_tls.py): HTTPS with the given pair,
nothing in clear, and a renewed pair served with no restart."""

from __future__ import annotations

import asyncio
import shutil
import ssl
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, Counter
from vllm_dp_operator.config import Config
from vllm_dp_operator.observability.metrics_http import serve_metrics
from vllm_dp_operator.observability.metrics_tls import ServingCert

DATA = Path(__file__).parent / "data" / "metrics-tls"


def _pair(tmp_path: Path, which: str) -> tuple[Path, Path]:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(DATA / f"{which}.crt", cert)
    shutil.copy(DATA / f"{which}.key", key)
    return cert, key


async def _peer(port: int) -> str:
    """The subject CN of the certificate the server shows, checked against the test CA."""
    ctx = ssl.create_default_context(cafile=str(DATA / "ca.crt"))
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx,
                                              server_hostname="metrics.test")  # fmt: skip
    try:
        cert = writer.get_extra_info("peercert")
        return dict(x[0] for x in cert["subject"])["commonName"]
    finally:
        writer.close()


async def test_metrics_are_served_over_tls_only(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    Counter("vllmdp_demo", "demo", registry=registry).inc()
    cert = ServingCert(*map(str, _pair(tmp_path, "first")))
    runner = await serve_metrics(registry, "127.0.0.1", 0, tls=cert.context)
    try:
        port = runner.addresses[0][1]
        ctx = ssl.create_default_context(cafile=str(DATA / "ca.crt"))
        async with aiohttp.ClientSession() as http:
            async with http.get(f"https://127.0.0.1:{port}/metrics", ssl=ctx) as resp:
                assert resp.status == 200 and "vllmdp_demo_total 1.0" in await resp.text()
            # Plain HTTP gets no metrics: the handshake is what the server waits for.
            with pytest.raises(aiohttp.ClientError):
                async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    assert "vllmdp_demo" not in await resp.text()
        assert await _peer(port) == "metrics.test first"
    finally:
        await runner.cleanup()


async def test_a_renewed_pair_is_served_without_a_restart(tmp_path: Path) -> None:
    cert_file, key_file = _pair(tmp_path, "first")
    cert = ServingCert(str(cert_file), str(key_file))
    runner = await serve_metrics(CollectorRegistry(), "127.0.0.1", 0, tls=cert.context)
    try:
        port = runner.addresses[0][1]
        assert not cert.reload()  # unchanged: nothing loaded
        # A half-written renewal (a new certificate, the old key) keeps the pair served.
        shutil.copy(DATA / "renewed.crt", cert_file)
        assert not cert.reload()
        assert await _peer(port) == "metrics.test first"
        shutil.copy(DATA / "renewed.key", key_file)
        assert cert.reload()
        assert await _peer(port) == "metrics.test renewed"
    finally:
        await runner.cleanup()


def test_a_missing_pair_fails_the_start_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tls\.crt"):
        ServingCert(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))


def test_the_certificate_and_the_key_come_together(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLMDP_METRICS_TLS_CERT_FILE", "/etc/tls/tls.crt")
    monkeypatch.delenv("VLLMDP_METRICS_TLS_KEY_FILE", raising=False)
    with pytest.raises(ValueError, match="set both"):
        Config.from_env()
    monkeypatch.setenv("VLLMDP_METRICS_TLS_KEY_FILE", "/etc/tls/tls.key")
    cfg = Config.from_env()
    assert (cfg.metrics_tls_cert_file, cfg.metrics_tls_key_file) == ("/etc/tls/tls.crt",
                                                                     "/etc/tls/tls.key")
