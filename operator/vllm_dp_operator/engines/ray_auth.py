"""Ray auth tokens: one per resource, derived from a key only the operator holds.

The operator creates each resource's token Secret and never reads Secrets: with its key it
computes the token again for every dashboard call, on any replica and after any restart.
A token is an HMAC of the resource's namespace and name, so a resource deleted and created
again under its name gets the same token, and a Secret its predecessor left for the garbage
collector still holds the right one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
from pathlib import Path

log = logging.getLogger(__name__)

#: Bytes of a generated key; a key file needs at least this many.
KEY_BYTES = 32
_CONTEXT = b"vllmdp.io ray auth token v1\0"


class RayTokens:
    """Derives each resource's Ray auth token from the operator's key."""

    def __init__(self, key: bytes) -> None:
        if len(key) < KEY_BYTES:
            raise ValueError(f"the Ray auth key must have at least {KEY_BYTES} bytes")
        self._key = key

    def token(self, namespace: str, name: str) -> str:
        """The token of one resource: URL-safe base64 of HMAC-SHA256(key, namespace, name)."""
        mac = hmac.new(self._key, _CONTEXT + f"{namespace}\0{name}".encode(), hashlib.sha256)
        return base64.urlsafe_b64encode(mac.digest()).decode().rstrip("=")

    def of_cluster(self, namespace: str, name: str, auth: str) -> str | None:
        """The token of a resource's Ray cluster; None where its spec.ray.auth is disabled."""
        return self.token(namespace, name) if auth == "token" else None

    @classmethod
    def random(cls) -> RayTokens:
        """A random key, for this process only."""
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_file(cls, path: str) -> RayTokens:
        """The key from a file (the chart mounts a Secret); a random one when path is empty.

        A random key lives as long as this process: after a restart, or on another replica,
        the operator's dashboard calls would be refused. Only a lone process for development
        should run without a file.
        """
        if not path:
            log.warning("VLLMDP_RAY_AUTH_KEY_FILE is unset: using a random Ray auth key for "
                        "this process only; another replica or a restart cannot call the Ray "
                        "dashboards of token-authenticated clusters this one created")  # fmt: skip
            return cls.random()
        key = Path(path).read_bytes().strip()
        if len(key) < KEY_BYTES:
            raise ValueError(f"VLLMDP_RAY_AUTH_KEY_FILE={path}: the key must have at least "
                             f"{KEY_BYTES} bytes, got {len(key)}")  # fmt: skip
        return cls(key)
