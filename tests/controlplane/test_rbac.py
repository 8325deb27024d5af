"""The chart's RBAC against a real API server: what the operator's ServiceAccount can and
cannot do, asked with its own token (`kubectl auth can-i` as the ServiceAccount).

`chartlib.apply_operator_identity` + `chartlib.operator_kubeconfig` give any scenario a
kubeconfig holding exactly the chart's permissions: start the operator with
KUBECONFIG=<that file> to prove it needs nothing more (see test_operator_identity_kubeconfig).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chart"))
import chartlib

if TYPE_CHECKING:
    from conftest import RunningTestbed  # type: ignore[import-not-found, attr-defined, unused-ignore]

pytestmark = pytest.mark.controlplane

CI = {p.stem: p for p in chartlib.CI_VALUES}

# (verb, resource as kubectl names it, subresource) the operator must be able to use in every
# namespace it watches. Mirrors REQUIRED in tests/chart/test_chart_rbac.py.
MUST_NAMESPACED = [
    *[(v, "vllmdataparallels.vllmdp.io", "") for v in ("get", "list", "watch", "patch")],
    *[(v, "vllmdataparallels.vllmdp.io", "status") for v in ("get", "patch")],
    ("update", "vllmdataparallels.vllmdp.io", "finalizers"),
    *[(v, r, "") for r in ("rayclusters.ray.io", "rayjobs.ray.io")
      for v in ("get", "list", "watch", "create", "patch", "delete")],
    *[(v, "services", "") for v in ("get", "list", "watch", "create", "patch", "delete")],
    *[(v, "networkpolicies.networking.k8s.io", "")
      for v in ("get", "list", "watch", "create", "patch", "delete")],
    *[(v, "endpointslices.discovery.k8s.io", "")
      for v in ("get", "list", "watch", "create", "patch", "delete")],
    ("delete", "endpoints", ""),
    *[(v, "pods", "") for v in ("get", "list", "watch")],
    ("get", "pods", "log"),  # the launcher's report, followed while a head job launches
    *[(v, r, "") for r in ("events", "events.events.k8s.io") for v in ("create", "patch")],
    ("create", "secrets", ""),  # the Ray token Secret, never read back
]
# Never, in any mode.
MUST_NOT_NAMESPACED = [
    ("get", "secrets", ""), ("list", "secrets", ""), ("watch", "secrets", ""),
    ("patch", "secrets", ""), ("update", "secrets", ""), ("delete", "secrets", ""),
    ("get", "configmaps", ""),
    # No pod write at all: routing is the operator's EndpointSlice, not a pod label.
    ("delete", "pods", ""), ("create", "pods", ""), ("update", "pods", ""), ("patch", "pods", ""),
    ("patch", "pods", "status"), ("update", "endpointslices.discovery.k8s.io", ""),
    ("create", "pods", "exec"), ("create", "pods", "portforward"),
    ("create", "deployments.apps", ""), ("create", "jobs.batch", ""),
    ("update", "services", ""), ("deletecollection", "services", ""),
    ("update", "rayclusters.ray.io", ""), ("create", "vllmdataparallels.vllmdp.io", ""),
    ("delete", "vllmdataparallels.vllmdp.io", ""), ("update", "vllmdataparallels.vllmdp.io", ""),
    ("create", "serviceaccounts", "token"), ("impersonate", "serviceaccounts", ""),
    ("create", "roles.rbac.authorization.k8s.io", ""),
    ("create", "rolebindings.rbac.authorization.k8s.io", ""),
    ("delete", "events", ""), ("create", "endpoints", ""), ("patch", "endpoints", ""),
]
MUST_NOT_CLUSTER = [
    ("list", "secrets", ""), ("get", "nodes", ""), ("patch", "nodes", "status"),
    ("escalate", "clusterroles.rbac.authorization.k8s.io", ""),
    ("bind", "clusterroles.rbac.authorization.k8s.io", ""),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", ""),
    ("impersonate", "users", ""), ("impersonate", "groups", ""),
    ("create", "customresourcedefinitions.apiextensions.k8s.io", ""),
    ("patch", "customresourcedefinitions.apiextensions.k8s.io", ""),
    ("delete", "namespaces", ""), ("create", "namespaces", ""),
    ("create", "certificatesigningrequests.certificates.k8s.io", ""),
]
KOPF_CRDS = [("list", "customresourcedefinitions.apiextensions.k8s.io", ""),
             ("watch", "customresourcedefinitions.apiextensions.k8s.io", "")]
KOPF_NAMESPACES = [("list", "namespaces", ""), ("watch", "namespaces", "")]
PROXY = [("get", "services", "proxy"), ("create", "services", "proxy")]
# Kueue's Workloads, read only. Asked by API group: `kubectl auth can-i` cannot map a kind the
# API server does not serve, and the bed serves it only while a Kueue test has installed it.
KUEUE_READ = [("get", "workloads"), ("list", "workloads"), ("watch", "workloads")]
KUEUE_WRITE = [("create", "workloads"), ("patch", "workloads"), ("delete", "workloads")]


@dataclass
class AsOperator:
    """kubectl with the chart ServiceAccount's token."""

    testbed: RunningTestbed
    kubeconfig: Path
    identity: chartlib.OperatorIdentity

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """kubectl with only the ServiceAccount kubeconfig (not the admin one)."""
        proc = subprocess.run([str(self.testbed.kubectl_path), f"--kubeconfig={self.kubeconfig}",
                               *args], capture_output=True, text=True, timeout=60, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} as {self.identity.username} failed:"
                                 f"\n{proc.stdout}{proc.stderr}")
        return proc

    def can_i(self, verb: str, resource: str, subresource: str = "",
              namespace: str | None = None) -> bool:
        args = ["auth", "can-i", verb, resource]
        if subresource:
            args.append(f"--subresource={subresource}")
        args += [f"--namespace={namespace}"] if namespace else ["--all-namespaces"]
        proc = self.kubectl(*args, check=False)
        answer = proc.stdout.strip().splitlines()[-1:] or [""]
        if proc.returncode not in (0, 1) or answer[0] not in ("yes", "no"):
            raise AssertionError(f"kubectl auth can-i failed: {proc.stdout}{proc.stderr}")
        return answer[0] == "yes"


