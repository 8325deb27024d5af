"""Pure renderers: RayCluster, Service and head RayJob shapes, and what their hashes follow."""

from __future__ import annotations

import base64
import copy
import json
import re
import shlex
from typing import Any

import pytest
import yaml
from vllm_dp_operator import constants
from vllm_dp_operator.api.validation import validate
from vllm_dp_operator.config import RenderOptions
from vllm_dp_operator.plan import build_plan
from vllm_dp_operator.render import (
    build_head_job,
    build_raycluster,
    build_service,
    cluster_hash,
    launcher_entrypoint,
    raycluster,
)
from vllm_dp_operator.render.meta import owner_reference

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
    raw = with_(tensorParallelSize=2, apiServerCount=2, resources={"cpu": "8", "memory": "64Gi"})
    cluster = cluster_of(raw)
    head, worker = templates(cluster)
    expected = {"nvidia.com/gpu": 8, "cpu": "8", "memory": "64Gi"}
    assert container(worker)["resources"] == {"limits": expected, "requests": expected}
    # The head also runs the API servers: 1 CPU and 2Gi more for each.
    head_expected = {"nvidia.com/gpu": 8, "cpu": "10", "memory": "68Gi"}
    assert container(head)["resources"] == {"limits": head_expected, "requests": head_expected}
    params = cluster["spec"]["headGroupSpec"]["rayStartParams"]
    [group] = cluster["spec"]["workerGroupSpecs"]
    assert params["num-gpus"] == group["rayStartParams"]["num-gpus"] == "8"


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
    cluster = cluster_of(with_(service={"port": 9000}))
    head = container(cluster["spec"]["headGroupSpec"]["template"])
    ports = {p["containerPort"] for p in head["ports"]}
    assert ports == {6379, 8265, 10001, 9000}
    [group] = cluster["spec"]["workerGroupSpecs"]
    assert "ports" not in container(group["template"])


def test_the_head_is_probed_every_second_until_ray_is_healthy_then_as_kuberay_does() -> None:
    c = container(templates(cluster_of(BASE))[0])
    health = {"path": "/api/healthz", "port": constants.RAY_AGENT_PORT}
    assert c["startupProbe"]["httpGet"] == health
    assert c["startupProbe"]["periodSeconds"] == 1
    # Ten minutes for Ray to come up; after that the kubelet restarts the container.
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] == 600
    ready = c["readinessProbe"]
    # KubeRay's check and pace, without its 10 s delay (the startup probe went first).
    assert ready["httpGet"] == health
    assert (ready["initialDelaySeconds"], ready["periodSeconds"],
            ready["failureThreshold"]) == (0, 5, 10)  # fmt: skip
    assert ready["timeoutSeconds"] == c["startupProbe"]["timeoutSeconds"] == 5
    assert "livenessProbe" not in c  # KubeRay's own


def test_a_worker_is_ready_once_it_runs_and_its_ray_health_is_left_to_kuberays_liveness() -> None:
    """Ready does not wait for the worker's join: KubeRay submits the head job meanwhile."""
    worker = container(templates(cluster_of(BASE))[1])
    ready = worker["readinessProbe"]
    assert ready["exec"] == {"command": ["true"]}
    assert ready["initialDelaySeconds"] == 0
    assert "startupProbe" not in worker, "a startup probe would hold readiness back"
    assert "livenessProbe" not in worker  # KubeRay's: the Ray health check, then a restart


def test_one_pod_clusters_have_only_the_heads_probes() -> None:
    cluster = cluster_of(with_(dataParallel={"size": 4, "ranksPerNode": 4}))
    assert not cluster["spec"].get("workerGroupSpecs")
    head = cluster["spec"]["headGroupSpec"]["template"]
    assert "startupProbe" in container(head)


