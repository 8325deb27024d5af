"""The "Pitfalls users hit" of FIELD_NOTES, each checked on the manifests of every example.

One test per pitfall that a rendered manifest or a validation rule prevents. Handled elsewhere:

- 7 (probes during model load): the operator probes /health itself and only that drives the
  `Serving` phase, because a fixed-delay probe on vLLM inside a Ray pod restarts the pod and
  with it the whole DP group. Here we only assert that no liveness, readiness or startup probe
  we render targets the serving port.
- 8 (start order): the reconcile creates the head job only once the RayCluster is ready, and
  the launcher waits until every planned Ray node has joined before `vllm serve` starts (the
  plan it receives carries the pod count and a wait timeout, asserted here); the end-to-end
  check lives in the control-plane and Ray tiers.
"""

from __future__ import annotations

import base64
import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from vllm_dp_operator import constants
from vllm_dp_operator.api.validation import SpecError, validate
from vllm_dp_operator.config import RenderOptions
from vllm_dp_operator.render.manifests import render_all

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
BASE: dict[str, Any] = {"model": "m", "dataParallel": {"size": 4, "ranksPerNode": 2}}


def _render(path: Path) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for doc in yaml.safe_load_all(path.read_text()):
        for manifest in render_all(doc, RenderOptions()):
            out.setdefault(manifest["kind"], []).append(manifest)
    return out


@pytest.fixture(params=EXAMPLES, ids=lambda p: p.stem)
def rendered(request: pytest.FixtureRequest) -> dict[str, list[dict[str, Any]]]:
    return _render(request.param)


def _templates(manifests: dict[str, list[dict[str, Any]]]) -> list[tuple[bool, dict[str, Any]]]:
    """(is_head, pod template) of every Ray pod group."""
    out = []
    for cluster in manifests["RayCluster"]:
        out.append((True, cluster["spec"]["headGroupSpec"]["template"]))
        out += [(False, g["template"]) for g in cluster["spec"]["workerGroupSpecs"]]
    return out


