"""Pure renderers: RayCluster, Service and head RayJob shapes, and what their hashes follow."""

from __future__ import annotations

import copy
import json
import shlex
from typing import Any

import pytest
from vllm_dp_operator import constants
from vllm_dp_operator.config import RenderOptions
from vllm_dp_operator.plan import build_plan
from vllm_dp_operator.render import (
    build_head_job,
    build_raycluster,
    build_service,
    cluster_hash,
    launcher_entrypoint,
)
from vllm_dp_operator.render.meta import owner_reference
from vllm_dp_operator.validation import validate

OPTIONS = RenderOptions()
OWNER = owner_reference("demo", "00000000-0000-0000-0000-000000000001")
BASE: dict[str, Any] = {
    "model": "Qwen/Qwen2.5-7B-Instruct",
    "dataParallel": {"size": 8, "ranksPerNode": 4},
}


def with_(**patch: Any) -> dict[str, Any]:
    out = copy.deepcopy(BASE)
    out.update(copy.deepcopy(patch))
    return out


def cluster_of(raw: dict[str, Any], name: str = "demo", **kw: Any) -> dict[str, Any]:
    spec = validate(name, raw)
    return build_raycluster(
        name, "ns", spec, build_plan(spec), kw.get("options", OPTIONS), kw.get("owner", OWNER)
    )


def templates(cluster: dict[str, Any]) -> list[dict[str, Any]]:
    spec = cluster["spec"]
    return [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]


def container(template: dict[str, Any]) -> dict[str, Any]:
    [c] = template["spec"]["containers"]
    return c


# --- RayCluster -------------------------------------------------------------------------------


