"""The operator, logged in with the chart's ServiceAccount, runs the integration scenario.

Proves the chart's RBAC is enough: create, reach Launching, relaunch on an engine change,
reshape, delete; and the operator's log holds no "forbidden" answer from the API server.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_proc import OperatorProcess, install_crd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chart"))
import chartlib

pytestmark = pytest.mark.controlplane

REPO = Path(__file__).resolve().parents[2]
PROXY_VALUES = REPO / "charts" / "vllm-dp-operator" / "ci" / "apiserver-proxy-values.yaml"


def _items(testbed: Any, ns: str, kind: str, selector: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = testbed.kubectl_json("-n", ns, "get", kind, "-l", selector)[
        "items"
    ]
    return found


def _status(testbed: Any, ns: str, name: str) -> dict[str, Any]:
    st: dict[str, Any] = testbed.kubectl_json("-n", ns, "get", "vdp", name).get("status") or {}
    return st


@pytest.mark.parametrize("scope", ["cluster", "namespace"])
def test_operator_with_chart_rbac_runs_scenario_without_forbidden(
    testbed: Any, testbed_namespace: str, tmp_path: Path, scope: str
) -> None:
    install_crd(testbed)
    ns = testbed_namespace
    sets = ["healthProbe.mode=apiserver-proxy", f"rbac.scope={scope}"]
    if scope == "namespace":
        sets.append(f"watchNamespace={ns}")
    identity = chartlib.apply_operator_identity(testbed.kubectl, f"vdp-{scope[:2]}", ns,
                                                (PROXY_VALUES,), sets)  # fmt: skip
    kubeconfig = chartlib.operator_kubeconfig(
        testbed.kubectl, identity, testbed.kubeconfig, tmp_path / "sa.kubeconfig"
    )
    env = {**testbed.env(), "KUBECONFIG": str(kubeconfig)}
    op = OperatorProcess(env, tmp_path / "operator.log")
    if scope == "namespace":
        op.namespace = ns
    op.start()
    try:
        doc = yaml.safe_load((REPO / "examples" / "dp4-tp2.yaml").read_text())
        doc["metadata"]["namespace"] = ns
        name = doc["metadata"]["name"]
        testbed.apply(doc)
        testbed.wait_until("Launching", lambda: _status(testbed, ns, name).get("phase") ==
                           "Launching", timeout=90)  # fmt: skip
        first_cluster = _status(testbed, ns, name)["rayCluster"]

        changed = copy.deepcopy(doc)
        changed["spec"]["engineArgs"] = ["--max-model-len", "4096"]
        testbed.apply(changed)
        testbed.wait_until("relaunch", lambda: any(
            "--max-model-len" in j["spec"]["entrypoint"]
            for j in _items(testbed, ns, "rayjobs", f"app.kubernetes.io/instance={name}")))
        changed["spec"]["dataParallel"]["size"] = 8
        testbed.apply(changed)
        testbed.wait_until("reshape", lambda: _status(testbed, ns, name).get("rayCluster")
                           not in (None, first_cluster))  # fmt: skip
        testbed.kubectl("-n", ns, "delete", "vdp", name, "--wait=true", "--timeout=60s")
    finally:
        op.stop()
        chartlib.delete_operator_identity(testbed.kubectl, identity)
    log = op.log_tail(chars=10**7)
    assert "forbidden" not in log.lower(), log[-4000:]
    assert "403" not in log, log[-4000:]
