"""Ray auth tokens: one per resource, derived from a key only the operator holds.

The operator creates each cluster's token Secret and never reads Secrets: with its key it
computes the token again for every dashboard call, on any replica and after any restart.

A token is an HMAC of the resource's namespace, name and uid under a key; the Secret that
holds it is named `<name>-ray-token-<key id><tag>`, where the key id names the key (a hash of
it) and the tag is another HMAC of the namespace, name and uid. So:

- a resource deleted and created again under its name gets another token and another Secret;
  the one its predecessor left for the garbage collector is never used;
- nobody without the key can name a resource's Secret before the operator makes it, so a
  Secret planted in the namespace ahead of time is never mounted;
- a cluster's own `authOptions.secretName` says which key made its token: after a rotation
  the operator still calls the clusters of the previous key, and a restart moves each resource
  to clusters of the new key (docs/security.md, "Rotating the key").

Clusters made before the key id (secretName `<name>-ray-token`) hold the first scheme's token,
an HMAC of the namespace and name only, under the oldest key the operator holds.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_dp_operator import constants

log = logging.getLogger(__name__)

#: Bytes of a generated key; a key file needs at least this many.
KEY_BYTES = 32
#: Hex digits of a key id and of a Secret's tag.
ID_HEX = 8
_LEGACY = b"vllmdp.io ray auth token v1\0"
_TOKEN = b"vllmdp.io ray auth token v2\0"
_TAG = b"vllmdp.io ray auth secret name v2\0"
_KEY_ID = b"vllmdp.io ray auth key id\0"


def key_id(key: bytes) -> str:
    """A key's public name: the first hex digits of a hash of it."""
    return hashlib.sha256(_KEY_ID + key).hexdigest()[:ID_HEX]


def _mac(key: bytes, context: bytes, *parts: str) -> bytes:
    return hmac.new(key, context + "\0".join(parts).encode(), hashlib.sha256).digest()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _checked(key: bytes, what: str) -> bytes:
    if len(key) < KEY_BYTES:
        raise ValueError(f"{what}: the key must have at least {KEY_BYTES} bytes, got {len(key)}")
    return key


class RayTokens:
    """Derives each resource's Ray auth token from the operator's key (and, while a rotation
    is under way, its previous one)."""

    def __init__(self, key: bytes, previous: bytes | None = None) -> None:
        self._key = _checked(key, "the Ray auth key")
        self._previous = _checked(previous, "the previous Ray auth key") if previous else None
        self.key_id = key_id(key)
        self._keys = {self.key_id: key}
        if previous:
            self._keys.setdefault(key_id(previous), previous)

    def secret_name(self, namespace: str, name: str, uid: str) -> str:
        """The token Secret of a cluster made now, under the current key."""
        tag = _mac(self._key, _TAG, namespace, name, uid).hex()[:ID_HEX]
        return f"{name}{constants.RAY_TOKEN_SECRET_SUFFIX}-{self.key_id}{tag}"

    def token(self, namespace: str, name: str, uid: str) -> str:
        """The token of a cluster made now: URL-safe base64 of an HMAC-SHA256 under the key."""
        return _b64(_mac(self._key, _TOKEN, namespace, name, uid))

    def legacy_token(self, namespace: str, name: str) -> str:
        """The first scheme's token (namespace and name), under the oldest key held."""
        return _b64(_mac(self._previous or self._key, _LEGACY, namespace, name))

    def of_secret(self, namespace: str, name: str, uid: str, secret: str) -> str | None:
        """The token a cluster whose authOptions name this Secret holds; None when the
        Secret is no name of the operator's keys (its calls would be refused)."""
        base = f"{name}{constants.RAY_TOKEN_SECRET_SUFFIX}"
        if secret == base:
            return self.legacy_token(namespace, name)
        key = self._keys.get(secret.removeprefix(f"{base}-")[:ID_HEX])
        if key is None or not secret.startswith(f"{base}-"):
            return None
        tag = _mac(key, _TAG, namespace, name, uid).hex()[:ID_HEX]
        if secret != f"{base}-{key_id(key)}{tag}":
            return None  # another resource's (an earlier uid's) Secret
        return _b64(_mac(key, _TOKEN, namespace, name, uid))

    def of_cluster(self, namespace: str, name: str, uid: str,
                   cluster: Mapping[str, Any] | None) -> str | None:  # fmt: skip
        """The token of a live RayCluster of the resource, from the Secret its authOptions
        name; None without token auth (or without the cluster)."""
        options = ((cluster or {}).get("spec") or {}).get("authOptions") or {}
        if options.get("mode") != "token" or not options.get("secretName"):
            return None
        return self.of_secret(namespace, name, uid, str(options["secretName"]))

    @classmethod
    def random(cls) -> RayTokens:
        """A random key, for this process only."""
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_file(cls, path: str, previous_path: str = "") -> RayTokens:
        """The key from a file (the chart mounts a Secret), and the previous key from another
        when that file exists (a rotation under way); a random key when path is empty.

        A random key lives as long as this process: after a restart, or on another replica,
        the operator's dashboard calls would be refused. Only a lone process for development
        should run without a file.
        """
        if not path:
            log.warning("VLLMDP_RAY_AUTH_KEY_FILE is unset: using a random Ray auth key for "
                        "this process only; another replica or a restart cannot call the Ray "
                        "dashboards of token-authenticated clusters this one created")  # fmt: skip
            return cls.random()
        key = _checked(Path(path).read_bytes().strip(), f"VLLMDP_RAY_AUTH_KEY_FILE={path}")
        previous = None
        if previous_path and Path(previous_path).is_file():
            previous = _checked(Path(previous_path).read_bytes().strip(),
                                f"VLLMDP_RAY_AUTH_PREVIOUS_KEY_FILE={previous_path}")
        log.info("Ray auth key id %s%s", key_id(key), f", previous key id {key_id(previous)} "
                 "(a rotation: restart every resource, then remove the previous key)"
                 if previous else "")  # fmt: skip
        return cls(key, previous)
