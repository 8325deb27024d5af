"""Events: every phase transition posts exactly one PhaseChanged event, and a resource whose
phase holds posts none (at the reconcile, and through the controller with its status writer)."""

from __future__ import annotations

from vllm_dp_operator import constants as c
from world import World, spec


def _phase_events(w: World) -> list[str]:
    return [m for _, r, m in w.events if r == c.REASON_PHASE_CHANGED]


async def test_each_transition_posts_one_event_and_steady_posts_none() -> None:
    w = World(spec(dataParallel={"size": 2, "ranksPerNode": 1}))
    await w.step()
    assert w.status["phase"] == c.PHASE_PROVISIONING
    for _ in range(3):  # nothing changes: no event at all
        before = len(w.events)
        await w.step(1)
        assert len(w.events) == before
    w.cluster_ready()
    await w.step()
    assert w.status["phase"] == c.PHASE_LAUNCHING
    w.run("demo-j00001")
    w.probe.ok = True
    await w.step()
    assert w.status["phase"] == c.PHASE_SERVING
    steady = len(w.events)
    for _ in range(5):  # Serving, probed at its cadence: no events
        await w.step(30)
    assert len(w.events) == steady
    w.job_status("demo-j00001", jobStatus="FAILED", jobDeploymentStatus="Failed")
    await w.step()
    assert w.status["phase"] == c.PHASE_BACKOFF
    transitions = [m.split(":")[0] for m in _phase_events(w)]
    assert transitions == ["New -> Provisioning", "Provisioning -> Launching",
                           "Launching -> Serving", "Serving -> Backoff"]
    assert all(t == c.EVENT_NORMAL for t, r, _ in w.events if r == c.REASON_PHASE_CHANGED)


async def test_invalid_spec_posts_one_phase_event_however_often_reconciled() -> None:
    w = World(spec(dataParallel={"size": 1}))
    for _ in range(4):
        await w.step(10)
    assert w.status["phase"] == c.PHASE_INVALID
    assert w.reasons().count(c.REASON_PHASE_CHANGED) == 1
    assert w.reasons().count(c.REASON_INVALID_SPEC) == 1


async def test_through_the_controller_reruns_and_a_restart_post_no_phase_event_again() -> None:
    """The previous phase is the status the controller's reconcile reads (the status writer's
    view): a reconcile run again, and a new operator reading the persisted status, post no
    second PhaseChanged."""
    from test_controller import KEY, Bed
    from vllm_dp_operator.controller.kube import RAYCLUSTER, RAYJOB

    first = Bed()
    first.ctl.start()
    try:
        first.add_owner()
        await first.until("the RayCluster", lambda: first.names(RAYCLUSTER), timeout=5)
        first.cluster_ready()
        await first.until("the head job", lambda: first.names(RAYJOB), timeout=5)
        await first.settle()
        for _ in range(3):
            await first.ctl.process(KEY)
        changes = [e.message.split(":")[0] for e in first.events
                   if e.reason == c.REASON_PHASE_CHANGED]  # fmt: skip
        assert changes == ["New -> Provisioning", "Provisioning -> Launching"]
        assert first.status()["phase"] == c.PHASE_LAUNCHING
    finally:
        await first.ctl.stop()
    second = Bed(api=first.api)
    second.ctl.start()
    try:
        second.kopf_event(None)
        await second.until("a reconcile", lambda: second.ctl.reconciles >= 1, timeout=5)
        await second.settle()
        assert not [e for e in second.events if e.reason == c.REASON_PHASE_CHANGED]
    finally:
        await second.ctl.stop()
