"""An operator upgrade restarts nothing, and restarts the user asks for go a few at a time.

Twenty resources serve (kwok GPU nodes of their own, vLLM's /health double in the pod
network). The operator is stopped and started again with another default engine image, NIC
name and fsGroup, as `helm upgrade --set engineImage=...,socketIfname=...,engineFsGroup=...`
would: no RayCluster is replaced (uids compared, polled every 2 s for
VLLMDP_UPGRADE_HOLD_SECONDS, 60 by default). Then five resources get `vllmdp.io/restartedAt`:
exactly those five get new RayClusters, with the new defaults, and no more than the
operator's update slots (the default 10 % of 20: two) update at once. "At once" is read from
watches, not polls (a Recreate on kwok nodes takes a few seconds, less than a poll of three
lists under load): every status the API server stored (the slot, `status.rollout`, and
whether the resource serves) and every RayCluster event (resources with no live cluster).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fleet import get, own_nodes, small, watched
from operator_proc import OperatorProcess, install_crd
from scenario import double_in_pod_network
from vllm_dp_operator import constants as c

pytestmark = pytest.mark.reliability

COUNT, RESTARTED, SLOTS = 20, 5, 2
HOLD = float(os.environ.get("VLLMDP_UPGRADE_HOLD_SECONDS") or 60)
UPGRADE = {"VLLMDP_ENGINE_IMAGE": "vllm-dp-engine:0.2.0", "VLLMDP_SOCKET_IFNAME": "ens5",
           "VLLMDP_ENGINE_FS_GROUP": "3000"}  # fmt: skip


def clusters(testbed: Any, ns: str) -> dict[str, tuple[str, str]]:
    """Each resource's live RayCluster: (name, uid)."""
    out = {}
    for cl in get(testbed, ns, "rayclusters"):
        meta = cl["metadata"]
        if not meta.get("deletionTimestamp"):
            out[meta["labels"][c.LABEL_INSTANCE]] = (meta["name"], meta["uid"])
    return out


def serving(testbed: Any, ns: str) -> dict[str, dict[str, Any]]:
    """The status of each resource that serves (routed, one replica ready)."""
    return {o["metadata"]["name"]: o["status"] for o in get(testbed, ns, "vdp")
            if (o.get("status") or {}).get("phase") == "Serving"
            and o["status"].get("readyReplicas") == 1}  # fmt: skip


def held_slot(obj: dict[str, Any]) -> bool:
    return bool((obj.get("status") or {}).get("rollout"))


def down(obj: dict[str, Any]) -> bool:
    st = obj.get("status") or {}
    return st.get("phase") != "Serving" or st.get("readyReplicas") != 1


def most_at_once(events: list[dict[str, Any]], holds: Callable[[dict[str, Any]], bool]) -> int:
    """The most VLLMDataParallels at once, over a watch's events, for which `holds` is true."""
    state: dict[str, bool] = {}
    most = 0
    for event in events:
        obj = event["object"]
        state[obj["metadata"]["name"]] = event["type"] != "DELETED" and holds(obj)
        most = max(most, sum(state.values()))
    return most


def most_without_cluster(events: list[dict[str, Any]]) -> int:
    """The most resources at once, over a watch's RayCluster events, with no live cluster
    (Recreate, the default strategy, deletes the old one before it makes the new one)."""
    live: dict[str, set[str]] = {}
    most = 0
    for event in events:
        meta = event["object"]["metadata"]
        mine = live.setdefault(meta["labels"][c.LABEL_INSTANCE], set())
        if event["type"] == "DELETED" or meta.get("deletionTimestamp"):
            mine.discard(meta["name"])
        else:
            mine.add(meta["name"])
        most = max(most, sum(1 for names in live.values() if not names))
    return most


def start(testbed: Any, ns: str, log: Path, extra: dict[str, str] | None = None
          ) -> OperatorProcess:  # fmt: skip
    op = OperatorProcess(testbed.env(), log, extra)
    op.namespace = ns
    op.start()
    return op


