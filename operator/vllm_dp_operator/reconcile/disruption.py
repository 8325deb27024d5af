"""The PodDisruptionBudget over a resource's Ray pods, kept to how many replicas route now
(render/disruption.py says why one budget and which minimum)."""

from __future__ import annotations

from typing import Any

from vllm_dp_operator.api import names
from vllm_dp_operator.api.models import VLLMDataParallelSpec
from vllm_dp_operator.controller.kube import PDB, Kube
from vllm_dp_operator.plan import Plan
from vllm_dp_operator.reconcile.member import create_child, ours
from vllm_dp_operator.reconcile.outcome import Resource
from vllm_dp_operator.render.disruption import build_disruption_budget, min_available


async def ensure_budget(kube: Kube, res: Resource, spec: VLLMDataParallelSpec, plan: Plan,
                        owner: dict[str, Any], routed: int) -> None:  # fmt: skip
    """Create, change or delete the budget; `routed`: the replicas routed after this step."""
    replicas = 0 if spec.suspend else spec.replicas
    minimum = min_available(replicas, plan.gpu_pods, routed)
    ns, name = res.namespace, names.disruption_budget(res.name)
    current = await kube.get(PDB, ns, name)
    if current is not None and not ours([current], res.uid):
        return  # a deleted namesake's, until the garbage collector takes it
    if minimum is None:
        if current is not None and not current["metadata"].get("deletionTimestamp"):
            await kube.delete(PDB, ns, name)
        return
    want = build_disruption_budget(res.name, ns, minimum, owner)
    if current is None:
        await create_child(kube, PDB, want)
    elif current.get("spec") != want["spec"]:
        await kube.patch(PDB, ns, name, {"spec": want["spec"]})
