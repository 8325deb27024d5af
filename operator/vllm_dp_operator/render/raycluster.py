"""Render the KubeRay RayCluster: identical GPU pods, the head being one of them."""

from __future__ import annotations

import copy
import json
from typing import Any

from vllm_dp_operator import __version__, constants
from vllm_dp_operator.api import names
from vllm_dp_operator.api.models import RayAuth, VLLMDataParallelSpec
from vllm_dp_operator.config import RenderOptions
from vllm_dp_operator.plan import Plan
from vllm_dp_operator.render.meta import metadata
from vllm_dp_operator.render.scheduling import kueue_queue, scheduling_labels

WORKER_GROUP = "gpu"
SHM_VOLUME = "dshm"
CACHE_VOLUME = "model-cache"


def _env(spec: VLLMDataParallelSpec, options: RenderOptions) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        # vLLM's DP master IP must equal this pod's Ray node:<ip> (aibrix#927, vllm#13521).
        {"name": "VLLM_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # Gloo and NCCL otherwise may pick a NIC other pods cannot reach (vllm#5094, #7074).
        {"name": "GLOO_SOCKET_IFNAME", "value": options.socket_ifname},
        {"name": "NCCL_SOCKET_IFNAME", "value": options.socket_ifname},
    ]
    for name, ref in (("HF_TOKEN", spec.hf_token_secret_ref),
                      ("VLLM_API_KEY", spec.api_key_secret_ref)):  # fmt: skip
        if ref is not None:
            env.append({"name": name,
                        "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    if spec.model_cache is not None:
        env.append({"name": "HF_HOME", "value": spec.model_cache.mount_path})
    env += [{"name": e.name, "valueFrom": e.value_from} for e in spec.env if e.value_from]
    return env


def _resources(spec: VLLMDataParallelSpec, plan: Plan, head: bool) -> dict[str, Any]:
    # The head also runs vLLM's API servers: it gets their CPU and memory on top (plan).
    amounts: dict[str, Any] = {spec.gpu.resource_name: plan.gpus_per_pod}
    cpu = plan.head_cpu if head else spec.resources.cpu
    memory = plan.head_memory if head else spec.resources.memory
    if cpu:
        amounts["cpu"] = cpu
    if memory:
        amounts["memory"] = memory
    return {"limits": dict(amounts), "requests": dict(amounts)}


def _head_ports(spec: VLLMDataParallelSpec) -> list[dict[str, Any]]:
    # Once one port is declared KubeRay exposes only declared ones: declare Ray's too. The
    # head Service (<cluster>-head-svc) then carries the dashboard and the API port, which is
    # how the operator reaches both on the head pod alone.
    return [
        {"name": "gcs-server", "containerPort": constants.RAY_GCS_PORT},
        {"name": "dashboard", "containerPort": constants.RAY_DASHBOARD_PORT},
        {"name": "client", "containerPort": constants.RAY_CLIENT_PORT},
        {"name": "http", "containerPort": spec.service.port},
    ]


def gpu_tolerations(spec: VLLMDataParallelSpec) -> list[dict[str, Any]]:
    """Tolerate the GPU resource taint GPU nodes commonly carry, plus the user's own."""
    return [
        {"key": spec.gpu.resource_name, "operator": "Exists", "effect": "NoSchedule"},
        *copy.deepcopy(spec.tolerations),
    ]


def _pod_template(
    instance: str, spec: VLLMDataParallelSpec, plan: Plan, options: RenderOptions, head: bool
) -> dict[str, Any]:
    mounts: list[dict[str, Any]] = [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [
        # NCCL needs far more shared memory than the 64Mi container default.
        {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}}
    ]
    if spec.model_cache is not None:
        cache = spec.model_cache
        mounts.append(
            {"name": CACHE_VOLUME, "mountPath": cache.mount_path, "readOnly": cache.read_only}
        )
        volumes.append(
            {"name": CACHE_VOLUME,
             "persistentVolumeClaim": {"claimName": cache.claim_name, "readOnly": cache.read_only}}
        )  # fmt: skip
    container: dict[str, Any] = {
        "name": constants.HEAD_CONTAINER if head else "ray-worker",
        "image": spec.image or options.default_image,
        "imagePullPolicy": "IfNotPresent",
        "resources": _resources(spec, plan, head),
        "env": _env(spec, options),
        "volumeMounts": mounts,
        # Pod Security Standards `restricted`: a namespace that enforces it admits these pods.
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if head:
        container["ports"] = _head_ports(spec)
    tolerations = gpu_tolerations(spec)
    pod: dict[str, Any] = {
        # A Service named like vLLM's settings would inject VLLM_PORT=tcp://... (vllm#34199).
        "enableServiceLinks": False,
        # KubeRay's command leaves `ray start` as PID 1, which ignores SIGTERM: a pod stop then
        # takes the whole grace period, and exited engine workers are never reaped. With the
        # pause container as PID 1 they are reaped, and `ray start` gets SIGTERM normally.
        "shareProcessNamespace": True,
        # The engine runs as a non-root user: fsGroup makes the model cache claim writable to
        # it; OnRootMismatch skips the recursive chown of a large cache once it is right.
        "securityContext": {
            "fsGroup": options.fs_group,
            "fsGroupChangePolicy": "OnRootMismatch",
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # Nothing in a Ray pod talks to the Kubernetes API; code run through Ray (a job, an
        # engine) must not find a credential for it.
        "automountServiceAccountToken": False,
        "containers": [container],
        "volumes": volumes,
        "tolerations": tolerations,
    }
    if spec.node_selector:
        pod["nodeSelector"] = dict(spec.node_selector)
    if spec.affinity:
        pod["affinity"] = spec.affinity
    if spec.priority_class_name:
        pod["priorityClassName"] = spec.priority_class_name
    if spec.service_account_name:
        pod["serviceAccountName"] = spec.service_account_name
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s.name} for s in spec.image_pull_secrets]
    labels = names.instance_labels(instance, constants.COMPONENT_ENGINE)
    # A copy per template: otherwise head and worker share the spec's own dicts (tolerations,
    # affinity, valueFrom), and editing one manifest would edit the other and the spec.
    return copy.deepcopy({"metadata": {"labels": labels}, "spec": pod})


def _cluster_spec(
    instance: str, spec: VLLMDataParallelSpec, plan: Plan, options: RenderOptions,
    token_secret: str,
) -> dict[str, Any]:  # fmt: skip
    gpus = str(plan.gpus_per_pod)
    cluster: dict[str, Any] = {
        "rayVersion": options.ray_version,
        "enableInTreeAutoscaling": False,
        "headGroupSpec": {
            "rayStartParams": {"num-gpus": gpus, "dashboard-host": "0.0.0.0"},
            "template": _pod_template(instance, spec, plan, options, head=True),
        },
        "workerGroupSpecs": [],
    }
    if spec.ray.auth == RayAuth.TOKEN:
        # KubeRay sets RAY_AUTH_MODE and RAY_AUTH_TOKEN (from this Secret, which the operator
        # creates) on every Ray container, and sends the token itself to submit the head job.
        # Its name says which key made the token (engines/ray_auth.py).
        cluster["authOptions"] = {"mode": "token",
                                  "secretName": token_secret or names.ray_token_secret(instance)}
    if plan.worker_pods:
        cluster["workerGroupSpecs"] = [
            {
                "groupName": WORKER_GROUP,
                "replicas": plan.worker_pods,
                "minReplicas": plan.worker_pods,
                "maxReplicas": plan.worker_pods,
                "rayStartParams": {"num-gpus": gpus},
                "template": _pod_template(instance, spec, plan, options, head=False),
            }
        ]
    return cluster


#: Ray's own health of a node, where KubeRay's probes read it: the raylet, plus the GCS on the head.
RAY_HEALTH = {"path": "/api/healthz", "port": constants.RAY_AGENT_PORT}
#: The head is probed every second until Ray first answers healthy, for up to 10 minutes.
STARTUP_PERIOD_SECONDS = 1
STARTUP_FAILURES = 600
#: KubeRay's timeout for the head's Ray health check.
HEAD_PROBE_TIMEOUT_SECONDS = 5
#: The kubelet runs a readiness probe as soon as the container starts; after that, rarely.
WORKER_READINESS_PERIOD_SECONDS = 10


def _head_probes() -> dict[str, Any]:
    """The head: a startup probe every second, then KubeRay's readiness probe without its delay.

    KubeRay's own readiness probe waits 10 s, then probes every 5 s: a head whose Ray is up
    stays unready for up to that long, and the head job (which KubeRay submits only once
    every pod is Ready) waits with it. The startup probe sees Ray healthy within a second,
    and the kubelet then runs the readiness probe at once, so the head turns Ready about a
    second after Ray is up there. Readiness after that is KubeRay's: the same check, timeout,
    period and failure threshold; liveness stays KubeRay's own.
    """
    return {
        "startupProbe": {
            "httpGet": dict(RAY_HEALTH),
            "periodSeconds": STARTUP_PERIOD_SECONDS,
            "timeoutSeconds": HEAD_PROBE_TIMEOUT_SECONDS,
            "failureThreshold": STARTUP_FAILURES,
        },
        "readinessProbe": {
            "httpGet": dict(RAY_HEALTH),
            "initialDelaySeconds": 0,
            "periodSeconds": 5,
            "timeoutSeconds": HEAD_PROBE_TIMEOUT_SECONDS,
            "failureThreshold": 10,
        },
    }


def _worker_probes() -> dict[str, Any]:
    """A worker is Ready once its container runs: its joining Ray is the launcher's to wait for.

    KubeRay starts a worker's container only once the head's GCS answers (its wait-gcs-ready
    init container), and submits the head job only once every pod is Ready. Were a worker's
    readiness Ray's health, the head job's submission and the Ray job's start (about 3.5 s)
    would follow the last node's join; with this, they run while the workers join, and the
    launcher, which lists Ray's nodes every 0.2 s and names a missing one, execs vLLM as the
    last one joins. A worker's raylet that never comes up, or dies, is still KubeRay's
    liveness probe's: the same Ray health check, and the kubelet restarts the container. No
    traffic is routed to a worker pod, so its readiness gates nothing else.
    """
    return {
        "readinessProbe": {
            "exec": {"command": ["true"]},
            "initialDelaySeconds": 0,
            "periodSeconds": WORKER_READINESS_PERIOD_SECONDS,
            "timeoutSeconds": 1,
            "failureThreshold": 1,
        },
    }


def _with_probes(body: dict[str, Any]) -> None:
    # After the hash: probe timing is not shape, so an operator that tunes it renames no
    # cluster, and a cluster made before it keeps serving as it is.
    body["headGroupSpec"]["template"]["spec"]["containers"][0].update(_head_probes())
    for group in body.get("workerGroupSpecs", []):
        group["template"]["spec"]["containers"][0].update(_worker_probes())


#: The longest a Ray pod's preStop hook holds its stop for the head's drain
#: (vllm_dp_launcher/prestop.py), and the pod's grace period: that, then as long as before.
PRESTOP_MAX_SECONDS = 20
STOP_GRACE_SECONDS = PRESTOP_MAX_SECONDS + 30


def _with_stop(body: dict[str, Any], port: int) -> None:
    """A pod deleted by anyone but the operator (a node drain's eviction) drains its head
    before its containers get SIGTERM: the hook returns at once where nothing serves. After
    the hash, as the probes: a cluster made before it keeps its name and its pods."""
    templates = [body["headGroupSpec"]["template"],
                 *(g["template"] for g in body.get("workerGroupSpecs", []))]  # fmt: skip
    for i, template in enumerate(templates):
        command = ["python", "-m", "vllm_dp_launcher.prestop", "--port", str(port),
                   "--max-seconds", str(PRESTOP_MAX_SECONDS), *(["--worker"] if i else [])]
        template["spec"]["terminationGracePeriodSeconds"] = STOP_GRACE_SECONDS
        template["spec"]["containers"][0]["lifecycle"] = {"preStop": {"exec": {
            "command": command}}}  # fmt: skip


#: Where replicas spread: across nodes, and across zones where the nodes carry one.
SPREAD_KEYS = ("kubernetes.io/hostname", "topology.kubernetes.io/zone")


def _spread(instance: str) -> list[dict[str, Any]]:
    """Prefer nodes (and zones) with fewer of the resource's Ray pods, so a lost node takes
    the fewest replicas. A preference only: a full cluster still schedules every pod."""
    selector = {"matchLabels": {constants.LABEL_INSTANCE: instance,
                                constants.LABEL_COMPONENT: constants.COMPONENT_ENGINE}}
    return [{"maxSkew": 1, "topologyKey": key, "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": selector} for key in SPREAD_KEYS]  # fmt: skip


def _with_replica(body: dict[str, Any], instance: str, replica: int) -> None:
    # After the hash too: every replica has the same shape (the name tells them apart), and
    # replica 0's clusters made before replicas keep their names.
    for template in (body["headGroupSpec"]["template"],
                     *(g["template"] for g in body.get("workerGroupSpecs", []))):  # fmt: skip
        template["metadata"]["labels"].update(names.replica_labels(replica))
        template["spec"].setdefault("topologySpreadConstraints", _spread(instance))


def _shape(body: dict[str, Any], queue_labels: dict[str, str], restart: str = "") -> str:
    # The queue labels are read when the cluster is admitted or its pods made: another queue
    # means another cluster; a restart (vllmdp.io/restartedAt) means new pods. Without either
    # the hash is what it always was (no cluster renamed).
    extra: dict[str, Any] = {"scheduling": queue_labels} if queue_labels else {}
    if restart:
        extra["restartedAt"] = restart
    return names.content_hash({**body, **extra})


def cluster_hash(
    instance: str, spec: VLLMDataParallelSpec, plan: Plan, options: RenderOptions,
    restart: str = "", token_secret: str = "",
) -> str:  # fmt: skip
    """Hash of everything that shapes the pods; a new value means a new RayCluster."""
    body = _cluster_spec(instance, spec, plan, options, token_secret)
    return _shape(body, scheduling_labels(spec.scheduling), restart)


def rendered_with(spec: VLLMDataParallelSpec, options: RenderOptions) -> str:
    """The operator-wide inputs a cluster is rendered with, as its annotation says them."""
    return json.dumps({"image": spec.image or options.default_image, "operator": __version__,
                       "rayVersion": options.ray_version, "socketIfname": options.socket_ifname,
                       "fsGroup": options.fs_group}, sort_keys=True)  # fmt: skip


def build_raycluster(
    instance: str,
    namespace: str,
    spec: VLLMDataParallelSpec,
    plan: Plan,
    options: RenderOptions,
    owner: dict[str, Any] | None,
    replica: int = 0,
    asked: str = "",
    restart: str = "",
    token_secret: str = "",
) -> dict[str, Any]:
    """One replica's RayCluster manifest for a plan; its name carries the shape hash. `asked`:
    the resource's `<generation>/<restartedAt>` it is made for; `restart`: its restartedAt;
    `token_secret`: its Ray token's Secret (engines/ray_auth.py; empty: the first scheme's
    `<name>-ray-token`, as an offline render without the operator's key says)."""
    body = _cluster_spec(instance, spec, plan, options, token_secret)
    queue_labels = scheduling_labels(spec.scheduling)
    shape = _shape(body, queue_labels, restart)
    labels = {
        **queue_labels,
        **names.instance_labels(instance, constants.COMPONENT_ENGINE),
        constants.LABEL_CLUSTER_HASH: shape,
        **names.replica_labels(replica),
    }
    # Suspending keeps the shape: it stops the pods without creating a new cluster. In a
    # Kueue queue it is made suspended, as Kueue's webhook would make it, and Kueue alone
    # unsuspends it (the operator never writes the field after that: reconcile/converge.py).
    body["suspend"] = True if kueue_queue(spec) else spec.suspend
    _with_probes(body)
    _with_stop(body, spec.service.port)
    _with_replica(body, instance, replica)
    return {
        "apiVersion": f"{constants.RAY_GROUP}/{constants.RAY_VERSION_API}",
        "kind": "RayCluster",
        "metadata": metadata(names.raycluster(instance, shape, replica), namespace, labels,
                             owner, _annotations(spec, options, asked)),
        "spec": body,
    }


def _annotations(spec: VLLMDataParallelSpec, options: RenderOptions, asked: str
                 ) -> dict[str, str]:  # fmt: skip
    out = {constants.ANNOTATION_RENDERED_WITH: rendered_with(spec, options),
           constants.ANNOTATION_API_PORT: str(spec.service.port)}  # fmt: skip
    if asked:
        out[constants.ANNOTATION_ACCEPTED] = asked
    return out
