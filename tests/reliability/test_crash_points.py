"""R1: SIGKILL the operator at 20 points of 50 resources' reconciles, restart it each time.

The points are chosen by count, not by sleeps: the test follows the children on its own watch
and kills the operator right after it sees the k-th child made by the operator since its last
start (k = 6, 7, 8, 0 in turn; 0 kills it while it lists and fills its caches). Of the 150
children (a RayCluster, a Service and a head RayJob each) about 105 are made under the schedule,
so the kills land between a resource's first create and its last, before and after status
patches, and during head-job creation.
After the last restart every resource converges. The watch also shows that no child was ever
created twice, which is stronger than counting at the end.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fleet import QUIET, audit, converged, explain, own_nodes, small
from kubernetes_asyncio import client, config
from operator_proc import OperatorProcess, install_crd
from vllm_dp_operator import constants as c
from vllm_dp_operator.controller.kube import RAYCLUSTER, RAYJOB, SERVICE, ApiKube
from watchlog import WatchLog

pytestmark = pytest.mark.reliability

RESOURCES = 50
POINTS = 20
# Kill after this many creates by the incarnation just started, in turn: about 105 of the 150
# creates happen under the schedule, the rest after the last restart.
SCHEDULE = (6, 7, 8, 0)
CHILDREN = 3 * RESOURCES
# Two workers, not 16: a kill lands within a create or two of its point instead of after a
# dozen concurrent ones, so the points spread over the whole reconcile.
WORKERS = {"VLLMDP_WORKERS": "2"}


@pytest.fixture
def operator(testbed: Any, testbed_namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    install_crd(testbed)
    op = OperatorProcess(testbed.env(), tmp_path / "operator.log", {**QUIET, **WORKERS})
    op.namespace = testbed_namespace
    yield op
    op.stop()


def _ours(obj: dict[str, Any]) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return labels.get(c.LABEL_MANAGED_BY) == c.MANAGER


async def _crash_points(testbed: Any, ns: str, op: OperatorProcess) -> list[int]:
    await config.load_kube_config(str(testbed.kubeconfig))
    async with (client.ApiClient() as raw,
                WatchLog(ApiKube(raw), ns, [RAYCLUSTER, SERVICE, RAYJOB]) as log):
        await asyncio.to_thread(op.start)

        def created() -> int:
            return sum(1 for s in log.seen if s.type == "ADDED" and _ours(s.obj))

        # The burst goes in while the first crash point is counted (kubectl takes a while).
        burst = asyncio.create_task(asyncio.to_thread(
            testbed.apply, [small(ns, f"r{i:02d}") for i in range(RESOURCES)]))
        killed_at = []
        for point in range(POINTS):
            # The k-th create of this incarnation; k = 0 kills it as soon as it is live, while
            # it lists and fills its caches. Once every child exists, k is 0.
            start = created()
            k = min(SCHEDULE[point % len(SCHEDULE)], CHILDREN - start)
            await log.wait_until(f"crash point {point + 1}: {k} creates after {start}",
                                 lambda k=k, start=start: created() >= start + k, timeout=120)
            op.kill(signal.SIGKILL)
            killed_at.append(created())
            await burst
            await asyncio.to_thread(op.start)
        await asyncio.to_thread(testbed.wait_until, "every resource to converge",
                                lambda: converged(testbed, ns, RESOURCES), 240, 1.0)
        # The watch's record of every create: none twice for one resource.
        made = Counter((s.kind.plural, s.obj["metadata"]["labels"].get(c.LABEL_INSTANCE))
                       for s in log.seen if s.type == "ADDED" and _ours(s.obj))
    twice = {k: n for k, n in made.items() if n > 1}
    assert not twice, f"children created more than once: {twice}"
    assert len(made) == CHILDREN, f"expected one of each child per resource: {len(made)}"
    return killed_at


def test_sigkill_at_20_points_converges_without_duplicates_or_orphans(
    testbed: Any, testbed_namespace: str, operator: OperatorProcess
) -> None:
    ns = testbed_namespace
    with own_nodes(testbed, ns, gpus=2 * RESOURCES):
        try:
            killed_at = asyncio.run(_crash_points(testbed, ns, operator))
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{explain(testbed, ns, operator)}") from exc
        report = audit(testbed, ns)
        sys.stderr.write(f"\n[R1] resources {RESOURCES}; crash points tried {len(killed_at)} "
                         f"(after children {killed_at}); converged {report['resources']}; "
                         f"orphans {len(report['orphans'])}; duplicate events "
                         f"{len(report['duplicate_events'])}\n")  # fmt: skip
        assert len(killed_at) == POINTS
        assert report["resources"] == RESOURCES
        assert not report["orphans"], report
        assert not report["not_one_each"], report
        assert not report["duplicate_events"], report
        testbed.kubectl("-n", ns, "delete", "vdp", "--all", "--wait=false")
