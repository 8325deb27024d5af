"""Render the Secret that holds a resource's Ray auth token (KubeRay authOptions.secretName)."""

from __future__ import annotations

import base64
from typing import Any

from vllm_dp_operator import constants
from vllm_dp_operator.api import names
from vllm_dp_operator.render.meta import metadata


def build_ray_token_secret(
    instance: str, namespace: str, name: str, token: str, owner: dict[str, Any] | None
) -> dict[str, Any]:
    """The token Secret `name`: KubeRay puts its key on every Ray container as RAY_AUTH_TOKEN.

    The operator creates it and never reads it back: it derives the same token from its own
    key whenever it calls the dashboard (`engines.ray_auth`), so it needs no get on Secrets.
    """
    labels = names.instance_labels(instance, constants.COMPONENT_RAY_AUTH)
    encoded = base64.b64encode(token.encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(name, namespace, labels, owner),
        "type": "Opaque",
        "data": {constants.RAY_TOKEN_SECRET_KEY: encoded},
    }
