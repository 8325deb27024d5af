"""End to end on kind: real images, real KubeRay, real Ray; only vLLM is a double.

Flow: create a kind cluster -> build and load the operator image and the engine-double image
(built FROM the engine image) -> install KubeRay 1.7.0 and our chart -> advertise
nvidia.com/gpu on the nodes (status patch; no real GPUs) -> apply a VLLMDataParallel ->
wait for phase Serving -> an OpenAI request through the Service (port-forward) -> delete it
and check the children are garbage-collected.

Needs Docker, kind, kubectl and network access (KubeRay's chart and operator image, the base
images). Skips with the reason when Docker or kind is missing. Knobs (docs/install.md):

  VLLMDP_E2E_CLUSTER        kind cluster name (default vllmdp-e2e)
  VLLMDP_E2E_KEEP=1         keep the cluster afterwards (and reuse one that exists)
  VLLMDP_E2E_ENGINE=real    use the real engine image and model on a cluster that has GPUs:
                            no kind, no GPU patch; images must be pullable by that cluster
  VLLMDP_E2E_OPERATOR_IMAGE / VLLMDP_E2E_ENGINE_IMAGE / VLLMDP_E2E_MODEL
  VLLMDP_E2E_KUBERAY_CHART  path of a local kuberay-operator-1.7.0.tgz (offline install)
  VLLMDP_E2E_SKIP_KUBERAY=1 the cluster already runs KubeRay 1.7.0; do not install it
  VLLMDP_E2E_TIMEOUT        seconds to wait for Serving (default 900)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chart"))
import chartlib

pytestmark = pytest.mark.kind

REPO = chartlib.REPO
REAL = os.environ.get("VLLMDP_E2E_ENGINE", "double") == "real"
CLUSTER = os.environ.get("VLLMDP_E2E_CLUSTER", "vllmdp-e2e")
KEEP = os.environ.get("VLLMDP_E2E_KEEP") == "1"
OPERATOR_IMAGE = os.environ.get("VLLMDP_E2E_OPERATOR_IMAGE", "vllm-dp-operator:e2e")
ENGINE_IMAGE = os.environ.get("VLLMDP_E2E_ENGINE_IMAGE", "vllm-dp-engine:0.1.0")
DOUBLE_IMAGE = "vllm-dp-engine-double:e2e"
MODEL = os.environ.get("VLLMDP_E2E_MODEL",
                       "Qwen/Qwen2.5-0.5B-Instruct" if REAL else "e2e/double-model")
SERVED = "e2e-model"
TIMEOUT = float(os.environ.get("VLLMDP_E2E_TIMEOUT", "900"))
KUBERAY_VERSION = "1.7.0"
KUBERAY_REPO = "https://ray-project.github.io/kuberay-helm/"
OPERATOR_NS = "vllm-dp-system"
APP_NS = "vllmdp-e2e"
NAME = "e2e"
GPUS_PER_NODE = 2


def _which_or_skip(tool: str, hint: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} not found on PATH: {hint}")
    return path


def _run(*cmd: str, check: bool = True, timeout: float = 600, input: str | None = None,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                          input=input, env=env, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed (rc={proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


@dataclass
class Cluster:
    kubectl_bin: str
    helm_bin: str
    kubeconfig: Path

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return _run(self.kubectl_bin, f"--kubeconfig={self.kubeconfig}", *args, check=check,
                    input=input, timeout=timeout)

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def helm(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        return _run(self.helm_bin, f"--kubeconfig={self.kubeconfig}", *args, timeout=timeout)

    def diagnostics(self) -> str:
        """What to look at when the flow fails: the resource, children, pods, logs, events."""
        parts = []
        for args in (
            ("get", "vllmdataparallels.vllmdp.io", "-A", "-o", "yaml"),
            ("get", "rayclusters.ray.io,rayjobs.ray.io,svc,pods", "-A", "-o", "wide"),
            ("logs", f"deployment/{NAME}-op-vllm-dp-operator", "-n", OPERATOR_NS, "--tail=200"),
            ("get", "events", "-n", APP_NS, "--sort-by=.lastTimestamp"),
        ):
            proc = self.kubectl(*args, check=False)
            parts.append(f"$ kubectl {' '.join(args)}\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}")
        return "\n".join(parts)


def _wait(what: str, check: Any, timeout: float, cluster: Cluster, interval: float = 3) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (AssertionError, OSError, ValueError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}\n"
                         f"{cluster.diagnostics()}")


def _docker_build(*args: str) -> None:
    _run("docker", "build", *args, timeout=3600)


def _helm_or_skip() -> str:
    try:
        path: str = chartlib.helm_binary()
        return path
    except chartlib.HelmUnavailable as exc:
        pytest.skip(f"helm unavailable (tests/chart/ensure_helm.sh needs Go): {exc}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if REAL:
        # A GPU user's cluster: the current kube context, images from a registry it can pull.
        kubectl = _which_or_skip("kubectl", "install kubectl (kubernetes.io/docs/tasks/tools)")
        kubeconfig = Path(os.environ.get("KUBECONFIG", Path.home() / ".kube" / "config"))
        yield Cluster(kubectl, _helm_or_skip(), kubeconfig)
        return

    # Cheap checks first: skip before building anything.
    _which_or_skip("docker", "install Docker (the kind tier runs Kubernetes in containers)")
    info = _run("docker", "info", check=False, timeout=60)
    if info.returncode != 0:
        pytest.skip(f"`docker info` failed (no reachable Docker daemon): "
                    f"{info.stderr.strip()[-500:]}")
    kind = _which_or_skip("kind", "go install sigs.k8s.io/kind@latest (or see kind.sigs.k8s.io)")
    kubectl = _which_or_skip("kubectl", "install kubectl (kubernetes.io/docs/tasks/tools)")
    helm = _helm_or_skip()

    kubeconfig = tmp_path_factory.mktemp("kind") / "kubeconfig"
    existing = _run(kind, "get", "clusters", check=False).stdout.split()
    created = False
    if CLUSTER not in existing:
        _run(kind, "create", "cluster", f"--name={CLUSTER}", "--wait=180s",
             f"--kubeconfig={kubeconfig}", timeout=900)
        created = True
    else:
        kubeconfig.write_text(_run(kind, "get", "kubeconfig", f"--name={CLUSTER}").stdout)
    try:
        _docker_build("-t", OPERATOR_IMAGE, str(REPO))
        _docker_build("-t", ENGINE_IMAGE, str(REPO / "engine_image"))
        _docker_build("-f", str(REPO / "tests" / "e2e" / "engine-double.Dockerfile"),
                      f"--build-arg=ENGINE_IMAGE={ENGINE_IMAGE}", "-t", DOUBLE_IMAGE, str(REPO))
        # The double carries the engine image's layers; loading the engine image itself would
        # only add transfer time, since nothing here runs it.
        for image in (OPERATOR_IMAGE, DOUBLE_IMAGE):
            _run(kind, "load", "docker-image", image, f"--name={CLUSTER}", timeout=3600)
        yield Cluster(kubectl, helm, kubeconfig)
    finally:
        if created and not KEEP:
            _run(kind, "delete", "cluster", f"--name={CLUSTER}", check=False, timeout=300)


def _advertise_fake_gpus(c: Cluster) -> None:
    """Patch node status with nvidia.com/gpu capacity (the documented way to advertise an
    extended resource); the kubelet then reports it as allocatable. No device plugin is
    involved, so pods requesting it are admitted without devices, which the double needs."""
    patch = json.dumps([{"op": "add", "path": "/status/capacity/nvidia.com~1gpu",
                         "value": str(GPUS_PER_NODE)}])
    nodes = c.kubectl("get", "nodes", "-o", "name").stdout.split()
    for node in nodes:
        c.kubectl("patch", node, "--subresource=status", "--type=json", f"-p={patch}")

    def advertised() -> bool:
        items = c.json("get", "nodes")["items"]
        return all(n["status"].get("allocatable", {}).get("nvidia.com/gpu") == str(GPUS_PER_NODE)
                   for n in items)

    _wait("nvidia.com/gpu allocatable on every node", advertised, 60, c, interval=1)


def _install_kuberay(c: Cluster) -> None:
    if os.environ.get("VLLMDP_E2E_SKIP_KUBERAY") != "1":
        _helm_install_kuberay(c)
    for crd in ("rayclusters.ray.io", "rayjobs.ray.io"):
        c.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=120s")


def _helm_install_kuberay(c: Cluster) -> None:
    local = os.environ.get("VLLMDP_E2E_KUBERAY_CHART")
    source = [local] if local else ["kuberay-operator", f"--repo={KUBERAY_REPO}",
                                    f"--version={KUBERAY_VERSION}"]
    c.helm("upgrade", "--install", "kuberay-operator", *source, "--namespace=kuberay-system",
           "--create-namespace", "--wait", "--timeout=10m")


def _install_operator(c: Cluster) -> None:
    repo, _, tag = OPERATOR_IMAGE.rpartition(":")
    engine = ENGINE_IMAGE if REAL else DOUBLE_IMAGE
    c.helm("upgrade", "--install", f"{NAME}-op", str(chartlib.CHART),
           f"--namespace={OPERATOR_NS}", "--create-namespace",
           f"--set=image.repository={repo}", f"--set=image.tag={tag}",
           f"--set=image.pullPolicy={'IfNotPresent' if REAL else 'Never'}",
           f"--set=engineImage={engine}", "--wait", "--timeout=5m")


def _resource() -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": MODEL,
        "servedModelName": SERVED,
        # Two Ray pods with one rank each: the head and one worker must join for a launch.
        "dataParallel": {"size": 2, "ranksPerNode": 1},
        "tensorParallelSize": 1,
    }
    if not REAL:
        spec["image"] = DOUBLE_IMAGE
        spec["resources"] = {"cpu": "1", "memory": "3Gi"}
        spec["shmSize"] = "256Mi"
    return {"apiVersion": "vllmdp.io/v1alpha1", "kind": "VLLMDataParallel",
            "metadata": {"name": NAME, "namespace": APP_NS}, "spec": spec}


@contextlib.contextmanager
def _port_forward(c: Cluster, target: str, namespace: str, remote: int) -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        local = s.getsockname()[1]
    proc = subprocess.Popen(
        [c.kubectl_bin, f"--kubeconfig={c.kubeconfig}", "port-forward", target,
         f"{local}:{remote}", "-n", namespace],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", local), 1):
                break
            if proc.poll() is not None:
                output = proc.stdout.read() if proc.stdout else ""
                raise AssertionError(f"port-forward exited: {output}")
            time.sleep(0.3)
        yield local
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _http(method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.status, json.loads(resp.read() or b"null")


CHILD_KINDS = ("rayclusters.ray.io", "rayjobs.ray.io", "services")


def _children(c: Cluster) -> dict[str, list[str]]:
    """Names of the resource's children per kind (by the instance label), empty kinds left out."""
    selector = f"app.kubernetes.io/instance={NAME}"
    found = {kind: c.kubectl("get", kind, "-n", APP_NS, "-l", selector, "-o", "name")
             .stdout.split() for kind in CHILD_KINDS}
    return {kind: names for kind, names in found.items() if names}


