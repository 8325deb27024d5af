"""The NetworkPolicy in front of the Ray pods: its rules, allowFrom, and the reconcile that keeps
it (created before the RayCluster, repaired after an edit or a delete, gone when turned off)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from vllm_dp_operator import constants as c
from vllm_dp_operator.api.validation import SpecError, validate
from vllm_dp_operator.config import Config, PolicyPeers, RenderOptions, parse_labels
from vllm_dp_operator.controller.kube import NETWORKPOLICY
from vllm_dp_operator.render.manifests import parse_resource, render_resource
from vllm_dp_operator.render.meta import owner_reference
from vllm_dp_operator.render.networkpolicy import (
    build_api_network_policy,
    build_egress_network_policy,
    build_network_policy,
)
from world import World, spec

OWNER = owner_reference("demo", "uid-demo")
PEERS = PolicyPeers(
    operator_namespace="vdp-system",
    operator_pod_labels=(("app.kubernetes.io/instance", "vdp"),
                         ("app.kubernetes.io/name", "vllm-dp-operator")),
    kuberay_namespace="kuberay",
)
OWN_PODS = {"matchLabels": {c.LABEL_INSTANCE: "demo", c.LABEL_COMPONENT: c.COMPONENT_ENGINE,
                            c.LABEL_MANAGED_BY: c.MANAGER}}  # fmt: skip


HEADS = {"matchLabels": {**OWN_PODS["matchLabels"], "ray.io/node-type": "head"}}


def policy(peers: PolicyPeers = PEERS, **over: Any) -> dict[str, Any]:
    validate("demo", spec(**over))  # the spec is valid; the Ray pods' policy reads none of it
    return build_network_policy("demo", "ns", peers, OWNER)


def api_policy(peers: PolicyPeers = PEERS, **over: Any) -> dict[str, Any]:
    return build_api_network_policy("demo", "ns", validate("demo", spec(**over)), peers, OWNER)


def rule_ports(rule: dict[str, Any]) -> list[int] | None:
    return [p["port"] for p in rule["ports"]] if "ports" in rule else None


def test_selects_every_ray_pod_of_the_resource_and_only_ingress() -> None:
    np = policy()
    assert np["apiVersion"] == "networking.k8s.io/v1" and np["kind"] == "NetworkPolicy"
    assert np["metadata"]["name"] == "demo-ray" and np["metadata"]["namespace"] == "ns"
    assert np["metadata"]["ownerReferences"] == [OWNER]
    assert np["metadata"]["labels"][c.LABEL_MANAGED_BY] == c.MANAGER  # cached by the reflector
    # Head and workers of any shape: no ray.io/cluster (its name carries the shape hash).
    assert np["spec"]["podSelector"] == OWN_PODS
    assert np["spec"]["policyTypes"] == ["Ingress"]  # egress (model downloads) untouched


def test_ray_ports_admit_the_cluster_the_operator_and_kuberay_only() -> None:
    own, operator, kuberay = policy()["spec"]["ingress"]
    # Every port from the cluster's own pods: Ray picks worker ports at random.
    assert own == {"from": [{"podSelector": OWN_PODS}]}
    assert operator["from"] == [{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "vdp-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/instance": "vdp",
                                        "app.kubernetes.io/name": "vllm-dp-operator"}},
    }]  # fmt: skip
    assert rule_ports(operator) == [c.RAY_DASHBOARD_PORT]
    assert kuberay["from"] == [{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
    }]  # fmt: skip
    assert rule_ports(kuberay) == [c.RAY_DASHBOARD_PORT]


def test_the_api_port_opens_on_the_head_pods_only() -> None:
    np = api_policy()
    assert np["metadata"]["name"] == "demo-api-port"
    assert np["metadata"]["ownerReferences"] == [OWNER]
    assert np["spec"]["podSelector"] == HEADS and np["spec"]["policyTypes"] == ["Ingress"]
    operator, api = np["spec"]["ingress"]
    assert operator["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "vdp-system"}
    assert rule_ports(operator) == [c.DEFAULT_SERVING_PORT]
    # The API port by default from the resource's own namespace and the namespaces labelled
    # for API access (issue 39); neither policy opens GCS or the client port.
    assert api == {"from": [{"podSelector": {}},
                            {"namespaceSelector": {"matchLabels": {c.LABEL_API_ACCESS: "true"}}}],
                   "ports": [{"protocol": "TCP", "port": c.DEFAULT_SERVING_PORT}]}  # fmt: skip
    for rule in (*policy()["spec"]["ingress"], operator, api):
        assert not {c.RAY_GCS_PORT, c.RAY_CLIENT_PORT} & set(rule_ports(rule) or [])


def test_api_port_follows_spec_service_port() -> None:
    operator, api = api_policy(service={"port": 9000})["spec"]["ingress"]
    assert rule_ports(api) == [9000] and rule_ports(operator) == [9000]


def test_allow_from_restricts_the_api_port() -> None:
    allow = [{"namespaceSelector": {"matchLabels": {"team": "y"}},
              "podSelector": {"matchLabels": {"role": "x"}}},
             {"podSelector": {"matchExpressions": [{"key": "tier", "operator": "Exists"}]}}]
    api = api_policy(service={"allowFrom": allow})["spec"]["ingress"][-1]
    assert api["from"] == [
        {"namespaceSelector": {"matchLabels": {"team": "y"}},
         "podSelector": {"matchLabels": {"role": "x"}}},
        {"podSelector": {"matchExpressions": [{"key": "tier", "operator": "Exists"}]}},
    ]  # fmt: skip
    assert rule_ports(api) == [c.DEFAULT_SERVING_PORT]


def test_the_api_ports_default_sources_are_the_operators_to_set() -> None:
    teams = dataclasses.replace(PEERS, api_namespace_labels=(("gateway", "yes"), ("team", "a")))
    assert api_policy(teams)["spec"]["ingress"][-1]["from"] == [
        {"podSelector": {}},
        {"namespaceSelector": {"matchLabels": {"gateway": "yes", "team": "a"}}},
    ]  # fmt: skip
    own = dataclasses.replace(PEERS, api_namespace_labels=())
    assert api_policy(own)["spec"]["ingress"][-1]["from"] == [{"podSelector": {}}]
    # Open to every pod, as before the default (a rule without `from`); allowFrom still wins.
    opened = dataclasses.replace(PEERS, api_open=True)
    assert "from" not in api_policy(opened)["spec"]["ingress"][-1]
    allow = [{"podSelector": {"matchLabels": {"role": "x"}}}]
    for peers in (opened, own, PEERS):
        assert api_policy(peers, service={"allowFrom": allow})["spec"]["ingress"][-1][
            "from"] == allow  # fmt: skip


def test_operator_outside_the_cluster_is_admitted_by_address_block() -> None:
    peers = PolicyPeers(operator_cidrs=("10.0.0.10/32",))
    rules = policy(peers)["spec"]["ingress"]
    assert rules[1] == {"from": [{"ipBlock": {"cidr": "10.0.0.10/32"}}],
                        "ports": [{"protocol": "TCP", "port": c.RAY_DASHBOARD_PORT}]}
    assert len(rules) == 2  # no operator or KubeRay namespace known: no pod peer for them
    assert api_policy(peers)["spec"]["ingress"][0] == {
        "from": [{"ipBlock": {"cidr": "10.0.0.10/32"}}],
        "ports": [{"protocol": "TCP", "port": c.DEFAULT_SERVING_PORT}]}


def test_kuberay_defaults_to_the_operator_namespace() -> None:
    peers = dataclasses.replace(PEERS, kuberay_namespace="")
    kuberay = policy(peers)["spec"]["ingress"][2]
    assert kuberay["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "vdp-system"}


def test_offline_render_puts_the_policy_first_unless_turned_off() -> None:
    doc = {"apiVersion": f"{c.GROUP}/{c.VERSION}", "kind": c.KIND,
           "metadata": {"name": "demo", "namespace": "ns"}, "spec": spec()}  # fmt: skip
    out = render_resource(parse_resource(doc), RenderOptions())
    assert [d["kind"] for d in out][:3] == ["NetworkPolicy", "NetworkPolicy", "RayCluster"]
    assert [d["metadata"]["name"] for d in out][:2] == ["demo-api-port", "demo-ray"]
    doc["spec"] = spec(networkPolicy={"enabled": False})
    assert "NetworkPolicy" not in [d["kind"] for d in
                                   render_resource(parse_resource(doc), RenderOptions())]
    off = RenderOptions(peers=PolicyPeers(enabled=False))
    doc["spec"] = spec()
    assert "NetworkPolicy" not in [d["kind"] for d in render_resource(parse_resource(doc), off)]


@pytest.mark.parametrize(("allow", "path"), [
    ([], "spec.service.allowFrom"),
    ([{"podSelector": {"matchLabels": {"a": "not a value"}}}],
     "spec.service.allowFrom[0].podSelector.matchLabels.a"),
    ([{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Equals"}]}}],
     "spec.service.allowFrom[0].podSelector.matchExpressions[0].operator"),
    ([{"ipBlock": {"cidr": "0.0.0.0/0"}}], "spec.service.allowFrom[0].ipBlock"),
])  # fmt: skip
def test_malformed_allow_from_is_refused_by_the_schema(allow: list[Any], path: str) -> None:
    with pytest.raises(SpecError) as info:
        validate("demo", spec(service={"allowFrom": allow}))
    assert path in [e.path for e in info.value.errors], info.value.errors


def test_network_policy_enabled_is_a_strict_boolean() -> None:
    with pytest.raises(SpecError, match=r"spec\.networkPolicy\.enabled"):
        validate("demo", spec(networkPolicy={"enabled": "false"}))


def test_peers_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "vdp-system")
    monkeypatch.setenv("VLLMDP_OPERATOR_POD_LABELS", "b=2,a=1")
    monkeypatch.setenv("VLLMDP_OPERATOR_CIDRS", "10.0.0.1/32, 10.0.0.2/32")
    monkeypatch.setenv("VLLMDP_NETWORK_POLICY", "false")
    peers = Config.from_env().render.peers
    assert peers.operator_namespace == "vdp-system" and not peers.enabled
    assert peers.operator_pod_labels == (("a", "1"), ("b", "2"))
    assert peers.operator_cidrs == ("10.0.0.1/32", "10.0.0.2/32")
    assert peers.kuberay_pod_labels == (("app.kubernetes.io/name", "kuberay-operator"),)
    assert peers.api_namespace_labels == ((c.LABEL_API_ACCESS, "true"),) and not peers.api_open
    monkeypatch.setenv("VLLMDP_API_NAMESPACE_LABELS", "")  # set, empty: no other namespace
    monkeypatch.setenv("VLLMDP_API_PORT_OPEN", "true")
    peers = Config.from_env().render.peers
    assert peers.api_namespace_labels == () and peers.api_open
    monkeypatch.setenv("VLLMDP_API_NAMESPACE_LABELS", "gateway=yes")
    assert Config.from_env().render.peers.api_namespace_labels == (("gateway", "yes"),)
    with pytest.raises(ValueError, match="VLLMDP_X"):
        parse_labels("VLLMDP_X", "novalue")


# ---------------------------------------------------------------- the reconcile keeps it


def _policies(w: World) -> list[dict[str, Any]]:
    return w.kube.named(NETWORKPOLICY)


async def test_reconcile_creates_the_policies_before_the_cluster() -> None:
    w = World()
    await w.step()
    assert sorted(np["metadata"]["name"] for np in _policies(w)) == ["demo-api-port", "demo-ray"]
    assert {np["metadata"]["ownerReferences"][0]["uid"] for np in _policies(w)} == {"uid-demo"}
    creates = [kind for verb, kind, _ in w.kube.writes if verb == "create"]
    assert creates.index("networkpolicies") < creates.index("rayclusters")


async def test_an_upgrade_opens_the_head_policy_before_the_old_rule_goes() -> None:
    w = World()
    await w.step()
    key = (NETWORKPOLICY, "default", "demo-ray")
    old = dict(w.kube.objects[key])
    old["spec"] = {**old["spec"], "ingress": [*old["spec"]["ingress"],
                                               {"ports": [{"protocol": "TCP", "port": 8000}]}]}
    w.kube.objects[key] = old  # as an earlier version left it: the API rule on every Ray pod
    del w.kube.objects[(NETWORKPOLICY, "default", "demo-api-port")]
    w.kube.writes.clear()
    await w.step()
    writes = [(verb, kind) for verb, kind, _ in w.kube.writes if kind == "networkpolicies"]
    assert writes == [("create", "networkpolicies"), ("patch", "networkpolicies")]


async def test_an_edited_policy_is_put_back_and_a_deleted_one_recreated() -> None:
    w = World()
    await w.step()
    key = (NETWORKPOLICY, "default", "demo-ray")
    w.kube.objects[key]["spec"]["ingress"] = [{}]  # someone opens every port
    await w.step()
    assert w.kube.objects[key]["spec"]["ingress"][0] == {"from": [{"podSelector": OWN_PODS}]}
    del w.kube.objects[key]
    await w.step()
    assert key in w.kube.objects
    writes = len(w.kube.writes)
    await w.step()
    assert len(w.kube.writes) == writes  # in line: no write


async def test_turning_it_off_deletes_ours_and_leaves_a_namesakes_alone() -> None:
    w = World()
    await w.step()
    w.update(spec(networkPolicy={"enabled": False}))
    await w.step()
    assert _policies(w) == []
    # Another uid's policy of that name (a deleted namesake's) is neither changed nor deleted.
    w.update(spec())
    foreign = {"metadata": {"name": "demo-ray", "namespace": "default",
                            "ownerReferences": [{**OWNER, "uid": "uid-old"}]},
               "spec": {"podSelector": {}}}  # fmt: skip
    w.kube.objects[(NETWORKPOLICY, "default", "demo-ray")] = foreign
    await w.step()
    assert w.kube.objects[(NETWORKPOLICY, "default", "demo-ray")] == foreign
    assert sorted(np["metadata"]["name"] for np in _policies(w)) == ["demo-api-port", "demo-ray"]


# ---------------------------------------------------------------- egress (opt-in)

EGRESS_ON = {"egress": {"enabled": True, "allowTo": [
    {"cidr": "10.20.0.0/16", "ports": [443, 9000]},
    {"namespaceSelector": {"matchLabels": {"team": "models"}},
     "podSelector": {"matchLabels": {"app": "cache"}}}]}}  # fmt: skip


def test_egress_is_open_unless_asked() -> None:
    doc = {"apiVersion": f"{c.GROUP}/{c.VERSION}", "kind": c.KIND,
           "metadata": {"name": "demo", "namespace": "ns"}, "spec": spec()}  # fmt: skip
    out = render_resource(parse_resource(doc), RenderOptions())
    assert [d["metadata"]["name"] for d in out if d["kind"] == "NetworkPolicy"] == [
        "demo-api-port", "demo-ray"]
    assert all(d["spec"]["policyTypes"] == ["Ingress"] for d in out if d["kind"] == "NetworkPolicy")


def test_egress_policy_allows_own_pods_dns_and_the_listed_destinations_only() -> None:
    np = build_egress_network_policy("demo", "ns", validate("demo", spec(networkPolicy=EGRESS_ON)),
                                     OWNER)  # fmt: skip
    assert np["metadata"]["name"] == "demo-egress" and np["metadata"]["ownerReferences"] == [OWNER]
    assert np["spec"]["podSelector"] == OWN_PODS and np["spec"]["policyTypes"] == ["Egress"]
    own, dns, block, pods = np["spec"]["egress"]
    assert own == {"to": [{"podSelector": OWN_PODS}]}  # every port: Ray's own traffic
    assert dns == {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    assert block == {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}],
                     "ports": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 9000}]}
    assert pods == {"to": [{"namespaceSelector": {"matchLabels": {"team": "models"}},
                            "podSelector": {"matchLabels": {"app": "cache"}}}]}  # any port
    # Nothing else: no rule without `to` but DNS's, so the metadata address and the API server
    # are out of reach unless listed.
    assert [r for r in np["spec"]["egress"] if "to" not in r] == [dns]


@pytest.mark.parametrize(("np", "path"), [
    ({"enabled": False, "egress": {"enabled": True}}, "spec.networkPolicy.egress.enabled"),
    ({"egress": {"enabled": True, "allowTo": [{}]}}, "spec.networkPolicy.egress.allowTo"),
    ({"egress": {"enabled": True, "allowTo": [{"cidr": "10.0.0.0/8", "podSelector": {}}]}},
     "spec.networkPolicy.egress.allowTo"),
    ({"egress": {"allowTo": [{"cidr": "10.0.0.300/8"}]}},
     "spec.networkPolicy.egress.allowTo[0].cidr"),
    ({"egress": {"allowTo": [{"cidr": "2001:db8::1::2/64"}]}},
     "spec.networkPolicy.egress.allowTo[0].cidr"),
    ({"egress": {"allowTo": [{"cidr": "10.0.0.0/8", "ports": [0]}]}},
     "spec.networkPolicy.egress.allowTo[0].ports[0]"),
    ({"egress": {"allowTo": [{"podSelector": {"matchExpressions": [
        {"key": "a", "operator": "Exists", "values": ["x"]}]}}]}},
     "spec.networkPolicy.egress.allowTo"),
])  # fmt: skip
def test_a_bad_egress_spec_is_refused_naming_the_field(np: dict[str, Any], path: str) -> None:
    with pytest.raises(SpecError) as info:
        validate("demo", spec(networkPolicy=np))
    assert path in [e.path for e in info.value.errors], info.value.errors


async def test_egress_policy_comes_and_goes_with_the_spec() -> None:
    w = World()
    await w.step()
    w.update(spec(networkPolicy=EGRESS_ON))
    await w.step()
    assert sorted(np["metadata"]["name"] for np in _policies(w)) == [
        "demo-api-port", "demo-egress", "demo-ray"]
    w.update(spec())
    await w.step()
    assert sorted(np["metadata"]["name"] for np in _policies(w)) == ["demo-api-port", "demo-ray"]
