"""Every manifest the operator creates for one resource, rendered offline (CLI, golden tests)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from vllm_dp_operator import constants
from vllm_dp_operator.api.models import VLLMDataParallelSpec
from vllm_dp_operator.api.validation import FieldError, SpecError, validate
from vllm_dp_operator.config import RenderOptions
from vllm_dp_operator.plan import Plan, build_plan
from vllm_dp_operator.render import (
    build_endpoint_slice,
    build_head_job,
    build_raycluster,
    build_service,
)
from vllm_dp_operator.render.networkpolicy import build_network_policies, wanted

DEFAULT_NAMESPACE = "default"
# The first head job of a resource; status.launchAttempts counts jobs created, from 0.
FIRST_ATTEMPT = 1
API_VERSION = f"{constants.GROUP}/{constants.VERSION}"


@dataclass(frozen=True)
class Resource:
    """A parsed, valid VLLMDataParallel: identity, spec and the plan derived from it."""

    name: str
    namespace: str
    spec: VLLMDataParallelSpec
    plan: Plan


def parse_resource(doc: Mapping[str, Any]) -> Resource:
    """Validate a VLLMDataParallel manifest as the API server and operator would."""
    errors: list[FieldError] = []
    if doc.get("apiVersion") != API_VERSION:
        errors.append(FieldError("apiVersion", f"must be {API_VERSION}"))
    if doc.get("kind") != constants.KIND:
        errors.append(FieldError("kind", f"must be {constants.KIND}"))
    meta = doc.get("metadata") or {}
    name = str(meta.get("name") or "")
    if not name:
        errors.append(FieldError("metadata.name", "is required"))
    spec: VLLMDataParallelSpec | None = None
    try:
        spec = validate(name, doc.get("spec"))
    except SpecError as err:
        errors += err.errors
    if errors or spec is None:
        raise SpecError(errors)
    namespace = str(meta.get("namespace") or DEFAULT_NAMESPACE)
    return Resource(name, namespace, spec, build_plan(spec))


def render_resource(
    resource: Resource, options: RenderOptions, owner: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The NetworkPolicies (unless turned off), each replica's RayCluster, Service, its
    EndpointSlice (no endpoint yet: a head pod's address is known only once it runs) and each
    replica's first head job, in creation order. A suspended resource has no Service, slice or
    head job."""
    name, ns, spec, plan = resource.name, resource.namespace, resource.spec, resource.plan
    clusters = [build_raycluster(name, ns, spec, plan, options, owner, r)
                for r in range(spec.replicas)]  # fmt: skip
    out = []
    if wanted(spec, options.peers):
        out += build_network_policies(name, ns, spec, options.peers, owner)
    out += clusters
    if not spec.suspend:
        out += [build_service(name, ns, spec, owner),
                build_endpoint_slice(name, ns, spec, None, False, owner)]  # fmt: skip
        out += [build_head_job(name, ns, spec, plan, cluster["metadata"]["name"], FIRST_ATTEMPT,
                               owner, replica=r) for r, cluster in enumerate(clusters)]  # fmt: skip
    return out


def render_all(
    doc: Mapping[str, Any], options: RenderOptions, owner: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Every manifest the operator would create for one VLLMDataParallel manifest."""
    return render_resource(parse_resource(doc), options, owner)


def load_documents(text: str) -> list[dict[str, Any]]:
    """The non-empty YAML (or JSON) documents of a stream; a v1 List is flattened."""
    docs: list[dict[str, Any]] = []
    for doc in yaml.safe_load_all(text):
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise ValueError(f"expected a mapping per document, got {type(doc).__name__}")
        if doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            docs += [item for item in doc["items"] if isinstance(item, dict)]
        else:
            docs.append(doc)
    return docs


class _PlainDumper(yaml.SafeDumper):
    """Writes an object shared by two places twice instead of as an &anchor and *alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml(docs: Iterable[Mapping[str, Any]]) -> str:
    """A multi-document YAML stream in the builders' key order, long strings unfolded."""
    return yaml.dump_all(
        [dict(d) for d in docs],
        Dumper=_PlainDumper,
        sort_keys=False,
        width=1 << 16,
        explicit_start=True,
    )
