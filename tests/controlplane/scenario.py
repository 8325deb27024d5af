"""Shared pieces of the operator scenarios on the control-plane test bed: the operator process
fixture, kubectl helpers, and the test doubles run in the test bed's pod network (vLLM's
/health, the Ray job API) for what kwok pods cannot run."""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_proc import OperatorProcess, install_crd

REPO = Path(__file__).resolve().parents[2]


def example(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / name).read_text())
    return doc


def launch_command(job: dict[str, Any]) -> list[str]:
    """The vllm serve argv a head RayJob carries (the base64 plan after --plan-b64)."""
    argv = str(job["spec"]["entrypoint"]).split()
    plan = json.loads(base64.b64decode(argv[argv.index("--plan-b64") + 1]))
    return list(plan["command"])


def run_operator(testbed: Any, tmp_path_factory: pytest.TempPathFactory,
                 extra_env: dict[str, str] | None = None) -> Iterator[OperatorProcess]:  # fmt: skip
    """The body of a module's `operator` fixture: one kopf process for the module's tests."""
    install_crd(testbed)
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    proc = OperatorProcess(testbed.env(), log, extra_env)
    proc.start()
    yield proc
    proc.stop()


def apply(testbed: Any, ns: str, doc: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    doc["metadata"]["namespace"] = ns
    testbed.apply(doc)
    return doc


def vdp(testbed: Any, ns: str, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = testbed.kubectl_json("-n", ns, "get", "vdp", name)
    return obj


def status(testbed: Any, ns: str, name: str) -> dict[str, Any]:
    st: dict[str, Any] = vdp(testbed, ns, name).get("status") or {}
    return st


def load_of(testbed: Any, ns: str, name: str) -> dict[str, Any]:
    """status.load of a resource while Serving: its level, ranks reporting and since when."""
    load: dict[str, Any] = status(testbed, ns, name).get("load") or {}
    return load


def items(testbed: Any, ns: str, kind: str, selector: str = "") -> list[dict[str, Any]]:
    args = ["-n", ns, "get", kind] + (["-l", selector] if selector else [])
    found: list[dict[str, Any]] = testbed.kubectl_json(*args)["items"]
    return found


def ray_pods(testbed: Any, ns: str, cluster: str) -> list[dict[str, Any]]:
    return items(testbed, ns, "pods", f"ray.io/cluster={cluster}")


def wait_phase(testbed: Any, ns: str, name: str, phase: str, timeout: float = 90) -> dict[str, Any]:
    st: dict[str, Any] = testbed.wait_until(
        f"{name} phase {phase}",
        lambda: (s := status(testbed, ns, name)).get("phase") == phase and s,
        timeout=timeout,
    )
    return st


def pod_network(testbed: Any) -> dict[str, Any]:
    net: dict[str, Any] | None = testbed.info.get("pod_network")
    if not net:
        pytest.fail("the test bed has no pod network (needs root and iproute2)", pytrace=False)
    return net


@contextmanager
def double_in_pod_network(testbed: Any, script: str, port: int, *args: str) -> Iterator[None]:
    """Run a tests/doubles server in the test bed's pod network: it answers every pod IP."""
    net = pod_network(testbed)
    server = subprocess.Popen(["ip", "netns", "exec", net["netns"], sys.executable,
                               str(REPO / "tests" / "doubles" / script), "--port", str(port),
                               *args])  # fmt: skip
    try:
        yield
    finally:
        server.terminate()
        server.wait(timeout=10)


def head_pod(testbed: Any, ns: str, cluster: str) -> dict[str, Any]:
    pods = items(testbed, ns, "pods", f"ray.io/cluster={cluster},ray.io/node-type=head")
    (pod,) = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return pod


def api_endpoints(testbed: Any, ns: str, name: str) -> list[str]:
    """Addresses the API Service routes to: its EndpointSlices' ready endpoints, as kube-proxy
    reads them (an unset ready counts as ready, per the EndpointSlice API)."""
    slices = items(testbed, ns, "endpointslices", f"kubernetes.io/service-name={name}-api")
    return sorted(a for s in slices for e in s.get("endpoints") or []
                  if (e.get("conditions") or {}).get("ready") is not False
                  for a in e["addresses"])  # fmt: skip


def pod_api(pod_ip: str, port: int, method: str, path: str, body: Any = None) -> Any:
    """Call a double's JSON API at a pod IP (routed into the pod network from here)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{pod_ip}:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read() or b"null")


def ray_api(pod_ip: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """Call the Ray job API double at a pod IP."""
    return pod_api(pod_ip, 8265, method, path, body)


def wait_head_job(testbed: Any, ns: str, name: str, job: str, timeout: float = 90) -> None:
    testbed.wait_until(
        f"head job {job}",
        lambda: any(j["metadata"]["name"] == job for j in items(testbed, ns, "rayjobs")),
        timeout=timeout,
    )
