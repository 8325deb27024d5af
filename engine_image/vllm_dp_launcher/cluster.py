"""Waiting for the Ray cluster to reach the planned shape, and checking that shape fits.

vLLM takes one snapshot of the cluster's nodes, and of their *available* resources, when it
places its data-parallel ranks: a worker that joins a moment later is ignored, and GPUs still
held by an old ``vllm serve`` make the placement wait forever. So the launch is gated here on
the full set of GPU nodes and on every one of their GPUs being free. Everything in this
module is pure except for the callables handed to ``wait_for_cluster``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_dp_launcher import stages
from vllm_dp_launcher.errors import ClusterNotReadyError, GpusHeldError
from vllm_dp_launcher.holders import HolderReport
from vllm_dp_launcher.plan import LaunchPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuNode:
    """An alive Ray node that offers GPUs."""

    node_id: str
    ip: str
    gpus: int
    free_gpus: float | None = None  # available right now; None: not known (taken as all)

    @property
    def busy_gpus(self) -> float:
        """GPUs of this node that something holds (placement groups, actors, tasks)."""
        return 0.0 if self.free_gpus is None else max(0.0, self.gpus - self.free_gpus)

    def describe(self, own_ip: str | None = None) -> str:
        """Return e.g. ``127.0.0.3 (node 1a2b3c4d, 4 GPUs)`` (plus how many are in use)."""
        mine = ", this node" if self.ip == own_ip else ""
        busy = f", {self.busy_gpus:g} in use" if self.busy_gpus > 0 else ""
        return f"{self.ip} (node {self.node_id[:8]}, {self.gpus} GPUs{busy}{mine})"


def gpu_nodes(
    ray_nodes: Iterable[Mapping[str, Any]],
    available: Mapping[str, Mapping[str, float]] | None = None,
) -> list[GpuNode]:
    """Select the alive GPU nodes from ``ray.nodes()``, with ``available`` GPUs per node id."""
    found = [
        GpuNode(
            node_id=str(n["NodeID"]),
            ip=str(n["NodeManagerAddress"]),
            gpus=int(n.get("Resources", {}).get("GPU", 0)),
            free_gpus=(
                None
                if available is None
                else float(available.get(str(n["NodeID"]), {}).get("GPU", 0.0))
            ),
        )
        for n in ray_nodes
        if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0
    ]
    return sorted(found, key=lambda node: (node.ip, node.node_id))


@dataclass(frozen=True)
class ClusterProgress:
    """How far the cluster is from the plan's GPU node and GPU counts."""

    nodes: int
    expected_nodes: int
    gpus: int
    expected_gpus: int
    busy: float = 0.0

    @property
    def ready(self) -> bool:
        """True when the planned GPU nodes and GPUs are all present (free or not)."""
        return self.nodes >= self.expected_nodes and self.gpus >= self.expected_gpus

    def summary(self) -> str:
        """Return e.g. ``2/3 GPU nodes, 8/12 GPUs`` (plus ``, 4 in use`` when some are)."""
        busy = f", {self.busy:g} in use" if self.busy > 0 else ""
        return (
            f"{self.nodes}/{self.expected_nodes} GPU nodes, "
            f"{self.gpus}/{self.expected_gpus} GPUs{busy}"
        )


def progress(plan: LaunchPlan, nodes: list[GpuNode]) -> ClusterProgress:
    """Compare the present GPU nodes with the plan."""
    return ClusterProgress(
        nodes=len(nodes),
        expected_nodes=plan.gpu_pods,
        gpus=sum(n.gpus for n in nodes),
        expected_gpus=plan.total_gpus,
        busy=sum(n.busy_gpus for n in nodes),
    )


def describe_held(state: ClusterProgress, report: HolderReport, live_only: bool) -> str:
    """Say which GPUs are in use, by whom, and why the launch cannot go ahead."""
    holders = HolderReport(report.live) if live_only else report
    return (
        f"{state.busy:g} of the cluster's {state.gpus} GPU(s) are in use, and vLLM's placement "
        f"would wait for them forever: {holders.describe()}. The previous head job must be "
        "stopped (ray job stop <submission id>) before a new launch"
    )


def describe_missing(plan: LaunchPlan, nodes: list[GpuNode], own_ip: str | None) -> str:
    """Say what the cluster lacks compared with the plan, and what it has."""
    state = progress(plan, nodes)
    missing_nodes = max(0, state.expected_nodes - state.nodes)
    missing_gpus = max(0, state.expected_gpus - state.gpus)
    parts = [f"missing {missing_nodes} GPU node(s) and {missing_gpus} GPU(s)"]
    own_present = any(n.ip == own_ip for n in nodes)
    workers_planned = sum(1 for p in plan.pods if p.role == "worker")
    workers_present = len(nodes) - (1 if own_present else 0)
    if own_ip is not None and not own_present:
        parts.append(f"the head pod's node {own_ip} (where the launcher runs) offers no GPUs")
    if workers_present < workers_planned:
        absent = workers_planned - workers_present
        parts.append(
            f"{absent} of {workers_planned} worker GPU pod(s) "
            f"({plan.gpus_per_pod} GPUs each) have not joined"
        )
    present = ", ".join(n.describe(own_ip) for n in nodes) or "none"
    parts.append(f"GPU nodes present: {present}")
    return "; ".join(parts)


