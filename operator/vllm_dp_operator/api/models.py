"""Pydantic models of the VLLMDataParallel API: the single source of the CRD schema."""

from __future__ import annotations

import ipaddress
import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    WithJsonSchema,
    field_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from vllm_dp_operator import constants

# Kubernetes quantity grammar (resource.Quantity), so bad sizes fail at admission.
QUANTITY_PATTERN = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[KMGTPE]i?|[mkMGTPE])?$"


def _json_integer(value: Any) -> Any:
    # The API server takes a JSON integer (or an integral number such as 2.0) and nothing else;
    # pydantic alone would also read "2" and true as 2, and so accept what admission refuses.
    if isinstance(value, bool | str):
        kind = "boolean" if isinstance(value, bool) else "string"
        raise PydanticCustomError("int_type", "Input should be a valid integer, not a {kind}",
                                  {"kind": kind})  # fmt: skip
    return value


#: An integer field as the API server reads one. The JSON schema is plain `integer`.
JsonInt = Annotated[int, BeforeValidator(_json_integer)]

#: A count of replicas or a percentage of spec.replicas (`25%`), as a Deployment's
#: maxSurge and maxUnavailable.
PERCENT_PATTERN = r"^[0-9]+%$"


def _int_or_percent(value: Any) -> Any:
    # Its range and its percentage's form are rules (api/validation.py), as in the CRD's CEL.
    return value if isinstance(value, str) else _json_integer(value)


def int_or_percent_ok(value: int | str) -> bool:
    """A count of 0 to MAX_REPLICAS, or a percentage."""
    if isinstance(value, str):
        return re.fullmatch(PERCENT_PATTERN, value) is not None
    return 0 <= value <= constants.MAX_REPLICAS


IntOrPercent = Annotated[int | str, BeforeValidator(_int_or_percent),
                         WithJsonSchema({"x-kubernetes-int-or-string": True})]


def resolve_count(value: int | str, total: int, round_up: bool) -> int:
    """A count, or a percentage of `total` rounded as a Deployment rounds it (maxSurge up,
    maxUnavailable down)."""
    if isinstance(value, int):
        return value
    share = int(value[:-1]) * total
    return -(-share // 100) if round_up else share // 100
#: 1 to 64 as an optional field needs it: constraints inside, so the schema has min/max.
JsonCount = Annotated[int, Field(ge=1, le=64), BeforeValidator(_json_integer)]
#: A TCP port number, as a JSON integer.
JsonPort = Annotated[int, Field(ge=1, le=65535), BeforeValidator(_json_integer)]
#: A boolean field as the API server reads one: true or false, never "false" or 0.
JsonBool = Annotated[bool, Strict()]


class ApiModel(BaseModel):
    """Base for every API object: camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(
        extra="forbid", alias_generator=to_camel, populate_by_name=True, use_enum_values=True
    )


class PackStrategy(StrEnum):
    """vLLM's VLLM_RAY_DP_PACK_STRATEGY: how DP ranks are packed onto Ray nodes."""

    STRICT = "strict"
    FILL = "fill"
    SPAN = "span"


class DataParallel(ApiModel):
    """Data-parallel layout: how many engine replicas and how they pack onto GPU pods."""

    size: JsonInt = Field(
        ge=1,
        le=1024,
        description="Number of data-parallel ranks (vLLM --data-parallel-size). At least 2: "
        "with the Ray backend vLLM resets the DP master address to 127.0.0.1 at DP=1.",
    )
    ranks_per_node: JsonInt = Field(
        ge=0,
        le=64,
        description="DP ranks on each GPU pod, the head pod included (vLLM "
        "--data-parallel-size-local). At least 1: vllm serve must run on a pod that sees a GPU.",
    )
    pack_strategy: PackStrategy = Field(
        default=PackStrategy.STRICT,
        description="How vLLM packs DP ranks onto Ray nodes (VLLM_RAY_DP_PACK_STRATEGY): "
        "strict (every pod holds exactly ranksPerNode ranks), fill (worker pods take as many "
        "ranks as fit), span (one rank's tensor-parallel group spans several pods).",
    )


class Gpu(ApiModel):
    """GPU shape of every Ray pod (the head is one of the GPU pods)."""

    resource_name: str = Field(
        default="nvidia.com/gpu",
        min_length=1,
        max_length=253,
        description="Extended resource name of the GPU (e.g. nvidia.com/gpu, amd.com/gpu).",
    )
    per_pod: JsonCount | None = Field(
        default=None,
        description="GPUs requested by each Ray pod. Defaults to ranksPerNode x "
        "tensorParallelSize; required for the span strategy.",
    )


class PodResources(ApiModel):
    """CPU and memory of each Ray pod; requests equal limits."""

    cpu: str | None = Field(
        default=None, pattern=QUANTITY_PATTERN, max_length=64, description="CPU per pod, e.g. '16'."
    )
    memory: str | None = Field(
        default=None, pattern=QUANTITY_PATTERN, max_length=64,
        description="Memory per pod, e.g. '128Gi'."
    )


class SecretKeyRef(ApiModel):
    """A key in a Secret in the resource's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Secret name.")
    key: str = Field(min_length=1, max_length=253, description="Key inside the Secret.")


#: A DNS-1123 subdomain, as ServiceAccount and Secret names are.
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class LocalObjectReference(ApiModel):
    """An object in the resource's namespace, by name (KubeRay's and the pod's `{name: ...}`)."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN,
                      description="Object name.")  # fmt: skip