def test_serving_end_to_end(cluster: Cluster) -> None:
    c = cluster
    if not REAL:
        _advertise_fake_gpus(c)
    _install_kuberay(c)
    _install_operator(c)
    c.kubectl("create", "namespace", APP_NS, check=False)
    c.kubectl("apply", "-f", "-", input=yaml.safe_dump(_resource()))

    def serving() -> dict[str, Any] | None:
        obj = c.json("get", "vllmdataparallels.vllmdp.io", NAME, "-n", APP_NS)
        return obj if (obj.get("status") or {}).get("phase") == "Serving" else None

    obj = _wait("phase Serving", serving, TIMEOUT, c, interval=5)
    status = obj["status"]
    assert status["endpoint"] == f"http://{NAME}-api.{APP_NS}.svc:8000/v1"
    assert set(_children(c)) == set(CHILD_KINDS), _children(c)

    with _port_forward(c, f"svc/{NAME}-api", APP_NS, 8000) as port:
        base = f"http://127.0.0.1:{port}"
        code, models = _http("GET", f"{base}/v1/models")
        assert code == 200 and SERVED in [m["id"] for m in models["data"]], models
        code, answer = _http("POST", f"{base}/v1/completions",
                             {"model": SERVED, "prompt": "Say hi", "max_tokens": 4})
        assert code == 200 and answer["choices"], answer
        if not REAL:
            # The double recorded how the launcher started `vllm serve`.
            _, recorded = _http("GET", f"{base}/double/argv")
            argv = recorded["argv"]
            assert argv[:2] == ["serve", MODEL], argv
            joined = " ".join(argv)
            assert "--data-parallel-size 2" in joined or "--data-parallel-size=2" in joined, argv
            assert "ray" in joined and "--data-parallel-backend" in joined, argv

    c.kubectl("delete", "vllmdataparallels.vllmdp.io", NAME, "-n", APP_NS, "--wait=true",
              "--timeout=180s", timeout=240)
    _wait("children garbage-collected", lambda: not _children(c), 180, c)
    _wait("Ray pods gone",
          lambda: not c.kubectl("get", "pods", "-n", APP_NS, "-l", "ray.io/cluster",
                                "-o", "name").stdout.split(), 300, c)
