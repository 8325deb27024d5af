"""The launch plan: the one schema of what the operator hands the launcher, and its transport.

The operator computes the data-parallel layout once, builds a ``LaunchPlan`` and renders the
head job's entrypoint with ``head_job_entrypoint``; the launcher decodes it with
``decode_plan``. Both sides import this module, so a field cannot be added on one side only.
Nothing here recomputes ranks or GPU counts: parsing checks types and a few invariants so that
a broken plan fails with a message naming the key instead of a confusing error later.

The plan travels as base64 (RFC 4648, standard alphabet, no line breaks) of its UTF-8 JSON:
the entrypoint passes through shells (``/bin/sh -c`` in Ray's job supervisor; bash and
``Popen(shell=True)`` in KubeRay's K8sJobMode), and base64 has no character any shell alters.
This module imports only the standard library: the operator uses it without Ray.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, cast

from vllm_dp_launcher import servecheck
from vllm_dp_launcher.errors import PlanError

SUPPORTED_VERSION = 1
PACK_STRATEGIES = ("strict", "fill", "span")
PackStrategy = Literal["strict", "fill", "span"]

DEFAULT_WAIT_TIMEOUT_SECONDS = 900.0
DEFAULT_PREFLIGHT_TIMEOUT_SECONDS = 30.0

LAUNCHER_MODULE = "vllm_dp_launcher"
PLAN_B64_FLAG = "--plan-b64"


@dataclass(frozen=True)
class PodPlan:
    """One GPU pod of the layout: which DP ranks it hosts and how many GPUs they use."""

    index: int
    role: Literal["head", "worker"]
    ranks: tuple[int, ...]
    gpus: int

    def __post_init__(self) -> None:
        # Accept any sequence from a caller; equality with a parsed plan needs a tuple.
        object.__setattr__(self, "ranks", tuple(self.ranks))


@dataclass(frozen=True)
class LaunchPlan:
    """Everything the launcher needs to start ``vllm serve`` on the Ray cluster."""

    version: int
    model: str
    data_parallel_size: int
    ranks_per_node: int
    tensor_parallel_size: int
    pack_strategy: PackStrategy
    gpu_pods: int
    gpus_per_pod: int  # requested by every GPU pod, so offered by every GPU Ray node
    total_gpus: int  # requested in all: what the cluster must offer before the launch
    pods: tuple[PodPlan, ...]
    port: int
    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    wait_timeout_seconds: float = DEFAULT_WAIT_TIMEOUT_SECONDS
    preflight_timeout_seconds: float = DEFAULT_PREFLIGHT_TIMEOUT_SECONDS
    # After forwarding a stop signal, how long vllm serve may take to exit before the
    # launcher kills its process group; None: wait for it (Ray's own stop still SIGKILLs
    # after RAY_JOB_STOP_WAIT_TIME_S). The operator sets that variable to the same value.
    drain_grace_seconds: float | None = None
    # The request that proves the engines serve (servecheck.py); "" derives it from `command`.
    serving_check: str = ""

    def __post_init__(self) -> None:
        # Accept lists and any mapping from a caller; equality with a parsed plan needs these.
        object.__setattr__(self, "pods", tuple(self.pods))
        object.__setattr__(self, "command", tuple(self.command))
        object.__setattr__(self, "env", dict(self.env))

    @property
    def head_pod(self) -> PodPlan:
        """The pod the launcher (and so ``vllm serve``) runs on."""
        return next(p for p in self.pods if p.role == "head")

    def to_json_dict(self) -> dict[str, Any]:
        """The plan as the launcher understood it, in the operator's camelCase form."""
        return {
            "version": self.version,
            "model": self.model,
            "dataParallelSize": self.data_parallel_size,
            "ranksPerNode": self.ranks_per_node,
            "tensorParallelSize": self.tensor_parallel_size,
            "packStrategy": self.pack_strategy,
            "gpuPods": self.gpu_pods,
            "gpusPerPod": self.gpus_per_pod,
            "totalGpus": self.total_gpus,
            "pods": [
                {"index": p.index, "role": p.role, "ranks": list(p.ranks), "gpus": p.gpus}
                for p in self.pods
            ],
            "port": self.port,
            "command": list(self.command),
            "env": dict(self.env),
            "waitTimeoutSeconds": self.wait_timeout_seconds,
            "preflightTimeoutSeconds": self.preflight_timeout_seconds,
            # Optional keys appear only when set: a launcher that predates them ignores them.
            **(
                {"drainGraceSeconds": self.drain_grace_seconds}
                if self.drain_grace_seconds is not None
                else {}
            ),
            **({"servingCheck": self.serving_check} if self.serving_check else {}),
        }


