"""Waiting for the cluster and checking its shape, against fake node lists and a fake clock."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from vllm_dp_launcher.cluster import (
    GpuNode,
    describe_missing,
    gpu_nodes,
    layout_problems,
    wait_for_cluster,
)
from vllm_dp_launcher.errors import ClusterNotReadyError, GpusHeldError
from vllm_dp_launcher.holders import GpuHolder, HolderReport
from vllm_dp_launcher.plan import LaunchPlan, parse_plan

EXAMPLE = Path(__file__).resolve().parents[2] / "engine_image" / "example-plan.json"
HEAD = GpuNode("a" * 56, "10.0.0.1", 4)
WORKER = GpuNode("b" * 56, "10.0.0.2", 4)


def plan(pods: int = 2, gpus: int = 4, **changes: Any) -> LaunchPlan:
    """The example plan resized to ``pods`` pods of ``gpus`` GPUs (strict, one rank per GPU)."""
    data: dict[str, Any] = copy.deepcopy(json.loads(EXAMPLE.read_text()))
    data.update(gpuPods=pods, gpusPerPod=gpus, totalGpus=pods * gpus, ranksPerNode=gpus)
    data["pods"] = [
        {"index": i, "role": "head" if i == 0 else "worker", "ranks": [i], "gpus": gpus}
        for i in range(pods)
    ]
    data.update(changes)
    return parse_plan(data)


def test_gpu_nodes_keeps_alive_gpu_nodes_only() -> None:
    """Dead nodes and CPU-only nodes do not count."""

    def node(node_id: str, alive: bool, ip: str, **resources: float) -> dict[str, Any]:
        return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": ip, "Resources": resources}

    raw = [
        node("n1", True, "10.0.0.2", GPU=4.0),
        node("n2", False, "10.0.0.3", GPU=4.0),
        node("n3", True, "10.0.0.4", CPU=8.0),
        node("n4", True, "10.0.0.1", GPU=2.0),
    ]
    assert gpu_nodes(raw) == [GpuNode("n4", "10.0.0.1", 2), GpuNode("n1", "10.0.0.2", 4)]


class FakeClock:
    """A clock that only moves when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        """Advance time."""
        self.now += seconds


def test_wait_returns_once_the_late_worker_joins(caplog: pytest.LogCaptureFixture) -> None:
    """Progress is logged at the interval; the nodes are returned when the plan is met."""
    clock = FakeClock()

    def nodes() -> list[GpuNode]:
        return [HEAD, WORKER] if clock.now >= 25 else [HEAD]

    with caplog.at_level(logging.INFO):
        result = wait_for_cluster(
            plan(), nodes, HEAD.ip, timeout=60, progress_interval=10,
            sleep=clock.sleep, clock=lambda: clock.now,
        )  # fmt: skip

    assert result == [HEAD, WORKER]
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting")]
    assert progress == ["waiting for the Ray cluster: 1/2 GPU nodes, 4/8 GPUs"] * 3  # 0, 10, 20 s
    assert caplog.records[-1].getMessage() == "Ray cluster ready: 2/2 GPU nodes, 8/8 GPUs"


def test_wait_times_out_naming_what_is_missing() -> None:
    """After the timeout the error gives the counts and what is absent."""
    clock = FakeClock()
    with pytest.raises(ClusterNotReadyError) as err:
        wait_for_cluster(
            plan(pods=3), lambda: [HEAD], HEAD.ip, timeout=30, progress_interval=10,
            sleep=clock.sleep, clock=lambda: clock.now,
        )  # fmt: skip
    message = str(err.value)
    assert clock.now == pytest.approx(30)
    assert "timed out after 30s waiting for the Ray cluster: 1/3 GPU nodes, 4/12 GPUs" in message
    assert "missing 2 GPU node(s) and 8 GPU(s)" in message
    assert "2 of 2 worker GPU pod(s) (4 GPUs each) have not joined" in message
    assert "GPU nodes present: 10.0.0.1 (node aaaaaaaa, 4 GPUs, this node)" in message