def _check_kueue(op: AsOperator, ns: str | None, expect: bool, asked: list[tuple[str, str]]
                 ) -> None:  # fmt: skip
    wrong = []
    for verb, resource in asked:
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                  "spec": {"resourceAttributes": {"group": "kueue.x-k8s.io", "verb": verb,
                                                  "resource": resource, "namespace": ns or ""}}}
        proc = subprocess.run([str(op.testbed.kubectl_path), f"--kubeconfig={op.kubeconfig}",
                               "create", "-f", "-", "-o", "json"], input=json.dumps(review),
                              capture_output=True, text=True, timeout=60, check=True)
        if json.loads(proc.stdout)["status"].get("allowed", False) != expect:
            wrong.append(f"{verb} {resource}.kueue.x-k8s.io")
    assert not wrong, f"{op.identity.username} {'cannot' if expect else 'can'} in {ns}: {wrong}"


def _check(op: AsOperator, allowed: list[tuple[str, str, str]], ns: str | None,
           expect: bool) -> None:
    wrong = [f"{v} {r}{'/' + s if s else ''}" for v, r, s in allowed
             if op.can_i(v, r, s, ns) != expect]
    where = f"namespace {ns}" if ns else "all namespaces"
    assert not wrong, f"{op.identity.username} {'cannot' if expect else 'can'} in {where}: {wrong}"


@pytest.fixture
def other_namespace(testbed: RunningTestbed) -> Iterator[str]:
    """A namespace the operator does not watch in namespace scope."""
    name = f"t-rbac-other-{os.urandom(3).hex()}"
    testbed.kubectl("create", "namespace", name)
    yield name
    testbed.kubectl("delete", "namespace", name, "--wait=false", check=False)


