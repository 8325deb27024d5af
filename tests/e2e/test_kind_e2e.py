"""End to end on kind: real images, real KubeRay, real Ray; vLLM a double, then vLLM itself.

The cluster is the kind tier's (tests/testbed/kindbed.py): two kind nodes on the tier's own
Docker engine from the node image built here, `nvidia.com/gpu` on the nodes' status, the
operator, engine-double and CPU engine test images loaded with `kind load image-archive`, and
KubeRay at versions.env's KUBERAY_VERSION. Here the chart is installed with helm, then:
- DP=2 on the engine double reaches Serving, answers a completion through its Service
  (port-forward) and is deleted with its children;
- examples/dev-cpu.yaml, as checked in, on vLLM's CPU engines reaches Serving and answers a
  completion through its Service.

`make e2e-kind` runs it (root: the tier starts its own dockerd); it skips, saying why, where
the tier's Docker cannot run (not root, no dockerd and no apt-get). The bed is conftest's
`kind_bed`; test_kind_down.py takes it down last and checks the host (`make e2e-kind-down`
does the same by hand). Knobs (docs/install.md):

  KIND_NODE_IMAGE=<ref>     use that node image (an upstream kindest/node on a host that can
                            pull it) instead of the one built here
  VLLMDP_E2E_KEEP=1         keep the cluster afterwards (and reuse one that is up)
  VLLMDP_E2E_ENGINE=real    a GPU user's cluster (the current kube context) with KubeRay
                            installed, images pullable there: the double test only, with the
                            real engine image and model
  VLLMDP_E2E_OPERATOR_IMAGE / VLLMDP_E2E_ENGINE_IMAGE / VLLMDP_E2E_MODEL (real mode)
  VLLMDP_E2E_TIMEOUT        seconds to wait for Serving (default 900)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chart"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testbed"))
import chartlib

from .conftest import KindBed

pytestmark = pytest.mark.kind

REPO = chartlib.REPO
REAL = os.environ.get("VLLMDP_E2E_ENGINE", "double") == "real"
OPERATOR_IMAGE = os.environ.get("VLLMDP_E2E_OPERATOR_IMAGE", "vllm-dp-operator:dev")
ENGINE_IMAGE = os.environ.get("VLLMDP_E2E_ENGINE_IMAGE", "vllm-dp-engine:0.1.0")
DOUBLE_IMAGE = "vllm-dp-engine-double:dev"
MODEL = os.environ.get("VLLMDP_E2E_MODEL",
                       "Qwen/Qwen2.5-0.5B-Instruct" if REAL else "e2e/double-model")
SERVED = "e2e-model"
TIMEOUT = float(os.environ.get("VLLMDP_E2E_TIMEOUT", "900"))
OPERATOR_NS = "vllm-dp-system"
RELEASE = "vdp"
DOUBLE_NS = "e2e-double"
CPU_NS = "e2e-cpu"
NAME = "e2e"
CPU_EXAMPLE = REPO / "examples" / "dev-cpu.yaml"
# The chart's values for a cluster whose images are local (never pulled) and whose two nodes
# have 2 CPUs each: the operator asks for no CPU (the Ray head takes all of one node).
LOCAL_VALUES = ("image.pullPolicy=Never", "resources.requests.cpu=0",
                "healthProbe.mode=service-dns",
                # The tenancy policy admits the engine images built here (the CPU example's
                # and the double's) besides the chart's engineImage.
                "tenancy.allowedImages={vllm-dp-engine,vllm-dp-engine-cpu,vllm-dp-engine-double}")


@dataclass
class Cluster:
    kubectl_bin: str
    helm_bin: str
    kubeconfig: Path

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:  # fmt: skip
        proc = subprocess.run([self.kubectl_bin, f"--kubeconfig={self.kubeconfig}", *args],
                              capture_output=True, text=True, timeout=timeout,
                              input=input)  # fmt: skip
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed (rc={proc.returncode}):\n"
                                 f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")  # fmt: skip
        return proc

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def helm(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig))
        proc = subprocess.run([self.helm_bin, *args], capture_output=True, text=True,
                              timeout=timeout, env=env)  # fmt: skip
        if proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed (rc={proc.returncode}):\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")  # fmt: skip
        return proc

    def diagnostics(self, ns: str, name: str) -> str:
        """What to look at when a wait fails: the resource, children, pods, logs, events."""
        parts = []
        for args in (
            ("get", "vllmdataparallels.vllmdp.io", "-n", ns, "-o", "yaml"),
            ("get", "rayclusters.ray.io,rayjobs.ray.io,svc,pods", "-A", "-o", "wide"),
            ("logs", f"deployment/{RELEASE}-vllm-dp-operator", "-n", OPERATOR_NS, "--tail=100"),
            ("logs", "-n", ns, "-l", f"app.kubernetes.io/instance={name}", "--tail=60",
             "--all-containers", "--prefix"),
            ("get", "events", "-n", ns, "--sort-by=.lastTimestamp"),
        ):
            proc = self.kubectl(*args, check=False)
            parts.append(f"$ kubectl {' '.join(args)}\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}")
        return "\n".join(parts)


def _wait(what: str, check: Any, timeout: float, explain: Any, interval: float = 3) -> Any:
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
                         f"{explain()}")  # fmt: skip


def _helm_or_skip() -> str:
    try:
        path: str = chartlib.helm_binary()
        return path
    except chartlib.HelmUnavailable as exc:
        pytest.skip(f"helm unavailable (tests/chart/ensure_helm.sh needs Go): {exc}")


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    if REAL:
        # A GPU user's cluster: the current kube context, images from a registry it can pull.
        kubeconfig = Path(os.environ.get("KUBECONFIG", Path.home() / ".kube" / "config"))
        yield Cluster("kubectl", _helm_or_skip(), kubeconfig)
        return
    kind_bed: KindBed = request.getfixturevalue("kind_bed")
    bed = kind_bed.bed
    c = Cluster(str(bed.kubectl_bin), _helm_or_skip(), bed.kubeconfig)
    _install_operator(c)
    yield c


def _install_operator(c: Cluster) -> None:
    repo, _, tag = OPERATOR_IMAGE.rpartition(":")
    local = () if REAL else LOCAL_VALUES
    c.helm("upgrade", "--install", RELEASE, str(chartlib.CHART), f"--namespace={OPERATOR_NS}",
           "--create-namespace", f"--set=image.repository={repo}", f"--set=image.tag={tag}",
           *(f"--set={v}" for v in local), "--wait", "--timeout=5m")  # fmt: skip


# Run inside a Ray pod (the engine images have python3): GET or POST from the pod network. The
# API Service has no selector (the operator writes its EndpointSlice itself), so `kubectl
# port-forward svc/...` cannot attach to it; a pod reaches it as clients do, by its DNS name.
_POD_HTTP = ("import json,sys,urllib.request as u;b=sys.argv[2].encode() or None;"
             "r=u.Request(sys.argv[1],data=b,headers={'Content-Type':'application/json'});"
             "print(u.urlopen(r,timeout=120).read().decode())")  # fmt: skip


def _through_service(c: Cluster, ns: str, url: str, body: dict[str, Any] | None = None) -> Any:
    """GET (POST with `body`) `url` from the Ray worker pod, which is on the other node than
    the head: through the Service's name and ClusterIP, across nodes. A non-2xx answer fails."""
    pods = c.json("get", "pods", "-n", ns, "-l", "ray.io/node-type=worker")["items"]
    assert pods, f"no Ray worker pod in {ns}"
    proc = c.kubectl("exec", "-n", ns, pods[0]["metadata"]["name"], "--", "python3", "-c",
                     _POD_HTTP, url, json.dumps(body) if body is not None else "",
                     timeout=180)  # fmt: skip
    return json.loads(proc.stdout)


