"""Render the NetworkPolicies that close a resource's Ray pods to all but the cluster itself.

Ray's ports (GCS, dashboard and job API, client, object and node managers, workers) carry no
authentication of their own: whoever reaches the dashboard runs code on the GPU pods. The
first policy (`<name>-ray`) selects every Ray pod of the resource (head and workers, of every
cluster shape) and admits, for ingress:

- every port from those same pods (Ray picks its worker ports at random);
- the dashboard from the operator's pods (the Ray job API), and from the operator's address
  blocks when it runs outside the pod network;
- the dashboard from KubeRay's operator pods (HTTP-mode RayJobs are submitted and polled there).

The second (`<name>-api-port`) selects only the head pods, where vLLM's API server listens,
and admits the API port from the operator (/health, /metrics, the LoRA calls) and from
`spec.service.allowFrom` when that is set; else from the resource's own namespace and the
namespaces that carry the operator's API-access labels (`vllmdp.io/api-access: "true"` by
default: a gateway's, an ingress controller's, Prometheus's), or from everywhere where the
operator is set so (VLLMDP_API_PORT_OPEN). A worker's port of the same number (a Ray, NCCL or
ZMQ listener may take it) stays closed to all but the cluster itself.
Policies add up, so the API policy is written before the other drops its old API rule.

Egress is left alone unless `spec.networkPolicy.egress.enabled`: the engines download models
and reach whatever the user points them at. With it, a third policy (`<name>-egress`) selects
every Ray pod and lets it connect only to the resource's own Ray pods, to port 53 anywhere
(DNS, wherever the cluster serves it: a kube-dns pod, NodeLocal DNSCache, a node), and to
`allowTo`. Answers to connections made to the pods (the operator's, KubeRay's, clients') are
not egress connections and need no rule.
"""

from __future__ import annotations

from typing import Any

from vllm_dp_operator import constants
from vllm_dp_operator.api import names
from vllm_dp_operator.api.models import (
    EgressDestination,
    LabelSelector,
    TrafficSource,
    VLLMDataParallelSpec,
)
from vllm_dp_operator.config import Labels, PolicyPeers
from vllm_dp_operator.render.meta import metadata

#: The namespace label the API server sets on every namespace (Kubernetes >= 1.22).
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def ray_pod_selector(instance: str) -> dict[str, Any]:
    """The Ray pods of one resource, whatever their cluster's shape (the pod template's
    labels): a reshape's new pods are covered before they exist, the old ones until gone."""
    labels = names.instance_labels(instance, constants.COMPONENT_ENGINE)
    # KubeRay may set app.kubernetes.io/name on the pods it makes (to `kuberay`): not relied on.
    labels.pop(constants.LABEL_NAME)
    return {"matchLabels": labels}


