"""R6: the Hugging Face token stays in its Secret.

A resource names a Secret holding a known marker (hfTokenSecretRef). Through its whole life,
a launch, a failed head job and the relaunch after it, the marker never appears in the
resource's status, its Events, the operator's log, the manifests it made (RayCluster, head
RayJobs with their entrypoints and runtime env, Service), or the pods' specs: the token reaches
the pods only as a secretKeyRef.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fleet import explain, get, own_nodes, resource
from operator_proc import OperatorProcess, install_crd
from vllm_dp_operator.config import RenderOptions
from vllm_dp_operator.render.manifests import render_all

pytestmark = pytest.mark.reliability


@pytest.fixture
def operator(testbed: Any, testbed_namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    install_crd(testbed)
    op = OperatorProcess(testbed.env(), tmp_path / "operator.log")
    op.namespace = testbed_namespace
    op.start()
    yield op
    op.stop()


def _jobs(testbed: Any, ns: str) -> list[str]:
    return sorted(j["metadata"]["name"] for j in get(testbed, ns, "rayjobs"))


def test_token_marker_never_leaves_its_secret(
    testbed: Any, testbed_namespace: str, operator: OperatorProcess
) -> None:
    ns = testbed_namespace
    marker = f"hf_MARKER{os.urandom(8).hex()}"
    testbed.kubectl("-n", ns, "create", "secret", "generic", "hf",
                    f"--from-literal=token={marker}")  # fmt: skip
    doc = resource(ns, "tok", hfTokenSecretRef={"name": "hf", "key": "token"},
                   env=[{"name": "NCCL_DEBUG", "value": "WARN"}])  # fmt: skip
    with own_nodes(testbed, ns, gpus=8):
        testbed.apply(doc)
        try:
            testbed.wait_until("the first head job", lambda: _jobs(testbed, ns) == ["tok-j00001"],
                               timeout=90)  # fmt: skip
            first = get(testbed, ns, "rayjobs")  # the relaunch deletes it
            # Fail it as KubeRay does when Ray's job fails; the operator relaunches.
            testbed.kubectl("-n", ns, "patch", "rayjob", "tok-j00001", "--subresource=status",
                            "--type=merge", "-p", json.dumps({"status": {
                                "jobStatus": "FAILED", "jobDeploymentStatus": "Failed",
                                "message": "the test failed it"}}))  # fmt: skip
            testbed.wait_until("the relaunched head job",
                               lambda: "tok-j00002" in _jobs(testbed, ns), timeout=90)
            testbed.wait_until("the failure in the status", lambda: (get(testbed, ns, "vdp")[0]
                               .get("status") or {}).get("lastFailedJob") == "tok-j00001")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{explain(testbed, ns, operator)}") from exc

        seen = {
            "status": get(testbed, ns, "vdp"),
            "events": get(testbed, ns, "events"),
            "rayclusters": get(testbed, ns, "rayclusters"),
            "rayjobs": first + get(testbed, ns, "rayjobs"),
            "services": get(testbed, ns, "services"),
            "pods": get(testbed, ns, "pods"),
            "rendered": render_all(doc, RenderOptions()),
        }
        for where, objs in seen.items():
            assert marker not in json.dumps(objs), f"the token is in the {where}"
        assert marker not in operator.log_tail(10**8), "the token is in the operator's log"
        assert get(testbed, ns, "events"), "no Events to look through"
        entrypoints = [j["spec"]["entrypoint"] for j in seen["rayjobs"]]
        assert {j["metadata"]["name"] for j in seen["rayjobs"]} == {"tok-j00001", "tok-j00002"}
        assert all(marker not in e for e in entrypoints)

        pods = [p for p in seen["pods"] if "ray.io/cluster" in p["metadata"].get("labels", {})]
        assert pods, "no Ray pods"
        for pod in pods:
            for container in pod["spec"]["containers"]:
                tokens = [e for e in container.get("env") or [] if e["name"] == "HF_TOKEN"]
                assert tokens == [{"name": "HF_TOKEN", "valueFrom": {
                    "secretKeyRef": {"name": "hf", "key": "token"}}}], tokens  # fmt: skip
        testbed.kubectl("-n", ns, "delete", "vdp", "--all", "--wait=false")