def test_missing_head_gpus_are_called_out() -> None:
    """A head without GPUs is named: vllm serve must run on a GPU node."""
    message = describe_missing(plan(), [WORKER], own_ip=HEAD.ip)
    assert "the head pod's node 10.0.0.1 (where the launcher runs) offers no GPUs" in message


def test_strict_layout_fits_and_misfits() -> None:
    """strict: this node and every other need ranksPerNode x TP GPUs."""
    assert layout_problems(plan(), [HEAD, WORKER], HEAD.ip) == []
    small = GpuNode("c" * 56, "10.0.0.3", 2)
    problems = layout_problems(plan(pods=2), [HEAD, small], HEAD.ip)
    assert problems == [
        "GPU node 10.0.0.3 (node cccccccc, 2 GPUs) must hold at least 4 GPUs "
        "for packStrategy strict"
    ]


def test_own_node_must_hold_its_ranks() -> None:
    """The launcher's node needs ranksPerNode x TP GPUs (vLLM places -dpl ranks there)."""
    p = plan(pods=2, gpus=4, tensorParallelSize=2, ranksPerNode=4)
    problems = layout_problems(p, [HEAD, GpuNode("b" * 56, "10.0.0.2", 8)], HEAD.ip)
    assert problems[0].startswith("this node 10.0.0.1 (node aaaaaaaa, 4 GPUs, this node) ")
    assert "at least 8 GPUs (4 ranks x tensor parallel 2)" in problems[0]


def test_own_node_without_gpus_is_refused() -> None:
    """vllm serve on a CPU-only node fails in vLLM (production-stack#1056)."""
    assert "offers no GPUs" in layout_problems(plan(), [WORKER], HEAD.ip)[0]


def test_fill_needs_only_tp_gpus_on_other_nodes() -> None:
    """fill: other nodes take as many ranks as fit, so TP GPUs suffice."""
    p = plan(packStrategy="fill", tensorParallelSize=2, ranksPerNode=2)
    two = GpuNode("c" * 56, "10.0.0.3", 2)
    one = GpuNode("d" * 56, "10.0.0.4", 1)
    assert layout_problems(p, [HEAD, two], HEAD.ip) == []
    assert (
        "must hold at least 2 GPUs for packStrategy fill"
        in layout_problems(p, [HEAD, one], HEAD.ip)[0]
    )


def test_span_needs_identical_nodes() -> None:
    """span: every node holds exactly gpusPerPod GPUs."""
    p = plan(packStrategy="span", tensorParallelSize=8, ranksPerNode=1, dataParallelSize=1)
    assert layout_problems(p, [HEAD, WORKER], HEAD.ip) == []
    big = GpuNode("c" * 56, "10.0.0.3", 8)
    problems = layout_problems(p, [HEAD, big], HEAD.ip)
    assert problems == [
        "GPU node 10.0.0.3 (node cccccccc, 8 GPUs) must hold exactly 4 GPUs for packStrategy span"
    ]
    assert "must hold exactly 4 GPUs" in layout_problems(p, [big, WORKER], big.ip)[0]


# Available GPUs: a stale driver holding them must fail the launch, not hang vLLM's placement.
def busy(node: GpuNode, free: float) -> GpuNode:
    """The node with only ``free`` of its GPUs available."""
    return GpuNode(node.node_id, node.ip, node.gpus, free_gpus=free)


LIVE = GpuHolder("02000000", 8, ("10.0.0.1", "10.0.0.2"), ("dp_rank_0", "dp_rank_1"),
                 submission_id="old-1", driver_alive=True)  # fmt: skip