class ModelCache(ApiModel):
    """An existing PersistentVolumeClaim mounted as the Hugging Face cache on every pod."""

    claim_name: str = Field(
        min_length=1, max_length=253, description="Name of an existing PersistentVolumeClaim."
    )
    mount_path: str = Field(
        default=constants.DEFAULT_MODEL_CACHE_PATH,
        pattern=r"^/",
        max_length=4096,
        description="Where the claim is mounted; HF_HOME points here. The engine runs as a "
        "non-root user, and the pods' fsGroup makes the claim writable to it.",
    )
    read_only: JsonBool = Field(default=False, description="Mount the claim read-only.")


class EnvVar(ApiModel):
    """An environment variable for vllm serve and its engines."""

    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$",
        description="Variable name.",
    )
    value: str | None = Field(
        default=None,
        max_length=32768,
        description="Literal value. Literal variables reach vllm serve through the head job, "
        "so changing them relaunches the engines without restarting pods.",
    )
    value_from: dict[str, Any] | None = Field(
        default=None,
        description="A Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef). "
        "Such variables are set on every Ray pod, so changing them replaces the pods.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


class LaunchSpec(ApiModel):
    """Deadlines of a head job: how long a launch may take, and how long a stop drains."""

    timeout_seconds: JsonInt = Field(
        default=constants.DEFAULT_LAUNCH_TIMEOUT_SECONDS,
        ge=5,
        le=7 * 24 * 3600,
        description="Seconds a head job may take from creation until vLLM answers /health. "
        "Past it, the head job is stopped and counted as a failure (relaunched with backoff), "
        "and the status names the stage it was stuck in. Allow for the model download.",
    )
    drain_seconds: JsonInt = Field(
        default=constants.DEFAULT_DRAIN_SECONDS,
        ge=0,
        le=3600,
        description="Grace given to in-flight requests when a head job is stopped (an engine "
        "change, a relaunch): the API Service stops routing to it first, then Ray sends SIGTERM "
        "and waits this long before SIGKILL (RAY_JOB_STOP_WAIT_TIME_S). Takes effect at the "
        "next launch.",
    )


class UpdateStrategy(StrEnum):
    """How a change that needs new engines reaches them."""

    RECREATE = "Recreate"
    SURGE = "Surge"
    #: Across replicas, as a Deployment rolls: a few replicas at a time (maxUnavailable by
    #: Recreate, maxSurge by Surge), the others serving what they run meanwhile.
    ROLLING_UPDATE = "RollingUpdate"


class ServingCheck(StrEnum):
    """The request that proves new engines serve (vllm_dp_launcher/servecheck.py)."""

    AUTO = "Auto"
    COMPLETION = "Completion"
    EMBEDDING = "Embedding"
    MODELS = "Models"


class UpdateSpec(ApiModel):
    """How a change that needs new engines (model, engine args, literal env, cluster shape)
    replaces the running ones. Changes that need none (labels, the Service) restart nothing."""

    strategy: UpdateStrategy = Field(
        default=UpdateStrategy.RECREATE,
        description="Recreate: stop the running engines, then start new ones on the same pods "
        "(or on a new RayCluster for a shape change); serving pauses meanwhile, and no extra "
        "GPUs are needed. Surge: start a second RayCluster and head job beside the serving one "
        "and switch the API Service to it only once it answers /health and one completion; "
        "the old one then drains and is deleted. Surge holds a second cluster's GPUs for the "
        "duration, and on a full cluster the new one never schedules (its deadline then ends "
        "the attempt and the old one keeps serving). RollingUpdate: replica by replica, at "
        "most maxUnavailable replicas unrouted for the update at a time and maxSurge replicas "
        "updating by Surge beside their old group; the others keep serving what they run until "
        "their turn. With maxSurge 0 no extra GPUs are held.",
    )
    max_unavailable: IntOrPercent = Field(
        default=1,
        description="RollingUpdate: replicas (or a percentage of spec.replicas, rounded down) "
        "that may be unrouted for the update at a time "
        "(each updated by Recreate: its engines stop, then the new ones start on its GPUs). "
        "The Service keeps at least replicas - maxUnavailable routed replicas, counting any "
        "that are down for other reasons.",
    )
    max_surge: IntOrPercent = Field(
        default=0,
        description="RollingUpdate: replicas (or a percentage of spec.replicas, rounded up) "
        "that may update at a time by Surge (a second "
        "group beside the serving one, switched once it serves), each holding a second "
        "group's GPUs meanwhile.",
    )
    serving_check: ServingCheck = Field(
        default=ServingCheck.AUTO,
        description="The request that proves new engines serve before a Surge switches to "
        "them (sent by the operator through their head Service, and by the launcher in the "
        "pod where the engines want an API key). Completion: one completion of one token. "
        "Embedding: one embedding (an embedding model answers no completion). Models: the "
        "model list (any other pooling model: classify, score, reward). Auto: Embedding for "
        "--convert embed or --task embed, Models for --runner pooling or another pooling "
        "--convert/--task, else Completion.",
    )
    drain_seconds: JsonInt = Field(
        default=constants.DEFAULT_UPDATE_DRAIN_SECONDS,
        ge=0,
        le=3600,
        description="Surge: seconds the old generation keeps running, no longer routed, after "
        "the API Service switched to the new one, so its in-flight requests finish; then its "
        "RayCluster is deleted.",
    )


class ServiceType(StrEnum):
    """Kubernetes Service types the API service may use."""

    CLUSTER_IP = "ClusterIP"
    NODE_PORT = "NodePort"
    LOAD_BALANCER = "LoadBalancer"


#: A label value: at most 63 characters, alphanumerics with inner '-', '_' and '.'; may be empty.
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
#: A label key: an optional DNS-subdomain prefix and '/', then a name as a label value's.
LABEL_KEY_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_KEY = re.compile(LABEL_KEY_PATTERN)
LABEL_KEY_RULE = ("label keys must be a name of at most 63 characters (letters, digits, '-', '_', "
                  "'.'), optionally after a DNS subdomain prefix and '/', e.g. team or "
                  "example.com/team")  # fmt: skip
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]


