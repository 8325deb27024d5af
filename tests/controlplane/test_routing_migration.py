"""An API Service of an earlier version, which selected the head pod by a label, is taken over.

Against a real API server and kube-controller-manager (its EndpointSlice controller makes a
slice for a Service with a selector, and leaves it when the selector goes): the operator,
with only the chart's RBAC, removes the selector by merge patch, deletes that controller's
slice, and routes through its own EndpointSlice.
"""

from __future__ import annotations

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
NAME = "legacy"


def _slices(testbed: Any, ns: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = testbed.kubectl_json(
        "-n", ns, "get", "endpointslices", "-l", f"kubernetes.io/service-name={NAME}-api")["items"]
    return found


def _managers(testbed: Any, ns: str) -> list[str]:
    return sorted(s["metadata"]["labels"].get("endpointslice.kubernetes.io/managed-by", "")
                  for s in _slices(testbed, ns))  # fmt: skip


def test_a_selector_service_is_made_selector_less_and_its_slices_replaced(
    testbed: Any, testbed_namespace: str, tmp_path: Path
) -> None:
    install_crd(testbed)
    ns = testbed_namespace
    doc = yaml.safe_load((REPO / "examples" / "dp4-tp2.yaml").read_text())
    doc["metadata"].update(name=NAME, namespace=ns)
    # No pods: this is about the Service. (Not suspended: a suspended resource has none.) Its
    # pods ask for a GPU no node has, so they stay Pending and nothing is routed.
    doc["spec"]["gpu"] = {"resourceName": "example.com/no-such-gpu"}
    testbed.apply(doc)
    uid = testbed.kubectl_json("-n", ns, "get", "vdp", NAME)["metadata"]["uid"]
    # What an earlier version made: the same Service, selecting the labelled head pod.
    labels = {"app.kubernetes.io/name": "vllm-dp", "app.kubernetes.io/instance": NAME,
              "app.kubernetes.io/component": "api",
              "app.kubernetes.io/managed-by": "vllm-dp-operator"}  # fmt: skip
    testbed.apply({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": f"{NAME}-api", "namespace": ns, "labels": labels,
                     "ownerReferences": [{"apiVersion": "vllmdp.io/v1alpha1",
                                          "kind": "VLLMDataParallel", "name": NAME, "uid": uid,
                                          "controller": True, "blockOwnerDeletion": True}]},
        "spec": {"selector": {"ray.io/cluster": f"{NAME}-old", "ray.io/node-type": "head",
                              "vllmdp.io/serving": "true"},
                 "ports": [{"name": "http", "protocol": "TCP", "port": 8000,
                            "targetPort": 8000}]},
    })  # fmt: skip
    testbed.wait_until("the EndpointSlice controller's slice for the selector", lambda: _managers(
        testbed, ns) == ["endpointslice-controller.k8s.io"], timeout=30)

    identity = chartlib.apply_operator_identity(testbed.kubectl, f"mig-{ns[-6:]}", ns, (),
                                                (f"watchNamespaces={{{ns}}}",))  # fmt: skip
    kubeconfig = chartlib.operator_kubeconfig(testbed.kubectl, identity, testbed.kubeconfig,
                                              tmp_path / "sa.kubeconfig")  # fmt: skip
    op = OperatorProcess({**testbed.env(), "KUBECONFIG": str(kubeconfig)},
                         tmp_path / "operator.log", {"VLLMDP_LEASE_NAMESPACE": ns})  # fmt: skip
    op.namespace = ns
    op.start()
    try:
        def taken_over() -> bool:
            svc = testbed.kubectl_json("-n", ns, "get", "service", f"{NAME}-api")
            return "selector" not in svc["spec"] and _managers(testbed, ns) == [
                "vllm-dp-operator.vllmdp.io"]

        testbed.wait_until("the selector gone and only the operator's slice left", taken_over,
                           timeout=60)  # fmt: skip
        (eps,) = _slices(testbed, ns)
        assert eps["metadata"]["name"] == f"{NAME}-api"
        assert eps["metadata"]["ownerReferences"][0]["uid"] == uid
        assert eps.get("endpoints") in (None, [])  # pods Pending: nothing to route to
    finally:
        op.stop()
        chartlib.delete_operator_identity(testbed.kubectl, identity)
    denied = [ln for ln in op.log_tail(chars=10**6).splitlines() if "forbidden" in ln.lower()]
    assert not denied, "\n".join(denied[-20:])
