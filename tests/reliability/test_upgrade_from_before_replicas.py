"""A resource served by the last release before replicas upgrades to this operator in place.

The earlier operator is the project's own source at PRE_REPLICAS (6d01635's parent, the last
commit before a resource became a set of replicas), taken from this checkout's history with
`git archive` and run as a `kopf run` process like any other test operator. Its CRD is
installed first, and one small resource serves from it (kwok GPU nodes of the test's own,
vLLM's /health double in the pod network). Then the upgrade, in the order docs/install.md
gives it: the new operator replaces the old one (a chart upgrade), and only after that is the
new CRD applied (helm never upgrades CRDs). Through both steps, on watches of every
RayCluster, RayJob, EndpointSlice and status the API server stored: no RayCluster, Ray pod or
head job is replaced, the API Service's slice never loses its ready endpoint, and the
resource never stops Serving. Then `kubectl scale` to 2 adds a second replica, and the status
is the replica set's (2/2); replica 0 should still be the cluster and head job the earlier
operator made, and today is not (SCALE_REPLACES, an expected failure until it is mended).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fleet import get, own_nodes, small, watched
from operator_proc import OperatorProcess, install_crd
from scenario import api_endpoints, double_in_pod_network
from vllm_dp_operator import constants as c

pytestmark = pytest.mark.reliability

REPO = Path(__file__).resolve().parents[2]
#: The last commit whose operator knew nothing of replicas.
PRE_REPLICAS = "542374c2c3cf53708c36df8fa81c60ae13517cdd"
NAME = "legacy"
#: How long each step of the upgrade is watched before the next: a replacement would come
#: with the first reconcile, a few seconds after the operator starts or the CRD changes.
HOLD = 15.0
CRD = "crd/vllmdataparallels.vllmdp.io"
#: A known defect, open in issue 37: a cluster is accepted for the resource's generation, and
#: a scale moves the generation; where this operator renders replica 0 otherwise than the
#: earlier one did, the first scale after the upgrade replaces it (a new RayCluster and head
#: job for a replica the user did not ask to change).
SCALE_REPLACES = "the first scale after the upgrade replaced replica 0's RayCluster"


@pytest.fixture
def earlier(tmp_path: Path) -> Path:
    """The earlier release's operator, launcher and CRD, unpacked from this checkout's history."""
    try:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", PRE_REPLICAS, "operator/vllm_dp_operator",
             "engine_image/vllm_dp_launcher", "crds"],
            capture_output=True, check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", b"") or str(err).encode()
        pytest.skip(f"the release before replicas ({PRE_REPLICAS[:7]}) is not in this "
                    f"checkout's history (a shallow clone or an exported tree): "
                    f"{detail.decode(errors='replace').strip()}")  # fmt: skip
    out = tmp_path / "earlier"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(out, filter="data")
    return out


def earlier_env(testbed: Any, src: Path) -> dict[str, str]:
    """The bed's environment with the earlier packages first on the import path, checked."""
    env = {**testbed.env(),
           "PYTHONPATH": os.pathsep.join([str(src / "operator"), str(src / "engine_image")])}
    for module in ("vllm_dp_operator", "vllm_dp_launcher"):
        found = subprocess.run([sys.executable, "-c", f"import {module}; print({module}.__file__)"],
                               env=env, capture_output=True, text=True, check=True).stdout
        assert found.startswith(str(src)), f"{module} imported from {found.strip()}, not {src}"
    return env


def apply_crd(testbed: Any, path: Path) -> None:
    testbed.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    testbed.kubectl("wait", "--for=condition=Established", "--timeout=60s", CRD)


@pytest.fixture
def restores_crd(testbed: Any) -> Iterator[None]:
    """The CRD is the bed's, shared by every later test: it is this operator's again after."""
    try:
        yield
    finally:
        install_crd(testbed)


def live(testbed: Any, ns: str, kind: str) -> dict[str, str]:
    """name -> uid of each `kind` in `ns` not being deleted."""
    return {o["metadata"]["name"]: o["metadata"]["uid"] for o in get(testbed, ns, kind)
            if not o["metadata"].get("deletionTimestamp")}  # fmt: skip


def resource(testbed: Any, ns: str) -> dict[str, Any]:
    found: dict[str, Any] = testbed.kubectl_json("-n", ns, "get", "vdp", NAME)
    return found


def hold(testbed: Any, ns: str, op: OperatorProcess, before: dict[str, dict[str, str]],
         seconds: float, what: str) -> None:  # fmt: skip
    """For `seconds`, every 2 s: the same children, one ready endpoint, phase Serving."""
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        now = {kind: live(testbed, ns, kind) for kind in before}
        phase = (resource(testbed, ns).get("status") or {}).get("phase")
        said = f"{what}: {now} against {before}, phase {phase}\noperator log:\n{op.log_tail()}"
        assert now == before, f"children replaced {said}"
        assert len(api_endpoints(testbed, ns, NAME)) == 1, f"no ready endpoint {said}"
        assert phase == c.PHASE_SERVING, f"stopped serving {said}"
        time.sleep(2)


