"""vLLM 0.33.0's own Ray DP placement puts each example's ranks where the plan says (-m vllm).

For every example, the operator's CLI renders the RayCluster and the head job; the launcher
builds the command it would run on the head (``--data-parallel-address 127.0.0.2``) and its
engine environment. ``place_with_vllm.py`` then runs, inside the cached vllm==0.33.0 /
ray==2.60.0 virtualenv, on a real Ray cluster started from that virtualenv's ``ray`` by the
ray tier's ``RayTestbed`` (one node per loopback IP, so each has its own ``node:<ip>``; one
node per GPU pod, each with the pod's GPUs as logical GPUs and as CPUs the num-cpus KubeRay
derives from the pod's CPU limit, or 16 where a pod sets none, as Ray then counts the node's):
vLLM's unmodified ``CoreEngineActorManager.create_dp_placement_groups`` on the
``VllmConfig`` built from that command, with ``VLLM_RAY_DP_PACK_STRATEGY`` from the plan.
Examples with the same pod shape share one cluster (three clusters in all).

What had to be set for vLLM to see a GPU platform on this GPU-less machine: vLLM detects CUDA
through NVML (``cuda_platform_plugin`` returns None here) and ``vllm.platforms.cuda`` cannot
even be imported without the NVIDIA driver (``libcuda.so.1``). So the helper sets
``vllm.platforms._current_platform``, before anything resolves it, to a stand-in
``Platform`` subclass whose class attributes are read from ``CudaPlatformBase`` in vLLM's own
``cuda.py`` (``_enum = PlatformEnum.CUDA``, ``ray_device_key = "GPU"`` - the only platform
attribute ``create_dp_placement_groups`` reads - ``device_control_env_var =
"CUDA_VISIBLE_DEVICES"``, ...) and whose ``device_count()`` is the head pod's GPU count (what
the head job's driver sees: Ray's job manager starts it with
``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``). ``VLLM_TARGET_DEVICE`` is unset. The model
config stays None: the placement reads only ``vllm_config.parallel_config``.

The assertions: no error; exactly DP placement groups ``dp_rank_0..DP-1``, all created, with
the Ray strategy vLLM uses for the pack strategy (STRICT_PACK, or PACK for span); every group
has world-size GPU bundles and one CPU control bundle on its first GPU bundle's node; the head
node (the DP master) holds exactly the head pod's ranks and GPUs, and the worker nodes together
hold exactly the worker pods' ranks and GPUs (workers are interchangeable: a multiset).

Negative controls prove the check can fail: the fill plan run as ``strict`` (vLLM refuses:
only 4 of 6 groups fit), and the dp8 plan with CPUs held on the worker so it has fewer CPUs
than ranks (vLLM's placement groups then never become ready; the helper's bounded wait says
so).
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_vllm_accepts_plans import (
    EXAMPLES,
    ROOT,
    plan_in_head_job,
    render_items,
    run_in_vllm_venv,
)
from vllm_dp_launcher.command import build_command, engine_env_overrides
from vllm_dp_launcher.plan import LaunchPlan

pytestmark = pytest.mark.vllm

TESTBED_DIR = ROOT / "tests" / "ray"
HEAD_IP = "127.0.0.2"  # ray_testbed.HEAD_IP: the head node, where the head job's driver runs
# A pod without a CPU limit: KubeRay leaves num-cpus out and Ray counts the node's CPUs.
UNLIMITED_POD_CPUS = 16
RAY_EXECUTOR = ["--distributed-executor-backend", "ray"]


@dataclass(frozen=True)
class Example:
    """One rendered example: its launch plan and the CPUs Ray gives each of its pods."""

    name: str
    plan: LaunchPlan
    cpus_per_pod: int


def pod_cpus(resources: dict[str, Any]) -> int:
    """The num-cpus KubeRay gives a Ray node for its container resources (limit, else request)."""
    for kind in ("limits", "requests"):
        cpu = str(resources.get(kind, {}).get("cpu", ""))
        if cpu:
            return max(1, int(float(cpu[:-1]) / 1000) if cpu.endswith("m") else int(float(cpu)))
    return UNLIMITED_POD_CPUS


def render(example: Path) -> Example:
    """Render an example with the operator's CLI: the plan in its head job, its pods' CPUs."""
    items = render_items(example)
    (cluster,) = [item for item in items if item["kind"] == "RayCluster"]
    plan = plan_in_head_job(items)
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"].get("workerGroupSpecs", [])]
    cpus = min(
        pod_cpus(group["template"]["spec"]["containers"][0].get("resources", {}))
        for group in groups
    )
    return Example(example.stem, plan, cpus)


def case(name: str, plan: LaunchPlan, **extra: Any) -> dict[str, Any]:
    """The launcher's command and engine environment for ``plan`` on the head node."""
    return {
        "name": name,
        "command": build_command(plan, HEAD_IP),
        "env": engine_env_overrides(plan, HEAD_IP, {}),
        **extra,
    }


