"""A real Prometheus for the test tiers (control-plane, real-engine cluster), and the
Prometheus operator's CRDs for the test bed.

- `Prometheus`: Debian's `prometheus` package (installed by .ci/run) run as a child process on
  127.0.0.1 with a scrape config of the test's, its TSDB in the test's temp dir; stopped by
  PID. `query()` asks its HTTP API.
- `scrape_config_from_pod_monitor()`: the scrape job a Prometheus operator would make of a
  PodMonitor (selector, port name, path, relabelings). Debian's Prometheus 2.42 has no
  kubernetes_sd, so `pod_targets()` turns pods read from the API server into the same
  `__meta_kubernetes_*` labels for a file_sd file, and the PodMonitor's rules select among
  them. The control-plane tier scrapes the vLLM test double with it, the real-engine
  cluster tier (tests/cluster/test_operator_vllm_cpu.py) real vLLM on the head pod.
- `install_monitoring_crds()`: ServiceMonitor and PodMonitor CRDs from the Prometheus
  operator's Go module (the Go module proxy), so the API server validates the chart's monitors.

Standard library plus PyYAML; no operator code.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

PROMETHEUS_OPERATOR_MODULE = "github.com/prometheus-operator/prometheus-operator"
PROMETHEUS_OPERATOR_VERSION = "v0.80.1"
MONITORING_CRDS = ("monitoring.coreos.com_servicemonitors.yaml",
                   "monitoring.coreos.com_podmonitors.yaml")  # fmt: skip


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _unavailable(reason: str) -> None:
    if _in_ci():
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def prometheus_binary() -> str:
    """Debian's prometheus on PATH (or /usr/bin); skips outside CI when it is missing."""
    found = shutil.which("prometheus") or ("/usr/bin/prometheus"
                                            if Path("/usr/bin/prometheus").exists() else None)
    if found is None:
        _unavailable("prometheus is not installed (Debian's package `prometheus`; .ci/run "
                     "installs it): apt-get install prometheus")
    assert found is not None
    return found


