"""Scrape wiring in the chart: absent by default; with monitoring on, a metrics Service and
ServiceMonitor for the operator, a PodMonitor for vLLM on every resource's head pod (selecting
the labels the operator's renderer really puts there), and the Grafana dashboard."""

from __future__ import annotations

import base64
import json
import ssl
from pathlib import Path
from typing import Any

import chartlib
import pytest
from vllm_dp_operator import constants as c
from vllm_dp_operator.api.validation import validate
from vllm_dp_operator.config import RenderOptions
from vllm_dp_operator.plan import build_plan
from vllm_dp_operator.render import build_raycluster

MONITORING = chartlib.CHART / "ci" / "monitoring-values.yaml"
MONITOR_KINDS = {"ServiceMonitor", "PodMonitor", "ConfigMap", "Service"}


def _one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (obj,) = chartlib.by_kind(objects, kind)
    return obj


def _container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = _one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def test_off_by_default_but_the_operator_serves_metrics(helm_bin: str) -> None:
    objects = chartlib.render()
    assert not {o["kind"] for o in objects} & MONITOR_KINDS
    container = _container(objects)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["VLLMDP_METRICS_PORT"] == "8081"
    # Secure by default: the scrape needs a token the API server vouches for.
    config = pytest.importorskip("vllm_dp_operator.config")
    assert env["VLLMDP_METRICS_AUTH"] == "kubernetes" == config.Config().metrics_auth
    assert env["VLLMDP_METRICS_HOST"] == "0.0.0.0"
    assert "VLLMDP_METRICS_AUDIENCES" not in env  # the API server's own audiences
    assert {"name": "metrics", "containerPort": 8081, "protocol": "TCP"} in container["ports"]


def test_token_audiences_reach_the_operator(helm_bin: str, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:  # fmt: skip
    objects = chartlib.render(set_values=("metrics.tokenAudiences={vllm-dp-metrics,other}",))
    env = {e["name"]: e.get("value") for e in _container(objects)["env"]}
    assert env["VLLMDP_METRICS_AUDIENCES"] == "vllm-dp-metrics,other"
    config = pytest.importorskip("vllm_dp_operator.config")
    monkeypatch.setenv("VLLMDP_METRICS_AUDIENCES", env["VLLMDP_METRICS_AUDIENCES"])
    assert config.Config.from_env().metrics_audiences == ("vllm-dp-metrics", "other")


def test_operator_service_monitor_reaches_the_metrics_port(helm_bin: str) -> None:
    objects = chartlib.render((MONITORING,))
    container = _container(objects)
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
    pod_labels = _one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    (svc,) = [s for s in chartlib.by_kind(objects, "Service") if s["metadata"]["name"]
              .endswith("-metrics")]  # fmt: skip
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics",
                                     "protocol": "TCP"}]  # fmt: skip
    monitor = _one(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [chartlib.DEFAULT_NAMESPACE]}
    full = svc["metadata"]["name"].removesuffix("-metrics")
    assert monitor["spec"]["endpoints"] == [{
        "port": "metrics", "path": "/metrics", "interval": "15s", "scheme": "https",
        "tlsConfig": {"serverName": f"{full}-metrics.{chartlib.DEFAULT_NAMESPACE}.svc",
                      "ca": {"secret": {"name": f"{full}-metrics-tls", "key": "ca.crt"}}},
        "bearerTokenFile": "/var/run/secrets/kubernetes.io/serviceaccount/token"}]  # fmt: skip