def test_probe_timing_is_not_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tuning the probes renames no cluster: an operator upgrade relaunches nothing for them.
    before = cluster_of(BASE)
    monkeypatch.setattr(raycluster, "STARTUP_PERIOD_SECONDS", 2)
    after = cluster_of(BASE)
    assert container(templates(after)[0])["startupProbe"]["periodSeconds"] == 2
    assert after["metadata"]["name"] == before["metadata"]["name"]
    spec = validate("demo", BASE)
    assert cluster_hash("demo", spec, build_plan(spec), OPTIONS) == (
        after["metadata"]["labels"][constants.LABEL_CLUSTER_HASH])


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
        assert env["HF_HOME"]["value"] == "/var/cache/huggingface"
        mounts = {m["name"]: m["mountPath"] for m in container(template)["volumeMounts"]}
        assert mounts["model-cache"] == "/var/cache/huggingface"
        assert "FROM_CM" in env
        assert "LITERAL" not in env  # literals travel in the head job, not the pods


def test_api_key_reaches_every_pod_from_its_secret_and_never_the_head_job() -> None:
    raw = with_(apiKeySecretRef={"name": "api", "key": "key"})
    for template in templates(cluster_of(raw)):
        env = {e["name"]: e for e in container(template)["env"]}
        assert env["VLLM_API_KEY"] == {
            "name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "api", "key": "key"}}}
        assert "value" not in env["VLLM_API_KEY"]
    job = job_of(raw)
    plan = base64.b64decode(shlex.split(job["spec"]["entrypoint"])[4]).decode()
    for text in (json.dumps(job), plan):
        assert "VLLM_API_KEY" not in text and "api-key" not in text and '"api"' not in text


def test_raycluster_pods_run_the_engine_as_non_root_with_a_writable_cache() -> None:
    # The engine image runs as UID 2000; /root is 0700 in vLLM's image, and a fresh claim is
    # root-owned: a cache outside /root, made group-writable by fsGroup.
    spec = validate("demo", with_(modelCache={"claimName": "hf"}))
    assert not spec.model_cache or not spec.model_cache.mount_path.startswith("/root")
    for template in templates(cluster_of(with_(modelCache={"claimName": "hf"}))):
        context = template["spec"]["securityContext"]
        assert (context["fsGroup"], context["fsGroupChangePolicy"]) == (2000, "OnRootMismatch")
    other = cluster_of(BASE, options=RenderOptions(fs_group=1234))
    assert templates(other)[0]["spec"]["securityContext"]["fsGroup"] == 1234


def test_raycluster_pods_meet_the_restricted_pod_security_standard() -> None:
    # What PSS `restricted` checks on every container and the pod; no API token in the pods.
    for template in templates(cluster_of(BASE)):
        pod = template["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in pod["containers"]:
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["capabilities"] == {"drop": ["ALL"]}
            assert ctx["runAsNonRoot"] is True and "runAsUser" not in ctx
            assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not any(k in pod for k in ("hostNetwork", "hostPID", "hostIPC"))
        assert all("hostPath" not in v for v in pod["volumes"])


def test_service_account_and_pull_secrets_reach_every_pod() -> None:
    raw = with_(serviceAccountName="engines", imagePullSecrets=[{"name": "regcred"}])
    for template in templates(cluster_of(raw)):
        assert template["spec"]["serviceAccountName"] == "engines"
        assert template["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert "serviceAccountName" not in templates(cluster_of(BASE))[0]["spec"]


def test_raycluster_pods_share_the_process_namespace() -> None:
    # `ray start` as PID 1 ignores SIGTERM and reaps nothing; the pause container does both.
    for template in templates(cluster_of(BASE)):
        assert template["spec"]["shareProcessNamespace"] is True


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
    return build_service(name, "ns", spec, owner)


def test_service_has_no_selector_its_endpoints_are_the_operators_slice() -> None:
    service = service_of(
        with_(service={"port": 9000, "type": "NodePort", "annotations": {"a": "b"}})
    )
    # No selector: the EndpointSlice controller leaves it alone, and no pod label is needed
    # (the operator writes no pods); test_routing.py covers the slice.
    assert "selector" not in service["spec"]
    assert service["spec"]["type"] == "NodePort"
    assert service["spec"]["ports"] == [
        {"name": "http", "protocol": "TCP", "port": 9000, "targetPort": 9000}
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
    raw: dict[str, Any], cluster_name: str = "demo-abcde", attempt: int = 1, owner: Any = OWNER,
    head_pod_uid: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    spec = validate("demo", raw)
    return build_head_job("demo", "ns", spec, build_plan(spec), cluster_name, attempt, owner,
                          head_pod_uid)  # fmt: skip


def test_head_job_is_submitted_over_http_without_a_submitter_pod() -> None:
    job = job_of({**BASE, "tolerations": [{"key": "team", "operator": "Exists"}]})
    assert job["spec"]["submissionMode"] == "HTTPMode"
    for key in ("submitterPodTemplate", "submitterConfig", "backoffLimit"):
        assert key not in job["spec"]
    # The RayJob name is the Ray submission id: the operator can ask about it by name.
    assert job["spec"]["jobId"] == job["metadata"]["name"]


def test_head_job_stop_waits_the_drain_grace() -> None:
    job = job_of(with_(launch={"drainSeconds": 45}))
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert env["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == "45"
    default = yaml.safe_load(job_of(BASE)["spec"]["runtimeEnvYAML"])
    assert default["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == str(constants.DEFAULT_DRAIN_SECONDS)


def test_head_job_tells_the_launcher_where_to_report_and_as_which_job() -> None:
    job = job_of(BASE)
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    assert env["VLLMDP_HEAD_JOB"] == job["metadata"]["name"]
    assert env["VLLMDP_STAGE_REPORT"] == "container-stdout"  # the head container's own log


def test_head_job_records_the_head_pod_it_runs_on() -> None:
    job = job_of(BASE, head_pod_uid="uid-head-1")
    assert job["metadata"]["annotations"] == {constants.ANNOTATION_HEAD_POD_UID: "uid-head-1"}
    assert "annotations" not in job_of(BASE)["metadata"]


def test_head_job_runs_on_the_existing_cluster() -> None:
    job = job_of(BASE, attempt=3)
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    assert job["metadata"]["name"] == "demo-j00003"
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
            env=[{"name": "QUOTE", "value": 'it\'s "quoted" $HOME `x`; (y) ünï'}],
            engineArgs=["--chat-template={{ 'x' }}"],
        ),
    ],
    ids=["plain", "shell-metacharacters"],
)
def test_head_job_entrypoint_carries_the_launch_spec(raw: dict[str, Any]) -> None:
    spec = validate("demo", raw)
    plan = build_plan(spec)
    job = build_head_job("demo", "ns", spec, plan, "demo-abcde", 1, None)
    entrypoint = job["spec"]["entrypoint"]
    assert entrypoint == launcher_entrypoint(plan)
    argv = shlex.split(entrypoint)
    assert argv[:4] == ["python", "-m", "vllm_dp_launcher", "--plan-b64"]
    assert len(argv) == 5
    # Standard base64, no line breaks: nothing a shell would expand, split or quote.
    assert re.fullmatch(r"[A-Za-z0-9+/]+=*", argv[4])
    assert json.loads(base64.b64decode(argv[4], validate=True).decode("utf-8")) == (
        plan.launch_spec()
    )


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
    "port": with_(service={"port": 9000}),
    # With resources set, the head is sized for its API servers: a new head pod.
    "api-server-count-sizes-head": with_(resources={"cpu": "8"}, apiServerCount=2),
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
    "api-server-count-without-resources": with_(apiServerCount=2),
    "pack-strategy-same-layout": with_(
        dataParallel={"size": 8, "ranksPerNode": 4, "packStrategy": "fill"}
    ),
}


def _hashes(raw: dict[str, Any]) -> tuple[str, str, str]:
    spec = validate("demo", raw)
    plan = build_plan(spec)
    cluster = build_raycluster("demo", "ns", spec, plan, OPTIONS, None)
    name = cluster["metadata"]["name"]
    job = build_head_job("demo", "ns", spec, plan, name, 1, None)
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


def test_launch_deadlines_change_neither_hash() -> None:
    # The deadline is the operator's; the drain is read when a job stops: no relaunch for them.
    assert _hashes(with_(launch={"timeoutSeconds": 60, "drainSeconds": 5})) == _hashes(BASE)


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