@contextmanager
def _as_operator(testbed: RunningTestbed, ns: str, tmp_path: Path,
                 values: tuple[Path, ...] = (), set_values: tuple[str, ...] = ()
                 ) -> Iterator[AsOperator]:
    release = f"rbac-{ns[-6:]}"
    identity = chartlib.apply_operator_identity(testbed.kubectl, release, ns, values, set_values)
    try:
        kubeconfig = chartlib.operator_kubeconfig(
            testbed.kubectl, identity, testbed.kubeconfig, tmp_path / "operator.kubeconfig")
        op = AsOperator(testbed, kubeconfig, identity)
        # RBAC is read from an informer cache: wait for the bindings to arrive.
        testbed.wait_until("RBAC for the operator", lambda: op.can_i("list", "pods", "", ns), 15)
        yield op
    finally:
        chartlib.delete_operator_identity(testbed.kubectl, identity)


def test_cluster_scope(testbed: RunningTestbed, testbed_namespace: str, other_namespace: str,
                       tmp_path: Path) -> None:
    with _as_operator(testbed, testbed_namespace, tmp_path) as op:
        for ns in (testbed_namespace, other_namespace, None):
            _check(op, MUST_NAMESPACED, ns, expect=True)
            _check(op, MUST_NOT_NAMESPACED, ns, expect=False)
            _check(op, PROXY, ns, expect=False)
            _check_kueue(op, ns, True, KUEUE_READ)
            _check_kueue(op, ns, False, KUEUE_WRITE)
        _check(op, KOPF_CRDS, None, expect=True)
        # --all-namespaces: kopf never lists namespaces, so the chart does not grant it.
        _check(op, KOPF_NAMESPACES, None, expect=False)
        _check(op, MUST_NOT_CLUSTER, None, expect=False)


def test_namespace_scope(testbed: RunningTestbed, testbed_namespace: str, other_namespace: str,
                         tmp_path: Path) -> None:
    values = (CI["namespace-scope-values"],)
    ns = testbed_namespace
    with _as_operator(testbed, ns, tmp_path, values, (f"watchNamespaces={{{ns}}}",)) as op:
        _check(op, MUST_NAMESPACED, ns, expect=True)
        _check(op, MUST_NOT_NAMESPACED, ns, expect=False)
        _check(op, MUST_NAMESPACED, other_namespace, expect=False)
        _check(op, MUST_NAMESPACED, None, expect=False)
        _check_kueue(op, ns, True, KUEUE_READ)
        _check_kueue(op, other_namespace, False, KUEUE_READ)
        _check(op, KOPF_CRDS + KOPF_NAMESPACES, None, expect=True)
        _check(op, MUST_NOT_CLUSTER, None, expect=False)


def test_namespace_scope_without_observation(testbed: RunningTestbed, testbed_namespace: str,
                                             tmp_path: Path) -> None:
    values = (CI["namespace-scope-no-observation-values"],)
    ns = testbed_namespace
    with _as_operator(testbed, ns, tmp_path, values, (f"watchNamespaces={{{ns}}}",)) as op:
        _check(op, MUST_NAMESPACED, ns, expect=True)
        _check(op, KOPF_CRDS + KOPF_NAMESPACES, None, expect=False)


def test_apiserver_proxy_mode(testbed: RunningTestbed, testbed_namespace: str,
                              tmp_path: Path) -> None:
    values = (CI["apiserver-proxy-values"],)
    with _as_operator(testbed, testbed_namespace, tmp_path, values) as op:
        _check(op, PROXY, testbed_namespace, expect=True)
        _check(op, MUST_NOT_NAMESPACED, testbed_namespace, expect=False)


def test_operator_identity_kubeconfig(testbed: RunningTestbed, testbed_namespace: str,
                                      tmp_path: Path) -> None:
    # The kubeconfig a scenario would hand to the operator: the right user, real calls
    # succeed where granted and are refused where not.
    ns = testbed_namespace
    with _as_operator(testbed, ns, tmp_path) as op:
        def as_sa(*args: str) -> str:
            return op.kubectl(*args).stdout

        who = json.loads(as_sa("auth", "whoami", "-o", "json"))
        assert who["status"]["userInfo"]["username"] == op.identity.username
        as_sa("get", "vllmdataparallels.vllmdp.io", "-n", ns)
        as_sa("get", "rayclusters.ray.io", "-A")
        as_sa("get", "services", "-n", ns)

        def fenced() -> str:
            # RBAC grants creating Services; the chart's admission policy refuses one that is
            # no VLLMDataParallel's (until its binding is seen, the create goes through).
            made = op.kubectl("create", "--dry-run=server", "service", "clusterip", "probe",
                              "--tcp=8000:8000", "-n", ns, check=False)  # fmt: skip
            return made.stderr if made.returncode != 0 else ""

        refusal = testbed.wait_until("the fence to refuse a foreign Service", fenced, 30)
        assert "vllm-dp-operator admission policy" in refusal, refusal
        denied = op.kubectl("get", "secrets", "-n", ns, check=False)
        assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()