class SelectorOperator(StrEnum):
    """A label selector requirement's operator (metav1.LabelSelectorOperator)."""

    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


class LabelSelectorRequirement(ApiModel):
    """One requirement of a label selector (metav1.LabelSelectorRequirement)."""

    key: str = Field(min_length=1, max_length=317, pattern=LABEL_KEY_PATTERN,
                     description="The label key.")  # fmt: skip
    operator: SelectorOperator = Field(description="In, NotIn, Exists or DoesNotExist.")
    values: list[LabelValue] = Field(
        default_factory=list, max_length=64,
        description="Values for In and NotIn (at least one); empty for Exists and DoesNotExist.",
    )  # fmt: skip


class LabelSelector(ApiModel):
    """A label selector (metav1.LabelSelector); an empty one selects everything."""

    match_labels: dict[str, LabelValue] = Field(
        default_factory=dict, max_length=64,
        description="Labels that must all be present with these values.",
    )  # fmt: skip
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, max_length=64, description="Requirements that must all hold."
    )

    @field_validator("match_labels")
    @classmethod
    def _label_keys(cls, labels: dict[str, str]) -> dict[str, str]:
        # A map's keys have no schema: the API server cannot check them, and a CEL regex over
        # them is priced at the largest request and refused at CRD install. So Python alone:
        # the operator reports such a spec as invalid, naming the field, and renders nothing.
        bad = [k for k in labels if not _LABEL_KEY.fullmatch(k)]
        if bad:
            raise PydanticCustomError("label_key", "{keys}: " + LABEL_KEY_RULE, {"keys": bad})
        return labels


class TrafficSource(ApiModel):
    """Pods that may reach the API port, as a NetworkPolicy peer: pods matching podSelector in
    namespaces matching namespaceSelector (either alone: any pod of those namespaces, or the
    matching pods of the resource's own namespace)."""

    namespace_selector: LabelSelector | None = Field(
        default=None, description="Namespaces, by their labels ({} for every namespace)."
    )
    pod_selector: LabelSelector | None = Field(
        default=None, description="Pods, by their labels ({} for every pod)."
    )


#: An IPv4 address block, each octet and the prefix in range, or an IPv6 one in outline (the
#: operator's own check parses it exactly before anything is made).
CIDR_PATTERN = (
    r"^(((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}"
    r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])/(3[0-2]|[12]?[0-9])"
    r"|[0-9a-fA-F:.]*:[0-9a-fA-F:.]*/(12[0-8]|1[01][0-9]|[1-9]?[0-9]))$"
)


class EgressDestination(ApiModel):
    """Where the Ray pods may connect when egress is limited: an address block, or pods by
    their namespace's and their own labels (as a NetworkPolicy peer); on `ports`, or any."""

    cidr: str | None = Field(
        default=None, max_length=43, pattern=CIDR_PATTERN,
        description="An address block (`10.20.0.0/16`, `2001:db8::/64`): a model store, a "
        "proxy, an object store's endpoints.",
    )  # fmt: skip
    namespace_selector: LabelSelector | None = Field(
        default=None, description="Namespaces, by their labels ({} for every namespace)."
    )
    pod_selector: LabelSelector | None = Field(
        default=None, description="Pods, by their labels ({} for every pod)."
    )
    ports: list[JsonPort] | None = Field(
        default=None, min_length=1, max_length=16,
        description="TCP ports; unset, every port.",
    )  # fmt: skip

    @field_validator("cidr")
    @classmethod
    def _cidr(cls, cidr: str | None) -> str | None:
        # The schema's pattern is the API server's outline check; the exact one is Python's.
        if cidr is not None:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError as e:
                raise PydanticCustomError("cidr", "not an address block: {why}",
                                          {"why": str(e)}) from None  # fmt: skip
        return cidr