def wait(testbed: Any, op: OperatorProcess, what: str, check: Any, timeout: float) -> None:
    try:
        testbed.wait_until(what, check, timeout=timeout, interval=1)
    except AssertionError as err:
        raise AssertionError(f"{err}\noperator log:\n{op.log_tail()}") from None


def slice_gaps(events: list[dict[str, Any]]) -> list[str]:
    """Every version of the API Service's slices with no ready endpoint, or one deleted."""
    gaps = []
    for event in events:
        obj = event["object"]
        if (obj["metadata"].get("labels") or {}).get("kubernetes.io/service-name") != \
                f"{NAME}-api":  # fmt: skip
            continue
        ready = [e for e in obj.get("endpoints") or []
                 if (e.get("conditions") or {}).get("ready") is not False]  # fmt: skip
        if event["type"] == "DELETED" or not ready:
            gaps.append(f"{event['type']} {obj['metadata']['name']} "
                        f"rv {obj['metadata']['resourceVersion']}: {obj.get('endpoints')}")
    return gaps


def test_a_resource_of_the_release_before_replicas_upgrades_in_place(
    testbed: Any, testbed_namespace: str, tmp_path: Path, earlier: Path, restores_crd: None
) -> None:
    ns = testbed_namespace
    (old_crd,) = (earlier / "crds").glob("*.yaml")
    assert "replicas" not in yaml.safe_load(old_crd.read_text())["spec"]["versions"][0][
        "schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]  # fmt: skip
    apply_crd(testbed, old_crd)
    with own_nodes(testbed, ns, 4), double_in_pod_network(testbed, "health_server.py", 8000):
        old = OperatorProcess(earlier_env(testbed, earlier), tmp_path / "earlier.log")
        old.namespace = ns
        new = OperatorProcess(testbed.env(), tmp_path / "operator.log")
        new.namespace = ns
        try:
            old.start()
            testbed.apply([small(ns, NAME)])
            wait(testbed, old, "Serving from the earlier operator", lambda: (
                (resource(testbed, ns).get("status") or {}).get("phase") == c.PHASE_SERVING
                and len(api_endpoints(testbed, ns, NAME)) == 1), 180)
            served = resource(testbed, ns)["status"]
            assert "replicaStatuses" not in served, "the earlier operator wrote replicas"
            before = {kind: live(testbed, ns, kind) for kind in ("rayclusters", "rayjobs", "pods")}
            endpoints = api_endpoints(testbed, ns, NAME)
            with (watched(testbed, ns, "endpointslices", tmp_path / "slices.watch") as slices,
                  watched(testbed, ns, "vdp", tmp_path / "vdp.watch") as statuses,
                  watched(testbed, ns, "rayclusters", tmp_path / "rc.watch") as clusters):
                old.stop()
                new.start()
                # The chart is upgraded; the CRD is still the earlier one.
                hold(testbed, ns, new, before, HOLD, "new operator, earlier CRD")
                apply_crd(testbed, REPO / "crds" / "vllmdp.io_vllmdataparallels.yaml")
                hold(testbed, ns, new, before, HOLD, "new operator, new CRD")

            gaps = slice_gaps(slices)
            phases = [(e["object"].get("status") or {}).get("phase") for e in statuses]
            added = sorted({e["object"]["metadata"]["name"] for e in clusters
                            if e["object"]["metadata"]["uid"] != before["rayclusters"].get(
                                e["object"]["metadata"]["name"])})  # fmt: skip
            print(f"\n[upgrade from {PRE_REPLICAS[:7]}] {len(slices)} slice, {len(statuses)} "
                  f"status and {len(clusters)} RayCluster watch events; phases {set(phases)}")
            said = f"(watches in {tmp_path})\noperator log:\n{new.log_tail()}"
            assert gaps == [], f"the route had a gap: {gaps} {said}"
            assert set(phases) <= {c.PHASE_SERVING}, f"phases {phases} {said}"
            assert added == [], f"RayClusters made during the upgrade: {added} {said}"
            assert api_endpoints(testbed, ns, NAME) == endpoints

            # The upgraded resource is a replica set like any other, its first replica the
            # cluster and head job the earlier operator made. (Applying the CRD changes no
            # resource, so its status takes the new fields at its next reconcile: this
            # scale, here.)
            testbed.kubectl("-n", ns, "scale", "vdp", NAME, "--replicas=2")
            wait(testbed, new, "two replicas routed", lambda: (
                len(api_endpoints(testbed, ns, NAME)) == 2
                and (resource(testbed, ns).get("status") or {}).get("ready") == "2/2"), 180)
            status = resource(testbed, ns)["status"]
            first = status["replicaStatuses"][0]
            (cluster,) = before["rayclusters"]
            (job,) = before["rayjobs"]
            assert (status["replicas"], status["readyReplicas"]) == (2, 2), status
            assert first["index"] == 0, first
            if first["rayCluster"] != cluster:
                pytest.xfail(f"{SCALE_REPLACES}: {cluster} became {first['rayCluster']}")
            assert first["servedJob"] == job == served["servedJob"], (first, served)
            assert live(testbed, ns, "rayclusters")[cluster] == before["rayclusters"][cluster]
            assert {n: u for n, u in live(testbed, ns, "rayjobs").items() if n == job} == \
                before["rayjobs"]  # fmt: skip
        finally:
            old.stop()
            new.stop()
