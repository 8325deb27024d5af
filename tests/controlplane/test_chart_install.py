"""The Helm chart against a real API server: every values file passes server-side validation,
and install / upgrade / uninstall behave (CRD kept, RBAC follows the values).

The test bed's kwok nodes run no containers, so the operator pod's image never executes here:
what is checked is what the API server admits and stores. The kind tier runs the image.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import shlex
import socket
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chart"))
sys.path.append(str(Path(__file__).resolve().parents[1] / "testbed"))  # promlib
import chartlib
from operator_proc import probe_mode
from promlib import install_monitoring_crds

if TYPE_CHECKING:
    from conftest import RunningTestbed  # type: ignore[import-not-found, attr-defined, unused-ignore]

pytestmark = pytest.mark.controlplane

CRD = "vllmdataparallels.vllmdp.io"
CASES = [pytest.param((), id="defaults")] + [
    pytest.param((p,), id=p.stem) for p in chartlib.CI_VALUES
]


@pytest.fixture(scope="module")
def helm_bin() -> str:
    try:
        path: str = chartlib.helm_binary()
        return path
    except chartlib.HelmUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)


def _helm(testbed: RunningTestbed, *args: str, check: bool = True,
          timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": str(testbed.kubeconfig),
           # Keep helm's own cache/config out of $HOME.
           "HELM_CACHE_HOME": str(testbed.state_dir / "helm" / "cache"),
           "HELM_CONFIG_HOME": str(testbed.state_dir / "helm" / "config"),
           "HELM_DATA_HOME": str(testbed.state_dir / "helm" / "data")}
    proc = subprocess.run([chartlib.helm_binary(), *args], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed (rc={proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def _watch_override(values: tuple[Path, ...], ns: str) -> tuple[str, ...]:
    # The ci files name an example namespace; point it at the test's own.
    sets_watch = any("watchNamespaces" in (yaml.safe_load(p.read_text()) or {}) for p in values)
    return (f"watchNamespaces={{{ns}}}",) if sets_watch else ()


@pytest.mark.parametrize("values", CASES)
def test_server_side_dry_run(testbed: RunningTestbed, testbed_namespace: str, helm_bin: str,
                             values: tuple[Path, ...]) -> None:
    # The API server validates every rendered field (pod security fields, RBAC rules, probe)
    # without persisting anything.
    ns = testbed_namespace
    objects = chartlib.render(values, _watch_override(values, ns),
                              release=f"dry-{ns[-6:]}", namespace=ns)
    if {o["kind"] for o in objects} & {"ServiceMonitor", "PodMonitor"}:
        install_monitoring_crds(testbed)  # the Prometheus operator's own schemas judge them
    proc = testbed.kubectl("apply", "--dry-run=server", "-f", "-",
                           input=yaml.safe_dump_all(objects), check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("(server dry run)") == len(objects), proc.stdout


@pytest.fixture
def release(testbed: RunningTestbed, testbed_namespace: str, helm_bin: str) -> Iterator[str]:
    name = f"op-{testbed_namespace[-6:]}"
    yield name
    _helm(testbed, "uninstall", name, f"--namespace={testbed_namespace}", "--wait",
          check=False)


def _get(testbed: RunningTestbed, *args: str) -> dict[str, Any] | None:
    proc = testbed.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def test_install_upgrade_uninstall(testbed: RunningTestbed, testbed_namespace: str,
                                   release: str) -> None:
    ns = testbed_namespace
    chart = str(chartlib.CHART)
    full = f"{release}-vllm-dp-operator"

    out = _helm(testbed, "install", release, chart, f"--namespace={ns}").stdout
    # NOTES.txt tells the user what to do next, KubeRay's own chart first.
    assert "kubectl apply" in out and "kuberay-operator" in out and "-api" in out, out
    testbed.kubectl("wait", "--for=condition=Established", f"crd/{CRD}", "--timeout=60s")

    dep = _get(testbed, "deployment", full, "-n", ns)
    assert dep is not None
    pod_spec = dep["spec"]["template"]["spec"]
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    assert pod_spec["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert _get(testbed, "serviceaccount", full, "-n", ns) is not None
    role = _get(testbed, "clusterrole", full)
    assert role is not None
    assert not any("services/proxy" in r["resources"] for r in role["rules"])
    # Two replicas behind a Lease: its Role in the release namespace, and a disruption budget.
    lease_role = _get(testbed, "role", f"{full}-leader-election", "-n", ns)
    assert lease_role is not None and lease_role["rules"] == [{
        "apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
        "verbs": ["get", "create", "update"]}]  # fmt: skip
    assert _get(testbed, "rolebinding", f"{full}-leader-election", "-n", ns) is not None
    pdb = _get(testbed, "poddisruptionbudget", full, "-n", ns)
    assert pdb is not None and pdb["spec"]["maxUnavailable"] == 1
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    # kwok runs the pod (no containers really start): the Deployment becomes available.
    try:
        testbed.wait_until(
            "operator Deployment available",
            lambda: (_get(testbed, "deployment", full, "-n", ns) or {})
            .get("status", {}).get("availableReplicas") == 2,
            120,
        )
    except AssertionError as exc:
        pods = testbed.kubectl("get", "pods,events", "-n", ns, "-o", "wide", check=False)
        raise AssertionError(f"{exc}\n{pods.stdout}{pods.stderr}") from None

    # Upgrade to the API-server-proxy probe: RBAC and env follow.
    _helm(testbed, "upgrade", release, chart, f"--namespace={ns}",
          f"--values={chartlib.CHART / 'ci' / 'apiserver-proxy-values.yaml'}")
    role = _get(testbed, "clusterrole", full)
    assert role is not None
    assert any("services/proxy" in r["resources"] and r["verbs"] == ["get", "create"]
               for r in role["rules"])
    dep = _get(testbed, "deployment", full, "-n", ns)
    assert dep is not None
    container = dep["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["VLLMDP_HEALTH_PROBE"] == "apiserver-proxy"

    # Watch a listed namespace: the ClusterRole goes, a Role appears in the namespace.
    _helm(testbed, "upgrade", release, chart, f"--namespace={ns}",
          f"--set=watchNamespaces={{{ns}}}")
    assert _get(testbed, "role", full, "-n", ns) is not None
    assert _get(testbed, "clusterrole", full) is None
    assert _get(testbed, "clusterrole", f"{full}-observer") is not None

    _helm(testbed, "uninstall", release, f"--namespace={ns}", "--wait")
    for args in (("deployment", full, "-n", ns), ("serviceaccount", full, "-n", ns),
                 ("role", full, "-n", ns), ("clusterrole", f"{full}-observer"),
                 ("clusterrolebinding", f"{full}-observer")):
        assert _get(testbed, *args) is None, args
    # Helm never deletes CRDs from crds/: resources of users survive an uninstall.
    assert _get(testbed, "crd", CRD) is not None


def test_chart_crd_matches_cluster_crd(testbed: RunningTestbed) -> None:
    # Whatever installed the CRD (the test bed from crds/, or helm from the chart), the stored
    # schema is the chart's.
    shipped = yaml.safe_load((chartlib.CHART / "crds" / "vllmdp.io_vllmdataparallels.yaml")
                             .read_text())
    stored = _get(testbed, "crd", CRD)
    assert stored is not None
    assert [v["name"] for v in stored["spec"]["versions"]] == \
        [v["name"] for v in shipped["spec"]["versions"]]
    assert stored["spec"]["versions"][0]["schema"] == shipped["spec"]["versions"][0]["schema"]


def test_helm_install_then_example_reaches_the_integration_state(
    testbed: RunningTestbed, testbed_namespace: str, release: str, tmp_path: Path
) -> None:
    """`helm install`, then `kubectl apply -f examples/...`: the same children as the tier.

    kwok runs no containers, so the Deployment's own command and environment are run here as
    a process, logged in with a token of the ServiceAccount the chart installed.
    """
    ns = testbed_namespace
    full = f"{release}-vllm-dp-operator"
    _helm(testbed, "install", release, str(chartlib.CHART), f"--namespace={ns}",
          f"--values={chartlib.CHART / 'ci' / 'apiserver-proxy-values.yaml'}")
    dep = _get(testbed, "deployment", full, "-n", ns)
    assert dep is not None
    container = dep["spec"]["template"]["spec"]["containers"][0]
    token = testbed.kubectl("create", "token", full, "-n", ns).stdout.strip()
    kubeconfig = chartlib.sa_kubeconfig(tmp_path / "sa.kubeconfig", testbed.kubeconfig, token)
    # The Ray auth key the chart made, where the pod would have it mounted (its volume).
    secret = _get(testbed, "secret", f"{full}-ray-auth-key", "-n", ns)
    assert secret is not None and secret["data"]["key"], "the chart made no Ray auth key"
    key_file = tmp_path / "ray-auth-key"
    key_file.write_bytes(base64.b64decode(secret["data"]["key"]))
    # The metrics certificate the chart made (metrics.tls), where the pod would mount it.
    tls = _get(testbed, "secret", f"{full}-metrics-tls", "-n", ns)
    assert tls is not None and tls["type"] == "kubernetes.io/tls", "the chart made no certificate"
    for item in ("tls.crt", "tls.key", "ca.crt"):
        (tmp_path / item).write_bytes(base64.b64decode(tls["data"][item]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        ready_port = s.getsockname()[1]
    env = {**os.environ, **{e["name"]: e["value"] for e in container["env"] if "value" in e},
           "KUBECONFIG": str(kubeconfig),
           "VLLMDP_HEALTH_PROBE": probe_mode(testbed.env()),
           # What the downward API gives the pod: the Lease is in the release namespace.
           "POD_NAME": f"{full}-test", "POD_NAMESPACE": ns,
           "VLLMDP_READINESS_HOST": "127.0.0.1", "VLLMDP_READINESS_PORT": str(ready_port),
           "VLLMDP_RAY_AUTH_KEY_FILE": str(key_file),
           "VLLMDP_METRICS_HOST": "127.0.0.1", "VLLMDP_METRICS_PORT": str(metrics_port),
           "VLLMDP_METRICS_TLS_CERT_FILE": str(tmp_path / "tls.crt"),
           "VLLMDP_METRICS_TLS_KEY_FILE": str(tmp_path / "tls.key")}
    # Everything as the Deployment says, but the liveness and readiness ports, which a test
    # must not bind as they are.
    args = [a for a in container["args"] if not a.startswith("--liveness")]
    log = (tmp_path / "operator.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", *container["command"], *args], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        testbed.kubectl("apply", "-n", ns, "-f", str(chartlib.REPO / "examples" / "dp4-tp2.yaml"))
        vdp = testbed.wait_until("the example to reach Launching", lambda: (
            (v := _get(testbed, "vdp", "llama8b-dp4-tp2", "-n", ns))
            and v.get("status", {}).get("phase") == "Launching" and v), 120)
        st = vdp["status"]
        # Ready with the chart's RBAC: caches synced, and the Lease taken in the release namespace.
        with urllib.request.urlopen(f"http://127.0.0.1:{ready_port}/readyz", timeout=5) as r:
            assert r.status == 200, r.read()
        # /metrics over TLS with the chart's certificate, for the metrics Service's name and
        # checked against the chart's CA (what its ServiceMonitor does); no token: 401.
        assert _metrics_status(metrics_port, tmp_path / "ca.crt",
                               f"{full}-metrics.{ns}.svc") == 401
        lease = _get(testbed, "lease", full, "-n", ns)
        assert lease is not None and lease["spec"]["holderIdentity"].startswith(f"{full}-test_")
        assert _get(testbed, "raycluster", st["rayCluster"], "-n", ns) is not None
        assert _get(testbed, "rayjob", st["headJob"], "-n", ns) is not None
        assert _get(testbed, "service", "llama8b-dp4-tp2-api", "-n", ns) is not None
        testbed.kubectl("delete", "vdp", "llama8b-dp4-tp2", "-n", ns, "--timeout=60s")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    text = (tmp_path / "operator.log").read_text(errors="replace")
    assert "forbidden" not in text.lower(), text[-3000:]


def _metrics_status(port: int, ca: Path, host: str) -> int:
    """The status of GET /metrics on 127.0.0.1:port over TLS, the certificate checked for
    `host` against `ca`."""
    context = ssl.create_default_context(cafile=str(ca))
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
    conn.sock = context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                                    server_hostname=host)  # fmt: skip
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().status
    finally:
        conn.close()


def _readme_helm_install() -> list[str]:
    """The README's `helm install` line, split as a shell would split it."""
    readme = (chartlib.REPO / "README.md").read_text()
    lines = [ln.strip() for ln in readme.splitlines() if ln.strip().startswith("helm install ")]
    assert len(lines) == 1, lines
    assert not lines[0].endswith("\\"), "keep the README's helm install on one line"
    return shlex.split(lines[0])