class EgressSpec(ApiModel):
    """Whether the Ray pods' outgoing connections are limited, and to what."""

    enabled: JsonBool = Field(
        default=False,
        description="Render a third NetworkPolicy (<name>-egress) that lets the Ray pods "
        "connect only to the resource's own Ray pods, to DNS (port 53) and to allowTo. Off by "
        "default: the engines download models from wherever the spec points them. On, the "
        "cloud's metadata address and the API server are out of their reach unless listed.",
    )
    allow_to: list[EgressDestination] = Field(
        default_factory=list, max_length=32,
        description="Destinations the Ray pods may reach besides their own pods and DNS.",
    )  # fmt: skip


class NetworkPolicySpec(ApiModel):
    """The NetworkPolicy the operator renders in front of the Ray pods."""

    enabled: JsonBool = Field(
        default=True,
        description="Render a NetworkPolicy that admits Ray's ports only from the cluster's "
        "own pods (and the operator's and KubeRay's on the dashboard port), and the API port "
        "from service.allowFrom. Turn off where the namespace's own policies govern the pods.",
    )
    egress: EgressSpec = Field(
        default_factory=EgressSpec,
        description="An egress policy for the Ray pods (opt-in).",
    )


class ServiceSpec(ApiModel):
    """The Service exposing vLLM's OpenAI-compatible API server."""

    type: ServiceType = Field(default=ServiceType.CLUSTER_IP, description="Service type.")
    port: JsonInt = Field(
        default=constants.DEFAULT_SERVING_PORT,
        ge=1,
        le=65535,
        description="Port of the API server on the head pod and on the Service.",
    )
    annotations: dict[str, str] = Field(
        default_factory=dict, description="Annotations added to the Service."
    )
    allow_from: list[TrafficSource] | None = Field(
        default=None,
        min_length=1,
        max_length=32,
        description="Who may reach the API port, enforced by the resource's NetworkPolicy: "
        "set, only pods matching one of these entries; unset, the operator's default (pods of "
        "the resource's namespace and of namespaces labelled vllmdp.io/api-access=true, or "
        "every pod where the operator is set to open it).",
    )


class RayAuth(StrEnum):
    """Whether the Ray cluster's dashboard, job API and GCS demand a token."""

    TOKEN = "token"
    DISABLED = "disabled"


class RaySpec(ApiModel):
    """Settings of the Ray cluster the engines run on."""

    auth: RayAuth = Field(
        default=RayAuth.TOKEN,
        description="Ray token authentication (KubeRay authOptions.mode, Ray "
        "RAY_AUTH_MODE): token (the default) makes Ray's dashboard, job API and GCS refuse "
        "callers without the cluster's token, which only the Ray pods, KubeRay and the operator "
        "hold; disabled lets anyone who reaches the head's ports submit a Ray job, that is run "
        "code on the GPU pods. Changing it replaces the Ray pods.",
    )


#: A queue or priority class name: a DNS-1123 subdomain (Kueue's object names; YuniKorn's
#: `root.team` queues) that fits a label value, where KubeRay and Kueue read it.
QUEUE_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


class Scheduler(StrEnum):
    """Who admits the Ray pods as one gang: Kueue, or a batch scheduler KubeRay v1.6.2 knows."""

    KUEUE = "kueue"
    VOLCANO = "volcano"
    YUNIKORN = "yunikorn"
    SCHEDULER_PLUGINS = "scheduler-plugins"
    KAI_SCHEDULER = "kai-scheduler"


class Scheduling(ApiModel):
    """Queue-aware admission of the whole RayCluster (docs/scheduling.md)."""

    scheduler_name: Scheduler = Field(
        default=Scheduler.KUEUE,
        description="kueue: the RayCluster joins a Kueue LocalQueue, and Kueue admits, "
        "suspends and resumes it as one workload. volcano, yunikorn, scheduler-plugins, "
        "kai-scheduler: the labels KubeRay's batch-scheduler plugin of that name reads (KubeRay "
        "must run with --batch-scheduler=<the same name>).",
    )
    queue_name: str | None = Field(
        default=None, min_length=1, max_length=63, pattern=QUEUE_NAME_PATTERN,
        description="The queue: a Kueue LocalQueue in this namespace "
        "(kueue.x-k8s.io/queue-name), a Volcano queue (volcano.sh/queue-name), a YuniKorn queue "
        "(yunikorn.apache.org/queue) or a KAI queue (kai.scheduler/queue).",
    )  # fmt: skip
    priority_class_name: str | None = Field(
        default=None, min_length=1, max_length=63, pattern=QUEUE_NAME_PATTERN,
        description="Kueue: a WorkloadPriorityClass (kueue.x-k8s.io/priority-class), which "
        "orders and preempts workloads without touching the pods. Volcano: a PriorityClass of "
        "its PodGroup (ray.io/priority-class-name). For the pods' own priority use "
        "spec.priorityClassName.",
    )  # fmt: skip