def wait(testbed: Any, op: OperatorProcess, what: str, check: Any, timeout: float) -> None:
    """Poll every second; a timeout says what the operator logged last."""
    try:
        testbed.wait_until(what, check, timeout=timeout, interval=1)
    except AssertionError as err:
        raise AssertionError(f"{err}\noperator log:\n{op.log_tail()}") from None


def test_an_operator_upgrade_replaces_nothing_and_restarts_take_turns(
    testbed: Any, testbed_namespace: str, tmp_path: Path
) -> None:
    ns, log = testbed_namespace, tmp_path / "operator.log"
    install_crd(testbed)
    with own_nodes(testbed, ns, COUNT * 2), \
            double_in_pod_network(testbed, "health_server.py", 8000):  # fmt: skip
        op = start(testbed, ns, log)
        try:
            testbed.apply([small(ns, f"r{i:02d}") for i in range(COUNT)])
            wait(testbed, op, f"{COUNT} resources Serving",
                 lambda: len(serving(testbed, ns)) == COUNT, 300)
            before = clusters(testbed, ns)
            assert len(before) == COUNT
        finally:
            op.stop()

        op = start(testbed, ns, log, UPGRADE)
        try:
            ends = time.monotonic() + HOLD
            while time.monotonic() < ends:
                now = clusters(testbed, ns)
                replaced = {n: (before[n], now.get(n)) for n in before if now.get(n) != before[n]}
                assert not replaced, f"replaced after the upgrade: {replaced}\n{op.log_tail()}"
                time.sleep(2)
            assert len(serving(testbed, ns)) == COUNT

            names = [f"r{i:02d}" for i in range(RESTARTED)]
            with (watched(testbed, ns, "vdp", tmp_path / "vdp.watch") as statuses,
                  watched(testbed, ns, "rayclusters", tmp_path / "rc.watch") as children):
                for name in names:
                    testbed.kubectl("-n", ns, "annotate", "vdp", name,
                                    f"{c.ANNOTATION_RESTARTED_AT}=2026-12-06T10:00:00Z")

                def restarted() -> bool:
                    objs = {o["metadata"]["name"]: o.get("status") or {}
                            for o in get(testbed, ns, "vdp")}  # fmt: skip
                    now, up = clusters(testbed, ns), serving(testbed, ns)
                    return all(now.get(n) not in (None, before[n]) and n in up
                               and not objs[n].get("rollout") for n in names)  # fmt: skip

                wait(testbed, op, f"{RESTARTED} restarted resources serving again", restarted,
                     300)  # fmt: skip
            holding, unready = most_at_once(statuses, held_slot), most_at_once(statuses, down)
            bare = most_without_cluster(children)
            print(f"\n[upgrade] at most {holding} resources held a slot, {unready} did not "
                  f"serve, {bare} had no RayCluster ({len(statuses)} and {len(children)} watch "
                  "events)")  # fmt: skip
            said = f"(watches in {tmp_path})\noperator log:\n{op.log_tail()}"
            assert 1 <= holding <= SLOTS, f"{holding} resources held an update slot at once {said}"
            assert 1 <= unready <= SLOTS, f"{unready} resources did not serve at once {said}"
            assert 1 <= bare <= SLOTS, f"{bare} resources had no RayCluster at once {said}"
            now = clusters(testbed, ns)
            assert {n for n in before if now.get(n) != before[n]} == set(names)
            for cl in get(testbed, ns, "rayclusters"):
                labels = cl["metadata"]["labels"]
                if labels[c.LABEL_INSTANCE] in names and not cl["metadata"].get(
                        "deletionTimestamp"):
                    image = cl["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
                    assert image["image"] == UPGRADE["VLLMDP_ENGINE_IMAGE"]
            assert len(serving(testbed, ns)) == COUNT
        finally:
            op.stop()
