"""Least privilege of the rendered RBAC, for every values file.

REQUIRED lists what the operator and kopf use; the test fails if any of it disappears.
ALLOWED_EXTRA lists what only some values switch on. Anything else rendered (a new verb, a
wildcard, any Secret access) fails too: widening the RBAC means changing this file on purpose.
"""

from __future__ import annotations

from pathlib import Path

import chartlib
import pytest
from chartlib import Grant

# (apiGroup, resource, verb) the operator's own code uses, in the watched namespace(s).
REQUIRED: frozenset[tuple[str, str, str]] = frozenset(
    [("vllmdp.io", "vllmdataparallels", v) for v in ("get", "list", "watch", "patch")]
    + [("vllmdp.io", "vllmdataparallels/status", v) for v in ("get", "patch")]
    # blockOwnerDeletion on children, under OwnerReferencesPermissionEnforcement.
    + [("vllmdp.io", "vllmdataparallels/finalizers", "update")]
    + [
        ("ray.io", r, v)
        for r in ("rayclusters", "rayjobs")
        for v in ("get", "list", "watch", "create", "patch", "delete")
    ]
    + [("", "services", v) for v in ("get", "list", "watch", "create", "patch", "delete")]
    # The NetworkPolicy in front of each resource's Ray pods, cached through a watch.
    + [("networking.k8s.io", "networkpolicies", v)
       for v in ("get", "list", "watch", "create", "patch", "delete")]
    # The PodDisruptionBudget over each resource's Ray pods (two replicas or more), cached.
    + [("policy", "poddisruptionbudgets", v)
       for v in ("get", "list", "watch", "create", "patch", "delete")]
    # The Service's own EndpointSlice; delete also takes what an earlier version's selector
    # left (the controllers' slices, and the stale Endpoints they would be mirrored from).
    + [("discovery.k8s.io", "endpointslices", v)
       for v in ("get", "list", "watch", "create", "patch", "delete")]
    + [("", "endpoints", "delete")]
    # Read only: the head pod's address and readiness, and why Ray pods are Pending.
    + [("", "pods", v) for v in ("get", "list", "watch")]
    # Read only: the launcher's report in the head container's log, while a head job launches.
    + [("", "pods/log", "get")]
    + [(g, "events", v) for g in ("", "events.k8s.io") for v in ("create", "patch")]
    # Each resource's Ray token Secret: created only; the token is derived, never read back.
    + [("", "secrets", "create")]
    # Kueue's Workloads, read only: why a RayCluster in a LocalQueue is Queued or Preempted.
    + [("kueue.x-k8s.io", "workloads", v) for v in ("get", "list", "watch")]
)
# kopf 1.45 (kopf/_core/reactor/observation.py): watches CRDs always; lists/watches Namespaces
# only in --namespace mode. Cluster-scoped, read-only; switched by rbac.frameworkObservation.
KOPF_CRDS: frozenset[tuple[str, str, str]] = frozenset(
    ("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")
)
KOPF_NAMESPACES: frozenset[tuple[str, str, str]] = frozenset(
    ("", "namespaces", v) for v in ("list", "watch")
)
# GET /health and the Ray job API, POST a Ray job stop: apiserver-proxy mode only.
PROXY: frozenset[tuple[str, str, str]] = frozenset(
    {("", "services/proxy", "get"), ("", "services/proxy", "create")}
)

# Leader election: the one Lease, read by name, created once, renewed by update (with its
# resourceVersion as precondition); in the release namespace only, as a Role.
LEASES: frozenset[tuple[str, str, str]] = frozenset(
    ("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")
)

# The secure /metrics: who a scraper's token is, and whether it may get /metrics. Cluster-scoped
# questions that store nothing; on whenever the metrics port is served with auth (the default).
METRICS_AUTH: frozenset[tuple[str, str, str]] = frozenset(
    {("authentication.k8s.io", "tokenreviews", "create"),
     ("authorization.k8s.io", "subjectaccessreviews", "create")}
)

FORBIDDEN_VERBS = {"*", "escalate", "bind", "impersonate", "deletecollection"}
# `update` only where a finalizer subresource needs it; everything else is patched.
UPDATE_ALLOWED = {("vllmdp.io", "vllmdataparallels/finalizers"),
                  ("coordination.k8s.io", "leases")}
FORBIDDEN_RESOURCES = {"*", "pods/exec", "pods/attach", "pods/portforward",
                       "serviceaccounts/token", "nodes", "configmaps"}

CI = {p.stem: p for p in chartlib.CI_VALUES}
CASES = [pytest.param((), id="defaults")] + [pytest.param((p,), id=p.stem) for p in CI.values()]


def _triples(gs: set[Grant]) -> set[tuple[str, str, str]]:
    return {(g.group, g.resource, g.verb) for g in gs}


