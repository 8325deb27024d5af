"""healthProbe.mode off: the operator sends no probe, and the launcher's report routes."""

from __future__ import annotations

from dataclasses import replace

from vllm_dp_launcher import stages
from vllm_dp_operator import constants as c
from world import CFG, launched


async def test_probes_off_routes_on_the_launchers_report_alone() -> None:
    w = await launched()
    w.cfg = replace(CFG, health_probe="off")
    w.run("demo-j00001")
    w.probe.ok = True  # what a probe would say: never asked
    await w.step()
    assert not w.routed() and w.status["phase"] == c.PHASE_LAUNCHING
    assert "waiting for the launcher" in w.status["message"]
    w.probe.stages["demo-j00001"] = stages.ENGINE_STARTING
    await w.step()
    assert not w.routed() and "its last stage: engine-starting" in w.status["message"]
    w.probe.stages["demo-j00001"] = stages.SERVING
    await w.step()
    assert w.routed() and w.status["phase"] == c.PHASE_SERVING
    assert w.probe.calls == [], "no probe is sent with probes off"
    # Served: it stays routed while its head job runs, with no report followed any more.
    followed = len(w.probe.followed)
    for _ in range(3):
        await w.step(advance=60)
    assert w.routed() and w.status["phase"] == c.PHASE_SERVING
    assert len(w.probe.followed) == followed
    # Its end unroutes at once, and the next head job waits for its own report.
    w.job_status("demo-j00001", jobStatus="FAILED", jobDeploymentStatus="Failed")
    w.ray.jobs["demo-j00001"] = "FAILED"
    await w.step()
    assert not w.routed()


async def test_a_launch_not_served_yet_has_its_report_followed_with_probes_on() -> None:
    w = await launched()
    w.run("demo-j00001")
    await w.step()
    assert w.probe.followed[-1] == "demo-j00001"
    w.probe.ok = True
    await w.step()
    assert w.routed()
    followed = len(w.probe.followed)
    await w.step(advance=30)
    assert len(w.probe.followed) == followed, "a head job that served is not followed"


async def test_a_head_container_not_running_yet_is_not_followed() -> None:
    # A follow asked of a container that has not started fails, and each failure waits
    # longer before the next (launch_reports.py): a replaced head pod's report would come
    # late. The follow starts once the head container runs, and a follow then stays open.
    w = await launched()
    w.run("demo-j00001")
    [head] = [p for p in w.kube.objects.values() if p["metadata"]["name"].endswith("-head-0")]
    head["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": "PodInitializing"}}
    await w.step()
    assert w.probe.followed == []
    head["status"]["containerStatuses"][0]["state"] = {"running": {}}
    await w.step()
    assert w.probe.followed[-1] == "demo-j00001"