CHILD_KINDS = ("rayclusters.ray.io", "rayjobs.ray.io", "services")


def _children(c: Cluster, ns: str, name: str) -> dict[str, list[str]]:
    """Names of the resource's children per kind (by the instance label), empty kinds left out."""
    selector = f"app.kubernetes.io/instance={name}"
    found = {kind: c.kubectl("get", kind, "-n", ns, "-l", selector, "-o", "name").stdout.split()
             for kind in CHILD_KINDS}  # fmt: skip
    return {kind: names for kind, names in found.items() if names}


def _apply_and_wait_serving(c: Cluster, doc: dict[str, Any]) -> dict[str, Any]:
    ns, name = doc["metadata"]["namespace"], doc["metadata"]["name"]
    c.kubectl("create", "namespace", ns, check=False)
    c.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))

    def serving() -> dict[str, Any] | None:
        obj: dict[str, Any] = c.json("get", "vllmdataparallels.vllmdp.io", name, "-n", ns)
        return obj if (obj.get("status") or {}).get("phase") == "Serving" else None

    return _wait(f"{ns}/{name} phase Serving", serving, TIMEOUT,  # type: ignore[no-any-return]
                 lambda: c.diagnostics(ns, name), interval=5)  # fmt: skip


def _double_resource() -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": MODEL,
        "servedModelName": SERVED,
        # Two Ray pods with one rank each: the head and one worker must join for a launch.
        "dataParallel": {"size": 2, "ranksPerNode": 1},
        "tensorParallelSize": 1,
    }
    if not REAL:
        spec["image"] = DOUBLE_IMAGE
        # 1 CPU a pod and 1 more on the head for its one API server: the head takes a whole
        # 2-CPU kind node (the operator's default, an API server per rank, would ask 3).
        spec["apiServerCount"] = 1
        spec["resources"] = {"cpu": "1", "memory": "3Gi"}
        spec["shmSize"] = "256Mi"
    return {"apiVersion": "vllmdp.io/v1alpha1", "kind": "VLLMDataParallel",
            "metadata": {"name": NAME, "namespace": DOUBLE_NS}, "spec": spec}  # fmt: skip