def _render(values: tuple[Path, ...] = (), set_values: tuple[str, ...] = ()) -> set[Grant]:
    return chartlib.grants(chartlib.render(values, set_values))


@pytest.mark.parametrize("values", CASES)
def test_no_wildcards_no_secrets_no_escalation(helm_bin: str, values: tuple[Path, ...]) -> None:
    for g in _render(values):
        assert "*" not in (g.group, g.resource, g.verb), g
        assert g.verb not in FORBIDDEN_VERBS, g
        assert g.verb != "update" or (g.group, g.resource) in UPDATE_ALLOWED, g
        assert g.resource not in FORBIDDEN_RESOURCES, g
        assert g.resource != "secrets" or g.verb == "create", g  # never read one
        # No pod is written: routing is the operator's EndpointSlice, not a pod label.
        assert g.resource != "pods" or g.verb in ("get", "list", "watch"), g
        assert g.group not in ("rbac.authorization.k8s.io", "apps", "batch"), g


@pytest.mark.parametrize("values", CASES)
def test_required_permissions_present(helm_bin: str, values: tuple[Path, ...]) -> None:
    missing = (REQUIRED | LEASES | METRICS_AUTH) - _triples(_render(values))
    assert not missing, f"missing permissions: {sorted(missing)}"


@pytest.mark.parametrize("values", CASES)
def test_nothing_beyond_the_known_lists(helm_bin: str, values: tuple[Path, ...]) -> None:
    extra = (_triples(_render(values)) - REQUIRED - KOPF_CRDS - KOPF_NAMESPACES - PROXY - LEASES
             - METRICS_AUTH)
    assert not extra, f"permissions not in this test's lists: {sorted(extra)}"


def test_default_is_cluster_role_without_proxy_or_namespaces(helm_bin: str) -> None:
    objects = chartlib.render()
    assert {o["kind"] for o in chartlib.rbac_objects(objects)} == {
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    assert _triples({g for g in chartlib.grants(objects) if g.kind == "Role"}) == LEASES
    triples = _triples(chartlib.grants(objects))
    assert triples >= KOPF_CRDS
    assert not (PROXY & triples), "services/proxy must be granted only for apiserver-proxy"
    # --all-namespaces: kopf never lists namespaces, so neither may the operator.
    assert not (KOPF_NAMESPACES & triples)


@pytest.mark.parametrize("values", CASES)
def test_cluster_role_and_role_grant_update_on_finalizers(
    helm_bin: str, values: tuple[Path, ...]
) -> None:
    # Whichever scope renders the operator's rules, it may set blockOwnerDeletion.
    gs = _render(values)
    kinds = {g.kind for g in gs if (g.resource, g.verb) == ("vllmdataparallels/finalizers",
                                                            "update")}  # fmt: skip
    own = {g.kind for g in gs if g.resource == "rayjobs"}
    assert kinds == own and kinds, (kinds, own)


def test_apiserver_proxy_adds_only_services_proxy_get_and_create(helm_bin: str) -> None:
    base = _triples(_render())
    proxy = _triples(_render((CI["apiserver-proxy-values"],)))
    assert proxy - base == PROXY
    assert base - proxy == set()


def test_listed_namespaces_get_a_role_and_binding_each(helm_bin: str) -> None:
    objects = chartlib.render((CI["namespace-scope-values"],))
    gs = chartlib.grants(objects)
    namespaced = {g for g in gs if g.kind == "Role" and g.resource != "leases"}
    assert {g.namespace for g in namespaced} == {"llm-serving", "llm-batch"}
    for ns in ("llm-serving", "llm-batch"):
        assert _triples({g for g in namespaced if g.namespace == ns}) == REQUIRED
    # What stays cluster-wide is kopf's read-only observation and the /metrics reviews,
    # nothing of the operator's own.
    assert _triples({g for g in gs if g.kind == "ClusterRole"}) == (
        KOPF_CRDS | KOPF_NAMESPACES | METRICS_AUTH)
    bindings = [b for b in chartlib.by_kind(objects, "RoleBinding")
                if not b["metadata"]["name"].endswith("-leader-election")]  # fmt: skip
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["llm-batch", "llm-serving"]
    for binding in bindings:
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "vdp-vllm-dp-operator",
                                        "namespace": chartlib.DEFAULT_NAMESPACE}]
    assert not [b for b in chartlib.by_kind(objects, "ClusterRoleBinding")
                if b["roleRef"]["name"] == "vdp-vllm-dp-operator"]  # fmt: skip


