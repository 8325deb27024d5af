"""The DP layout, computed once from a valid spec: pods, ranks and the head job's command."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, cast

from vllm_dp_launcher import drain_gate, lora_gate, servecheck
from vllm_dp_launcher import plan as launcher_plan

from vllm_dp_operator import constants
from vllm_dp_operator.api.models import (
    LoraSpec,
    PackStrategy,
    ServingCheck,
    VLLMDataParallelSpec,
)
from vllm_dp_operator.api.quantity import cpu_quantity, memory_quantity, quantity_value
from vllm_dp_operator.engines.lora import Adapter

# Prefixes vLLM copies from the driver to every engine actor, on top of its own.
# GLOO_ is not copied by default (vllm#5094); NCCL_ and HF_ settings must reach every rank.
# VLLM_ is left to vLLM's own list, which keeps each node's VLLM_HOST_IP local (vllm#13521).
COPIED_ENV_PREFIXES = ("GLOO_", "NCCL_", "HF_")


@dataclass(frozen=True)
class PodPlan:
    """One GPU pod: its role and the DP ranks vLLM will place on it."""

    index: int
    role: str  # "head" or "worker"
    ranks: tuple[int, ...]
    gpus: int  # GPUs used by engines on this pod

    def ranks_text(self) -> str:
        """Ranks as a compact range list, e.g. '0-3' or '4,6'."""
        return compact_ranges(self.ranks)


@dataclass(frozen=True)
class Plan:
    """Everything derived from the spec that the renderers and the launcher need."""

    model: str
    data_parallel_size: int
    ranks_per_node: int
    tensor_parallel_size: int
    pack_strategy: str
    gpus_per_pod: int
    pods: tuple[PodPlan, ...]
    port: int
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    api_servers: int  # vLLM API server processes on the head pod (--api-server-count)
    head_cpu: str | None  # the head pod's CPU: the per-pod CPU plus one per API server
    head_memory: str | None  # the head pod's memory: per-pod memory plus some per API server
    #: spec.update.servingCheck when named ("" for Auto: derived from the command).
    serving_check: str = ""

    @property
    def check(self) -> str:
        """The serving check to send (servecheck.resolve)."""
        return servecheck.resolve(self.serving_check, self.command)

    @property
    def gpu_pods(self) -> int:
        """Number of GPU pods, the head included."""
        return len(self.pods)

    @property
    def worker_pods(self) -> int:
        """GPU pods besides the head."""
        return len(self.pods) - 1

    @property
    def total_gpus(self) -> int:
        """GPUs requested by all pods."""
        return self.gpus_per_pod * len(self.pods)

    def launch_plan(self) -> launcher_plan.LaunchPlan:
        """The plan as the launcher's own type: the one definition of the head job contract."""
        return launcher_plan.LaunchPlan(
            version=launcher_plan.SUPPORTED_VERSION,
            model=self.model,
            data_parallel_size=self.data_parallel_size,
            ranks_per_node=self.ranks_per_node,
            tensor_parallel_size=self.tensor_parallel_size,
            pack_strategy=cast(launcher_plan.PackStrategy, self.pack_strategy),
            gpu_pods=self.gpu_pods,
            gpus_per_pod=self.gpus_per_pod,
            total_gpus=self.total_gpus,
            pods=tuple(
                launcher_plan.PodPlan(
                    index=p.index,
                    role=cast(Literal["head", "worker"], p.role),
                    ranks=p.ranks,
                    gpus=p.gpus,
                )
                for p in self.pods
            ),
            port=self.port,
            command=self.command,
            env=dict(self.env),
            serving_check=self.serving_check,
        )

    def launch_spec(self) -> dict[str, Any]:
        """The JSON document the head job hands to the launcher, as the launcher writes it."""
        return self.launch_plan().to_json_dict()


