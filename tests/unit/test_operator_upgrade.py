"""An operator upgrade restarts nothing; the user asks for new engines (a spec change, or
`vllmdp.io/restartedAt`), and only so many resources update at once (issue 38, item 1).

Before the fix, the shape hash of a serving cluster was compared with the operator's current
render: a new default image, NIC or fsGroup (or a new release's pod template) replaced every
RayCluster of every resource that named none, all at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from vllm_dp_operator import constants as c
from vllm_dp_operator.config import RenderOptions, update_limit
from vllm_dp_operator.controller.update_slots import UpdateSlots
from world import World, serving, spec

#: What a `helm upgrade` may change operator-wide: the default image, the NIC, the fsGroup.
UPGRADED = RenderOptions(default_image="vllm-dp-engine:0.2.0", socket_ifname="ens5",
                         fs_group=3000)  # fmt: skip


def surge(**over: Any) -> dict[str, Any]:
    return spec(update={"strategy": "Surge", "drainSeconds": 30},
                launch={"timeoutSeconds": 300}, **over)  # fmt: skip


def rolling(**over: Any) -> dict[str, Any]:
    return spec(replicas=2, update={"strategy": "RollingUpdate"}, **over)


def live(w: World) -> list[tuple[str, str]]:
    """(name, uid) of every live RayCluster."""
    return sorted((cl["metadata"]["name"], cl["metadata"]["uid"]) for cl in w.clusters()
                  if not cl["metadata"].get("deletionTimestamp"))  # fmt: skip


def image_of(cluster: dict[str, Any]) -> str:
    return str(cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"])


def upgrade(w: World) -> None:
    """Restart the operator with other operator-wide render inputs."""
    w.cfg = dataclasses.replace(w.cfg, render=UPGRADED)


async def all_serving(raw: dict[str, Any]) -> World:
    if raw.get("replicas", 1) == 1:
        return await serving(raw)
    w = World(raw)
    w.probe.ok = True
    for _ in range(4):  # replicas beyond the first come up too
        w.cluster_ready()
        for job in w.job_names():
            w.run(job)
        await w.step(1)
    assert w.status["readyReplicas"] == raw.get("replicas", 1), w.status
    return w


@pytest.mark.parametrize("raw", [spec(), surge(), rolling()], ids=["Recreate", "Surge",
                                                                   "RollingUpdate"])
async def test_an_operator_upgrade_replaces_no_cluster_and_relaunches_no_job(
    raw: dict[str, Any],
) -> None:
    w = await all_serving(raw)
    clusters, jobs = live(w), w.job_names()
    upgrade(w)
    for _ in range(3):
        await w.step(30)
    assert live(w) == clusters and w.job_names() == jobs
    assert w.ray.stops == [] and "update" not in w.status
    assert w.status["phase"] == c.PHASE_SERVING
    assert w.status["updatedReplicas"] == w.status["replicas"] == raw.get("replicas", 1)
    conds = {cond["type"]: cond for cond in w.status["conditions"]}
    assert conds.get(c.COND_UPDATED, {}).get("status", "True") == "True"
    assert all(image_of(cl) == "vllm-dp-engine:0.1.0" for cl in w.clusters())


async def test_a_cluster_made_before_the_annotation_is_kept_and_then_annotated() -> None:
    w = await serving()
    for cl in w.clusters():  # as an earlier release made it
        cl["metadata"].pop("annotations", None)
    clusters = live(w)
    upgrade(w)
    await w.step(30)
    await w.step(30)
    assert live(w) == clusters and w.job_names() == ["demo-j00001"]
    [cluster] = w.clusters()
    assert cluster["metadata"]["annotations"][c.ANNOTATION_ACCEPTED] == "1/"


async def test_a_spec_change_after_the_upgrade_brings_the_new_defaults() -> None:
    w = await serving()
    [(old, _)] = live(w)
    upgrade(w)
    await w.step(30)
    w.update(spec(engineArgs=["--max-model-len", "4096"]))
    await w.step(1)
    [(new, _)] = live(w)
    assert new != old
    [cluster] = [cl for cl in w.clusters() if cl["metadata"]["name"] == new]
    assert image_of(cluster) == "vllm-dp-engine:0.2.0"
    assert cluster["metadata"]["annotations"][c.ANNOTATION_ACCEPTED] == "2/"


async def test_restarted_at_replaces_the_pods_under_recreate_and_surges_under_surge() -> None:
    w = await serving()
    [(old, _)] = live(w)
    upgrade(w)
    w.restarted_at = "2026-12-06T10:00:00Z"
    await w.step(1)
    [(new, _)] = live(w)
    assert new != old
    [cluster] = w.clusters()
    assert image_of(cluster) == "vllm-dp-engine:0.2.0"
    assert cluster["metadata"]["annotations"][c.ANNOTATION_ACCEPTED] == (
        "1/2026-12-06T10:00:00Z")

    s = await serving(surge())
    [(old, _)] = live(s)
    s.restarted_at = "2026-12-06T10:00:00Z"
    await s.step(1)
    assert s.status["update"]["phase"] == "Starting" and s.status["update"]["from"] == old
    assert s.status["phase"] == c.PHASE_SERVING


class Refused:
    """Every slot taken by other resources."""

    def take(self, key: tuple[str, str]) -> bool:
        return False


async def test_without_a_free_update_slot_the_resource_serves_on_update_pending() -> None:
    w = await serving(surge())
    clusters = live(w)
    w.slots = Refused()
    w.update(surge(engineArgs=["--max-model-len", "4096"]))
    await w.step(1)
    out = await w.step(1)
    assert out.retry_after is not None and out.retry_after <= 10  # it asks again
    assert live(w) == clusters and "update" not in w.status and "rollout" not in w.status
    assert w.status["phase"] == c.PHASE_SERVING and w.routed()
    conds = {cond["type"]: cond for cond in w.status["conditions"]}
    assert (conds[c.COND_UPDATED]["status"], conds[c.COND_UPDATED]["reason"]) == (
        "False", c.REASON_UPDATE_PENDING)
    assert "update slots" in conds[c.COND_UPDATED]["message"]

    w.slots = UpdateSlots("1", lambda: [], lambda: 1)
    await w.step(1)
    assert w.status["update"]["phase"] == "Starting"
    assert w.status["rollout"]["asked"] == "2/"
    new = w.status["update"]["to"]
    w.cluster_ready()
    await w.step(5)
    w.run("demo-j00002")
    await w.step(5)
    assert w.status["update"]["phase"] == "Draining" and w.status["rayCluster"] == new
    await w.step(31)
    w.ray.jobs["demo-j00001"] = "STOPPED"
    for _ in range(3):
        await w.step(1)
    assert "update" not in w.status and "rollout" not in w.status  # the slot went back


async def test_a_resource_that_does_not_serve_needs_no_slot() -> None:
    w = World()
    w.slots = Refused()
    await w.step()
    w.update(spec(engineArgs=["--max-model-len", "4096"]))
    await w.step(1)
    assert "rollout" not in w.status
    conds = {cond["type"]: cond for cond in w.status["conditions"]}
    assert conds.get(c.COND_UPDATED, {}).get("reason") != c.REASON_UPDATE_PENDING


def test_update_slots_count_holders_and_grants_up_to_the_limit() -> None:
    holders: list[tuple[str, str]] = [("a", "x")]
    slots = UpdateSlots("2", lambda: holders, lambda: 50)
    assert slots.take(("a", "x"))  # holds one already
    assert slots.take(("b", "y"))  # the second
    assert not slots.take(("c", "z"))
    slots.written(("b", "y"))  # its status did not take it after all
    assert slots.take(("c", "z"))
    assert UpdateSlots("10%", lambda: [], lambda: 50).limit() == 5
    assert UpdateSlots("10%", lambda: [], lambda: 3).limit() == 1
    assert UpdateSlots("0", lambda: holders * 9, lambda: 9).take(("q", "r"))


@pytest.mark.parametrize("raw", ["-1", "abc", "0%", "150%", "1.5"])
def test_a_bad_update_limit_is_refused_naming_the_variable(raw: str) -> None:
    with pytest.raises(ValueError, match="VLLMDP_MAX_CONCURRENT_UPDATES"):
        update_limit(raw)
