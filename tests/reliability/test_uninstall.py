"""Uninstalling the chart while resources exist does what the README and docs/install.md say.

The chart's release is uninstalled with resources present: `helm uninstall --wait` finishes,
the CRD and the resources with every child stay ("uninstalling the chart leaves the CRD and your
resources in place"), and with no operator left the resources can still be deleted, their
children following ("the operator adds no finalizer, so resources and the operator can be
deleted in any order").

kwok pods run no containers, so the operator that works on the resources here is the test's
own process; the chart's Deployment is installed and removed like any other.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fleet import converged, explain, get, own_nodes, small
from operator_proc import OperatorProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chart"))
import chartlib

pytestmark = pytest.mark.reliability


def _helm(testbed: Any, *args: str) -> subprocess.CompletedProcess[str]:
    try:
        helm = chartlib.helm_binary()
    except chartlib.HelmUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    env = {**os.environ, "KUBECONFIG": str(testbed.kubeconfig),
           "HELM_CACHE_HOME": str(testbed.state_dir / "helm" / "cache"),
           "HELM_CONFIG_HOME": str(testbed.state_dir / "helm" / "config"),
           "HELM_DATA_HOME": str(testbed.state_dir / "helm" / "data")}  # fmt: skip
    proc = subprocess.run([helm, *args], capture_output=True, text=True, env=env, timeout=300,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _names(testbed: Any, ns: str, kind: str) -> list[str]:
    return sorted(o["metadata"]["name"] for o in get(testbed, ns, kind))


def test_uninstall_with_resources_keeps_them_and_they_still_delete(
    testbed: Any, testbed_namespace: str, operator: OperatorProcess
) -> None:
    ns = testbed_namespace
    release = f"un-{ns[-6:]}"
    with own_nodes(testbed, ns, gpus=4):
        _helm(testbed, "install", release, str(chartlib.CHART), f"--namespace={ns}",
              f"--set=watchNamespaces={{{ns}}}")
        testbed.apply([small(ns, "u0"), small(ns, "u1")])
        try:
            testbed.wait_until("two resources to converge", lambda: converged(testbed, ns, 2),
                               timeout=90)  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{explain(testbed, ns, operator)}") from exc
        before = {k: _names(testbed, ns, k) for k in ("vdp", "rayclusters", "rayjobs")}

        _helm(testbed, "uninstall", release, f"--namespace={ns}", "--wait", "--timeout=60s")
        operator.stop()  # the operator is gone with its release
        assert testbed.kubectl("get", "crd", "vllmdataparallels.vllmdp.io", check=False
                               ).returncode == 0, "the CRD went with the chart"  # fmt: skip
        assert {k: _names(testbed, ns, k) for k in before} == before
        assert not any(o["metadata"].get("deletionTimestamp") for o in get(testbed, ns, "vdp"))

        testbed.kubectl("-n", ns, "delete", "vdp", "--all", "--wait=true", "--timeout=30s")
        testbed.wait_until("the children collected with no operator", lambda: not any(
            get(testbed, ns, k) for k in ("rayclusters", "rayjobs")), timeout=60)  # fmt: skip
