"""Object metadata shared by the renderers."""

from __future__ import annotations

from typing import Any

from vllm_dp_operator import constants


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    """Controller owner reference to a VLLMDataParallel, so deletion cascades."""
    return {
        "apiVersion": f"{constants.GROUP}/{constants.VERSION}",
        "kind": constants.KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(
    name: str,
    namespace: str,
    labels: dict[str, str],
    owner: dict[str, Any] | None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """ObjectMeta with labels, optional annotations and the owner reference."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if annotations:
        meta["annotations"] = dict(annotations)
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return meta
