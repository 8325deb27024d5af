"""Deletion under faults: resources deleted while the operator is down leave nothing behind.

Owner references let the garbage collector take the children with no operator running. One
resource carries the finalizer that versions before the event-driven controller added: it
stays Terminating while the operator is down, and the restarted operator releases it (as the
README says this version does), after which it and its children go too.
"""

from __future__ import annotations

import json
import signal
from typing import Any

import pytest
from fleet import converged, explain, get, own_nodes, small
from operator_proc import OperatorProcess
from vllm_dp_operator import constants as c

pytestmark = pytest.mark.reliability

LEGACY_FINALIZER = f"{c.GROUP}/finalizer"


def _left(testbed: Any, ns: str) -> dict[str, list[str]]:
    kinds = ("vdp", "rayclusters", "rayjobs", "services", "pods")
    found = {k: [o["metadata"]["name"] for o in get(testbed, ns, k)] for k in kinds}
    return {k: v for k, v in found.items() if v}


def test_delete_while_operator_down_leaves_nothing_and_releases_the_finalizer(
    testbed: Any, testbed_namespace: str, operator: OperatorProcess
) -> None:
    ns = testbed_namespace
    with own_nodes(testbed, ns, gpus=6):
        testbed.apply([small(ns, f"d{i}") for i in range(3)])
        try:
            testbed.wait_until("three resources to converge", lambda: converged(testbed, ns, 3),
                               timeout=120)  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{explain(testbed, ns, operator)}") from exc
        # Killed first: a live operator would release the finalizer as soon as it saw it.
        operator.kill(signal.SIGKILL)
        testbed.kubectl("-n", ns, "patch", "vdp", "d0", "--type=merge", "-p",
                        json.dumps({"metadata": {"finalizers": [LEGACY_FINALIZER]}}))
        testbed.kubectl("-n", ns, "delete", "vdp", "--all", "--wait=false")
        try:
            testbed.wait_until("d1 and d2 gone, d0 held by its finalizer", lambda: [
                o["metadata"]["name"] for o in get(testbed, ns, "vdp")] == ["d0"], timeout=30)
            testbed.wait_until("the children of d1 and d2 collected", lambda: not any(
                n.startswith(("d1-", "d2-")) for names in _left(testbed, ns).values()
                for n in names), timeout=60)  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nleft: {_left(testbed, ns)}") from exc
        assert get(testbed, ns, "vdp")[0]["metadata"].get("deletionTimestamp")

        operator.start()
        try:
            testbed.wait_until("nothing left", lambda: not _left(testbed, ns), timeout=90)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nleft: {_left(testbed, ns)}\n"
                                 f"{operator.log_tail()}") from exc
