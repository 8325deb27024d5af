"""The DP layout: exact plans per pack strategy, then invariants over a grid of valid specs."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
from vllm_dp_operator.api.validation import SpecError, validate
from vllm_dp_operator.plan import (
    COPIED_ENV_PREFIXES,
    Plan,
    PodPlan,
    build_plan,
    compact_ranges,
)

MODEL = "Qwen/Qwen2.5-7B-Instruct"


def plan_of(**spec: Any) -> Plan:
    return build_plan(validate("p", {"model": MODEL, **spec}))


def dp(size: int, per_node: int, strategy: str = "strict") -> dict[str, Any]:
    return {"size": size, "ranksPerNode": per_node, "packStrategy": strategy}


def layout(plan: Plan) -> list[tuple[int, str, tuple[int, ...], int]]:
    return [(p.index, p.role, p.ranks, p.gpus) for p in plan.pods]


# --- exact layouts ---------------------------------------------------------------------------


def test_strict_dp8_four_per_node() -> None:
    plan = plan_of(dataParallel=dp(8, 4))
    assert layout(plan) == [(0, "head", (0, 1, 2, 3), 4), (1, "worker", (4, 5, 6, 7), 4)]
    assert (plan.gpu_pods, plan.worker_pods, plan.gpus_per_pod, plan.total_gpus) == (2, 1, 4, 8)


def test_strict_dp4_tp2() -> None:
    plan = plan_of(dataParallel=dp(4, 2), tensorParallelSize=2)
    assert layout(plan) == [(0, "head", (0, 1), 4), (1, "worker", (2, 3), 4)]
    assert plan.gpus_per_pod == 4


def test_strict_with_spare_gpus_per_pod() -> None:
    plan = plan_of(dataParallel=dp(4, 1), gpu={"perPod": 2})
    assert layout(plan) == [(i, "head" if i == 0 else "worker", (i,), 1) for i in range(4)]
    assert plan.gpus_per_pod == 2
    assert plan.total_gpus == 8


def test_strict_single_pod() -> None:
    plan = plan_of(dataParallel=dp(2, 2))
    assert layout(plan) == [(0, "head", (0, 1), 2)]
    assert plan.worker_pods == 0


def test_fill_head_holds_ranks_per_node_workers_take_what_fits() -> None:
    plan = plan_of(dataParallel=dp(6, 2, "fill"), gpu={"perPod": 4})
    assert layout(plan) == [(0, "head", (0, 1), 2), (1, "worker", (2, 3, 4, 5), 4)]
    assert plan.gpus_per_pod == 4


def test_fill_partial_last_worker() -> None:
    plan = plan_of(dataParallel=dp(7, 2, "fill"), gpu={"perPod": 4})
    assert layout(plan) == [
        (0, "head", (0, 1), 2),
        (1, "worker", (2, 3, 4, 5), 4),
        (2, "worker", (6,), 1),
    ]


def test_fill_with_tp() -> None:
    plan = plan_of(dataParallel=dp(5, 1, "fill"), tensorParallelSize=2, gpu={"perPod": 4})
    assert layout(plan) == [
        (0, "head", (0,), 2),
        (1, "worker", (1, 2), 4),
        (2, "worker", (3, 4), 4),
    ]


def test_span_each_rank_over_two_pods() -> None:
    plan = plan_of(dataParallel=dp(2, 1, "span"), tensorParallelSize=16, gpu={"perPod": 8})
    assert layout(plan) == [
        (0, "head", (0,), 8),
        (1, "worker", (0,), 8),
        (2, "worker", (1,), 8),
        (3, "worker", (1,), 8),
    ]
    assert plan.total_gpus == 32
    # vLLM rejects a world size above the head's GPUs unless the Ray executor is named.
    i = plan.command.index("--distributed-executor-backend")
    assert plan.command[i + 1] == "ray"


def test_executor_left_to_vllm_when_a_rank_fits_one_pod() -> None:
    plan = plan_of(dataParallel=dp(8, 4), tensorParallelSize=2, gpu={"perPod": 8})
    assert "--distributed-executor-backend" not in plan.command


def test_span_one_pod_per_rank() -> None:
    plan = plan_of(dataParallel=dp(3, 1, "span"), tensorParallelSize=8, gpu={"perPod": 8})
    assert layout(plan) == [(i, "head" if i == 0 else "worker", (i,), 8) for i in range(3)]


# --- command and env ---------------------------------------------------------------------------


def test_command_owns_dp_flags_and_appends_engine_args() -> None:
    plan = plan_of(
        dataParallel=dp(8, 4),
        servedModelName="qwen",
        apiServerCount=4,
        service={"port": 9000},
        engineArgs=["--max-model-len", "8192", "--enable-prefix-caching"],
    )
    assert plan.command == (
        "vllm",
        "serve",
        MODEL,
        "--host",
        "0.0.0.0",
        "--port",
        "9000",
        "--data-parallel-backend",
        "ray",
        "--data-parallel-size",
        "8",
        "--data-parallel-size-local",
        "4",
        "--tensor-parallel-size",
        "1",
        "--served-model-name",
        "qwen",
        "--api-server-count",
        "4",
        # Kept-alive connections leave a head before its engines stop (drain_gate.py).
        "--middleware",
        "vllm_dp_launcher.drain_gate.DrainGate",
        "--max-model-len",
        "8192",
        "--enable-prefix-caching",
    )
    assert plan.port == 9000


def test_command_leaves_the_dp_address_to_the_launcher() -> None:
    plan = plan_of(dataParallel=dp(4, 2))
    assert "--data-parallel-address" not in plan.command
    assert "--served-model-name" not in plan.command


def test_api_server_count_is_explicit_vllms_default_when_unset() -> None:
    # vLLM 0.33 starts one API server per DP rank with its own load balancing; the plan says
    # so out loud, so the head can be sized for it.
    plan = plan_of(dataParallel=dp(4, 2))
    assert plan.api_servers == 4
    i = plan.command.index("--api-server-count")
    assert plan.command[i + 1] == "4"
    assert plan_of(dataParallel=dp(4, 2), apiServerCount=1).api_servers == 1


def test_lora_brings_its_limits_the_gate_one_api_server_and_no_adapter() -> None:
    adapters = [{"name": "sql", "source": {"path": "/adapters/sql"}}]
    plan = plan_of(dataParallel=dp(4, 2), engineArgs=["--max-model-len=512"],
                   lora={"maxLoras": 2, "maxLoraRank": 64, "maxCpuLoras": 8,
                         "adapters": adapters})  # fmt: skip
    cmd = list(plan.command)
    assert plan.api_servers == 1
    assert cmd[cmd.index("--api-server-count") + 1] == "1"
    lora = cmd[cmd.index("--enable-lora"):cmd.index("--max-model-len=512")]
    assert lora == ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "64",
                    "--max-cpu-loras", "8", "--middleware", "vllm_dp_launcher.lora_gate.LoraGate"]
    assert ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True") in plan.env
    # The adapters are loaded at runtime: another set is the same head job.
    other = plan_of(dataParallel=dp(4, 2), engineArgs=["--max-model-len=512"],
                    lora={"maxLoras": 2, "maxLoraRank": 64, "maxCpuLoras": 8})  # fmt: skip
    assert other == plan
    assert "--enable-lora" not in plan_of(dataParallel=dp(4, 2)).command


@pytest.mark.parametrize(
    ("resources", "servers", "cpu", "memory"),
    [
        ({"cpu": "16", "memory": "64Gi"}, 8, "24", "80Gi"),
        ({"cpu": "2500m", "memory": "1536Mi"}, 1, "3500m", "3584Mi"),
        ({"cpu": "4"}, 2, "6", None),
        ({}, 8, None, None),
    ],
)
def test_head_gets_cpu_and_memory_per_api_server(
    resources: dict[str, str], servers: int, cpu: str | None, memory: str | None
) -> None:
    plan = plan_of(dataParallel=dp(8, 2), apiServerCount=servers, resources=resources)
    assert (plan.head_cpu, plan.head_memory) == (cpu, memory)


def test_env_pack_strategy_prefixes_and_literals() -> None:
    plan = plan_of(
        dataParallel=dp(6, 2, "fill"),
        env=[
            {"name": "NCCL_DEBUG", "value": "INFO"},
            {"name": "MY_SETTING", "value": "1"},
            {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"},
            {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            {"name": "EMPTY"},
        ],
    )
    assert plan.env == (
        ("VLLM_RAY_DP_PACK_STRATEGY", "fill"),
        ("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", "GLOO_,NCCL_,HF_,MY_SETTING,EMPTY"),
        ("NCCL_DEBUG", "INFO"),
        ("MY_SETTING", "1"),
        ("VLLM_LOGGING_LEVEL", "DEBUG"),
        ("EMPTY", ""),
    )


def test_env_never_carries_per_pod_settings() -> None:
    plan = plan_of(dataParallel=dp(4, 2))
    names = dict(plan.env)
    assert "VLLM_HOST_IP" not in names  # each pod's own, from its pod IP (vllm#13521)
    assert "VLLM_PORT" not in names
    assert not any(p.startswith("VLLM_") for p in COPIED_ENV_PREFIXES)


def test_launch_spec_mirrors_the_plan() -> None:
    plan = plan_of(dataParallel=dp(6, 2, "fill"), gpu={"perPod": 4})
    doc = plan.launch_spec()
    assert doc["version"] == 1
    assert doc["model"] == MODEL
    assert (doc["dataParallelSize"], doc["ranksPerNode"], doc["tensorParallelSize"]) == (6, 2, 1)
    assert doc["packStrategy"] == "fill"
    assert (doc["gpuPods"], doc["gpusPerPod"], doc["totalGpus"]) == (2, 4, 8)
    assert doc["pods"] == [
        {"index": 0, "role": "head", "ranks": [0, 1], "gpus": 2},
        {"index": 1, "role": "worker", "ranks": [2, 3, 4, 5], "gpus": 4},
    ]
    assert doc["command"] == list(plan.command)
    assert doc["env"] == dict(plan.env)
    assert doc["port"] == 8000
    assert doc["waitTimeoutSeconds"] > 0 and doc["preflightTimeoutSeconds"] > 0


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ((), ""),
        ((3,), "3"),
        ((0, 1, 2, 3), "0-3"),
        ((0, 1, 2, 5), "0-2,5"),
        ((4, 6), "4,6"),
        ((2, 0, 1), "0-2"),
    ],
)
def test_compact_ranges(ranks: tuple[int, ...], text: str) -> None:
    assert compact_ranges(ranks) == text
    assert PodPlan(0, "head", ranks, 0).ranks_text() == text


# --- invariants over a grid of valid specs ------------------------------------------------------


def _grid() -> list[dict[str, Any]]:
    specs: list[dict[str, Any]] = []
    for strategy, size, per_node, tp, extra in itertools.product(
        ("strict", "fill"), range(2, 13), (1, 2, 3, 4), (1, 2, 4), (None, 0, 1, 8)
    ):
        spec: dict[str, Any] = {
            "dataParallel": dp(size, per_node, strategy),
            "tensorParallelSize": tp,
        }
        if extra is not None:  # perPod: exactly what the head needs, one rank more, or 8
            spec["gpu"] = {"perPod": extra if extra == 8 else per_node * tp + extra * tp}
        specs.append(spec)
    for size, per_pod, pods_per_rank in itertools.product((2, 3, 4), (1, 2, 4, 8), (1, 2, 4)):
        specs.append(
            {
                "dataParallel": dp(size, 1, "span"),
                "tensorParallelSize": per_pod * pods_per_rank,
                "gpu": {"perPod": per_pod},
            }
        )
    valid: list[dict[str, Any]] = []
    for spec in specs:
        try:
            validate("grid", {"model": MODEL, **spec})
        except SpecError:
            continue
        valid.append(spec)
    return valid


GRID = _grid()


def _grid_id(spec: dict[str, Any]) -> str:
    d = spec["dataParallel"]
    per_pod = spec.get("gpu", {}).get("perPod", "-")
    tp = spec["tensorParallelSize"]
    return f"{d['packStrategy']}-dp{d['size']}-rpn{d['ranksPerNode']}-tp{tp}-g{per_pod}"


def test_grid_is_large_and_covers_every_strategy() -> None:
    assert len(GRID) > 200
    assert {s["dataParallel"]["packStrategy"] for s in GRID} == {"strict", "fill", "span"}


@pytest.mark.parametrize("spec", GRID, ids=_grid_id)
def test_layout_invariants(spec: dict[str, Any]) -> None:
    plan = plan_of(**spec)
    d = spec["dataParallel"]
    size, per_node, tp = d["size"], d["ranksPerNode"], spec["tensorParallelSize"]
    pods = plan.pods
    assert [p.index for p in pods] == list(range(len(pods)))
    assert [p.role for p in pods] == ["head"] + ["worker"] * (len(pods) - 1)
    # No pod uses more GPUs than the (identical) request; every pod uses some.
    assert all(0 < p.gpus <= plan.gpus_per_pod for p in pods)
    assert plan.total_gpus == plan.gpus_per_pod * plan.gpu_pods
    counts = Counter(r for p in pods for r in p.ranks)
    assert sorted(counts) == list(range(size))
    if d["packStrategy"] == "span":
        pods_per_rank = tp // plan.gpus_per_pod
        assert set(counts.values()) == {pods_per_rank}
        assert all(len(p.ranks) == 1 and p.gpus == plan.gpus_per_pod for p in pods)
        # A rank's pods are consecutive, rank 0 on the head.
        assert [p.ranks[0] for p in pods] == [i // pods_per_rank for i in range(len(pods))]
        return
    assert set(counts.values()) == {1}
    assert len(pods[0].ranks) == per_node  # vLLM raises unless the head holds exactly -dpl
    assert all(p.gpus == len(p.ranks) * tp for p in pods)
    flat = [r for p in pods for r in p.ranks]
    assert flat == list(range(size))  # ranks in pod order, as vLLM assigns them
    fits = plan.gpus_per_pod // tp
    if d["packStrategy"] == "strict":
        assert all(len(p.ranks) == per_node for p in pods)
    else:
        assert all(len(p.ranks) == fits for p in pods[1:-1])
        assert all(0 < len(p.ranks) <= fits for p in pods[1:])
    assert plan.command[plan.command.index("--data-parallel-size") + 1] == str(size)
    assert plan.command[plan.command.index("--data-parallel-size-local") + 1] == str(per_node)
