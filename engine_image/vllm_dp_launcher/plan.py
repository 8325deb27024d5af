"""The launch plan: the typed form of the JSON the operator renders into the head job.

The operator computes the data-parallel layout once; this module only reads it. Nothing here
recomputes ranks or GPU counts: it checks types and a few invariants so that a broken plan
fails with a message naming the key instead of a confusing error later.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from vllm_dp_launcher.errors import PlanError

SUPPORTED_VERSION = 1
PACK_STRATEGIES = ("strict", "fill", "span")
PackStrategy = Literal["strict", "fill", "span"]

DEFAULT_WAIT_TIMEOUT_SECONDS = 900.0
DEFAULT_PREFLIGHT_TIMEOUT_SECONDS = 30.0


@dataclass(frozen=True)
class PodPlan:
    """One GPU pod of the layout: which DP ranks it hosts and how many GPUs they use."""

    index: int
    role: Literal["head", "worker"]
    ranks: tuple[int, ...]
    gpus: int


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
    )
    _check_consistency(plan)
    return plan


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