#: An adapter's name as clients send it in `model`: a label value's characters (it is also
#: the `adapter` label of the operator's metrics), at most 63.
LORA_NAME_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
#: A Hugging Face repo id: `owner/name`, nothing else (no URL, no credentials, no revision).
HF_REPO_PATTERN = r"^[A-Za-z0-9][-A-Za-z0-9_.]{0,95}/[A-Za-z0-9][-A-Za-z0-9_.]{0,95}$"
#: A directory below the model cache's root: segments that begin with a letter, a digit or
#: `_` (so never `.` or `..`), joined by `/`; the same after a leading `/` for an absolute one.
_SEGMENT = r"[A-Za-z0-9_][-A-Za-z0-9_.]*"
LORA_SUBPATH_PATTERN = rf"^{_SEGMENT}(/{_SEGMENT})*/?$"
LORA_PATH_PATTERN = rf"^(/{_SEGMENT})+/?$"
#: vLLM's --max-lora-rank choices (vllm/config/lora.py, MaxLoRARanks).
LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraSource(ApiModel):
    """Where an adapter's files are: exactly one of modelCache, path and huggingFace."""

    model_cache: str | None = Field(
        default=None, min_length=1, max_length=1024, pattern=LORA_SUBPATH_PATTERN,
        description="A directory on spec.modelCache's claim, relative to its root (as a "
        "volume subPath), e.g. adapters/sql-lora.",
    )  # fmt: skip
    path: str | None = Field(
        default=None, min_length=2, max_length=1024, pattern=LORA_PATH_PATTERN,
        description="An absolute directory in the engine container (in the image, or under "
        "a volume the image or the cache provides).",
    )  # fmt: skip
    hugging_face: str | None = Field(
        default=None, max_length=193, pattern=HF_REPO_PATTERN,
        description="A Hugging Face repo id (owner/name), downloaded by vLLM on the head pod "
        "with the resource's hfTokenSecretRef, into spec.modelCache where set.",
    )  # fmt: skip


class LoraAdapter(ApiModel):
    """One LoRA adapter, served under its own name beside the base model."""

    name: str = Field(
        min_length=1, max_length=63, pattern=LORA_NAME_PATTERN,
        description="The name clients send as `model` to use it.",
    )  # fmt: skip
    source: LoraSource = Field(description="Where its files are.")


class LoraSpec(ApiModel):
    """LoRA adapters on every rank of every replica, loaded and unloaded without a restart
    (docs/lora.md). Setting the block (or its limits) relaunches the engines with
    --enable-lora; changing `adapters` does not."""

    max_loras: JsonInt = Field(
        default=1, ge=1, le=256,
        description="Adapters one batch may use at once (--max-loras): each holds GPU "
        "memory on every rank.",
    )  # fmt: skip
    max_lora_rank: JsonInt = Field(
        default=16,
        description="The highest adapter rank served (--max-lora-rank), one of "
        + ", ".join(str(r) for r in LORA_RANKS) + "; an adapter of a higher rank is "
        "refused at load and reported.",
    )
    max_cpu_loras: Annotated[int, Field(ge=1, le=4096), BeforeValidator(_json_integer)] | None = (
      Field(
        default=None,
        description="Adapters kept in CPU memory (--max-cpu-loras), at least maxLoras; "
        "unset: vLLM's default (maxLoras).",
    ))  # fmt: skip
    adapters: list[LoraAdapter] = Field(
        default_factory=list, max_length=64,
        description="The adapters to serve. Adding or removing one loads or unloads it on the "
        "running engines through vLLM's runtime LoRA API, on every replica, with no relaunch.",
    )  # fmt: skip