_MISSING = object()


def _get(data: Mapping[str, Any], key: str, where: str, default: Any = _MISSING) -> Any:
    """Return ``data[key]``, or raise a PlanError naming the missing key."""
    if key in data:
        return data[key]
    if default is _MISSING:
        raise PlanError(f"launch plan: missing required key '{where}{key}'")
    return default


def _int(value: Any, name: str, minimum: int = 1) -> int:
    """Check an integer (booleans are not integers here) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"launch plan: '{name}' must be an integer, got {value!r}")
    if value < minimum:
        raise PlanError(f"launch plan: '{name}' must be >= {minimum}, got {value}")
    return value


def _seconds(value: Any, name: str) -> float:
    """Check a positive number of seconds."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise PlanError(f"launch plan: '{name}' must be a positive number, got {value!r}")
    return float(value)


def _optional_seconds(value: Any, name: str) -> float | None:
    """Check an optional positive number of seconds (null or absent: None)."""
    return None if value is None else _seconds(value, name)


def _str(value: Any, name: str) -> str:
    """Check a non-empty string."""
    if not isinstance(value, str) or not value:
        raise PlanError(f"launch plan: '{name}' must be a non-empty string, got {value!r}")
    return value


def _pod(data: Any, i: int) -> PodPlan:
    """Parse ``pods[i]``."""
    where = f"pods[{i}]."
    if not isinstance(data, Mapping):
        raise PlanError(f"launch plan: 'pods[{i}]' must be an object, got {data!r}")
    role = _get(data, "role", where)
    if role not in ("head", "worker"):
        raise PlanError(f"launch plan: '{where}role' must be 'head' or 'worker', got {role!r}")
    ranks = _get(data, "ranks", where)
    if not isinstance(ranks, list):
        raise PlanError(f"launch plan: '{where}ranks' must be a list, got {ranks!r}")
    return PodPlan(
        index=_int(_get(data, "index", where), f"{where}index", minimum=0),
        role=role,
        ranks=tuple(_int(r, f"{where}ranks[{j}]", minimum=0) for j, r in enumerate(ranks)),
        gpus=_int(_get(data, "gpus", where), f"{where}gpus"),
    )


def _command(value: Any) -> tuple[str, ...]:
    """Check the command: a non-empty list of strings."""
    if not isinstance(value, list) or not value:
        raise PlanError(f"launch plan: 'command' must be a non-empty list, got {value!r}")
    for i, arg in enumerate(value):
        if not isinstance(arg, str):
            raise PlanError(f"launch plan: 'command[{i}]' must be a string, got {arg!r}")
    return tuple(value)


def _env(value: Any) -> dict[str, str]:
    """Check the environment: an object of string values."""
    if not isinstance(value, Mapping):
        raise PlanError(f"launch plan: 'env' must be an object, got {value!r}")
    for key, item in value.items():
        if not isinstance(item, str):
            raise PlanError(f"launch plan: 'env.{key}' must be a string, got {item!r}")
    return dict(value)


def parse_plan(data: Any) -> LaunchPlan:
    """Build a LaunchPlan from decoded JSON; unknown keys are ignored."""
    if not isinstance(data, Mapping):
        raise PlanError(f"launch plan: must be a JSON object, got {type(data).__name__}")
    version = _get(data, "version", "")
    if version != SUPPORTED_VERSION:
        raise PlanError(
            f"launch plan: unsupported 'version' {version!r}; this launcher reads version "
            f"{SUPPORTED_VERSION} (launcher and operator versions do not match)"
        )
    strategy = _get(data, "packStrategy", "")
    if strategy not in PACK_STRATEGIES:
        raise PlanError(
            f"launch plan: 'packStrategy' must be one of {', '.join(PACK_STRATEGIES)}, "
            f"got {strategy!r}"
        )
    pods_raw = _get(data, "pods", "")
    if not isinstance(pods_raw, list) or not pods_raw:
        raise PlanError(f"launch plan: 'pods' must be a non-empty list, got {pods_raw!r}")
    plan = LaunchPlan(
        version=version,
        model=_str(_get(data, "model", ""), "model"),
        data_parallel_size=_int(_get(data, "dataParallelSize", ""), "dataParallelSize"),
        ranks_per_node=_int(_get(data, "ranksPerNode", ""), "ranksPerNode"),
        tensor_parallel_size=_int(_get(data, "tensorParallelSize", ""), "tensorParallelSize"),
        pack_strategy=cast(PackStrategy, strategy),
        gpu_pods=_int(_get(data, "gpuPods", ""), "gpuPods"),
        gpus_per_pod=_int(_get(data, "gpusPerPod", ""), "gpusPerPod"),
        total_gpus=_int(_get(data, "totalGpus", ""), "totalGpus"),
        pods=tuple(_pod(p, i) for i, p in enumerate(pods_raw)),
        port=_int(_get(data, "port", ""), "port"),
        command=_command(_get(data, "command", "")),
        env=_env(_get(data, "env", "", {})),
        wait_timeout_seconds=_seconds(
            _get(data, "waitTimeoutSeconds", "", DEFAULT_WAIT_TIMEOUT_SECONDS),
            "waitTimeoutSeconds",
        ),
        preflight_timeout_seconds=_seconds(
            _get(data, "preflightTimeoutSeconds", "", DEFAULT_PREFLIGHT_TIMEOUT_SECONDS),
            "preflightTimeoutSeconds",
        ),
        drain_grace_seconds=_optional_seconds(
            _get(data, "drainGraceSeconds", "", None), "drainGraceSeconds"
        ),
        serving_check=_serving_check(_get(data, "servingCheck", "", "")),
    )
    _check_consistency(plan)
    return plan