def test_metrics_are_served_over_tls_with_a_certificate_the_chart_makes(
    helm_bin: str, tmp_path: Path
) -> None:
    """The default: the chart's own certificate for the metrics Service, mounted, its key
    matching; a Secret of the user's instead when named; plain HTTP only when asked."""
    objects = chartlib.render()
    (secret,) = [s for s in chartlib.by_kind(objects, "Secret")
                 if s["metadata"]["name"].endswith("-metrics-tls")]  # fmt: skip
    assert secret["type"] == "kubernetes.io/tls"
    assert secret["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    pem = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    assert set(pem) == {"tls.crt", "tls.key", "ca.crt"}
    for name, data in pem.items():
        (tmp_path / name).write_bytes(data)
    # The key is the certificate's, and the certificate chains to the CA the monitor checks.
    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
        tmp_path / "tls.crt", tmp_path / "tls.key")
    ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
    container = _container(objects)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["VLLMDP_METRICS_TLS_CERT_FILE"] == "/etc/vllm-dp-operator/metrics-tls/tls.crt"
    assert env["VLLMDP_METRICS_TLS_KEY_FILE"] == "/etc/vllm-dp-operator/metrics-tls/tls.key"
    volumes = _one(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]
    (tls,) = [v for v in volumes if v["name"] == "metrics-tls"]
    assert tls["secret"]["secretName"] == secret["metadata"]["name"]
    # A certificate of the user's (cert-manager's): no Secret of the chart's, theirs mounted.
    theirs = chartlib.render((MONITORING,), ("metrics.tls.existingSecret=metrics-cert",))
    assert not [s for s in chartlib.by_kind(theirs, "Secret")
                if s["metadata"]["name"].endswith("-metrics-tls")]  # fmt: skip
    volumes = _one(theirs, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert [v["secret"]["secretName"] for v in volumes if v["name"] == "metrics-tls"] == [
        "metrics-cert"]
    endpoint = _one(theirs, "ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": "metrics-cert", "key": "ca.crt"}
    # Plain HTTP, asked for.
    plain = chartlib.render((MONITORING,), ("metrics.tls.enabled=false",))
    env = {e["name"] for e in _container(plain)["env"]}
    assert not {"VLLMDP_METRICS_TLS_CERT_FILE", "VLLMDP_METRICS_TLS_KEY_FILE"} & env
    assert "scheme" not in _one(plain, "ServiceMonitor")["spec"]["endpoints"][0]
    assert not [s for s in chartlib.by_kind(plain, "Secret")
                if s["metadata"]["name"].endswith("-metrics-tls")]  # fmt: skip


def test_the_secure_metrics_rbac_reviews_tokens_and_offers_a_reader_role(helm_bin: str) -> None:
    objects = chartlib.render()
    roles = {r["metadata"]["name"]: r for r in chartlib.by_kind(objects, "ClusterRole")}
    auth = next(r for n, r in roles.items() if n.endswith("-metrics-auth"))
    assert auth["rules"] == [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
         "verbs": ["create"]},
        {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"],
         "verbs": ["create"]}]  # fmt: skip
    reader = next(r for n, r in roles.items() if n.endswith("-metrics-reader"))
    assert reader["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    bindings = [b for b in chartlib.by_kind(objects, "ClusterRoleBinding")
                if b["roleRef"]["name"] == auth["metadata"]["name"]]  # fmt: skip
    assert len(bindings) == 1
    plain = chartlib.render((), ("metrics.auth=none",))
    assert not [r for r in chartlib.by_kind(plain, "ClusterRole")
                if r["metadata"]["name"].endswith(("-metrics-auth", "-metrics-reader"))]
    monitor = _one(chartlib.render((MONITORING,), ("metrics.auth=none",)), "ServiceMonitor")
    assert "bearerTokenFile" not in monitor["spec"]["endpoints"][0]


def _head_pod_template() -> tuple[dict[str, str], list[dict[str, Any]]]:
    """Labels and ports of a head pod as KubeRay makes it from our RayCluster: the template's
    labels (KubeRay keeps them) plus KubeRay's own ray.io/node-type."""
    raw = {"model": "m", "dataParallel": {"size": 4, "ranksPerNode": 2},
           "service": {"port": 8123}}  # fmt: skip
    spec = validate("demo", raw)
    cluster = build_raycluster("demo", "ns1", spec, build_plan(spec), RenderOptions(), None)
    template = cluster["spec"]["headGroupSpec"]["template"]
    labels = {**template["metadata"]["labels"], c.LABEL_RAY_NODE_TYPE: "head"}
    return labels, template["spec"]["containers"][0]["ports"]


def test_engine_pod_monitor_selects_head_pods_on_the_serving_port(helm_bin: str) -> None:
    monitor = _one(chartlib.render((MONITORING,)), "PodMonitor")
    labels, ports = _head_pod_template()
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    assert selector[c.LABEL_RAY_NODE_TYPE] == "head"  # not the worker pods
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert {"name": endpoint["port"], "containerPort": 8123} in ports
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "10s"
    relabel = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert relabel["vllmdataparallel"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"]
    assert relabel["namespace"] == ["__meta_kubernetes_namespace"]
    assert monitor["spec"]["namespaceSelector"] == {"any": True}


def test_engine_pod_monitor_follows_the_watched_namespace(helm_bin: str) -> None:
    objects = chartlib.render((MONITORING,), ("watchNamespaces={team-a,team-b}",))
    monitor = _one(objects, "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def test_dashboard_config_map_carries_the_dashboard(helm_bin: str) -> None:
    cm = _one(chartlib.render((MONITORING,)), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((chartlib.CHART / "dashboards" / "vllm-dp.json").read_text())
    assert json.loads(cm["data"]["vllm-dp.json"]) == shipped


def test_service_monitor_without_a_port_is_refused(helm_bin: str) -> None:
    proc = chartlib.helm("template", *chartlib.template_args(
        (MONITORING,), ("metrics.port=0",)), check=False)  # fmt: skip
    assert proc.returncode != 0
    assert "metrics.serviceMonitor.enabled needs metrics.port" in proc.stderr


@pytest.mark.parametrize("bad", ["metrics.port=70000", "metrics.podMonitor.interval=soon",
                                 "metrics.nosuch=1"])
def test_schema_rejects_bad_metrics_values(helm_bin: str, bad: str) -> None:
    proc = chartlib.helm("template", *chartlib.template_args((), (bad,)), check=False)
    assert proc.returncode != 0, bad