def _containers(manifests: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [c for _, t in _templates(manifests) for c in t["spec"]["containers"]]


def _launch_spec(manifests: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    [job] = manifests["RayJob"]
    argv = shlex.split(job["spec"]["entrypoint"])
    spec: dict[str, Any] = json.loads(base64.b64decode(argv[argv.index("--plan-b64") + 1]))
    return spec


def _rejected(patch: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as info:
        validate("x", {**BASE, **patch})
    return [str(e) for e in info.value.errors]


def test_examples_exist() -> None:
    assert len(EXAMPLES) >= 5


def test_pitfall_1_vllm_serve_runs_on_a_gpu_pod(rendered: dict[str, Any]) -> None:
    for is_head, template in _templates(rendered):
        [c] = template["spec"]["containers"]
        gpus = {k: v for k, v in c["resources"]["limits"].items() if k.endswith("/gpu")}
        assert gpus and all(int(v) >= 1 for v in gpus.values()), (is_head, c["resources"])
    head = _launch_spec(rendered)["pods"][0]
    assert head["role"] == "head" and head["ranks"] and head["gpus"] >= 1
    assert any(
        "ranksPerNode: must be at least 1" in e
        for e in _rejected({"dataParallel": {"size": 4, "ranksPerNode": 0}})
    )


def test_pitfall_2_dp1_with_the_ray_backend_is_rejected(rendered: dict[str, Any]) -> None:
    spec = _launch_spec(rendered)
    assert spec["dataParallelSize"] >= 2
    command = spec["command"]
    assert command[command.index("--data-parallel-backend") + 1] == "ray"
    assert any(
        "size: must be at least 2" in e
        for e in _rejected({"dataParallel": {"size": 1, "ranksPerNode": 1}})
    )


def test_pitfall_3_vllm_host_ip_is_each_pods_own_ip(rendered: dict[str, Any]) -> None:
    for c in _containers(rendered):
        [var] = [e for e in c["env"] if e["name"] == "VLLM_HOST_IP"]
        assert var == {
            "name": "VLLM_HOST_IP",
            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
        }
    spec = _launch_spec(rendered)
    # Not forced into vllm serve's env, and not copied to actors on other nodes.
    assert "VLLM_HOST_IP" not in spec["env"]
    prefixes = spec["env"]["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"].split(",")
    assert not any("VLLM_HOST_IP".startswith(p) for p in prefixes)
    assert "--data-parallel-address" not in spec["command"]  # the launcher sets it
    assert any(
        "VLLM_HOST_IP (use" in e
        for e in _rejected({"env": [{"name": "VLLM_HOST_IP", "value": "1.2.3.4"}]})
    )


def test_pitfall_4_no_service_links_and_service_never_named_vllm(
    rendered: dict[str, Any],
) -> None:
    for _, template in _templates(rendered):
        assert template["spec"]["enableServiceLinks"] is False
    for service in rendered["Service"]:
        assert service["metadata"]["name"] != "vllm"
    # Even a resource named `vllm` gets a Service named otherwise.
    doc = {
        "apiVersion": "vllmdp.io/v1alpha1",
        "kind": "VLLMDataParallel",
        "metadata": {"name": "vllm"},
        "spec": BASE,
    }
    [service] = [m for m in render_all(doc, RenderOptions()) if m["kind"] == "Service"]
    assert service["metadata"]["name"] != "vllm"
    assert all("VLLM_PORT" not in (e["name"] for e in c["env"]) for c in _containers(rendered))
    assert any(
        "VLLM_PORT (use" in e
        for e in _rejected({"env": [{"name": "VLLM_PORT", "value": "tcp://x:1"}]})
    )


def test_pitfall_5_dev_shm_is_memory_backed(rendered: dict[str, Any]) -> None:
    for _, template in _templates(rendered):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        [c] = template["spec"]["containers"]
        [mount] = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        empty_dir = volumes[mount["name"]]["emptyDir"]
        assert empty_dir["medium"] == "Memory"
        assert empty_dir["sizeLimit"] not in ("64Mi", "")


def test_pitfall_6_gloo_and_nccl_bind_the_pod_nic(rendered: dict[str, Any]) -> None:
    ifname = RenderOptions().socket_ifname
    for c in _containers(rendered):
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == ifname
    # Ray actors get GLOO_* only when the prefix is listed for copying (vllm#5094).
    prefixes = _launch_spec(rendered)["env"]["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"]
    assert {"GLOO_", "NCCL_"} <= set(prefixes.split(","))


def test_pitfall_7_no_kubelet_probe_on_the_serving_port(rendered: dict[str, Any]) -> None:
    [service] = rendered["Service"]
    port = service["spec"]["ports"][0]["targetPort"]
    for c in _containers(rendered):
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            target = c.get(probe) or {}
            handler = target.get("httpGet") or target.get("tcpSocket") or {}
            assert handler.get("port") not in (port, "http"), (probe, target)


def test_pitfall_8_the_launcher_knows_how_many_pods_to_wait_for(rendered: dict[str, Any]) -> None:
    spec = _launch_spec(rendered)
    [cluster] = rendered["RayCluster"]
    workers = sum(g["replicas"] for g in cluster["spec"]["workerGroupSpecs"])
    assert spec["gpuPods"] == len(spec["pods"]) == workers + 1
    assert spec["waitTimeoutSeconds"] > 0


def test_pitfall_9_no_ray_client_address_and_rpc_port_left_alone(rendered: dict[str, Any]) -> None:
    for c in _containers(rendered):
        for var in c["env"]:
            assert var["name"] != "RAY_ADDRESS" or not str(var.get("value", "")).startswith(
                "ray://"
            )
    spec = _launch_spec(rendered)
    assert "RAY_ADDRESS" not in spec["env"]
    assert not any(a.startswith(("--data-parallel-rpc-port", "-dpp")) for a in spec["command"])
    assert not any(low <= spec["port"] <= high for low, high, _ in constants.RESERVED_PORTS)
    assert any(
        "RAY_ADDRESS (use" in e
        for e in _rejected({"env": [{"name": "RAY_ADDRESS", "value": "ray://h:10001"}]})
    )
    assert any(
        "--data-parallel-rpc-port" in e
        for e in _rejected({"engineArgs": ["--data-parallel-rpc-port=8000"]})
    )