def test_gpu_nodes_reads_available_gpus() -> None:
    """Free GPUs come from available_resources_per_node, keyed by node id."""
    raw = [{"NodeID": "n1", "Alive": True, "NodeManagerAddress": "10.0.0.1",
            "Resources": {"GPU": 4.0}}]  # fmt: skip
    (node,) = gpu_nodes(raw, {"n1": {"GPU": 1.0, "CPU": 2.0}})
    assert (node.free_gpus, node.busy_gpus) == (1.0, 3.0)
    assert node.describe() == "10.0.0.1 (node n1, 4 GPUs, 3 in use)"
    (unknown,) = gpu_nodes(raw, {})
    assert unknown.busy_gpus == 4.0


def test_gpus_held_by_a_live_job_fail_at_once() -> None:
    """All nodes joined, GPUs held by a running job: GpusHeldError at time 0, naming it."""
    clock = FakeClock()
    with pytest.raises(GpusHeldError) as err:
        wait_for_cluster(
            plan(), lambda: [busy(HEAD, 0), busy(WORKER, 0)], HEAD.ip, timeout=600,
            progress_interval=10, find_holders=lambda: HolderReport((LIVE,)),
            sleep=clock.sleep, clock=lambda: clock.now,
        )  # fmt: skip
    assert clock.now == 0
    assert err.value.exit_status == 5
    message = str(err.value)
    assert message.startswith("8 of the cluster's 8 GPU(s) are in use, and vLLM's placement")
    assert "Ray job 02000000 (submission 'old-1', driver running) holds 8 GPU(s)" in message
    assert "ray job stop" in message


def test_gpus_being_released_are_waited_for(caplog: pytest.LogCaptureFixture) -> None:
    """Held by a job that has ended (release under way): wait, then go once they are free."""
    clock = FakeClock()
    ended = HolderReport((dataclasses.replace(LIVE, driver_alive=False),))

    def nodes() -> list[GpuNode]:
        return [HEAD, WORKER] if clock.now >= 3 else [busy(HEAD, 0), WORKER]

    with caplog.at_level(logging.INFO):
        result = wait_for_cluster(
            plan(), nodes, HEAD.ip, timeout=60, progress_interval=10,
            find_holders=lambda: ended, sleep=clock.sleep, clock=lambda: clock.now,
        )  # fmt: skip
    assert result == [HEAD, WORKER]
    assert clock.now == pytest.approx(3)
    messages = [r.getMessage() for r in caplog.records]
    assert "stage=waiting-for-free-gpus nodes=2/2 gpus=8/8 busy=4" in messages
    assert any(m.startswith("waiting for GPUs to be released: 2/2 GPU nodes, 8/8 GPUs, 4 in use")
               for m in messages)  # fmt: skip


def test_gpus_never_released_time_out_naming_what_is_known() -> None:
    """Unknown holders (state API down) are waited for until the deadline, then reported."""
    clock = FakeClock()
    with pytest.raises(GpusHeldError) as err:
        wait_for_cluster(
            plan(), lambda: [busy(HEAD, 2), WORKER], HEAD.ip, timeout=20, progress_interval=10,
            find_holders=lambda: HolderReport(error="Ray's state API: refused"),
            sleep=clock.sleep, clock=lambda: clock.now,
        )  # fmt: skip
    assert clock.now == pytest.approx(20)
    assert str(err.value).startswith(
        "timed out after 20s waiting for GPUs to be released: 2 of the cluster's 8 GPU(s)"
    )
    assert "the holders could not be listed (Ray's state API: refused)" in str(err.value)


def test_wait_enters_its_stage_first(caplog: pytest.LogCaptureFixture) -> None:
    """stage=waiting-for-cluster is printed even when the cluster is already complete."""
    with caplog.at_level(logging.INFO):
        wait_for_cluster(plan(), lambda: [HEAD, WORKER], HEAD.ip, timeout=5, progress_interval=1)
    assert caplog.records[0].getMessage() == "stage=waiting-for-cluster nodes=2 gpus=8 timeout=5"
