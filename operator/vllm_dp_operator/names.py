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


def head_job(instance: str, attempt: int) -> str:
    """Head RayJob name for a launch attempt."""
    return f"{instance}-launch-{attempt}"


def service(instance: str) -> str:
    """API Service name; the suffix keeps it from ever being `vllm` (vllm#34199)."""
    return f"{instance}-api"


def endpoint(instance: str, namespace: str, port: int) -> str:
    """In-cluster base URL of the OpenAI-compatible API."""
    return f"http://{service(instance)}.{namespace}.svc:{port}/v1"


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