def _own_namespace(c: Cluster, ns: str, wait_after: bool = True) -> Iterator[str]:
    """The test's namespace, deleted after it, pass or fail, and (`wait_after`) waited for:
    the next test's Ray head needs a whole node, which pods left behind would hold. Its own
    start deletes and waits too, for a kept cluster's earlier run."""
    c.kubectl("delete", "namespace", ns, "--ignore-not-found", "--wait=true", timeout=300)
    yield ns
    c.kubectl("delete", "namespace", ns, f"--wait={str(wait_after).lower()}", "--timeout=240s",
              check=False, timeout=300)  # fmt: skip


@pytest.fixture
def double_ns(cluster: Cluster) -> Iterator[str]:
    yield from _own_namespace(cluster, DOUBLE_NS)


@pytest.fixture
def cpu_ns(cluster: Cluster) -> Iterator[str]:
    # The tier's last test: the cluster goes next (test_kind_down.py), so nothing waits on
    # its namespace's deletion (48 s of vLLM's shutdown in CI).
    yield from _own_namespace(cluster, CPU_NS, wait_after=False)


def test_dp2_on_the_engine_double_serves_and_deletes_cleanly(cluster: Cluster,
                                                             double_ns: str) -> None:
    c = cluster
    obj = _apply_and_wait_serving(c, _double_resource())
    assert obj["status"]["endpoint"] == f"http://{NAME}-api.{DOUBLE_NS}.svc:8000/v1"
    assert set(_children(c, DOUBLE_NS, NAME)) == set(CHILD_KINDS), _children(c, DOUBLE_NS, NAME)

    base = obj["status"]["endpoint"].removesuffix("/v1")
    models = _through_service(c, DOUBLE_NS, f"{base}/v1/models")
    assert SERVED in [m["id"] for m in models["data"]], models
    answer = _through_service(c, DOUBLE_NS, f"{base}/v1/completions",
                              {"model": SERVED, "prompt": "Say hi", "max_tokens": 4})  # fmt: skip
    assert answer["choices"], answer
    if not REAL:
        # The double recorded how the launcher started `vllm serve`.
        argv = _through_service(c, DOUBLE_NS, f"{base}/double/argv")["argv"]
        assert argv[:2] == ["serve", MODEL], argv
        joined = " ".join(argv)
        assert "--data-parallel-size 2" in joined or "--data-parallel-size=2" in joined, argv
        assert "ray" in joined and "--data-parallel-backend" in joined, argv

    c.kubectl("delete", "vllmdataparallels.vllmdp.io", NAME, "-n", DOUBLE_NS, "--wait=true",
              "--timeout=180s", timeout=240)  # fmt: skip
    explain = lambda: c.diagnostics(DOUBLE_NS, NAME)  # noqa: E731
    _wait("children garbage-collected", lambda: not _children(c, DOUBLE_NS, NAME), 180, explain)
    _wait("Ray pods gone", lambda: not c.kubectl(
        "get", "pods", "-n", DOUBLE_NS, "-l", "ray.io/cluster", "-o", "name").stdout.split(),
        300, explain)  # fmt: skip


@pytest.mark.skipif(REAL, reason="the CPU example runs the test image built here (kind only)")
def test_dev_cpu_example_on_vllm_cpu_engines_serves_a_completion(cluster: Cluster,
                                                                 cpu_ns: str) -> None:
    c = cluster
    doc: dict[str, Any] = yaml.safe_load(CPU_EXAMPLE.read_text())
    doc["metadata"]["namespace"] = CPU_NS
    name = doc["metadata"]["name"]
    served = doc["spec"]["servedModelName"]
    t0 = time.monotonic()
    _apply_and_wait_serving(c, doc)
    sys.stderr.write(f"[kind] {name} Serving {time.monotonic() - t0:.0f}s after apply\n")
    pods = c.json("get", "pods", "-n", CPU_NS, "-l", "ray.io/cluster")["items"]
    assert len({p["spec"]["nodeName"] for p in pods}) == 2, [p["spec"]["nodeName"] for p in pods]
    out = _through_service(c, CPU_NS, f"http://{name}-api.{CPU_NS}.svc:8000/v1/completions",
                           {"model": served, "prompt": "hello world", "max_tokens": 4})  # fmt: skip
    assert out["object"] == "text_completion" and out["model"] == served, out
    assert out["usage"]["completion_tokens"] >= 1 and len(out["choices"]) == 1, out