def _ports(*numbers: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": n} for n in dict.fromkeys(numbers)]


def _in_namespace(namespace: str, labels: Labels) -> dict[str, Any]:
    return {
        "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}},
        "podSelector": {"matchLabels": dict(labels)},
    }


def _values(values: list[str]) -> dict[str, Any]:
    return {"values": list(values)} if values else {}


def _selector(sel: LabelSelector) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if sel.match_labels:
        out["matchLabels"] = dict(sel.match_labels)
    if sel.match_expressions:
        out["matchExpressions"] = [
            {"key": e.key, "operator": str(e.operator), **_values(e.values)}
            for e in sel.match_expressions
        ]
    return out


def _peer(source: TrafficSource | EgressDestination) -> dict[str, Any]:
    """The selectors of an allowFrom or allowTo entry, as a NetworkPolicy peer."""
    peer: dict[str, Any] = {}
    if source.namespace_selector is not None:
        peer["namespaceSelector"] = _selector(source.namespace_selector)
    if source.pod_selector is not None:
        peer["podSelector"] = _selector(source.pod_selector)
    return peer


def operator_peers(peers: PolicyPeers) -> list[dict[str, Any]]:
    """The operator's pods (by namespace and labels) and its address blocks."""
    out: list[dict[str, Any]] = []
    if peers.operator_namespace:
        out.append(_in_namespace(peers.operator_namespace, peers.operator_pod_labels))
    out += [{"ipBlock": {"cidr": cidr}} for cidr in peers.operator_cidrs]
    return out


def kuberay_peers(peers: PolicyPeers) -> list[dict[str, Any]]:
    """KubeRay's operator pods: in its namespace, else the operator's; none if neither is known."""
    namespace = peers.kuberay_namespace or peers.operator_namespace
    return [_in_namespace(namespace, peers.kuberay_pod_labels)] if namespace else []


def build_network_policy(
    instance: str, namespace: str, peers: PolicyPeers, owner: dict[str, Any] | None
) -> dict[str, Any]:
    """The NetworkPolicy in front of all of one resource's Ray pods (the module docstring):
    nothing of the spec, whose API port is the head policy's."""
    own_pods = ray_pod_selector(instance)
    dashboard = constants.RAY_DASHBOARD_PORT
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": own_pods}]}]
    if operator := operator_peers(peers):
        ingress.append({"from": operator, "ports": _ports(dashboard)})
    if kuberay := kuberay_peers(peers):
        ingress.append({"from": kuberay, "ports": _ports(dashboard)})
    return _policy(names.network_policy(instance), instance, namespace, own_pods, ingress, owner)


def api_sources(spec: VLLMDataParallelSpec, peers: PolicyPeers) -> list[dict[str, Any]] | None:
    """The peers the API port admits besides the operator; None: every source (a rule without
    `from`). allowFrom is never empty (the schema), so it never opens the port by accident."""
    if spec.service.allow_from is not None:
        return [_peer(s) for s in spec.service.allow_from]
    if peers.api_open:
        return None
    own: list[dict[str, Any]] = [{"podSelector": {}}]  # every pod of the policy's namespace
    if peers.api_namespace_labels:
        own.append({"namespaceSelector": {"matchLabels": dict(peers.api_namespace_labels)}})
    return own


def build_api_network_policy(
    instance: str,
    namespace: str,
    spec: VLLMDataParallelSpec,
    peers: PolicyPeers,
    owner: dict[str, Any] | None,
    api_ports: tuple[int, ...] = (),
) -> dict[str, Any]:
    """The NetworkPolicy that opens the API port on one resource's head pods only; with
    `api_ports`, the ports the live generations listen on as well (during a Surge that changes
    spec.service.port, the old one's until it is gone)."""
    heads = ray_pod_selector(instance)
    heads["matchLabels"][constants.LABEL_RAY_NODE_TYPE] = "head"
    ports = sorted({spec.service.port, *api_ports})
    ingress: list[dict[str, Any]] = []
    if operator := operator_peers(peers):
        ingress.append({"from": operator, "ports": _ports(*ports)})
    api_rule: dict[str, Any] = {"ports": _ports(*ports)}
    if (sources := api_sources(spec, peers)) is not None:
        api_rule = {"from": sources, **api_rule}
    ingress.append(api_rule)
    return _policy(names.api_network_policy(instance), instance, namespace, heads, ingress,
                   owner)  # fmt: skip


def _destination(dest: EgressDestination) -> dict[str, Any]:
    peer = {"ipBlock": {"cidr": dest.cidr}} if dest.cidr is not None else _peer(dest)
    rule: dict[str, Any] = {"to": [peer]}
    if dest.ports:
        rule["ports"] = _ports(*dest.ports)
    return rule


def build_egress_network_policy(
    instance: str, namespace: str, spec: VLLMDataParallelSpec, owner: dict[str, Any] | None
) -> dict[str, Any]:
    """The opt-in policy that limits the Ray pods' connections (the module docstring)."""
    own_pods = ray_pod_selector(instance)
    dns = [{"protocol": proto, "port": 53} for proto in ("UDP", "TCP")]
    egress: list[dict[str, Any]] = [{"to": [{"podSelector": own_pods}]}, {"ports": dns}]
    egress += [_destination(d) for d in spec.network_policy.egress.allow_to]
    return _policy(names.egress_network_policy(instance), instance, namespace, own_pods,
                   egress, owner, direction="Egress")  # fmt: skip


def build_network_policies(
    instance: str, namespace: str, spec: VLLMDataParallelSpec, peers: PolicyPeers,
    owner: dict[str, Any] | None, api_ports: tuple[int, ...] = (),
) -> list[dict[str, Any]]:  # fmt: skip
    """The policies, the API port's first (see the module docstring); the egress one when the
    spec asks for it."""
    out = [build_api_network_policy(instance, namespace, spec, peers, owner, api_ports),
           build_network_policy(instance, namespace, peers, owner)]  # fmt: skip
    if spec.network_policy.egress.enabled:
        out.append(build_egress_network_policy(instance, namespace, spec, owner))
    return out


def _policy(name: str, instance: str, namespace: str, pods: dict[str, Any],
            rules: list[dict[str, Any]], owner: dict[str, Any] | None,
            direction: str = "Ingress") -> dict[str, Any]:  # fmt: skip
    """A policy of the resource over `pods`, with `rules` for one direction."""
    labels = names.instance_labels(instance, constants.COMPONENT_NETWORK_POLICY)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(name, namespace, labels, owner),
        "spec": {"podSelector": pods, "policyTypes": [direction], direction.lower(): rules},
    }


def wanted(spec: VLLMDataParallelSpec, peers: PolicyPeers) -> bool:
    """Whether the resource gets a NetworkPolicy: on unless the operator or the spec says off."""
    return peers.enabled and spec.network_policy.enabled