def compact_ranges(ranks: tuple[int, ...]) -> str:
    """Render sorted integers as ranges: (0, 1, 2, 5) -> '0-2,5'."""
    parts: list[str] = []
    start = prev = None
    for r in sorted(set(ranks)):
        if start is None:
            start = prev = r
        elif prev is not None and r == prev + 1:
            prev = r
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = r
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def _strict_pods(dp: int, per_node: int, tp: int) -> list[PodPlan]:
    # vLLM strict: the head and every other node hold exactly ranksPerNode ranks.
    return [
        PodPlan(i, "head" if i == 0 else "worker", tuple(range(i * per_node, (i + 1) * per_node)),
                per_node * tp)
        for i in range(dp // per_node)
    ]


def _fill_pods(dp: int, per_node: int, tp: int, gpus_per_pod: int) -> list[PodPlan]:
    # vLLM fill: the head holds exactly ranksPerNode; other nodes take as many as fit.
    pods = [PodPlan(0, "head", tuple(range(per_node)), per_node * tp)]
    per_worker = gpus_per_pod // tp
    next_rank = per_node
    for i in range(1, 1 + math.ceil((dp - per_node) / per_worker)):
        ranks = tuple(range(next_rank, min(dp, next_rank + per_worker)))
        pods.append(PodPlan(i, "worker", ranks, len(ranks) * tp))
        next_rank += len(ranks)
    return pods


def _span_pods(dp: int, tp: int, gpus_per_pod: int) -> list[PodPlan]:
    # vLLM span: each rank's TP group covers tp / gpusPerPod whole pods, rank 0 on the head.
    pods_per_rank = tp // gpus_per_pod
    return [
        PodPlan(i, "head" if i == 0 else "worker", (i // pods_per_rank,), gpus_per_pod)
        for i in range(dp * pods_per_rank)
    ]


def api_server_count(spec: VLLMDataParallelSpec) -> int:
    """API servers on the head: the spec's, else vLLM's default with its own load balancing.

    vLLM 0.33 starts one per DP rank when --api-server-count is unset (internal load
    balancing); the operator passes the count explicitly so the head can be sized for it.
    With spec.lora one: vLLM refuses runtime LoRA updates beside several API servers (each
    would keep its own list of adapters).
    """
    if spec.lora is not None:
        return 1
    return spec.api_server_count or spec.data_parallel.size


def head_resources(spec: VLLMDataParallelSpec) -> tuple[str | None, str | None]:
    """The head pod's CPU and memory: the per-pod amounts plus a share per API server."""
    servers = api_server_count(spec)
    cpu = memory = None
    if spec.resources.cpu:
        cores = quantity_value(spec.resources.cpu) + servers * constants.HEAD_CPU_PER_API_SERVER
        cpu = cpu_quantity(cores)
    if spec.resources.memory:
        extra = servers * constants.HEAD_MEMORY_PER_API_SERVER_MI * 2**20
        memory = memory_quantity(quantity_value(spec.resources.memory) + extra)
    return cpu, memory


def build_command(
    spec: VLLMDataParallelSpec, ranks_per_node: int, gpus_per_pod: int
) -> tuple[str, ...]:
    """The vllm serve argv, without the DP address only the launcher can know."""
    cmd = [
        "vllm", "serve", spec.model,
        "--host", "0.0.0.0",
        "--port", str(spec.service.port),
        "--data-parallel-backend", "ray",
        "--data-parallel-size", str(spec.data_parallel.size),
        "--data-parallel-size-local", str(ranks_per_node),
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
    ]  # fmt: skip
    if spec.tensor_parallel_size > gpus_per_pod:
        # A rank wider than one pod: vLLM checks the world size against the head's GPUs
        # before it looks at the DP backend, and needs the Ray executor named (vllm#25775).
        cmd += ["--distributed-executor-backend", "ray"]
    if spec.served_model_name:
        cmd += ["--served-model-name", spec.served_model_name]
    cmd += ["--api-server-count", str(api_server_count(spec))]
    # Kept-alive connections leave the head before its engines stop (drain_gate.py).
    cmd += ["--middleware", drain_gate.MIDDLEWARE]
    if spec.lora is not None:
        cmd += lora_flags(spec.lora)
    return (*cmd, *spec.engine_args)


def lora_flags(lora: LoraSpec) -> list[str]:
    """LoRA's limits, and the gate that lets only the operator change the adapters (its
    adapters themselves are loaded at runtime, so a change of them needs no new head job)."""
    flags = ["--enable-lora", "--max-loras", str(lora.max_loras),
             "--max-lora-rank", str(lora.max_lora_rank)]  # fmt: skip
    if lora.max_cpu_loras is not None:
        flags += ["--max-cpu-loras", str(lora.max_cpu_loras)]
    return [*flags, "--middleware", lora_gate.MIDDLEWARE]


def lora_adapters(spec: VLLMDataParallelSpec) -> tuple[Adapter, ...] | None:
    """The adapters the head serves, each with the path vLLM loads it from; None without
    spec.lora. Not part of the plan: they change on the running engines, never the head job."""
    if spec.lora is None:
        return None
    out = []
    for a in spec.lora.adapters:
        src = a.source
        if src.model_cache is not None:
            assert spec.model_cache is not None  # a rule (api/validation.py)
            path = f"{spec.model_cache.mount_path.rstrip('/')}/{src.model_cache.strip('/')}"
        else:
            path = src.path.rstrip("/") if src.path is not None else str(src.hugging_face)
        out.append(Adapter(a.name, path))
    return tuple(out)


def build_env(spec: VLLMDataParallelSpec) -> tuple[tuple[str, str], ...]:
    """Environment of vllm serve: pack strategy, prefixes Ray copies, the user's literals."""
    literals = [(e.name, e.value or "") for e in spec.env if e.value_from is None]
    extra = (n for n, _ in literals if not n.startswith((*COPIED_ENV_PREFIXES, "VLLM_")))
    prefixes = [*COPIED_ENV_PREFIXES, *extra]
    lora = [(lora_gate.RUNTIME_ENV, "True")] if spec.lora is not None else []
    return (
        ("VLLM_RAY_DP_PACK_STRATEGY", str(spec.data_parallel.pack_strategy)),
        ("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", ",".join(prefixes)),
        *lora,
        *literals,
    )


def gpus_per_pod(spec: VLLMDataParallelSpec) -> int:
    """GPUs each pod requests: gpu.perPod, else what the head's ranks need."""
    if spec.gpu.per_pod is not None:
        return spec.gpu.per_pod
    return spec.data_parallel.ranks_per_node * spec.tensor_parallel_size


def build_plan(spec: VLLMDataParallelSpec) -> Plan:
    """Lay the DP ranks onto identical GPU pods the way vLLM's placement will."""
    dp = spec.data_parallel.size
    per_node = spec.data_parallel.ranks_per_node
    tp = spec.tensor_parallel_size
    per_pod = gpus_per_pod(spec)
    strategy = PackStrategy(spec.data_parallel.pack_strategy)
    if strategy is PackStrategy.STRICT:
        pods = _strict_pods(dp, per_node, tp)
    elif strategy is PackStrategy.FILL:
        pods = _fill_pods(dp, per_node, tp, per_pod)
    else:
        pods = _span_pods(dp, tp, per_pod)
    head_cpu, head_memory = head_resources(spec)
    return Plan(
        model=spec.model,
        data_parallel_size=dp,
        ranks_per_node=per_node,
        tensor_parallel_size=tp,
        pack_strategy=str(strategy),
        gpus_per_pod=per_pod,
        pods=tuple(pods),
        port=spec.service.port,
        command=build_command(spec, per_node, per_pod),
        env=build_env(spec),
        api_servers=api_server_count(spec),
        head_cpu=head_cpu,
        head_memory=head_memory,
        serving_check="" if spec.update.serving_check == ServingCheck.AUTO
        else str(spec.update.serving_check),
    )
