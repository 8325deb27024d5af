"""Children's events drive the reconcile: KubeRay's changes are answered within a second.

The operator here has its safety resync and its /health cadence set to an hour, and relaunches
with no backoff, so whatever it does within the test's deadlines was caused by a watch event.
Both ends of each interval are taken on this test's own watch of the same API server.

The test bed's KubeRay cannot reach a Ray dashboard (HTTPMode submissions never arrive), so it
never fails a head job by itself: the test writes the Failed status KubeRay writes when a Ray
job fails. With no dashboard there is nothing to confirm a stop with either, so the operator
runs without pod HTTP access and with no stop-confirmation wait: it gives up on the old job's
stop at once, and what is timed is its reaction to the event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio import client, config
from operator_proc import OperatorProcess, install_crd
from vllm_dp_operator.api.validation import validate
from vllm_dp_operator.controller.kube import RAYCLUSTER, RAYJOB, VDP, ApiKube
from vllm_dp_operator.engines.jobstate import JobState, job_state
from vllm_dp_operator.plan import build_plan
from vllm_dp_operator.reconcile.status import cluster_readiness
from watchlog import Seen, WatchLog

pytestmark = pytest.mark.controlplane

REPO = Path(__file__).resolve().parents[2]
QUIET = {"VLLMDP_RESYNC_SECONDS": "3600", "VLLMDP_PROBE_LAUNCHING_SECONDS": "3600",
         "VLLMDP_PROBE_SERVING_SECONDS": "3600", "VLLMDP_BACKOFF_BASE_SECONDS": "0",
         "VLLMDP_HEALTH_PROBE": "off", "VLLMDP_STOP_CONFIRM_SECONDS": "0"}


@pytest.fixture(scope="module")
def quiet_operator(testbed: Any, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[OperatorProcess]:  # fmt: skip
    install_crd(testbed)
    proc = OperatorProcess(testbed.env(), tmp_path_factory.mktemp("op") / "operator.log", QUIET)
    proc.start()
    yield proc
    proc.stop()


async def _scenario(kubeconfig: Path, ns: str, doc: dict[str, Any]) -> dict[str, float]:
    await config.load_kube_config(str(kubeconfig))
    name = doc["metadata"]["name"]
    workers = build_plan(validate(name, doc["spec"])).worker_pods
    async with client.ApiClient() as raw:
        api = ApiKube(raw)
        async with WatchLog(api, ns, [RAYCLUSTER, RAYJOB]) as log:
            await api.create(VDP, ns, {**doc, "metadata": {"name": name, "namespace": ns}})

            def cluster_ready(s: Seen) -> bool:
                return s.kind == RAYCLUSTER and cluster_readiness(s.obj, workers).ready

            ready = await log.wait_for("KubeRay to report the RayCluster ready", cluster_ready,
                                       timeout=120)  # fmt: skip
            job = await log.wait_for("the head job", lambda s: s.kind == RAYJOB and
                                     s.type == "ADDED", timeout=10)  # fmt: skip
            first = job.name
            await api.patch_status(RAYJOB, ns, first, {  # as KubeRay does when Ray's job fails
                "jobStatus": "FAILED", "jobDeploymentStatus": "Failed",
                "message": "the test failed it"})  # fmt: skip
            failed = await log.wait_for(
                f"{first} failed", lambda s: s.kind == RAYJOB and s.name == first
                and job_state(s.obj) is JobState.FAILED, timeout=30)  # fmt: skip
            relaunch = await log.wait_for(
                "the relaunched head job", lambda s: s.kind == RAYJOB and s.type == "ADDED"
                and s.name != first, timeout=10)  # fmt: skip
    return {"ready_to_job": job.t - ready.t, "failed_to_relaunch": relaunch.t - failed.t}


def test_child_events_reconcile_within_a_second_without_resync(
    testbed: Any, quiet_operator: OperatorProcess, testbed_namespace: str
) -> None:
    doc = yaml.safe_load((REPO / "examples" / "dp4-tp2.yaml").read_text())
    try:
        took = asyncio.run(_scenario(testbed.kubeconfig, testbed_namespace, doc))
    except AssertionError as exc:
        raise AssertionError(f"{exc}\noperator log:\n{quiet_operator.log_tail()}") from exc
    assert took["ready_to_job"] < 1.0, (took, quiet_operator.log_tail())
    assert took["failed_to_relaunch"] < 1.0, (took, quiet_operator.log_tail())