def sets_ray_executor(command: Sequence[str]) -> bool:
    """True when ``command`` passes ``--distributed-executor-backend ray``."""
    joined = [f"{a}={b}" for a, b in itertools.pairwise(command)] + list(command)
    return "=".join(RAY_EXECUTOR) in joined


def without_ray_executor(command: Sequence[str]) -> list[str]:
    """``command`` with ``--distributed-executor-backend ray`` taken out."""
    out = list(command)
    i = out.index(RAY_EXECUTOR[0])
    assert out[i : i + 2] == RAY_EXECUTOR, out
    return out[:i] + out[i + 2 :]


def requests(examples: dict[str, Example]) -> list[dict[str, Any]]:
    """Group the examples (and the controls) by pod shape: one Ray cluster per shape."""
    groups: dict[tuple[int, int], dict[str, Any]] = {}
    for ex in examples.values():
        shape = (ex.plan.gpu_pods, ex.plan.gpus_per_pod)
        group = groups.setdefault(
            shape,
            {"pods": shape[0], "gpusPerPod": shape[1], "cpusPerPod": ex.cpus_per_pod, "cases": []},
        )
        group["cpusPerPod"] = min(group["cpusPerPod"], ex.cpus_per_pod)
        group["cases"].append(case(ex.name, ex.plan))
        if ex.plan.pack_strategy == "span":
            # Control: why the plan names the Ray executor for a rank wider than one pod.
            bare = case(ex.name, ex.plan)
            bare.update(name="control-span-without-ray-executor",
                        command=without_ray_executor(bare["command"]))  # fmt: skip
            group["cases"].append(bare)
    fill, dp8 = examples["fill"].plan, examples["dp8-rpn4-tp1"].plan
    shape = (fill.gpu_pods, fill.gpus_per_pod)
    assert (dp8.gpu_pods, dp8.gpus_per_pod) == shape, "the controls expect one 2 x 4 cluster"
    strict_fill = case("control-fill-as-strict", fill)
    strict_fill["env"] = {**strict_fill["env"], "VLLM_RAY_DP_PACK_STRATEGY": "strict"}
    spare = groups[shape]["cpusPerPod"] - 1  # leaves the worker 1 CPU for its 4 ranks
    hold = {"ip": "127.0.0.3", "CPU": spare}
    starved = case("control-cpu-starved-worker", dp8, readyTimeout=5, hold=hold)
    groups[shape]["cases"] += [strict_fill, starved]
    return list(groups.values())


@pytest.fixture(scope="module")
def examples() -> dict[str, Example]:
    """Every example, rendered."""
    pytest.importorskip("vllm_dp_operator.cli", reason="the operator package is not installed")
    return {example.stem: render(example) for example in EXAMPLES}


@pytest.fixture(scope="module")
def placed(examples: dict[str, Example]) -> dict[str, Any]:
    """Install (once) vLLM; run vLLM's placement for every case on real Ray clusters."""
    request = {"testbed": str(TESTBED_DIR), "groups": requests(examples)}
    out: dict[str, Any] = run_in_vllm_venv("place_with_vllm.py", request)
    out["results"] = {result["name"]: result for result in out["results"]}
    return out