def test_raycluster_worker_replicas_are_pods_minus_one() -> None:
    cluster = cluster_of(with_(dataParallel={"size": 12, "ranksPerNode": 4}))
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    [group] = cluster["spec"]["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 2
    assert cluster["spec"]["enableInTreeAutoscaling"] is False


def test_raycluster_head_and_workers_request_identical_gpus() -> None:
    cluster = cluster_of(with_(tensorParallelSize=2, resources={"cpu": "8", "memory": "64Gi"}))
    expected = {"nvidia.com/gpu": 8, "cpu": "8", "memory": "64Gi"}
    for template in templates(cluster):
        resources = container(template)["resources"]
        assert resources == {"limits": expected, "requests": expected}
    head = cluster["spec"]["headGroupSpec"]["rayStartParams"]
    [group] = cluster["spec"]["workerGroupSpecs"]
    assert head["num-gpus"] == group["rayStartParams"]["num-gpus"] == "8"


def test_raycluster_gpu_resource_name_and_per_pod() -> None:
    raw = with_(
        dataParallel={"size": 6, "ranksPerNode": 2, "packStrategy": "fill"},
        gpu={"resourceName": "amd.com/gpu", "perPod": 4},
    )
    cluster = cluster_of(raw)
    for template in templates(cluster):
        assert container(template)["resources"]["limits"] == {"amd.com/gpu": 4}
        tolerations = template["spec"]["tolerations"]
        assert {"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "4"


def test_raycluster_single_pod_has_no_worker_group() -> None:
    cluster = cluster_of(with_(dataParallel={"size": 4, "ranksPerNode": 4}))
    assert cluster["spec"]["workerGroupSpecs"] == []


@pytest.mark.parametrize("suspend", [False, True])
def test_raycluster_suspend_keeps_the_name(suspend: bool) -> None:
    cluster = cluster_of(with_(suspend=suspend))
    assert cluster["spec"]["suspend"] is suspend
    assert cluster["metadata"]["name"] == cluster_of(BASE)["metadata"]["name"]


def test_raycluster_owner_reference_comes_from_the_argument() -> None:
    assert cluster_of(BASE)["metadata"]["ownerReferences"] == [OWNER]
    assert "ownerReferences" not in cluster_of(BASE, owner=None)["metadata"]
    assert OWNER["controller"] is True and OWNER["blockOwnerDeletion"] is True


def test_raycluster_name_labels_and_image() -> None:
    cluster = cluster_of(BASE, options=RenderOptions(default_image="reg/engine:9"))
    meta = cluster["metadata"]
    digest = meta["labels"][constants.LABEL_CLUSTER_HASH]
    assert meta["name"] == f"demo-{digest[:5]}"
    assert meta["namespace"] == "ns"
    assert meta["labels"][constants.LABEL_INSTANCE] == "demo"
    assert meta["labels"][constants.LABEL_MANAGED_BY] == constants.MANAGER
    for template in templates(cluster):
        assert container(template)["image"] == "reg/engine:9"
        assert template["metadata"]["labels"][constants.LABEL_INSTANCE] == "demo"
    own = cluster_of(with_(image="mine:1"), options=RenderOptions(default_image="reg/engine:9"))
    assert all(container(t)["image"] == "mine:1" for t in templates(own))


def test_raycluster_name_fits_kubernetes_limits_at_max_length() -> None:
    name = "n" * constants.MAX_NAME_LENGTH
    cluster = cluster_of(BASE, name=name)
    cluster_name = cluster["metadata"]["name"]
    # KubeRay names pods <cluster>-<group>-worker-<5> and the head Service <cluster>-head-svc.
    assert len(f"{cluster_name}-gpu-worker-abcde") <= 63
    assert len(f"{cluster_name}-head-svc") <= 63


def test_raycluster_head_declares_ray_ports_and_the_serving_port() -> None:
    cluster = cluster_of(with_(service={"port": 8080}))
    head = container(cluster["spec"]["headGroupSpec"]["template"])
    ports = {p["containerPort"] for p in head["ports"]}
    assert ports == {6379, 8265, 10001, 8080}
    [group] = cluster["spec"]["workerGroupSpecs"]
    assert "ports" not in container(group["template"])


def test_raycluster_pod_options_reach_every_pod() -> None:
    raw = with_(
        nodeSelector={"pool": "gpu"},
        tolerations=[{"key": "dedicated", "operator": "Exists"}],
        affinity={"nodeAffinity": {"x": 1}},
        priorityClassName="inference",
        modelCache={"claimName": "hf", "readOnly": True},
        hfTokenSecretRef={"name": "hf", "key": "token"},
        env=[
            {"name": "FROM_CM", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
            {"name": "LITERAL", "value": "1"},
        ],
    )
    for template in templates(cluster_of(raw)):
        pod = template["spec"]
        assert pod["nodeSelector"] == {"pool": "gpu"}
        assert {"key": "dedicated", "operator": "Exists"} in pod["tolerations"]
        assert pod["affinity"] == {"nodeAffinity": {"x": 1}}
        assert pod["priorityClassName"] == "inference"
        assert {
            "name": "model-cache",
            "persistentVolumeClaim": {"claimName": "hf", "readOnly": True},
        } in pod["volumes"]
        env = {e["name"]: e for e in container(template)["env"]}
        assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
        assert env["HF_HOME"]["value"] == "/root/.cache/huggingface"
        assert "FROM_CM" in env
        assert "LITERAL" not in env  # literals travel in the head job, not the pods


def test_raycluster_templates_share_no_objects() -> None:
    raw = with_(tolerations=[{"key": "a", "operator": "Exists"}], affinity={"podAffinity": {}})
    head, worker = templates(cluster_of(raw))
    head["spec"]["tolerations"][-1]["key"] = "changed"
    head["spec"]["affinity"]["changed"] = True
    assert worker["spec"]["tolerations"][-1]["key"] == "a"
    assert "changed" not in worker["spec"]["affinity"]


# --- Service ----------------------------------------------------------------------------------


def service_of(raw: dict[str, Any], name: str = "demo", owner: Any = OWNER) -> dict[str, Any]:
    spec = validate(name, raw)
    return build_service(name, "ns", spec, "demo-abcde", owner)


def test_service_selects_only_the_head_of_that_cluster() -> None:
    service = service_of(
        with_(service={"port": 8080, "type": "NodePort", "annotations": {"a": "b"}})
    )
    assert service["spec"]["selector"] == {
        "ray.io/cluster": "demo-abcde",
        "ray.io/node-type": "head",
    }
    assert service["spec"]["type"] == "NodePort"
    assert service["spec"]["ports"] == [
        {"name": "http", "protocol": "TCP", "port": 8080, "targetPort": 8080}
    ]
    assert service["metadata"]["annotations"] == {"a": "b"}
    assert service["metadata"]["ownerReferences"] == [OWNER]
    assert "ownerReferences" not in service_of(BASE, owner=None)["metadata"]


@pytest.mark.parametrize("name", ["vllm", "demo", "v"])
def test_service_is_never_named_vllm(name: str) -> None:
    service = service_of(BASE, name=name)
    assert service["metadata"]["name"] != "vllm"
    assert service["metadata"]["name"] == f"{name}-api"


# --- head job ---------------------------------------------------------------------------------


def job_of(
    raw: dict[str, Any], cluster_name: str = "demo-abcde", attempt: int = 1, owner: Any = OWNER
) -> dict[str, Any]:
    spec = validate("demo", raw)
    return build_head_job("demo", "ns", spec, build_plan(spec), OPTIONS, cluster_name, attempt,
                          owner)  # fmt: skip


def test_head_job_submitter_schedules_on_gpu_nodes_and_does_not_retry_itself() -> None:
    job = job_of({**BASE, "tolerations": [{"key": "team", "operator": "Exists"}]})
    pod = job["spec"]["submitterPodTemplate"]
    keys = [t["key"] for t in pod["spec"]["tolerations"]]
    assert keys == ["nvidia.com/gpu", "team"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/instance"] == "demo"
    (container,) = pod["spec"]["containers"]
    assert "command" not in container  # KubeRay fills in `ray job submit`
    assert container["image"] == OPTIONS.default_image
    assert job["spec"]["submitterConfig"] == {"backoffLimit": 0}


def test_head_job_runs_on_the_existing_cluster() -> None:
    job = job_of(BASE, attempt=3)
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    assert job["metadata"]["name"] == "demo-launch-3"
    assert job["metadata"]["labels"][constants.LABEL_ATTEMPT] == "3"
    assert job["metadata"]["labels"][constants.LABEL_CLUSTER] == "demo-abcde"
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": "demo-abcde"}
    assert job["spec"]["shutdownAfterJobFinishes"] is False
    # KubeRay rejects these together with clusterSelector.
    assert not job["spec"].get("backoffLimit")
    assert "suspend" not in job["spec"]
    assert "rayClusterSpec" not in job["spec"]
    assert job["metadata"]["ownerReferences"] == [OWNER]
    assert "ownerReferences" not in job_of(BASE, owner=None)["metadata"]


@pytest.mark.parametrize(
    "raw",
    [
        BASE,
        with_(
            env=[{"name": "QUOTE", "value": 'it\'s "quoted" $HOME `x`'}],
            engineArgs=["--chat-template={{ 'x' }}"],
        ),
    ],
    ids=["plain", "shell-metacharacters"],
)
def test_head_job_entrypoint_carries_the_launch_spec(raw: dict[str, Any]) -> None:
    spec = validate("demo", raw)
    plan = build_plan(spec)
    job = build_head_job("demo", "ns", spec, plan, OPTIONS, "demo-abcde", 1, None)
    entrypoint = job["spec"]["entrypoint"]
    assert entrypoint == launcher_entrypoint(plan)
    argv = shlex.split(entrypoint)
    assert argv[:4] == ["python", "-m", "vllm_dp_launcher", "--plan"]
    assert len(argv) == 5
    assert json.loads(argv[4]) == plan.launch_spec()


# --- what the hashes follow -------------------------------------------------------------------

SHAPE_CHANGES = {
    "dp-size": with_(dataParallel={"size": 12, "ranksPerNode": 4}),
    "ranks-per-node": with_(dataParallel={"size": 8, "ranksPerNode": 2}),
    "tp": with_(tensorParallelSize=2),
    "image": with_(image="other:2"),
    "gpu-per-pod": with_(gpu={"perPod": 8}),
    "gpu-resource": with_(gpu={"resourceName": "amd.com/gpu"}),
    "cpu": with_(resources={"cpu": "32"}),
    "memory": with_(resources={"memory": "256Gi"}),
    "shm": with_(shmSize="32Gi"),
    "port": with_(service={"port": 8080}),
    "env-from-secret": with_(
        env=[{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
    ),
    "node-selector": with_(nodeSelector={"pool": "b"}),
    "model-cache": with_(modelCache={"claimName": "hf"}),
}
ENGINE_CHANGES = {
    "engine-args": with_(engineArgs=["--max-model-len=4096"]),
    "model": with_(model="Qwen/Qwen2.5-14B-Instruct"),
    "served-model-name": with_(servedModelName="qwen"),
    "env-literal": with_(env=[{"name": "NCCL_DEBUG", "value": "INFO"}]),
    "api-server-count": with_(apiServerCount=2),
    "pack-strategy-same-layout": with_(
        dataParallel={"size": 8, "ranksPerNode": 4, "packStrategy": "fill"}
    ),
}


def _hashes(raw: dict[str, Any]) -> tuple[str, str, str]:
    spec = validate("demo", raw)
    plan = build_plan(spec)
    cluster = build_raycluster("demo", "ns", spec, plan, OPTIONS, None)
    name = cluster["metadata"]["name"]
    job = build_head_job("demo", "ns", spec, plan, OPTIONS, name, 1, None)
    return (
        cluster_hash("demo", spec, plan, OPTIONS),
        name,
        job["metadata"]["labels"][constants.LABEL_JOB_HASH],
    )


@pytest.mark.parametrize("raw", list(SHAPE_CHANGES.values()), ids=list(SHAPE_CHANGES))
def test_shape_change_makes_a_new_cluster(raw: dict[str, Any]) -> None:
    base_hash, base_name, base_job = _hashes(BASE)
    new_hash, new_name, new_job = _hashes(raw)
    assert new_hash != base_hash
    assert new_name != base_name
    assert new_job != base_job  # the job follows its cluster


@pytest.mark.parametrize("raw", list(ENGINE_CHANGES.values()), ids=list(ENGINE_CHANGES))
def test_engine_only_change_keeps_the_cluster_and_makes_a_new_job(raw: dict[str, Any]) -> None:
    base_hash, base_name, base_job = _hashes(BASE)
    new_hash, new_name, new_job = _hashes(raw)
    assert (new_hash, new_name) == (base_hash, base_name)
    assert new_job != base_job


def test_suspend_changes_neither_hash() -> None:
    assert _hashes(with_(suspend=True)) == _hashes(BASE)


def test_socket_ifname_option_is_part_of_the_shape() -> None:
    spec = validate("demo", BASE)
    plan = build_plan(spec)
    other = RenderOptions(socket_ifname="ib0")
    assert cluster_hash("demo", spec, plan, other) != cluster_hash("demo", spec, plan, OPTIONS)
    for template in templates(build_raycluster("demo", "ns", spec, plan, other, None)):
        env = {e["name"]: e.get("value") for e in container(template)["env"]}
        assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "ib0"


def test_renderers_are_deterministic() -> None:
    assert cluster_of(BASE) == cluster_of(BASE)
    assert job_of(BASE) == job_of(BASE)