class VLLMDataParallelSpec(ApiModel):
    """Desired state: one data-parallel vLLM deployment on a Ray cluster."""

    model: str = Field(
        min_length=1,
        max_length=1024,
        description="Model to serve: a Hugging Face repo id or a path on the model cache.",
    )
    served_model_name: str | None = Field(
        default=None,
        max_length=1024,
        description="Name the API answers to (vLLM --served-model-name); defaults to model.",
    )
    image: str | None = Field(
        default=None,
        max_length=1024,
        description="Engine image (vLLM + Ray + launcher); defaults to the operator's setting.",
    )
    data_parallel: DataParallel = Field(description="Data-parallel layout.")
    replicas: JsonInt = Field(
        default=1,
        ge=0,
        le=constants.MAX_REPLICAS,
        description="Identical DP groups behind the one API Service, each its own RayCluster "
        "and head job at this layout: the unit of failure, scaling and queueing. 0 keeps the "
        "Service and holds no RayCluster. The /scale subresource sets it (kubectl scale, HPA, "
        "KEDA). A replica that leaves is unrouted first and drains (spec.update.drainSeconds).",
    )
    tensor_parallel_size: JsonInt = Field(
        default=1,
        ge=1,
        le=64,
        description="GPUs per DP rank (vLLM --tensor-parallel-size).",
    )
    api_server_count: JsonCount | None = Field(
        default=None,
        description="API server processes on the head pod (vLLM --api-server-count). Unset "
        "means vLLM's default, one per DP rank. The head pod gets 1 CPU and 2Gi of memory per "
        "API server on top of resources, so this count is part of the cluster shape.",
    )
    gpu: Gpu = Field(default_factory=Gpu, description="GPU shape of the Ray pods.")
    resources: PodResources = Field(
        default_factory=PodResources, description="CPU and memory of each Ray pod."
    )
    shm_size: str = Field(
        default=constants.DEFAULT_SHM_SIZE,
        pattern=QUANTITY_PATTERN,
        max_length=64,
        description="Size of the memory-backed /dev/shm on each pod (NCCL needs more than "
        "the container default of 64Mi).",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node selector for every Ray pod."
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=64,
        description="Tolerations for every Ray pod, added to one for the GPU resource taint.",
        json_schema_extra={
            "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        },
    )
    affinity: dict[str, Any] | None = Field(
        default=None,
        description="Affinity for every Ray pod.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    priority_class_name: str | None = Field(
        default=None, max_length=253, description="PriorityClass of every Ray pod."
    )
    service_account_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=DNS1123_SUBDOMAIN,
        description="ServiceAccount of every Ray pod (the namespace's default when unset). Its "
        "token is not mounted: nothing in the pods talks to the Kubernetes API.",
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=16,
        description="Secrets for pulling the engine image, on every Ray pod.",
    )  # fmt: skip
    engine_args: list[str] = Field(
        default_factory=list,
        max_length=128,
        description="Extra vllm serve flags, passed through as given. Flags the operator owns "
        "(DP, TP, address, backend, host, port, API servers, model) are rejected.",
        json_schema_extra={"items": {"type": "string", "maxLength": 4096}},
    )
    env: list[EnvVar] = Field(
        default_factory=list, max_length=128, description="Environment for the engines."
    )
    hf_token_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding a Hugging Face token, exposed as HF_TOKEN on every pod.",
    )
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding the API key clients must send (Authorization: Bearer), "
        "exposed as VLLM_API_KEY on every pod. vLLM then refuses /v1 requests without it; "
        "/health and /metrics, which the operator reads, stay open.",
    )
    model_cache: ModelCache | None = Field(
        default=None, description="PersistentVolumeClaim used as the Hugging Face cache."
    )
    service: ServiceSpec = Field(
        default_factory=ServiceSpec, description="Service exposing the API server."
    )
    launch: LaunchSpec = Field(
        default_factory=LaunchSpec, description="Launch deadline and stop drain of head jobs."
    )
    update: UpdateSpec = Field(
        default_factory=UpdateSpec,
        description="How engine and shape changes are rolled out: Recreate (the default) or "
        "Surge (zero downtime, twice the GPUs while it lasts). A Surge's new generation must "
        "serve within spec.launch.timeoutSeconds of the change.",
    )
    ray: RaySpec = Field(default_factory=RaySpec, description="The Ray cluster's settings.")
    network_policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec,
        description="The NetworkPolicy that closes Ray's ports to all but the cluster itself.",
    )
    suspend: JsonBool = Field(
        default=False,
        description="Stop the engines and release the GPU pods, keeping the resource. The API "
        "Service goes meanwhile, which frees its cluster IP; resuming makes it again. In a "
        "Kueue queue the RayCluster is deleted instead (Kueue owns its suspend), which frees "
        "its quota; resuming queues a new one.",
    )
    scheduling: Scheduling | None = Field(
        default=None,
        description="Queue-aware admission: a Kueue queue and priority, or a gang scheduler.",
    )
    lora: LoraSpec | None = Field(
        default=None,
        description="LoRA adapters served beside the base model (docs/lora.md).",
    )