def test_readme_helm_install_works_as_written(testbed: RunningTestbed) -> None:
    """The README's line, from the repository root, installs the chart: no vendored
    dependency, no placeholder to fill in. (It names its own release and namespace.)"""
    argv = _readme_helm_install()
    release, ns = argv[2], argv[argv.index("-n") + 1]
    if _get(testbed, "namespace", ns) is not None:  # left over from an interrupted run
        _helm(testbed, "uninstall", release, f"--namespace={ns}", "--wait", check=False)
        testbed.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=120s")
    env = {**os.environ, "KUBECONFIG": str(testbed.kubeconfig),
           "HELM_CACHE_HOME": str(testbed.state_dir / "helm" / "cache"),
           "HELM_CONFIG_HOME": str(testbed.state_dir / "helm" / "config"),
           "HELM_DATA_HOME": str(testbed.state_dir / "helm" / "data")}
    try:
        proc = subprocess.run([chartlib.helm_binary(), *argv[1:]], cwd=chartlib.REPO, env=env,
                              capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, f"{' '.join(argv)} failed:\n{proc.stdout}\n{proc.stderr}"
        assert "STATUS: deployed" in proc.stdout, proc.stdout
        full = f"{release}-vllm-dp-operator"
        assert _get(testbed, "deployment", full, "-n", ns) is not None
        role = _get(testbed, "clusterrole", full)
        assert role is not None
        assert any("vllmdataparallels/finalizers" in r["resources"] and "update" in r["verbs"]
                   for r in role["rules"])  # fmt: skip
        testbed.kubectl("wait", "--for=condition=Established", f"crd/{CRD}", "--timeout=60s")
    finally:
        _helm(testbed, "uninstall", release, f"--namespace={ns}", "--wait", check=False)
        testbed.kubectl("delete", "namespace", ns, "--wait=false", check=False)
