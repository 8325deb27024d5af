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


def raycluster(instance: str, cluster_hash: str) -> str:
    """RayCluster name: one per cluster shape, so a reshape never reuses stale pods."""
    return f"{instance}-{cluster_hash[:5]}"


_BASE36 = "0123456789abcdefghijklmnopqrstuvwxyz"
_ATTEMPT_DIGITS = constants.ATTEMPT_SUFFIX - 2  # after "-j"


def attempt_tag(attempt: int) -> str:
    """The attempt as fixed-width base 36 ('00001', '0000a', ...), wrapping after 36^5 - 1."""
    n = attempt % 36**_ATTEMPT_DIGITS
    digits = ""
    for _ in range(_ATTEMPT_DIGITS):
        n, r = divmod(n, 36)
        digits = _BASE36[r] + digits
    return digits


def head_job(instance: str, attempt: int) -> str:
    """Head RayJob name for a launch attempt; it is also the Ray job's submission id.

    A fixed-width suffix keeps every attempt within KubeRay's 47-character RayJob limit for
    any resource name the CRD admits (a growing decimal suffix did not).
    """
    return f"{instance}-j{attempt_tag(attempt)}"


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