class Prometheus:
    """One Prometheus server process, scraping what `scrape_configs` says."""

    def __init__(self, workdir: Path, scrape_configs: list[dict[str, Any]],
                 interval: str = "1s", host: str = "127.0.0.1") -> None:  # fmt: skip
        """`host`: the address it listens on (a bed's own address where pods ask it, as
        KEDA's Prometheus scaler does)."""
        self.workdir = workdir
        self.port = free_port()
        self.host = host
        self.url = f"http://{host}:{self.port}"
        self.config = {"global": {"scrape_interval": interval, "evaluation_interval": interval},
                       "scrape_configs": scrape_configs}  # fmt: skip
        self.log = workdir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> None:
        """Start it and wait until /-/ready answers."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config, sort_keys=False))
        cmd = [prometheus_binary(), f"--config.file={config}",
               f"--storage.tsdb.path={self.workdir / 'data'}",
               f"--web.listen-address={self.host}:{self.port}", "--log.level=info"]  # fmt: skip
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited early:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready within {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop it by PID."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def _get(self, path: str, **params: str) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as resp:
            doc = json.loads(resp.read())
        assert doc.get("status") == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant PromQL query: the vector's samples ({metric, value})."""
        data = self._get("/api/v1/query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        return result

    def value(self, expr: str) -> float | None:
        """The one sample of an instant query, or None when the vector is empty."""
        result = self.query(expr)
        if not result:
            return None
        assert len(result) == 1, result
        return float(result[0]["value"][1])

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets with their labels, health and last error."""
        active: list[dict[str, Any]] = self._get("/api/v1/targets")["activeTargets"]
        return active

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def _label_name(key: str) -> str:
    """A Kubernetes label key as Prometheus' kubernetes_sd meta label suffix."""
    return "".join(ch if ch.isalnum() else "_" for ch in key)


def kubernetes_sd(api_server: str, token: str, namespaces: list[str] | None = None,
                  ca_file: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Pod discovery through the API server, for a Prometheus built with kubernetes_sd."""
    sd: dict[str, Any] = {"role": "pod", "api_server": api_server,
                          "authorization": {"credentials": token},
                          "tls_config": ({"ca_file": ca_file} if ca_file
                                         else {"insecure_skip_verify": True})}  # fmt: skip
    if namespaces:
        sd["namespaces"] = {"names": list(namespaces)}
    return {"kubernetes_sd_configs": [sd]}


def pod_targets(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What kubernetes_sd's pod role makes of pods: one target per container port, with the
    same __meta_kubernetes_* labels (namespace, pod name, every pod label, the port's name).

    Debian's Prometheus 2.42 is built without kubernetes_sd; written to a file_sd file, these
    targets go through the same relabel rules a PodMonitor's job has.
    """
    targets = []
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            continue
        meta = pod["metadata"]
        common = {"__meta_kubernetes_namespace": meta["namespace"],
                  "__meta_kubernetes_pod_name": meta["name"],
                  **{f"__meta_kubernetes_pod_label_{_label_name(k)}": v
                     for k, v in (meta.get("labels") or {}).items()}}  # fmt: skip
        for container in pod["spec"]["containers"]:
            for port in container.get("ports") or []:
                targets.append({"targets": [f"{ip}:{port['containerPort']}"], "labels": {
                    **common, "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                    "__meta_kubernetes_pod_container_name": container["name"]}})  # fmt: skip
    return targets


def file_sd(path: Path) -> dict[str, Any]:
    """Discovery from a JSON file of targets (pod_targets), re-read every second."""
    return {"file_sd_configs": [{"files": [str(path)], "refresh_interval": "1s"}]}


def scrape_config_from_pod_monitor(pod_monitor: dict[str, Any],
                                   discovery: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """The scrape job the Prometheus operator generates for a PodMonitor's one endpoint.

    The selector's labels and the endpoint's port name become `keep` rules over the pod
    meta labels, and the endpoint's relabelings follow them, in the operator's order.
    `discovery` is kubernetes_sd() (a Prometheus with it; namespaces from the PodMonitor's
    namespaceSelector) or file_sd() over pod_targets().
    """
    spec = pod_monitor["spec"]
    (endpoint,) = spec["podMetricsEndpoints"]
    keep = [{"action": "keep", "regex": value,
             "source_labels": [f"__meta_kubernetes_pod_label_{_label_name(key)}"]}
            for key, value in sorted(spec["selector"]["matchLabels"].items())]  # fmt: skip
    names = (spec.get("namespaceSelector") or {}).get("matchNames")
    if names:
        keep.append({"action": "keep", "regex": "|".join(names),
                     "source_labels": ["__meta_kubernetes_namespace"]})
    keep.append({"action": "keep", "regex": endpoint["port"],
                 "source_labels": ["__meta_kubernetes_pod_container_port_name"]})
    relabel = [{"source_labels": r["sourceLabels"], "target_label": r["targetLabel"]}
               for r in endpoint.get("relabelings") or []]  # fmt: skip
    return {
        "job_name": f"podMonitor/{pod_monitor['metadata']['name']}",
        "metrics_path": endpoint.get("path", "/metrics"),
        **discovery,
        "relabel_configs": keep + relabel,
    }


def monitoring_crd_files() -> list[Path]:
    """The ServiceMonitor and PodMonitor CRDs from the Prometheus operator's Go module."""
    if shutil.which("go") is None:
        _unavailable("the Prometheus operator's CRDs come from its Go module: Go not found")
    ref = f"{PROMETHEUS_OPERATOR_MODULE}@{PROMETHEUS_OPERATOR_VERSION}"
    proc = subprocess.run(["go", "mod", "download", "-json", ref], capture_output=True,
                          text=True, timeout=600, cwd="/")  # fmt: skip
    try:
        info = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"go mod download {ref} failed:\n{proc.stderr}") from None
    if info.get("Error") or not info.get("Dir"):
        raise AssertionError(f"go mod download {ref}: {info.get('Error')}")
    crd_dir = Path(info["Dir"]) / "example" / "prometheus-operator-crd"
    return [crd_dir / name for name in MONITORING_CRDS]


def install_monitoring_crds(testbed: Any) -> None:
    """Apply the ServiceMonitor and PodMonitor CRDs and wait until the API serves them."""
    for path in monitoring_crd_files():
        testbed.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    for name in ("servicemonitors", "podmonitors"):
        testbed.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                        f"crd/{name}.monitoring.coreos.com")  # fmt: skip
