"""Why Ray pods are Pending, in the user's words: the hint follows the scheduler's reason."""

from __future__ import annotations

from typing import Any

import pytest
from vllm_dp_operator.reconcile.status import PodAsks, explain_pending, pending_hint

ASKS = PodAsks(gpus=1, gpu_resource="nvidia.com/gpu", cpu="1", head_cpu="2", memory="4Gi",
               head_memory="6Gi")  # fmt: skip
CPU = ("0/2 nodes are available: 2 Insufficient cpu. no new claims to deallocate, preemption: "
       "0/2 nodes are available: 2 No preemption victims found for incoming pod.")  # fmt: skip


def pending(message: str) -> dict[str, Any]:
    return {"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": message}]}}  # fmt: skip


def test_cpu_shortage_names_the_cpu_asked_not_gpus() -> None:
    msg = explain_pending([pending(CPU), {"status": {"phase": "Running"}}], ASKS)
    assert msg.startswith("1 of 2 Ray pod(s) cannot be scheduled: 0/2 nodes are available")
    assert "The head asks 2 and each worker 1 of cpu" in msg
    assert "lower resources.cpu or apiServerCount" in msg
    assert "GPU" not in msg.split("victims found for incoming pod.")[1]


def test_memory_shortage_names_the_memory_asked() -> None:
    hint = pending_hint("0/3 nodes are available: 3 Insufficient memory.", ASKS)
    assert hint.startswith("The head asks 6Gi and each worker 4Gi of memory")
    assert "cpu" not in hint and "GPU" not in hint


def test_gpu_shortage_keeps_the_gpu_hint() -> None:
    hint = pending_hint("0/4 nodes are available: 4 Insufficient nvidia.com/gpu.", ASKS)
    assert hint == ("Each pod needs 1 nvidia.com/gpu; free GPUs, add GPU nodes, or lower "
                    "dataParallel.size, tensorParallelSize or gpu.perPod.")  # fmt: skip


def test_every_reason_given_gets_its_hint_in_order() -> None:
    hint = pending_hint("0/4 nodes are available: 1 Insufficient cpu, 1 Insufficient "
                        "nvidia.com/gpu, 1 node(s) had untolerated taint {gpu: true}, 1 "
                        "node(s) didn't match Pod's node affinity/selector.", ASKS)  # fmt: skip
    found = [hint.find(s) for s in ("Each pod needs 1 nvidia.com/gpu", "of cpu",
                                    "tolerations", "nodeSelector")]  # fmt: skip
    assert -1 not in found and found == sorted(found), hint


def test_unset_cpu_says_the_namespace_defaults_apply() -> None:
    asks = PodAsks(gpus=1, gpu_resource="nvidia.com/gpu", cpu=None, head_cpu=None,
                   memory=None, head_memory=None)  # fmt: skip
    hint = pending_hint(CPU, asks)
    assert hint.startswith("resources.cpu is unset, so the namespace's defaults apply")
    assert "None" not in hint


@pytest.mark.parametrize("message", ["0/1 nodes are available: 1 Too many pods.", ""])
def test_a_reason_we_do_not_know_falls_back_to_gpus(message: str) -> None:
    assert pending_hint(message, ASKS).startswith("Each pod needs 1 nvidia.com/gpu")


def test_nothing_unschedulable_says_nothing() -> None:
    waiting = {"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "True"}]}}  # fmt: skip
    assert explain_pending([waiting, {"status": {"phase": "Running"}}], ASKS) == ""