def test_listed_namespaces_without_observation_have_no_cluster_rbac(helm_bin: str) -> None:
    objects = chartlib.render((CI["namespace-scope-no-observation-values"],))
    # Cluster-wide, only the token and access reviews of the secure /metrics (and the roles
    # the chart offers, bound by no one here).
    cluster = {g for g in chartlib.grants(objects) if g.kind == "ClusterRole"}
    assert _triples(cluster) == METRICS_AUTH
    roles = [r for r in chartlib.by_kind(objects, "Role")
             if not r["metadata"]["name"].endswith("-leader-election")]  # fmt: skip
    assert [r["metadata"]["namespace"] for r in roles] == ["llm-serving"]


def test_single_namespace_observes_namespaces(helm_bin: str) -> None:
    triples = _triples(_render((CI["single-namespace-values"],)))
    assert triples >= KOPF_NAMESPACES


EDITOR_VERBS = {"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"}


def _aggregated(objects: list[dict]) -> dict[str, dict]:  # type: ignore[type-arg]
    return {r["metadata"]["name"]: r for r in chartlib.by_kind(objects, "ClusterRole")
            if any(k.startswith("rbac.authorization.k8s.io/aggregate-to-")
                   for k in r["metadata"]["labels"])}  # fmt: skip


@pytest.mark.parametrize("values", [(), (CI["namespace-scope-values"],)], ids=["all", "listed"])
def test_aggregated_roles_for_namespace_edit_and_view_users(
    helm_bin: str, values: tuple[Path, ...]
) -> None:
    objects = chartlib.render(values)
    roles = _aggregated(objects)
    editor = roles.pop("vdp-vllm-dp-operator-vllmdataparallel-editor")
    viewer = roles.pop("vdp-vllm-dp-operator-vllmdataparallel-viewer")
    assert not roles
    agg = "rbac.authorization.k8s.io/aggregate-to-"
    assert {k: v for k, v in editor["metadata"]["labels"].items() if k.startswith(agg)} == {
        f"{agg}edit": "true", f"{agg}admin": "true"}
    assert {k: v for k, v in viewer["metadata"]["labels"].items() if k.startswith(agg)} == {
        f"{agg}view": "true"}

    def rules(role: dict) -> set[tuple[str, str, str]]:  # type: ignore[type-arg]
        return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"]
                for r in rule["resources"] for v in rule["verbs"]}  # fmt: skip

    assert rules(editor) == ({("vllmdp.io", "vllmdataparallels", v) for v in EDITOR_VERBS}
                             | {("vllmdp.io", "vllmdataparallels/status", "get")}
                             | {("vllmdp.io", "vllmdataparallels/scale", v)
                                for v in ("get", "update", "patch")})  # fmt: skip
    assert rules(viewer) == {("vllmdp.io", r, v)
                             for r in ("vllmdataparallels", "vllmdataparallels/status",
                                       "vllmdataparallels/scale")
                             for v in ("get", "list", "watch")}  # fmt: skip
    # Offered to the built-in roles, bound by no one: the operator gets none of it.
    bound = {b["roleRef"]["name"] for b in objects if b["kind"].endswith("RoleBinding")}
    assert not bound & {editor["metadata"]["name"], viewer["metadata"]["name"]}


def test_aggregated_roles_can_be_left_out(helm_bin: str) -> None:
    objects = chartlib.render(set_values=("rbac.aggregateToDefaultRoles=false",))
    assert not _aggregated(objects)


@pytest.mark.parametrize("values", CASES)
def test_leases_only_in_the_release_namespace_as_a_role(
    helm_bin: str, values: tuple[Path, ...]
) -> None:
    leases = {g for g in _render(values) if g.resource == "leases"}
    assert _triples(leases) == LEASES
    assert {(g.kind, g.namespace) for g in leases} == {("Role", chartlib.DEFAULT_NAMESPACE)}


def test_no_lease_rbac_without_leader_election(helm_bin: str) -> None:
    gs = _render(set_values=("leaderElection.enabled=false", "replicas=1"))
    assert not {g for g in gs if g.resource == "leases"}


def test_rbac_create_false_renders_no_rbac(helm_bin: str) -> None:
    objects = chartlib.render(set_values=("rbac.create=false",))
    assert not chartlib.grants(objects)
    assert not [o for o in objects if o["kind"].endswith("RoleBinding")]


def test_bindings_point_at_the_chart_service_account(helm_bin: str) -> None:
    for values in [(), (CI["namespace-scope-values"],)]:
        objects = chartlib.render(values)
        sa = chartlib.by_kind(objects, "ServiceAccount")[0]["metadata"]["name"]
        deployment = chartlib.by_kind(objects, "Deployment")[0]
        assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == sa
        role_names = {(o["kind"], o["metadata"]["name"]) for o in objects
                      if o["kind"] in ("Role", "ClusterRole")}
        for binding in [o for o in objects if o["kind"].endswith("RoleBinding")]:
            assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa,
                                            "namespace": chartlib.DEFAULT_NAMESPACE}]
            ref = binding["roleRef"]
            assert (ref["kind"], ref["name"]) in role_names