def layout_problems(plan: LaunchPlan, nodes: list[GpuNode], own_ip: str) -> list[str]:
    """Return why vLLM's placement would fail on these nodes for this plan (empty: fits)."""
    world = plan.tensor_parallel_size
    own = [n for n in nodes if n.ip == own_ip]
    problems: list[str] = []
    if not own:
        return [
            f"the launcher's node {own_ip} offers no GPUs; vllm serve must run on a GPU node "
            "(the head pod must be a GPU pod)"
        ]
    if plan.pack_strategy == "span":
        own_needed, others_rule = plan.head_pod.gpus, "exactly"
    else:
        own_needed, others_rule = plan.ranks_per_node * world, "at least"
    if plan.pack_strategy == "span" and own[0].gpus != own_needed:
        problems.append(
            f"this node {own[0].describe(own_ip)} must hold exactly {own_needed} GPUs "
            f"(the head pod's GPUs for packStrategy span)"
        )
    elif own[0].gpus < own_needed:
        problems.append(
            f"this node {own[0].describe(own_ip)} must hold at least {own_needed} GPUs "
            f"({plan.ranks_per_node} ranks x tensor parallel {world})"
        )
    if plan.pack_strategy == "strict":
        other_needed = plan.ranks_per_node * world
    elif plan.pack_strategy == "fill":
        other_needed = world
    else:
        other_needed = plan.gpus_per_pod
    for node in nodes:
        if node.ip == own_ip:
            continue
        short = node.gpus < other_needed
        if short or (others_rule == "exactly" and node.gpus != other_needed):
            problems.append(
                f"GPU node {node.describe(own_ip)} must hold {others_rule} {other_needed} GPUs "
                f"for packStrategy {plan.pack_strategy}"
            )
    return problems


def no_holders() -> HolderReport:
    """The ``find_holders`` default: nothing can be asked."""
    return HolderReport(error="no way to ask Ray was given")


def wait_for_cluster(
    plan: LaunchPlan,
    list_nodes: Callable[[], list[GpuNode]],
    own_ip: str,
    timeout: float,
    progress_interval: float,
    find_holders: Callable[[], HolderReport] = no_holders,
    poll_interval: float = 0.2,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> list[GpuNode]:
    """Poll until the planned GPU nodes are present with all their GPUs free.

    GPUs held by a job whose driver still runs (a stale ``vllm serve``) fail the launch at
    once, naming the job; GPUs that are being released are waited for, within ``timeout``.
    """
    start = clock()
    next_report = start
    current = stages.WAITING_FOR_CLUSTER
    stages.enter(current, nodes=plan.gpu_pods, gpus=plan.total_gpus, timeout=f"{timeout:g}")
    while True:
        nodes = list_nodes()
        state = progress(plan, nodes)
        now = clock()
        if state.ready and state.busy <= 0:
            log.info("Ray cluster ready: %s", state.summary())
            return nodes
        report = find_holders() if state.ready else None
        if report is not None and report.live:
            raise GpusHeldError(describe_held(state, report, live_only=True))
        stage = stages.WAITING_FOR_CLUSTER if report is None else stages.WAITING_FOR_FREE_GPUS
        if stage != current:
            current = stage
            stages.enter(
                stage,
                nodes=f"{state.nodes}/{state.expected_nodes}",
                gpus=f"{state.gpus}/{state.expected_gpus}",
                busy=f"{state.busy:g}",
            )
        if now - start >= timeout:
            if report is not None:
                raise GpusHeldError(
                    f"timed out after {timeout:g}s waiting for GPUs to be released: "
                    + describe_held(state, report, live_only=False)
                )
            raise ClusterNotReadyError(
                f"timed out after {timeout:g}s waiting for the Ray cluster: {state.summary()}; "
                f"{describe_missing(plan, nodes, own_ip)}"
            )
        if now >= next_report:
            if report is None:
                log.info("waiting for the Ray cluster: %s", state.summary())
            else:
                log.info("waiting for GPUs to be released: %s; %s", state.summary(),
                         report.describe())  # fmt: skip
            next_report = now + progress_interval
        sleep(min(poll_interval, max(0.0, start + timeout - now)))