def _serving_check(value: Any) -> str:
    """Check an optional serving check name (servecheck.CHECKS; "" derives it)."""
    if value == "":
        return ""
    if value not in servecheck.CHECKS:
        raise PlanError(f"launch plan: 'servingCheck' must be one of "
                        f"{', '.join(servecheck.CHECKS)}, got {value!r}")
    return str(value)


def _check_consistency(plan: LaunchPlan) -> None:
    """Reject plans whose parts contradict each other (a rendering bug, not a user error)."""
    heads = [p.index for p in plan.pods if p.role == "head"]
    if len(heads) != 1:
        raise PlanError(f"launch plan: 'pods' must hold exactly one head pod, found {len(heads)}")
    if len(plan.pods) != plan.gpu_pods:
        raise PlanError(
            f"launch plan: 'gpuPods' is {plan.gpu_pods} but 'pods' lists {len(plan.pods)} pods"
        )
    # A pod's "gpus" is what its ranks use; "gpusPerPod" is what each pod requests (and what
    # its Ray node offers). With fill, the head may use fewer than it requests.
    for pod in plan.pods:
        if pod.gpus > plan.gpus_per_pod:
            raise PlanError(
                f"launch plan: pods[{pod.index}] uses {pod.gpus} GPUs but 'gpusPerPod' is "
                f"{plan.gpus_per_pod}"
            )


def load_plan(text: str) -> LaunchPlan:
    """Parse a launch plan from its JSON text."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"launch plan: not valid JSON: {exc}") from exc
    return parse_plan(data)


def plan_json(plan: LaunchPlan) -> str:
    """The plan's canonical JSON text (sorted keys, no spaces, non-ASCII kept as is)."""
    doc = plan.to_json_dict()
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def encode_plan(plan: LaunchPlan) -> str:
    """Base64 (standard alphabet, no line breaks) of the plan's UTF-8 JSON, checked first.

    The plan must read back as itself: a plan the launcher would refuse, or one that changes
    on the way, raises PlanError here, in the operator, before anything is created.
    """
    back = parse_plan(plan.to_json_dict())
    if back != plan:
        differ = [f.name for f in fields(plan) if getattr(back, f.name) != getattr(plan, f.name)]
        raise PlanError(f"launch plan: {', '.join(differ)} do not read back as given")
    return base64.b64encode(plan_json(plan).encode("utf-8")).decode("ascii")


def decode_plan(text: str, source: str = PLAN_B64_FLAG) -> LaunchPlan:
    """Read a plan from ``encode_plan``'s form; errors name ``source`` and the rule broken."""
    rule = "base64 of the plan's UTF-8 JSON (RFC 4648 standard alphabet, no line breaks)"
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error) as exc:
        raise PlanError(f"{source}: not valid base64 ({exc}); expected {rule}") from exc
    try:
        decoded = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PlanError(
            f"{source}: the decoded bytes are not UTF-8 ({exc}); expected {rule}"
        ) from exc
    try:
        data = json.loads(decoded)
    except json.JSONDecodeError as exc:
        raise PlanError(f"{source}: the decoded text is not JSON ({exc}); expected {rule}") from exc
    try:
        return parse_plan(data)
    except PlanError as exc:
        raise PlanError(f"{source}: {exc}") from exc


def head_job_entrypoint(plan: LaunchPlan) -> str:
    """The head job's entrypoint: no shell alters it, so the plan arrives byte for byte."""
    return f"python -m {LAUNCHER_MODULE} {PLAN_B64_FLAG} {encode_plan(plan)}"
