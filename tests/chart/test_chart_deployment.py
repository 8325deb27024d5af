"""Shape of the rendered operator Deployment: two replicas behind a Lease, a rolling update,
a PodDisruptionBudget, spread across nodes, hardened pod, kopf command line, readiness and the
VLLMDP_* settings the operator reads (vllm_dp_operator.config)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import chartlib
import pytest
import yaml

CI = {p.stem: p for p in chartlib.CI_VALUES}
KOPF_ARGS = ["run", "--standalone", "--liveness=http://0.0.0.0:8080/healthz",
             "-m", "vllm_dp_operator.handlers"]
ENV_NAMES = ["POD_NAME", "POD_NAMESPACE", "VLLMDP_ENGINE_IMAGE", "VLLMDP_SOCKET_IFNAME",
             "VLLMDP_ENGINE_FS_GROUP", "VLLMDP_MAX_CONCURRENT_UPDATES",
             "VLLMDP_HEALTH_PROBE", "VLLMDP_HEALTH_TIMEOUT_SECONDS",
             "VLLMDP_PROBE_LAUNCHING_SECONDS", "VLLMDP_PROBE_SERVING_SECONDS",
             "VLLMDP_PROBE_METRICS_SECONDS",
             "VLLMDP_PROBE_CONCURRENCY", "VLLMDP_PROXY_QPS",
             "VLLMDP_UNROUTE_AFTER_FAILURES", "VLLMDP_UNROUTE_AFTER_SECONDS",
             "VLLMDP_RELAUNCH_HUNG_AFTER_SECONDS",
             "VLLMDP_CLUSTER_DOMAIN", "VLLMDP_STOP_CONFIRM_SECONDS", "VLLMDP_RESYNC_SECONDS",
             "VLLMDP_WORKERS",
             "VLLMDP_BACKOFF_BASE_SECONDS", "VLLMDP_BACKOFF_CAP_SECONDS", "VLLMDP_WATCH_NAMESPACES",
             "VLLMDP_METRICS_PORT", "VLLMDP_METRICS_HOST", "VLLMDP_METRICS_AUTH",
             "VLLMDP_METRICS_TLS_CERT_FILE", "VLLMDP_METRICS_TLS_KEY_FILE",
             "VLLMDP_ENGINE_METRICS_MAX_BYTES", "VLLMDP_LEADER_ELECTION",
             "VLLMDP_LEASE_NAME", "VLLMDP_LEASE_DURATION_SECONDS",
             "VLLMDP_RENEW_DEADLINE_SECONDS", "VLLMDP_RETRY_PERIOD_SECONDS",
             "VLLMDP_READINESS_PORT", "VLLMDP_RAY_AUTH_KEY_FILE",
             "VLLMDP_RAY_AUTH_PREVIOUS_KEY_FILE", "VLLMDP_NETWORK_POLICY",
             "VLLMDP_OPERATOR_NAMESPACE", "VLLMDP_OPERATOR_POD_LABELS", "VLLMDP_OPERATOR_CIDRS",
             "VLLMDP_KUBERAY_NAMESPACE", "VLLMDP_KUBERAY_POD_LABELS",
             "VLLMDP_API_NAMESPACE_LABELS", "VLLMDP_API_PORT_OPEN"]


def _deployment(values: tuple[Path, ...] = (), set_values: tuple[str, ...] = ()) -> dict[str, Any]:
    (dep,) = chartlib.by_kind(chartlib.render(values, set_values), "Deployment")
    return dep


def _container(dep: dict[str, Any]) -> dict[str, Any]:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert isinstance(c, dict)
    return c


def _env(dep: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in _container(dep)["env"]}


def test_two_replicas_rolling_update(helm_bin: str) -> None:
    spec = _deployment()["spec"]
    assert spec["replicas"] == 2
    # A new pod is ready (synced, Lease API answering) before an old one stops.
    assert spec["strategy"] == {"type": "RollingUpdate",
                                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def test_replicas_without_leader_election_are_refused(helm_bin: str) -> None:
    proc = chartlib.helm("template", *chartlib.template_args(
        set_values=["leaderElection.enabled=false"]), check=False)  # fmt: skip
    assert proc.returncode != 0 and "needs leaderElection.enabled" in proc.stderr
    one = _deployment(set_values=("leaderElection.enabled=false", "replicas=1"))
    assert one["spec"]["replicas"] == 1 and _env(one)["VLLMDP_LEADER_ELECTION"] == "false"


def test_lease_timings_that_overlap_are_refused(helm_bin: str) -> None:
    proc = chartlib.helm("template", *chartlib.template_args(
        set_values=["leaderElection.renewDeadlineSeconds=15"]), check=False)  # fmt: skip
    assert proc.returncode != 0
    assert "renewDeadlineSeconds < leaseDurationSeconds" in proc.stderr


def test_pod_disruption_budget_keeps_one_pod(helm_bin: str) -> None:
    objects = chartlib.render()
    (pdb,) = chartlib.by_kind(objects, "PodDisruptionBudget")
    (dep,) = chartlib.by_kind(objects, "Deployment")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"] == dep["spec"]["selector"]
    assert pdb["metadata"]["namespace"] == chartlib.DEFAULT_NAMESPACE
    off = chartlib.render(set_values=("podDisruptionBudget.enabled=false",))
    assert not chartlib.by_kind(off, "PodDisruptionBudget")


def test_replicas_prefer_different_nodes(helm_bin: str) -> None:
    dep = _deployment()
    anti = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (term,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"] == dep["spec"]["selector"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in anti  # one node still runs
    mine = _deployment(set_values=("affinity.nodeAffinity.x=y",))
    assert mine["spec"]["template"]["spec"]["affinity"] == {"nodeAffinity": {"x": "y"}}


def test_readiness_probe_on_the_operator_readyz(helm_bin: str) -> None:
    c = _container(_deployment())
    probe = c["readinessProbe"]["httpGet"]
    assert probe == {"path": "/readyz", "port": "readiness"}
    assert {"name": "readiness", "containerPort": 8082, "protocol": "TCP"} in c["ports"]
    assert _env(_deployment())["VLLMDP_READINESS_PORT"] == "8082"


def test_pod_identity_and_lease_settings_reach_the_environment(helm_bin: str) -> None:
    c = _container(_deployment())
    downward = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]
                if "valueFrom" in e}  # fmt: skip
    assert downward == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    env = _env(_deployment())
    assert env["VLLMDP_LEADER_ELECTION"] == "true"
    assert env["VLLMDP_LEASE_NAME"] == "vdp-vllm-dp-operator"
    named = _env(_deployment(set_values=("leaderElection.leaseName=ops-lease",)))
    assert named["VLLMDP_LEASE_NAME"] == "ops-lease"


def test_liveness_probe_on_kopf_health_endpoint(helm_bin: str) -> None:
    c = _container(_deployment())
    probe = c["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    port = probe["port"]
    assert port == 8080 or {"name": port, "containerPort": 8080, "protocol": "TCP"} in c["ports"]
    assert "--liveness=http://0.0.0.0:8080/healthz" in c["args"]


def test_hardened_security_context(helm_bin: str) -> None:
    dep = _deployment()
    pod = dep["spec"]["template"]["spec"]
    c = _container(dep)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert pod["enableServiceLinks"] is False


def test_platform_may_choose_uid(helm_bin: str) -> None:
    pod = _deployment((CI["single-namespace-values"],))["spec"]["template"]["spec"]
    assert "runAsUser" not in pod["securityContext"]
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_only_the_operator_pod_mounts_the_token(helm_bin: str) -> None:
    objects = chartlib.render()
    (sa,) = chartlib.by_kind(objects, "ServiceAccount")
    (dep,) = chartlib.by_kind(objects, "Deployment")
    assert sa["automountServiceAccountToken"] is False
    assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is True


def test_cluster_wide_command_line_and_env(helm_bin: str) -> None:
    dep = _deployment()
    c = _container(dep)
    assert c["command"] == ["kopf"]
    assert c["args"] == [*KOPF_ARGS, "--all-namespaces"]
    env = _env(dep)
    assert list(env) == ENV_NAMES
    assert env["VLLMDP_WATCH_NAMESPACES"] == ""
    assert env["VLLMDP_HEALTH_PROBE"] == "service-dns"
    assert c["image"] == "vllm-dp-operator:0.1.0"


@pytest.mark.parametrize(
    ("values", "namespaces"),
    [("namespace-scope-values", ["llm-serving", "llm-batch"]),
     ("namespace-scope-no-observation-values", ["llm-serving"]),
     ("single-namespace-values", ["llm-serving"])],
)
def test_listed_namespaces_command_line(helm_bin: str, values: str,
                                        namespaces: list[str]) -> None:
    # kopf takes one --namespace per namespace; the controller's reflectors the same list.
    dep = _deployment((CI[values],))
    args = _container(dep)["args"]
    assert args[: len(KOPF_ARGS)] == KOPF_ARGS
    assert [a for a in args if a.startswith("--namespace=")] == [
        f"--namespace={n}" for n in namespaces]
    assert "--all-namespaces" not in args
    assert _env(dep)["VLLMDP_WATCH_NAMESPACES"] == ",".join(namespaces)


def test_values_reach_the_environment(helm_bin: str, tmp_path: Path) -> None:
    # A values file, not --set: --set turns 1.5 into a string, which the schema rejects.
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "engineImage": "registry.example.com/engine:1",
        "healthProbe": {"mode": "off", "timeoutSeconds": 1.5, "launchingSeconds": 3,
                        "servingSeconds": 45, "metricsSeconds": 90},
        "resyncSeconds": 30, "workers": 8, "backoff": {"baseSeconds": 2, "capSeconds": 64},
        "socketIfname": "ens5", "engineFsGroup": 3000, "stopConfirmSeconds": 90}))
    env = _env(_deployment((values,)))
    assert env["VLLMDP_ENGINE_IMAGE"] == "registry.example.com/engine:1"
    assert env["VLLMDP_HEALTH_PROBE"] == "off"
    assert env["VLLMDP_RESYNC_SECONDS"] == "30"
    assert env["VLLMDP_WORKERS"] == "8"
    assert env["VLLMDP_PROBE_LAUNCHING_SECONDS"] == "3"
    assert env["VLLMDP_PROBE_SERVING_SECONDS"] == "45"
    assert env["VLLMDP_PROBE_METRICS_SECONDS"] == "90"
    assert env["VLLMDP_BACKOFF_BASE_SECONDS"] == "2"
    assert env["VLLMDP_BACKOFF_CAP_SECONDS"] == "64"
    assert env["VLLMDP_HEALTH_TIMEOUT_SECONDS"] == "1.5"
    assert env["VLLMDP_SOCKET_IFNAME"] == "ens5"
    assert env["VLLMDP_ENGINE_FS_GROUP"] == "3000"
    assert env["VLLMDP_STOP_CONFIRM_SECONDS"] == "90"


def test_chart_defaults_match_operator_defaults(helm_bin: str) -> None:
    # The chart should not silently change the operator's documented defaults.
    config = pytest.importorskip("vllm_dp_operator.config")
    defaults = config.Config()
    env = _env(_deployment())
    assert env["VLLMDP_ENGINE_IMAGE"] == defaults.render.default_image
    assert env["VLLMDP_SOCKET_IFNAME"] == defaults.render.socket_ifname
    assert env["VLLMDP_HEALTH_PROBE"] == defaults.health_probe
    assert float(env["VLLMDP_RESYNC_SECONDS"]) == defaults.resync_seconds
    assert int(env["VLLMDP_WORKERS"]) == defaults.workers
    assert float(env["VLLMDP_PROBE_LAUNCHING_SECONDS"]) == defaults.probe_launching_seconds
    assert float(env["VLLMDP_PROBE_SERVING_SECONDS"]) == defaults.probe_serving_seconds
    assert float(env["VLLMDP_PROBE_METRICS_SECONDS"]) == defaults.probe_metrics_seconds
    assert int(env["VLLMDP_PROBE_CONCURRENCY"]) == defaults.probe_concurrency
    assert float(env["VLLMDP_PROXY_QPS"]) == defaults.proxy_qps
    assert int(env["VLLMDP_UNROUTE_AFTER_FAILURES"]) == defaults.unroute_after_failures
    assert float(env["VLLMDP_UNROUTE_AFTER_SECONDS"]) == defaults.unroute_after_seconds
    assert float(env["VLLMDP_RELAUNCH_HUNG_AFTER_SECONDS"]) == \
        defaults.relaunch_hung_after_seconds  # fmt: skip
    assert float(env["VLLMDP_BACKOFF_BASE_SECONDS"]) == defaults.backoff_base_seconds
    assert float(env["VLLMDP_BACKOFF_CAP_SECONDS"]) == defaults.backoff_cap_seconds
    assert float(env["VLLMDP_HEALTH_TIMEOUT_SECONDS"]) == defaults.health_timeout_seconds
    assert int(env["VLLMDP_ENGINE_FS_GROUP"]) == defaults.render.fs_group
    assert env["VLLMDP_MAX_CONCURRENT_UPDATES"] == defaults.max_concurrent_updates
    assert float(env["VLLMDP_STOP_CONFIRM_SECONDS"]) == defaults.stop_confirm_seconds
    assert env["VLLMDP_CLUSTER_DOMAIN"] == defaults.cluster_domain
    election = defaults.election
    assert env["VLLMDP_LEADER_ELECTION"] == str(election.enabled).lower()
    assert float(env["VLLMDP_LEASE_DURATION_SECONDS"]) == election.lease_duration_seconds == 15
    assert float(env["VLLMDP_RENEW_DEADLINE_SECONDS"]) == election.renew_deadline_seconds == 10
    assert float(env["VLLMDP_RETRY_PERIOD_SECONDS"]) == election.retry_period_seconds == 2
    assert int(env["VLLMDP_READINESS_PORT"]) == defaults.readiness_port


def test_operator_reads_the_rendered_environment(
    helm_bin: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every VLLMDP_* value as the chart writes it is what the operator parses at start: helm
    # prints a large number from values.yaml as a float (4.194304e+06), which int() rejects.
    config = pytest.importorskip("vllm_dp_operator.config")
    for name, value in _env(_deployment()).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("VLLMDP_RAY_AUTH_KEY_FILE", "")  # the mount: see the next test
    read = config.Config.from_env()
    assert read.engine_metrics_max_bytes == config.Config().engine_metrics_max_bytes == 4194304


def test_the_ray_auth_key_is_a_mounted_secret_the_operator_reads(
    helm_bin: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import base64

    config = pytest.importorskip("vllm_dp_operator.config")
    objects = chartlib.render()
    dep = chartlib.by_kind(objects, "Deployment")[0]
    (secret,) = [s for s in chartlib.by_kind(objects, "Secret")
                 if s["metadata"]["name"] == "vdp-vllm-dp-operator-ray-auth-key"]  # fmt: skip
    # Kept on upgrade (read back live) and on uninstall: tokens of surviving resources hold.
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    key = base64.b64decode(secret["data"]["key"])
    assert len(key) >= 32
    path = _env(dep)["VLLMDP_RAY_AUTH_KEY_FILE"]
    (volume,) = [v for v in dep["spec"]["template"]["spec"]["volumes"]
                 if v["name"] == "ray-auth-key"]  # fmt: skip
    (mount,) = [m for m in _container(dep)["volumeMounts"] if m["name"] == "ray-auth-key"]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"] and mount["readOnly"]
    # The whole Secret: `key`, and `previous` while a rotation is under way.
    assert "items" not in volume["secret"] and path == f"{mount['mountPath']}/key"
    assert _env(dep)["VLLMDP_RAY_AUTH_PREVIOUS_KEY_FILE"] == f"{mount['mountPath']}/previous"
    (tmp_path / "key").write_bytes(key)
    monkeypatch.setenv("VLLMDP_RAY_AUTH_KEY_FILE", str(tmp_path / "key"))
    tokens = config.Config.from_env().ray_tokens
    assert tokens.token("ns", "a", "u") == config.RayTokens(key).token("ns", "a", "u")
    # An existing Secret instead: the chart makes none and mounts that one.
    own = chartlib.render((), ("rayAuth.existingKeySecret=mine",))
    assert not [s for s in chartlib.by_kind(own, "Secret") if "ray-auth" in s["metadata"]["name"]]
    (volume,) = [v for v in chartlib.by_kind(own, "Deployment")[0]["spec"]["template"]["spec"]
                 ["volumes"] if v["name"] == "ray-auth-key"]  # fmt: skip
    assert volume["secret"]["secretName"] == "mine"


def test_cluster_domain_reaches_the_operator(
    helm_bin: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = pytest.importorskip("vllm_dp_operator.config")
    env = _env(_deployment(set_values=("clusterDomain=corp.example",)))
    monkeypatch.setenv("VLLMDP_CLUSTER_DOMAIN", env["VLLMDP_CLUSTER_DOMAIN"])
    assert config.Config.from_env().cluster_domain == "corp.example"


@pytest.mark.parametrize("bad", ["Cluster.Local", "cluster.local.", "a..b"])
def test_a_bad_cluster_domain_fails_the_install(helm_bin: str, bad: str) -> None:
    with pytest.raises(AssertionError, match="clusterDomain"):
        chartlib.render((), (f"clusterDomain={bad}",))


def test_image_and_pull_settings(helm_bin: str) -> None:
    dep = _deployment((CI["single-namespace-values"],))
    c = _container(dep)
    assert c["image"] == "registry.example.com/vllm-dp-operator:0.1.0-rc1"
    assert c["imagePullPolicy"] == "Always"
    assert dep["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert c["args"][-1] == "--verbose"
    assert {"name": "PYTHONASYNCIODEBUG", "value": "0"} in c["env"]


def test_an_image_digest_pins_the_image_and_overrides_the_tag(helm_bin: str) -> None:
    digest = "sha256:" + "0123456789abcdef" * 4
    dep = _deployment((), ("image.tag=ignored", f"image.digest={digest}"))
    assert _container(dep)["image"] == f"vllm-dp-operator@{digest}"


@pytest.mark.parametrize("bad", ["0123abcd", "sha256:XYZ", "sha512:" + "a" * 64])
def test_a_malformed_image_digest_fails_the_install(helm_bin: str, bad: str) -> None:
    with pytest.raises(AssertionError, match=r"image.digest|/image/digest"):
        chartlib.render((), (f"image.digest={bad}",))


def test_image_pull_secrets_take_the_name_form_and_plain_names(helm_bin: str) -> None:
    sets = ("imagePullSecrets[0].name=regcred", "imagePullSecrets[1]=legacy")
    dep = _deployment((), sets)
    assert dep["spec"]["template"]["spec"]["imagePullSecrets"] == [
        {"name": "regcred"}, {"name": "legacy"},
    ]  # fmt: skip


def test_network_policy_peers_reach_the_operator(
    helm_bin: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The operator's pods are named by the Deployment's own selector, in the release namespace.
    config = pytest.importorskip("vllm_dp_operator.config")
    dep = _deployment()
    env = _env(dep)
    selector = dep["spec"]["selector"]["matchLabels"]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("VLLMDP_RAY_AUTH_KEY_FILE")  # a mounted Secret in the pod, not here
    peers = config.Config.from_env().render.peers
    assert peers.enabled and peers.operator_namespace == chartlib.DEFAULT_NAMESPACE
    assert dict(peers.operator_pod_labels) == selector
    assert dep["spec"]["template"]["metadata"]["labels"].items() >= selector.items()
    assert peers.kuberay_namespace == "" and peers.operator_cidrs == ()
    assert peers.kuberay_pod_labels == config.PolicyPeers().kuberay_pod_labels
    # The API port: the own namespace and the namespaces labelled for API access (issue 39).
    assert peers.api_namespace_labels == (("vllmdp.io/api-access", "true"),)
    assert peers.api_namespace_labels == config.PolicyPeers().api_namespace_labels
    assert not peers.api_open
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"networkPolicy": {
        "enabled": False, "operatorCIDRs": ["10.0.0.10/32", "10.0.0.11/32"],
        "apiPort": {"open": True,
                    "namespaceLabels": {"gateway": "yes", "vllmdp.io/api-access": None}},
        "kuberay": {"namespace": "kuberay-system",
                    # Helm merges maps: null drops the default label.
                    "podLabels": {"app": "kuberay", "team": "ray",
                                  "app.kubernetes.io/name": None}}}}))  # fmt: skip
    for name, value in _env(_deployment((values,))).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("VLLMDP_RAY_AUTH_KEY_FILE")
    peers = config.Config.from_env().render.peers
    assert not peers.enabled
    assert peers.operator_cidrs == ("10.0.0.10/32", "10.0.0.11/32")
    assert peers.kuberay_namespace == "kuberay-system"
    assert peers.kuberay_pod_labels == (("app", "kuberay"), ("team", "ray"))
    assert peers.api_namespace_labels == (("gateway", "yes"),) and peers.api_open


@pytest.mark.parametrize("bad", ["networkPolicy.kuberay.namespace=Kube_Ray",
                                 "networkPolicy.operatorCIDRs={10.0.0.1}",
                                 "networkPolicy.apiPort.open=maybe",
                                 "networkPolicy.apiPort.namespaceLabels.a=b\\,c=d"])
def test_bad_network_policy_values_fail_the_install(helm_bin: str, bad: str) -> None:
    with pytest.raises(AssertionError, match="networkPolicy"):
        chartlib.render((), (bad,))
