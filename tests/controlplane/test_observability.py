"""Observability on the control-plane test bed, with a real Prometheus (Debian's package).

One resource goes New -> Provisioning -> Launching -> Serving against the real API server,
KubeRay and kwok; the vLLM test double (tests/doubles/health_server.py, four DP ranks) answers
/health and /metrics for the pod IPs. Prometheus scrapes the operator's /metrics, and, through
a scrape job made from the chart's own PodMonitor (label selector, port name, relabelings over
the pods read from the API server, as kubernetes_sd labels them: Debian's Prometheus 2.42 is
built without kubernetes_sd), the double on the head pod's IP. The test reads both back with PromQL,
and reads status.load, the per-rank vllmdp_engine_* gauges, `kubectl get vdp` and the Events
from the API server.
"""

from __future__ import annotations

import json
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from operator_proc import OperatorProcess, install_crd
from prometheus_client.parser import text_string_to_metric_families
from scenario import (
    apply,
    double_in_pod_network,
    example,
    head_pod,
    items,
    load_of,
    status,
    wait_phase,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chart"))
sys.path.append(str(Path(__file__).resolve().parents[1] / "testbed"))  # promlib
import chartlib
from common import kubectl_table
from promlib import Prometheus, file_sd, free_port, pod_targets, scrape_config_from_pod_monitor

pytestmark = pytest.mark.controlplane

RANKS = 4  # examples/dp4-tp2.yaml
NAME = "observed"
#: The metrics server's certificate (for metrics.test and 127.0.0.1) and its CA: TLS, as the
#: chart serves it by default.
TLS = Path(__file__).resolve().parents[1] / "unit" / "data" / "metrics-tls"
TLS_NAME = "metrics.test"


def phase_events(testbed: Any, ns: str, name: str) -> list[str]:
    """The PhaseChanged Events of one resource, oldest first, as 'Old -> New'."""
    events = [e for e in items(testbed, ns, "events")
              if e["involvedObject"].get("kind") == "VLLMDataParallel"
              and e["involvedObject"].get("name") == name]  # fmt: skip
    events.sort(key=lambda e: (e.get("eventTime") or e.get("firstTimestamp") or "",
                               e["metadata"]["creationTimestamp"]))  # fmt: skip
    return [e["message"].split(":")[0] for e in events if e.get("reason") == "PhaseChanged"]


def scrape(operator: OperatorProcess, token: str | None) -> tuple[int, str]:
    """GET the operator's /metrics with a bearer token (or none): the status and the body."""
    port = operator.metrics_port  # type: ignore[attr-defined]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"https://127.0.0.1:{port}/metrics", headers=headers)
    tls = ssl.create_default_context(cafile=str(TLS / "ca.crt"))  # its SAN has 127.0.0.1
    try:
        with urllib.request.urlopen(request, timeout=5, context=tls) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def operator_reconciles(operator: OperatorProcess) -> float:
    """vllmdp_reconcile_total summed over results, read from the operator's /metrics with
    prometheus_client's own parser."""
    code, text = scrape(operator, operator.scraper.token)  # type: ignore[attr-defined]
    assert code == 200, (code, text)
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllmdp_reconcile_total")  # fmt: skip


def all_events(testbed: Any, ns: str, name: str) -> int:
    return sum(1 for e in items(testbed, ns, "events")
               if e["involvedObject"].get("name") == name)  # fmt: skip


@pytest.fixture
def ns(testbed_namespace: str) -> str:
    return testbed_namespace


class Scraper:
    """A ServiceAccount bound to the chart's metrics-reader ClusterRole, and one that is not."""

    def __init__(self, testbed: Any, ns: str, tmp_path: Path) -> None:
        (reader,) = [r for r in chartlib.by_kind(chartlib.render(), "ClusterRole")
                     if r["metadata"]["name"].endswith("-metrics-reader")]  # fmt: skip
        self.testbed, self.role = testbed, reader["metadata"]["name"]
        self.binding = f"{ns}-metrics-scraper"
        testbed.apply(reader)
        for sa in ("scraper", "nobody"):
            testbed.kubectl("create", "serviceaccount", sa, "-n", ns)
        testbed.kubectl("create", "clusterrolebinding", self.binding, f"--clusterrole={self.role}",
                        f"--serviceaccount={ns}:scraper")  # fmt: skip
        self.token = self._token(ns, "scraper")
        self.nobody = self._token(ns, "nobody")
        self.token_file = tmp_path / "scraper.token"
        self.token_file.write_text(self.token)

    def _token(self, ns: str, sa: str) -> str:
        return str(self.testbed.kubectl("create", "token", sa, "-n", ns).stdout.strip())

    def close(self) -> None:
        self.testbed.kubectl("delete", "clusterrolebinding", self.binding, "--ignore-not-found")


@pytest.fixture
def operator(testbed: Any, ns: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    """An operator watching only this test's namespace, its /metrics on a loopback port,
    behind the secure metrics server over TLS (the chart's default) with a scraper allowed
    in."""
    install_crd(testbed)
    scraper = Scraper(testbed, ns, tmp_path)
    metrics_port = free_port()
    proc = OperatorProcess(testbed.env(), tmp_path / "operator.log", extra_env={
        "VLLMDP_METRICS_PORT": str(metrics_port), "VLLMDP_METRICS_HOST": "127.0.0.1",
        "VLLMDP_METRICS_AUTH": "kubernetes",
        "VLLMDP_METRICS_TLS_CERT_FILE": str(TLS / "first.crt"),
        "VLLMDP_METRICS_TLS_KEY_FILE": str(TLS / "first.key")})
    proc.namespace = ns
    proc.metrics_port = metrics_port  # type: ignore[attr-defined]
    proc.scraper = scraper  # type: ignore[attr-defined]
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
        scraper.close()


def _operator_job(operator: OperatorProcess) -> dict[str, Any]:
    """Scraping the operator as the chart's ServiceMonitor does: over TLS, checked against
    the CA for the Service's name, with a bearer token."""
    port = operator.metrics_port  # type: ignore[attr-defined]
    token_file = operator.scraper.token_file  # type: ignore[attr-defined]
    return {"job_name": "vllm-dp-operator", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
            "scheme": "https",
            "tls_config": {"ca_file": str(TLS / "ca.crt"), "server_name": TLS_NAME},
            "authorization": {"type": "Bearer", "credentials_file": str(token_file)}}


def _pod_monitor_job(ns: str, targets: Path) -> dict[str, Any]:
    """The chart's engine PodMonitor (monitoring on, watching this namespace) as a plain
    scrape job over every pod of the namespace, as kubernetes_sd would list them."""
    objects = chartlib.render((chartlib.CHART / "ci" / "monitoring-values.yaml",),
                              (f"watchNamespaces={{{ns}}}",))  # fmt: skip
    (monitor,) = chartlib.by_kind(objects, "PodMonitor")
    return scrape_config_from_pod_monitor(monitor, file_sd(targets))


@pytest.fixture
def prometheus(testbed: Any, ns: str, operator: OperatorProcess,
               tmp_path: Path) -> Iterator[Prometheus]:  # fmt: skip
    targets = tmp_path / "pods.json"
    targets.write_text("[]")
    prom = Prometheus(tmp_path / "prometheus", [
        _operator_job(operator),
        _pod_monitor_job(ns, targets),
    ])
    prom.pods_file = targets  # type: ignore[attr-defined]
    prom.start()
    yield prom
    prom.stop()


def _wait_value(testbed: Any, prom: Prometheus, expr: str, want: float,
                timeout: float = 30) -> None:  # fmt: skip
    try:
        testbed.wait_until(f"PromQL {expr} == {want}", lambda: prom.value(expr) == want,
                           timeout=timeout)  # fmt: skip
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nlast: {prom.query(expr)}\ntargets: "
                             f"{json.dumps(prom.targets())[:3000]}\n{prom.log_tail()}") from None


@pytest.fixture
def operator_prometheus(operator: OperatorProcess, tmp_path: Path) -> Iterator[Prometheus]:
    """Prometheus scraping the operator alone (no pod network needed)."""
    prom = Prometheus(tmp_path / "prometheus", [_operator_job(operator)])
    prom.start()
    yield prom
    prom.stop()


def test_prometheus_scrapes_the_operator_and_a_launch_posts_one_event_per_phase(
    testbed: Any, ns: str, operator: OperatorProcess, operator_prometheus: Prometheus
) -> None:
    """Two resources: one launches (Provisioning, then Launching: vLLM never answers on kwok
    pods), one is suspended. PromQL reads the operator's counts; each resource has posted one
    PhaseChanged Event per transition, and none while its phase holds."""
    prom = operator_prometheus
    doc = example("fill.yaml")
    doc["metadata"]["name"] = NAME
    apply(testbed, ns, doc)
    parked = example("fill.yaml")
    parked["metadata"]["name"] = "parked"
    parked["spec"]["suspend"] = True
    apply(testbed, ns, parked)
    wait_phase(testbed, ns, NAME, "Launching")
    wait_phase(testbed, ns, "parked", "Suspended")
    _wait_value(testbed, prom, 'vllmdp_resources{phase="Launching"}', 1)
    _wait_value(testbed, prom, 'vllmdp_resources{phase="Suspended"}', 1)
    _wait_value(testbed, prom, 'vllmdp_resources{phase="Serving"}', 0)
    _wait_value(testbed, prom, "sum(vllmdp_resources)", 2)
    _wait_value(testbed, prom, f'vllmdp_resource_phase{{namespace="{ns}",name="parked",'
                'phase="Suspended"}', 1)  # fmt: skip
    _wait_value(testbed, prom, "vllmdp_head_job_launches_total", 1)
    _wait_value(testbed, prom, "vllmdp_head_job_failures_total", 0)
    _wait_value(testbed, prom, "vllmdp_reconcile_errors_total", 0)
    _wait_value(testbed, prom, 'vllmdp_reconcile_total{result="error"}', 0)
    # Launching asks for the launch deadline as a time-based step: a requeue.
    testbed.wait_until("requeue results", lambda: (prom.value(
        'vllmdp_reconcile_total{result="requeue"}') or 0) >= 1, timeout=30)
    assert (prom.value('vllmdp_reconcile_total{result="success"}') or 0) >= 2
    assert (prom.value("vllmdp_reconcile_duration_seconds_count") or 0) >= 3
    total = prom.value("sum(vllmdp_reconcile_total)") or 0
    assert 0 < total <= operator_reconciles(operator), total  # scraped a little earlier

    want = {NAME: ["New -> Provisioning", "Provisioning -> Launching"],
            "parked": ["New -> Suspended"]}  # fmt: skip
    testbed.wait_until("one PhaseChanged Event per transition", lambda: {
        n: phase_events(testbed, ns, n) for n in want} == want, timeout=15)  # fmt: skip
    before = all_events(testbed, ns, NAME), all_events(testbed, ns, "parked")
    time.sleep(6)  # Launching is probed every second here: six reconciles, no transition
    assert status(testbed, ns, NAME)["phase"] == "Launching"
    assert (all_events(testbed, ns, NAME), all_events(testbed, ns, "parked")) == before


def test_prometheus_scrapes_operator_and_engines_status_and_events(
    testbed: Any, ns: str, operator: OperatorProcess, prometheus: Prometheus
) -> None:
    doc = example("dp4-tp2.yaml")
    doc["metadata"]["name"] = NAME
    apply(testbed, ns, doc)
    st = wait_phase(testbed, ns, NAME, "Launching")
    pod_ip = head_pod(testbed, ns, st["rayCluster"])["status"]["podIP"]
    assert "load" not in st  # nothing before Serving
    with double_in_pod_network(testbed, "health_server.py", 8000, "--ranks", str(RANKS)):
        wait_phase(testbed, ns, NAME, "Serving", timeout=60)

        # status.load: ranks 0-3 report from the head's /metrics; ranks 1-3 have requests
        # waiting, so the level is Saturated. The per-rank numbers are metrics, not status.
        load = testbed.wait_until("status.load with every rank",
                                  lambda: load_of(testbed, ns, NAME).get("ranksReporting")
                                  == RANKS and load_of(testbed, ns, NAME))  # fmt: skip
        assert load["level"] == "Saturated", load
        st = status(testbed, ns, NAME)
        assert "engines" not in st and "requestsRunning" not in st
        cond = next(x for x in st["conditions"] if x["type"] == "EnginesReporting")
        assert cond["status"] == "True" and cond["reason"] == "AllRanksReporting"
        table = kubectl_table(testbed.kubectl("-n", ns, "get", "vdp", NAME).stdout)
        assert table[0]["LOAD"] == "Saturated" and table[0]["UPDATE"] == "", table

        # Events: one per transition, a chain with no gap and no repeat; then, steady, none.
        chain = ["New -> Provisioning", "Provisioning -> Launching", "Launching -> Serving"]
        testbed.wait_until("one PhaseChanged Event per transition",
                           lambda: phase_events(testbed, ns, NAME) == chain, timeout=15)
        before = all_events(testbed, ns, NAME)
        time.sleep(8)  # four /health + /metrics probes at VLLMDP_PROBE_SERVING_SECONDS=2
        assert status(testbed, ns, NAME)["phase"] == "Serving"
        assert all_events(testbed, ns, NAME) == before, "a steady resource posts no Event"

        # Prometheus: the operator's series after the scenario.
        _wait_value(testbed, prometheus, 'vllmdp_resources{phase="Serving"}', 1)
        _wait_value(testbed, prometheus, 'sum(vllmdp_resources)', 1)
        _wait_value(testbed, prometheus,
                    f'vllmdp_resource_phase{{namespace="{ns}",name="{NAME}"}}', 1)
        assert prometheus.query(f'vllmdp_resource_phase{{name="{NAME}"}}')[0]["metric"][
            "phase"] == "Serving"
        _wait_value(testbed, prometheus, "vllmdp_head_job_launches_total", 1)
        _wait_value(testbed, prometheus, "vllmdp_head_job_failures_total", 0)
        _wait_value(testbed, prometheus, "vllmdp_reconcile_errors_total", 0)
        _wait_value(testbed, prometheus, "vllmdp_time_to_serving_seconds_count", 1)
        # Per-rank load, from the operator's last read of the head's /metrics.
        for r in range(RANKS):
            at = f'{{namespace="{ns}",name="{NAME}",rank="{r}"}}'
            _wait_value(testbed, prometheus, f"vllmdp_engine_requests_running{at}", r + 1)
            _wait_value(testbed, prometheus, f"vllmdp_engine_requests_waiting{at}", r)
            _wait_value(testbed, prometheus, f"vllmdp_engine_kv_cache_usage{at}", (r + 1) / 10)
        ok = prometheus.value('vllmdp_reconcile_total{result="success"}') or 0
        assert ok >= 4, ok  # create, follow-ups, cluster ready, launch, serving probes
        total = prometheus.value("sum(vllmdp_reconcile_total)") or 0
        assert 0 < total <= operator_reconciles(operator), total  # scraped a little earlier

        # Prometheus: vLLM's series through the chart's PodMonitor selector and port, with
        # the resource's name and namespace on each. Every pod of the namespace is offered
        # (workers answer the double too): the PodMonitor's rules pick the head.
        pods = items(testbed, ns, "pods")
        assert len(pods) >= 2
        prometheus.pods_file.write_text(json.dumps(pod_targets(pods)))  # type: ignore[attr-defined]
        _wait_value(testbed, prometheus,
                    f'count(vllm:num_requests_running{{vllmdataparallel="{NAME}",'
                    f'namespace="{ns}"}})', RANKS)  # fmt: skip
        _wait_value(testbed, prometheus,
                    f'sum(vllm:num_requests_waiting{{vllmdataparallel="{NAME}"}})', 6)
        (target,) = [t for t in prometheus.targets()
                     if t["labels"].get("vllmdataparallel") == NAME]  # fmt: skip
        assert target["scrapeUrl"] == f"http://{pod_ip}:8000/metrics", target
        assert target["health"] == "up", target

    # vLLM gone: Launching again, one more event, the per-rank view removed.
    st = wait_phase(testbed, ns, NAME, "Launching", timeout=60)
    assert "load" not in st
    cond = next(x for x in st["conditions"] if x["type"] == "EnginesReporting")
    assert cond["status"] == "Unknown" and cond["reason"] == "NotServing"
    testbed.wait_until("the Serving -> Launching event", lambda: phase_events(
        testbed, ns, NAME)[-1:] == ["Serving -> Launching"], timeout=15)
    assert len(phase_events(testbed, ns, NAME)) == 4
    _wait_value(testbed, prometheus, 'vllmdp_resources{phase="Launching"}', 1)


def test_operator_metrics_need_a_token_whose_user_may_get_them(
    testbed: Any, ns: str, operator: OperatorProcess
) -> None:
    """The secure metrics server asks the real API server: TokenReview, SubjectAccessReview."""
    scraper = operator.scraper  # type: ignore[attr-defined]
    testbed.wait_until("the operator's /metrics to answer",
                       lambda: scrape(operator, scraper.token)[0] == 200, timeout=60)
    code, body = scrape(operator, None)
    assert code == 401 and "vllmdp_" not in body, (code, body)
    code, body = scrape(operator, "not-a-token")
    assert code == 401 and "vllmdp_" not in body, (code, body)
    code, body = scrape(operator, scraper.nobody)  # a real token, without the reader role
    assert code == 403 and "vllmdp_" not in body, (code, body)
    code, body = scrape(operator, scraper.token)
    assert code == 200 and "vllmdp_reconcile_total" in body, (code, body[:300])
    # Nothing in clear: the port speaks TLS only, so no token or metric crosses unencrypted.
    port = operator.metrics_port  # type: ignore[attr-defined]
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
