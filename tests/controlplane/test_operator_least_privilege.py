"""The operator, logged in with the chart's ServiceAccount, runs the integration scenario.

Proves the chart's RBAC is enough: create, reach Launching, relaunch on an engine change,
reshape, delete; and the operator's log holds no "forbidden" answer from the API server. The
test bed's API server runs the OwnerReferencesPermissionEnforcement admission plugin (as
OpenShift does), so creating children with blockOwnerDeletion needs the finalizers grant.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_proc import OperatorProcess, install_crd
from scenario import launch_command

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


# An HTTP 403 as the operator logs one ("HTTP 403", "(403)", "status: 403", "code": 403), not
# any "403": a log timestamp such as 12:00:01,403 is no refusal.
HTTP_403 = re.compile(r"(\bHTTP/?[\d.]*\s*|\(|\bstatus\W{0,3}|\bcode\W{0,3})403\b", re.IGNORECASE)


def _foreign_namespace_deletion(line: str, ns: str) -> bool:
    # Another test's namespace going away: the API server refuses writes there with 403
    # "... because it is being terminated". Not this scenario, and not an RBAC failure.
    return "being terminated" in line and not re.search(rf"\b{re.escape(ns)}\b", line)


def _assert_owner_references_enforced(testbed: Any, kubeconfig: Path, ns: str) -> None:
    """The admission plugin is on: blockOwnerDeletion to an owner whose finalizers the
    ServiceAccount may not update (a ConfigMap) is refused, though it may create the child (a
    Service) itself."""
    testbed.kubectl("-n", ns, "create", "configmap", "owner-probe")
    owner = testbed.kubectl_json("-n", ns, "get", "configmap", "owner-probe")
    svc = {"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": "owner-probe", "namespace": ns, "ownerReferences": [{
               "apiVersion": "v1", "kind": "ConfigMap", "name": "owner-probe",
               "uid": owner["metadata"]["uid"], "blockOwnerDeletion": True}]},
           "spec": {"ports": [{"port": 80}]}}  # fmt: skip

    def attempt() -> str:
        proc = subprocess.run([str(testbed.kubectl_path), f"--kubeconfig={kubeconfig}", "create",
                               "-f", "-"], input=yaml.safe_dump(svc), capture_output=True,
                              text=True, timeout=60, check=False)  # fmt: skip
        assert proc.returncode != 0, "OwnerReferencesPermissionEnforcement is not enabled"
        # Until the new RoleBinding is seen the refusal is plain RBAC: ask again.
        return proc.stderr if "blockOwnerDeletion" in proc.stderr else ""

    testbed.wait_until("the admission plugin to refuse blockOwnerDeletion", attempt, 20)


@pytest.mark.parametrize("scope", ["cluster", "namespace"])
def test_operator_with_chart_rbac_runs_scenario_without_forbidden(
    testbed: Any, testbed_namespace: str, tmp_path: Path, scope: str
) -> None:
    install_crd(testbed)
    ns = testbed_namespace
    sets = ["healthProbe.mode=apiserver-proxy"]
    if scope == "namespace":
        sets.append(f"watchNamespaces={{{ns}}}")
    identity = chartlib.apply_operator_identity(testbed.kubectl, f"vdp-{scope[:2]}", ns,
                                                (PROXY_VALUES,), sets)  # fmt: skip
    kubeconfig = chartlib.operator_kubeconfig(
        testbed.kubectl, identity, testbed.kubeconfig, tmp_path / "sa.kubeconfig"
    )
    _assert_owner_references_enforced(testbed, kubeconfig, ns)
    env = {**testbed.env(), "KUBECONFIG": str(kubeconfig)}
    # The chart's Role for the Lease lives in the release namespace (here the test's own).
    op = OperatorProcess(env, tmp_path / "operator.log", {"VLLMDP_LEASE_NAMESPACE": ns})
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
            "--max-model-len" in launch_command(j)
            for j in _items(testbed, ns, "rayjobs", f"app.kubernetes.io/instance={name}")))
        changed["spec"]["dataParallel"]["size"] = 8
        testbed.apply(changed)
        testbed.wait_until("reshape", lambda: _status(testbed, ns, name).get("rayCluster")
                           not in (None, first_cluster))  # fmt: skip
        testbed.kubectl("-n", ns, "delete", "vdp", name, "--wait=true", "--timeout=60s")
    finally:
        op.stop()
        chartlib.delete_operator_identity(testbed.kubectl, identity)
    lines = [ln for ln in op.log_tail(chars=10**7).splitlines()
             if not _foreign_namespace_deletion(ln, ns)]  # fmt: skip
    denied = [ln for ln in lines if "forbidden" in ln.lower() or HTTP_403.search(ln)]
    assert not denied, "\n".join(denied[-20:])


@pytest.mark.parametrize(("line", "refusal"), [
    ("Reconcile of a/b failed: HTTP 403 forbidden: User cannot create", True),
    ("kubernetes_asyncio.client.exceptions.ApiException: (403)", True),
    ('{"kind":"Status","status":"Failure","code":403}', True),
    ("[2026-11-30 14:12:01,403] vllm_dp_operator.controller.manager [INFO] Caches filled", False),
    ("Created head job q7-j00403 on q7-abc", False),
])
def test_http_403_pattern_matches_a_refusal_not_a_timestamp(line: str, refusal: bool) -> None:
    assert bool(HTTP_403.search(line)) is refusal


def _as_operator(testbed: Any, kubeconfig: Path, *args: str, doc: dict[str, Any] | None = None
                 ) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run([str(testbed.kubectl_path), f"--kubeconfig={kubeconfig}", *args],
                          input=yaml.safe_dump(doc) if doc is not None else None,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip


def test_the_fence_refuses_what_the_operator_never_writes(
    testbed: Any, testbed_namespace: str, tmp_path: Path
) -> None:
    """As the operator's ServiceAccount, with the chart's defaults (cluster-wide RBAC): a
    privileged RayCluster in kube-system, an EndpointSlice for a Service the operator does not
    own, and a patch of a foreign Service are refused by the chart's admission policy, naming
    it, though RBAC allows each (issue 39)."""
    install_crd(testbed)
    ns = testbed_namespace
    identity = chartlib.apply_operator_identity(testbed.kubectl, "vdp-fence", ns)
    kubeconfig = chartlib.operator_kubeconfig(
        testbed.kubectl, identity, testbed.kubeconfig, tmp_path / "sa.kubeconfig"
    )
    cluster = chartlib.privileged_raycluster("x")
    testbed.kubectl("-n", ns, "create", "service", "clusterip", "foreign", "--tcp=80:80")
    owned = [{"apiVersion": "vllmdp.io/v1alpha1", "kind": "VLLMDataParallel", "name": "mine",
              "uid": "00000000-0000-0000-0000-000000000001", "controller": True}]
    slices = [{"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": f"hijack-{i}", "namespace": ns, "ownerReferences": refs,
                            "labels": {"kubernetes.io/service-name": "foreign",
                                       "app.kubernetes.io/managed-by": "vllm-dp-operator"}},
               "addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"]}],
               "ports": [{"port": 80}]} for i, refs in enumerate(([], owned))]
    try:
        def refused(*args: str, doc: dict[str, Any] | None = None) -> str:
            proc = _as_operator(testbed, kubeconfig, *args, doc=doc)
            assert proc.returncode != 0, f"accepted: {args}"
            # Until the new binding is seen the refusal may be RBAC's or none: ask again.
            return proc.stderr if "vllm-dp-operator admission policy" in proc.stderr else ""

        for args, doc in [
            (("create", "--dry-run=server", "-f", "-"), cluster),
            *((("create", "--dry-run=server", "-f", "-"), s) for s in slices),
            (("-n", ns, "patch", "service", "foreign", "--dry-run=server", "--type=merge",
              "-p", '{"spec": {"ports": [{"port": 81, "targetPort": 81}]}}'), None),
        ]:
            why = testbed.wait_until(f"the fence to refuse {args[:2]}",
                                     lambda a=args, d=doc: refused(*a, doc=d), 30)
            assert "-fence" in why, why  # the policy's name: {release}-vllm-dp-operator-fence
    finally:
        chartlib.delete_operator_identity(testbed.kubectl, identity)


def test_the_tenancy_policy_refuses_each_ask_beyond_a_tenants_own_naming_the_field(
    testbed: Any, testbed_namespace: str
) -> None:
    """A tenant with only `create` on vllmdataparallels, under the chart's tenancy policy
    with its defaults: an image outside the allow-list, a Secret other than its refs, a
    system priority class and a NodePort Service are each refused at admission, naming the
    field; a resource within them is accepted, and a Secret named like a Ray token Secret is
    refused (issue 39). A resource admitted before the
    policy keeps its metadata writable (a finalizer's removal), not its spec."""
    install_crd(testbed)
    ns = testbed_namespace
    rendered = chartlib.render((), (), "vdp-ten", ns)  # the chart's defaults: on
    policy = [o for o in rendered if o.get("kind") in chartlib.FENCE_KINDS
              and o["metadata"]["name"].endswith(("-tenancy", "-token-secrets"))]  # fmt: skip
    for obj in policy:  # on the shared bed, this test's namespace only
        if obj["kind"] == "ValidatingAdmissionPolicyBinding":
            obj["spec"]["matchResources"] = {"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": ns}}}

    def doc(**spec: Any) -> dict[str, Any]:
        base = {"model": "m", "dataParallel": {"size": 2, "ranksPerNode": 2},
                "apiKeySecretRef": {"name": "mine", "key": "k"}}
        return {"apiVersion": "vllmdp.io/v1alpha1", "kind": "VLLMDataParallel",
                "metadata": {"name": "t", "namespace": ns}, "spec": {**base, **spec}}

    # Admitted before the policy, with an image it does not allow, and a finalizer.
    before = doc(image="elsewhere/other:1", suspend=True)
    before["metadata"].update(name="before", finalizers=["vllmdp.io/test"])
    testbed.kubectl("create", "-f", "-", input=yaml.safe_dump(before))
    testbed.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(policy))
    tenant = f"system:serviceaccount:{ns}:tenant"
    testbed.kubectl("-n", ns, "create", "serviceaccount", "tenant")
    testbed.kubectl("-n", ns, "create", "role", "vdp-creator", "--verb=create",
                    "--resource=vllmdataparallels.vllmdp.io")
    testbed.kubectl("-n", ns, "create", "rolebinding", "vdp-creator", "--role=vdp-creator",
                    f"--serviceaccount={ns}:tenant")
    testbed.kubectl("-n", ns, "create", "role", "secret-creator", "--verb=create",
                    "--resource=secrets")
    testbed.kubectl("-n", ns, "create", "rolebinding", "secret-creator",
                    "--role=secret-creator", f"--serviceaccount={ns}:tenant")

    def create(body: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        return testbed.kubectl("create", "--dry-run=server", f"--as={tenant}", "-f", "-",
                               input=yaml.safe_dump(body), check=False)

    try:
        for field, body in [
            ("spec.image", doc(image="elsewhere/other:1")),
            ("spec.env", doc(env=[{"name": "DB", "valueFrom": {"secretKeyRef": {
                "name": "someone-elses", "key": "password"}}}])),
            ("spec.priorityClassName", doc(priorityClassName="system-node-critical")),
            ("spec.service.type", doc(service={"type": "NodePort"})),
        ]:
            def refused(b: dict[str, Any] = body) -> str:
                proc = create(b)
                assert proc.returncode != 0, f"accepted: {b['spec']}"
                return proc.stderr if "tenancy policy" in proc.stderr else ""

            why = testbed.wait_until(f"the tenancy policy to refuse {field}", refused, 30)
            assert field in why and "-tenancy" in why, why
        ok = create(doc(env=[{"name": "KEY", "valueFrom": {"secretKeyRef": {
            "name": "mine", "key": "k"}}}]))
        assert ok.returncode == 0, ok.stderr
        # A token Secret planted ahead of the resource (an earlier release's name, or this
        # one's): refused, whatever its token; another name is the tenant's to use.
        for planted in ("t-ray-token", "t-ray-token-0123456789abcdef"):
            def plant(n: str = planted) -> str:
                proc = testbed.kubectl("-n", ns, "create", "secret", "generic", n,
                                       "--from-literal=auth_token=known", "--dry-run=server",
                                       f"--as={tenant}", check=False)  # fmt: skip
                assert proc.returncode != 0, f"accepted: Secret {n}"
                return proc.stderr if "token Secret policy" in proc.stderr else ""

            why = testbed.wait_until(f"the policy to refuse Secret {planted}", plant, 30)
            assert "metadata.name" in why and "-token-secrets" in why, why
        mine = testbed.kubectl("-n", ns, "create", "secret", "generic", "t-ray-tokens",
                               "--from-literal=k=v", "--dry-run=server", f"--as={tenant}",
                               check=False)  # fmt: skip
        assert mine.returncode == 0, mine.stderr
        # The resource from before: its spec is judged when written, its metadata is not.
        spec = testbed.kubectl("-n", ns, "patch", "vdp", "before", "--type=merge", "-p",
                               '{"spec":{"suspend":false}}', check=False)  # fmt: skip
        assert spec.returncode != 0 and "spec.image" in spec.stderr, spec.stderr
        testbed.kubectl("-n", ns, "patch", "vdp", "before", "--type=json", "-p",
                        '[{"op":"remove","path":"/metadata/finalizers"}]')
    finally:
        testbed.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-",
                        input=yaml.safe_dump_all(policy))