class Condition(ApiModel):
    """A status condition shaped like metav1.Condition."""

    type: str = Field(description="Condition type.")
    status: str = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: str = Field(description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(
        default=None, description="Generation the condition was computed from."
    )


class PodLayout(ApiModel):
    """One GPU pod of the plan."""

    index: int = Field(description="Pod index; 0 is the Ray head.")
    role: str = Field(description="head or worker.")
    ranks: str = Field(description="DP ranks placed on the pod, e.g. '0-3'.")
    gpus: int = Field(description="GPUs of the pod used by engines.")


class Layout(ApiModel):
    """The planned layout of DP ranks onto GPU pods."""

    gpu_pods: int = Field(description="Number of GPU pods, head included.")
    gpus_per_pod: int = Field(description="GPUs requested by each pod.")
    total_gpus: int = Field(description="GPUs requested in all.")
    api_servers: int | None = Field(
        default=None,
        description="vLLM API server processes on the head pod (its --api-server-count).",
    )
    pods: list[PodLayout] = Field(default_factory=list, description="Per-pod placement.")


class LoadSummary(ApiModel):
    """The engines' load in a word, written only when it changes (engines/load_summary.py).

    Per-rank numbers are metrics (`vllmdp_engine_*`, and vLLM's own series), not status.
    """

    level: Literal["Idle", "Busy", "Saturated"] = Field(
        description="Idle: no request running or waiting on any rank. Busy: requests running, "
        "none waiting, every rank's KV cache below 90%. Saturated: some rank has requests "
        "waiting or its KV cache at 90% or more. A new level replaces one that has stood a "
        "minute; until then the old one stays."
    )
    ranks_reporting: int = Field(description="Planned DP ranks that report in vLLM's /metrics.")
    since: str = Field(description="When the level last changed (RFC 3339).")


class UpdateStatus(ApiModel):
    """A Surge update in progress (reconcile/update.py)."""

    phase: Literal["Starting", "Draining"] = Field(
        description="Starting: the new generation is coming up, the old one serves. Draining: "
        "the API Service routes to the new one, the old one finishes its requests."
    )
    from_: str = Field(alias="from", description="RayCluster of the generation being replaced.")
    to: str = Field(description="RayCluster of the new generation.")
    target: str = Field(description="Job hash of what the new generation runs (its identity).")
    started_at: str = Field(description="When this update started (RFC 3339).")
    deadline: str | None = Field(
        default=None,
        description="Starting: when the new generation is deleted if it does not serve by "
        "then (startedAt + spec.launch.timeoutSeconds; RFC 3339).",
    )
    draining_since: str | None = Field(
        default=None, description="Draining: when the API Service switched (RFC 3339)."
    )


class RolloutStatus(ApiModel):
    """An update of the resource's replicas that holds one of the operator's update slots."""

    started_at: str = Field(description="When it took the slot (RFC 3339).")
    asked: str = Field(
        description="The resource's <generation>/<vllmdp.io/restartedAt> it updates to."
    )


class AdapterFailure(ApiModel):
    """An adapter that did not load, and vLLM's answer."""

    name: str = Field(description="The adapter.")
    error: str = Field(description="Why, as vLLM answered the load.")


class ReplicaLora(ApiModel):
    """The adapters one replica's engines serve, as the operator last synced them."""

    loaded: list[str] = Field(default_factory=list, description="Adapters vLLM lists.")
    failed: list[AdapterFailure] = Field(
        default_factory=list, description="Adapters whose last load failed."
    )
    detail: str | None = Field(
        default=None, description="Why its adapters could not be read, where they could not."
    )


class AdapterStatus(ApiModel):
    """One adapter of spec.lora across the replicas."""

    name: str = Field(description="The adapter, as clients ask for it.")
    replicas: list[int] = Field(
        default_factory=list,
        description="The routed replicas whose engines serve it (on every DP rank: vLLM "
        "loads an adapter on all engines of its DP group, or reports an error).",
    )
    error: str | None = Field(default=None, description="Its last load's error, if it failed.")


class LoraStatus(ApiModel):
    """spec.lora's adapters as served."""

    adapters: list[AdapterStatus] = Field(
        default_factory=list, description="Each adapter of the spec."
    )
    ready: str | None = Field(
        default=None,
        description="Adapters served by every routed replica / adapters in the spec.",
    )


class ReplicaStatus(ApiModel):
    """One replica (one DP group): what its reconcile carries from one run to the next."""

    index: int = Field(description="The replica's index: its children are named after it.")
    phase: str | None = Field(default=None, description="The replica's own phase.")
    message: str | None = Field(default=None, description="What is happening to it, in words.")
    routed: bool = Field(default=False, description="Whether the API Service routes to its head.")
    leaving: str | None = Field(
        default=None,
        description="Scale-down: when it was unrouted to leave (RFC 3339); it drains, then its "
        "head job stops and its RayCluster is deleted.",
    )
    updated: bool = Field(default=False, description="Whether it runs what the spec asks for.")
    conditions: list[Condition] = Field(default_factory=list, description="Its conditions.")
    ray_cluster: str | None = Field(default=None, description="Its RayCluster.")
    head_job: str | None = Field(default=None, description="Its current head RayJob.")
    served_job: str | None = Field(default=None, description="Its head job last seen serving.")
    served_head_pod: str | None = Field(
        default=None, description="The UID of the head pod servedJob served on."
    )
    launch_attempts: int = Field(default=0, description="Head jobs it created so far.")
    consecutive_failures: int = Field(
        default=0, description="Head-job failures since it last served."
    )
    last_failed_job: str | None = Field(default=None, description="Last head job seen failed.")
    last_failure_time: str | None = Field(default=None, description="When (RFC 3339).")
    last_failure_reason: str | None = Field(default=None, description="Why, in words.")
    next_launch_time: str | None = Field(default=None, description="Backoff: next launch.")
    launch_deadline: str | None = Field(default=None, description="Launch deadline.")
    probe_failures: int | None = Field(default=None, description="Failed probes in a row.")
    probe_failing_since: str | None = Field(default=None, description="Since when.")
    update: UpdateStatus | None = Field(default=None, description="Its Surge in progress.")
    failed_update: str | None = Field(default=None, description="Its last failed Surge target.")
    load: LoadSummary | None = Field(default=None, description="Its engines' load.")
    lora: ReplicaLora | None = Field(default=None, description="Its adapters (spec.lora).")


class VLLMDataParallelStatus(ApiModel):
    """Observed state, written by the operator."""

    phase: str | None = Field(default=None, description="Lifecycle phase.")
    message: str | None = Field(default=None, description="What is happening, in words.")
    observed_generation: int | None = Field(
        default=None, description="Generation last reconciled."
    )
    conditions: list[Condition] = Field(default_factory=list, description="Conditions.")
    layout: Layout | None = Field(default=None, description="Planned layout.")
    ray_cluster: str | None = Field(default=None, description="Name of the RayCluster.")
    head_job: str | None = Field(default=None, description="Name of the current head RayJob.")
    endpoint: str | None = Field(default=None, description="OpenAI-compatible base URL.")
    launch_attempts: int = Field(default=0, description="Head jobs created so far.")
    consecutive_failures: int = Field(
        default=0, description="Head-job failures since the engines last served."
    )
    last_failed_job: str | None = Field(default=None, description="Last head job seen failed.")
    last_failure_time: str | None = Field(
        default=None, description="When the last head-job failure was seen (RFC 3339)."
    )
    last_failure_reason: str | None = Field(
        default=None, description="Why the last head job failed, in words."
    )
    served_job: str | None = Field(
        default=None,
        description="The last head job seen serving; the launch deadline no longer applies "
        "to it.",
    )
    served_head_pod: str | None = Field(
        default=None,
        description="The UID of the head pod servedJob served on. KubeRay runs a head job "
        "again on a replaced head pod; that run is routed only once it answers.",
    )
    next_launch_time: str | None = Field(
        default=None,
        description="While in Backoff: when the next head job is launched (RFC 3339).",
    )
    launch_deadline: str | None = Field(
        default=None,
        description="While a head job starts: when it counts as failed if vLLM has not "
        "answered /health by then (spec.launch.timeoutSeconds after its creation; RFC 3339).",
    )
    probe_failures: int | None = Field(
        default=None,
        description="Failed /health probes in a row of the head job that served. It keeps its "
        "route until the operator's unroute threshold (failures over a minimum time) is met.",
    )
    probe_failing_since: str | None = Field(
        default=None, description="When the first of those failed probes was seen (RFC 3339)."
    )
    update: UpdateStatus | None = Field(
        default=None, description="A Surge update in progress; absent otherwise."
    )
    failed_update: str | None = Field(
        default=None,
        description="Job hash of the last Surge target that did not serve by its deadline: it "
        "is not tried again until the spec asks for something else.",
    )
    rollout: RolloutStatus | None = Field(
        default=None,
        description="While its replicas update to a new spec or restart: one of the "
        "operator's update slots (VLLMDP_MAX_CONCURRENT_UPDATES) is held; absent otherwise. "
        "A resource that waits for one says UpdatePending in its Updated condition.",
    )
    replicas: int = Field(
        default=0, description="Replicas that exist (the /scale subresource's status)."
    )
    ready_replicas: int = Field(default=0, description="Replicas the API Service routes to.")
    ready: str | None = Field(
        default=None, description="readyReplicas/spec.replicas, as kubectl get shows it."
    )
    updated_replicas: int = Field(
        default=0, description="Replicas that run what the spec asks for."
    )
    selector: str | None = Field(
        default=None,
        description="Label selector of the replicas' Ray head pods (the /scale subresource's, "
        "for HPA and KEDA).",
    )
    replica_statuses: list[ReplicaStatus] = Field(
        default_factory=list,
        description="Each replica's own state. The fields above that name one RayCluster or "
        "head job (rayCluster, headJob, servedJob, ...) show the first replica's.",
    )
    lora: LoraStatus | None = Field(
        default=None, description="spec.lora's adapters: where each is served, or why not."
    )
    load: LoadSummary | None = Field(
        default=None,
        description="While Serving: the engines' load level and how many ranks report, read "
        "from the head's /metrics at the /health probe's cadence. A planned rank missing is "
        "named in the EnginesReporting condition.",
    )
