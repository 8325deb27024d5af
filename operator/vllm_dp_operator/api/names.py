"""Names of every child object, derived in one place."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from vllm_dp_operator import constants


def content_hash(obj: Any, length: int = 8) -> str:
    """A short stable hash of a JSON-serialisable object."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def raycluster(instance: str, cluster_hash: str, replica: int = 0) -> str:
    """RayCluster name: one per cluster shape and replica, so a reshape never reuses stale pods.

    Replica 0 has the name a resource had before replicas (no RayCluster is replaced on an
    upgrade); replica r > 0 adds `-r<r>`, within KubeRay's 53 characters for any admitted name.
    """
    base = f"{instance}-{cluster_hash[:5]}"
    return f"{base}-r{replica}" if replica else base


_BASE36 = "0123456789abcdefghijklmnopqrstuvwxyz"
_TAG_DIGITS = constants.ATTEMPT_SUFFIX - 2  # after "-j"
#: A replica above 0 has its index in the tag's first two digits, the attempt in the rest.
_REPLICA_DIGITS = 2


def _base36(n: int, width: int) -> str:
    digits = ""
    for _ in range(width):
        n, r = divmod(n, 36)
        digits = _BASE36[r] + digits
    return digits


def attempt_tag(attempt: int, replica: int = 0) -> str:
    """The attempt as fixed-width base 36: replica 0's as it always was, five digits that
    wrap after 36^5 - 1 ('00001', '0000a', ...); another replica's, two digits of its index
    and three of the attempt, which wrap after 36^3 - 1 ('01001': replica 1, attempt 1)."""
    if replica == 0:
        return _base36(attempt % 36**_TAG_DIGITS, _TAG_DIGITS)
    attempt_digits = _TAG_DIGITS - _REPLICA_DIGITS
    return _base36(replica, _REPLICA_DIGITS) + _base36(attempt % 36**attempt_digits,
                                                        attempt_digits)  # fmt: skip


def head_job(instance: str, attempt: int, replica: int = 0) -> str:
    """Head RayJob name for a replica's launch attempt; also the Ray job's submission id.

    A fixed-width suffix keeps every attempt within KubeRay's 47-character RayJob limit for
    any resource name the CRD admits (a growing decimal suffix did not). Replica 0's is
    `-j<attempt>`, the name every head job had before replicas; another replica's is
    `-r<replica><attempt>`, so the two never meet.
    """
    return f"{instance}-{'r' if replica else 'j'}{attempt_tag(attempt, replica)}"


def replica_of(obj: dict[str, Any]) -> int:
    """The replica a child belongs to: its label, or 0 for one made before replicas."""
    labels = obj.get("metadata", {}).get("labels") or {}
    try:
        return int(labels.get(constants.LABEL_REPLICA, "0"))
    except ValueError:
        return -1  # not ours to place: no replica adopts it


def replica_labels(replica: int) -> dict[str, str]:
    """The label that says which replica a RayCluster, head job or Ray pod belongs to."""
    return {constants.LABEL_REPLICA: str(replica)}


def head_service(cluster: str) -> str:
    """KubeRay's Service in front of the Ray head pod: the dashboard and declared ports."""
    return f"{cluster}{constants.HEAD_SERVICE_SUFFIX}"


def ray_token_secret(instance: str) -> str:
    """Secret holding the Ray cluster's auth token (KubeRay authOptions.secretName).

    One per resource, whatever the cluster's shape: a reshape keeps the token.
    """
    return f"{instance}{constants.RAY_TOKEN_SECRET_SUFFIX}"


def service(instance: str) -> str:
    """API Service name; the suffix keeps it from ever being `vllm` (vllm#34199)."""
    return f"{instance}{constants.API_SERVICE_SUFFIX}"


def endpoint_slice(instance: str) -> str:
    """The API Service's one EndpointSlice, the operator's: named as the Service it serves.

    The EndpointSlice controller names its slices `<service>-<random>`, so this never clashes.
    """
    return service(instance)


def network_policy(instance: str) -> str:
    """The NetworkPolicy in front of the resource's Ray pods."""
    return f"{instance}{constants.NETWORK_POLICY_SUFFIX}"


def disruption_budget(instance: str) -> str:
    """The PodDisruptionBudget over every replica's Ray pods (spec.replicas of 2 or more)."""
    return f"{instance}{constants.DISRUPTION_BUDGET_SUFFIX}"


def api_network_policy(instance: str) -> str:
    """The NetworkPolicy that admits the API port, on the resource's head pods only."""
    return f"{instance}{constants.API_POLICY_SUFFIX}"


def egress_network_policy(instance: str) -> str:
    """The NetworkPolicy that limits where the resource's Ray pods connect (opt-in)."""
    return f"{instance}{constants.EGRESS_POLICY_SUFFIX}"


def endpoint(instance: str, namespace: str, port: int) -> str:
    """In-cluster base URL of the OpenAI-compatible API, as a user types it.

    Short on purpose: it is text for people and for clients configured once, it holds in any
    cluster whatever its domain, and a client pays the search-path lookups once per
    connection. The operator's own probes, repeated every few seconds, use `service_fqdn`.
    """
    return f"http://{service(instance)}.{namespace}.svc:{port}/v1"


def service_fqdn(service_name: str, namespace: str, cluster_domain: str) -> str:
    """A Service's absolute DNS name, trailing dot included: the resolver asks for it alone.

    With the pod default `ndots:5`, a name of fewer dots is first tried under each search
    domain (`<ns>.svc.<domain>`, `svc.<domain>`, `<domain>`, the node's), each a failed
    lookup before the real one; an absolute name skips them all.
    """
    return f"{service_name}.{namespace}.svc.{cluster_domain}."


def head_pods_selector(instance: str) -> str:
    """Label selector of every replica's Ray head pod (status.selector, for HPA and KEDA)."""
    return (f"{constants.LABEL_INSTANCE}={instance},"
            f"{constants.LABEL_COMPONENT}={constants.COMPONENT_ENGINE},"
            f"{constants.LABEL_RAY_NODE_TYPE}=head")  # fmt: skip


def cluster_pods_selector(cluster: str) -> str:
    """Label selector of every Ray pod of one RayCluster (KubeRay's label)."""
    return f"{constants.LABEL_RAY_CLUSTER}={cluster}"


def head_pod_selector(cluster: str) -> str:
    """Label selector of the Ray head pod of one RayCluster."""
    return f"{constants.LABEL_RAY_CLUSTER}={cluster},{constants.LABEL_RAY_NODE_TYPE}=head"


def instance_labels(instance: str, component: str) -> dict[str, str]:
    """Recommended labels shared by every child of one resource."""
    return {
        constants.LABEL_NAME: constants.APP_NAME,
        constants.LABEL_INSTANCE: instance,
        constants.LABEL_COMPONENT: component,
        constants.LABEL_MANAGED_BY: constants.MANAGER,
    }


def instance_selector(instance: str, component: str) -> str:
    """Label selector matching the children of one resource of one component."""
    labels = {
        constants.LABEL_INSTANCE: instance,
        constants.LABEL_COMPONENT: component,
        constants.LABEL_MANAGED_BY: constants.MANAGER,
    }
    return ",".join(f"{k}={v}" for k, v in labels.items())