def layout(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per node IP: the DP ranks with a GPU bundle there, GPU bundles, local ranks."""
    nodes: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"ranks": set(), "gpus": 0, "local_ranks": []}
    )
    for group in result["groups"]:
        rank = int(group["name"].removeprefix("dp_rank_"))
        gpu_ips = [b["node_ip"] for b in group["bundles"] if "GPU" in b["resources"]]
        for ip in gpu_ips:
            nodes[ip]["ranks"].add(rank)
            nodes[ip]["gpus"] += 1
        nodes[gpu_ips[0]]["local_ranks"].append(group["local_rank"])
    return {ip: {**node, "ranks": tuple(sorted(node["ranks"]))} for ip, node in nodes.items()}


def check_placement(plan: LaunchPlan, result: dict[str, Any]) -> None:
    """Assert vLLM placed exactly the plan's ranks on each node."""
    assert result["error"] is None, f"{result['name']}: {result['error']}"
    facts = result["facts"]
    assert facts["pack_strategy"] == plan.pack_strategy
    assert facts["data_parallel_size"] == plan.data_parallel_size
    assert facts["data_parallel_size_local"] == plan.ranks_per_node
    assert facts["data_parallel_master_ip"] == HEAD_IP
    assert facts["world_size"] == plan.tensor_parallel_size
    assert facts["distributed_executor_backend"] == "ray"

    groups = result["groups"]
    assert [g["name"] for g in groups] == [f"dp_rank_{i}" for i in range(plan.data_parallel_size)]
    strategy = "PACK" if plan.pack_strategy == "span" else "STRICT_PACK"
    for group in groups:
        assert group["state"] == "CREATED", group
        assert group["strategy"] == strategy, group
        gpu = [b for b in group["bundles"] if "GPU" in b["resources"]]
        cpu = [b for b in group["bundles"] if "GPU" not in b["resources"]]
        assert len(gpu) == plan.tensor_parallel_size, group
        assert len(cpu) == 1 and cpu[0]["resources"]["CPU"] == 1.0, group
        assert cpu[0]["node_ip"] == gpu[0]["node_ip"], f"control bundle off its node: {group}"
        for bundle in group["bundles"]:
            assert bundle["resources"][f"node:{bundle['node_ip']}"] == 0.001, group

    nodes = layout(result)
    assert set(nodes) <= set(result["cluster"]), nodes
    empty = {"ranks": (), "gpus": 0, "local_ranks": []}
    head = nodes.get(HEAD_IP, empty)
    assert head["ranks"] == plan.head_pod.ranks, f"head node: {head}, plan: {plan.head_pod}"
    assert head["gpus"] == plan.head_pod.gpus, f"head node: {head}, plan: {plan.head_pod}"
    placed_workers = Counter(
        (nodes.get(ip, empty)["ranks"], nodes.get(ip, empty)["gpus"])
        for ip in result["cluster"]
        if ip != HEAD_IP
    )
    planned_workers = Counter((pod.ranks, pod.gpus) for pod in plan.pods if pod.role == "worker")
    assert placed_workers == planned_workers, (
        f"worker nodes (ranks, GPUs): vLLM {sorted(placed_workers.elements())}, "
        f"plan {sorted(planned_workers.elements())}"
    )
    if plan.pack_strategy != "span":
        for ip, node in nodes.items():
            assert sorted(node["local_ranks"]) == list(range(len(node["ranks"]))), (ip, node)


def test_vllm_sees_a_gpu_platform(placed: dict[str, Any]) -> None:
    """vLLM alone finds no GPU here; the stand-in carries CudaPlatformBase's Ray attributes."""
    platform = placed["platform"]
    assert platform["cuda_platform_plugin"] is None
    assert "libcuda.so.1" in platform["import_vllm_platforms_cuda"]
    assert platform["is_cuda"] is True
    assert platform["ray_device_key"] == "GPU"
    assert platform["stand_in"]["device_control_env_var"] == "CUDA_VISIBLE_DEVICES"


@pytest.mark.parametrize("example", [e.stem for e in EXAMPLES if e.stem != "span"])
def test_vllm_places_the_plan(
    example: str, examples: dict[str, Example], placed: dict[str, Any]
) -> None:
    """vLLM creates exactly DP placement groups, each node holding the plan's ranks."""
    check_placement(examples[example].plan, placed["results"][example])


def test_vllm_places_span_plan(examples: dict[str, Example], placed: dict[str, Any]) -> None:
    """span, as the launcher runs it, places each TP-16 rank on two whole 8-GPU nodes."""
    assert sets_ray_executor(examples["span"].plan.command)
    check_placement(examples["span"].plan, placed["results"]["span"])


def test_span_needs_the_ray_executor_named(placed: dict[str, Any]) -> None:
    """Without the flag, vLLM rejects a world size above the head's GPUs before placing.

    On a CUDA head with 8 GPUs and world size 16, vLLM's ParallelConfig does not pick the Ray
    executor by itself (vllm#25775 removed that fallback), hence the flag in the plan. The CPU
    platform of test_vllm_accepts_plans skips that check, so only this tier sees it.
    """
    error = placed["results"]["control-span-without-ray-executor"]["error"] or ""
    assert "World size (16) is larger than the number of available GPUs (8)" in error, error


def test_the_placement_check_can_fail(examples: dict[str, Example], placed: dict[str, Any]) -> None:
    """Negative controls: vLLM refuses fill as strict; a CPU-starved node never gets its ranks."""
    strict_fill = placed["results"]["control-fill-as-strict"]
    assert (strict_fill["error"] or "").startswith(
        "ValueError: Not enough resources to allocate 6 placement groups, only created 4 "
    ), strict_fill["error"]
    with pytest.raises(AssertionError):
        check_placement(examples["fill"].plan, strict_fill)

    starved = placed["results"]["control-cpu-starved-worker"]
    # How many groups stay pending depends on which ranks Ray placed first; at least one does.
    assert (starved["error"] or "").startswith("TimeoutError: "), starved["error"]
    assert "placement groups not ready" in starved["error"], starved["error"]
    pending = [g for g in starved["groups"] if g["state"] != "CREATED"]
    assert pending, starved["groups"]
    # Pending: no bundle landed; each still asks for the starved worker.
    assert {b["node_ip"] for g in pending for b in g["bundles"]} == {None}, pending
    assert all("node:127.0.0.3" in b["resources"] for g in pending for b in g["bundles"])
    with pytest.raises(AssertionError):
        check_placement(examples["dp8-rpn4-tp1"].plan, starved)


def test_clusters_stopped(placed: dict[str, Any]) -> None:
    """Every Ray process the helper started is gone (by its own stop, or SIGKILL by PID)."""
    for result in placed["results"].values():
        assert not [x for x in result["leftover_processes"] if "still alive" in x], result