def _can(testbed: RunningTestbed, user: str, verb: str, resource: str, ns: str) -> bool:
    proc = testbed.kubectl("auth", "can-i", verb, resource, f"--as={user}", f"--namespace={ns}",
                           check=False)  # fmt: skip
    answer = proc.stdout.strip().splitlines()[-1:] or [""]
    if proc.returncode not in (0, 1) or answer[0] not in ("yes", "no"):
        raise AssertionError(f"kubectl auth can-i failed: {proc.stdout}{proc.stderr}")
    return answer[0] == "yes"


def test_namespace_edit_users_create_and_view_users_read(
    testbed: RunningTestbed, testbed_namespace: str, tmp_path: Path
) -> None:
    # The chart's aggregated roles reach the built-in edit/admin/view ClusterRoles through the
    # clusterrole-aggregation controller (this bed's kube-controller-manager runs it), so a
    # user bound to `edit` in a namespace manages VLLMDataParallels there, one bound to `view`
    # only reads them, and neither can in another namespace.
    from operator_proc import install_crd  # type: ignore[import-not-found, unused-ignore]

    install_crd(testbed)
    ns, suffix = testbed_namespace, os.urandom(3).hex()
    editor, viewer = f"alice-{suffix}", f"bob-{suffix}"
    for user, role in ((editor, "edit"), (viewer, "view")):
        testbed.kubectl("-n", ns, "create", "rolebinding", f"{role}-{suffix}",
                        f"--clusterrole={role}", f"--user={user}")  # fmt: skip
    resource = "vllmdataparallels.vllmdp.io"
    with _as_operator(testbed, ns, tmp_path) as op:
        aggregated = testbed.kubectl_json("get", "clusterrole", "edit")
        testbed.wait_until("the chart's editor role aggregated into edit", lambda: any(
            "vllmdataparallels" in (r.get("resources") or [])
            for r in testbed.kubectl_json("get", "clusterrole", "edit").get("rules") or []), 30)
        testbed.wait_until("the view role aggregated", lambda: _can(testbed, viewer, "list",
                                                                   resource, ns), 30)  # fmt: skip
        assert aggregated["metadata"]["name"] == "edit"
        for verb in ("create", "patch", "delete", "get", "list", "watch"):
            assert _can(testbed, editor, verb, resource, ns), (editor, verb)
        for verb in ("get", "list", "watch"):
            assert _can(testbed, viewer, verb, resource, ns), (viewer, verb)
        for verb in ("create", "patch", "delete"):
            assert not _can(testbed, viewer, verb, resource, ns), (viewer, verb)
        assert not _can(testbed, editor, "create", resource, "default")
        # A real create as each user, not only the authorizer's answer.
        doc = {"apiVersion": "vllmdp.io/v1alpha1", "kind": "VLLMDataParallel",
               "metadata": {"name": f"rbac-{suffix}", "namespace": ns},
               "spec": {"model": "m", "dataParallel": {"size": 2, "ranksPerNode": 1},
                        "suspend": True}}  # fmt: skip
        body = json.dumps(doc)
        refused = testbed.kubectl("create", f"--as={viewer}", "-f", "-", input=body, check=False)
        assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), refused.stderr
        testbed.kubectl("create", f"--as={editor}", "-f", "-", input=body)
        testbed.kubectl("get", f"--as={viewer}", "-n", ns, "vdp", f"rbac-{suffix}")
        testbed.kubectl("delete", f"--as={editor}", "-n", ns, "vdp", f"rbac-{suffix}",
                        "--wait=false")  # fmt: skip
        assert op.identity.objects  # the chart's roles were applied for this test
