"""Generate the VLLMDataParallel CustomResourceDefinition from the pydantic models."""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

from vllm_dp_operator import constants
from vllm_dp_operator.api.models import VLLMDataParallelSpec, VLLMDataParallelStatus
from vllm_dp_operator.api.validation import NAME_RULES, RULES, TRANSITION_RULES

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "DP", "type": "integer", "jsonPath": ".spec.dataParallel.size"},
    {"name": "TP", "type": "integer", "jsonPath": ".spec.tensorParallelSize"},
    {"name": "Pods", "type": "integer", "jsonPath": ".status.layout.gpuPods"},
    {"name": "Ready", "type": "string", "jsonPath": ".status.ready"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Update", "type": "string", "jsonPath": ".status.update.phase"},
    {"name": "Load", "type": "string", "jsonPath": ".status.load.level"},
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Inline $refs and reduce pydantic's JSON schema to a Kubernetes structural schema."""
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    # anyOf first: an Optional[Model] is anyOf[{$ref}, {type: null}], whose $ref must be inlined.
    if "anyOf" in node:  # Optional[X]: absence already means null
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express union in a structural schema: {branches}")
        node = {**branches[0], **node}
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**copy.deepcopy(target), **node}
    node.pop("title", None)
    if node.get("default", 0) is None:
        node.pop("default")
    if node.get("additionalProperties") is False:  # the API server prunes unknown fields
        node.pop("additionalProperties")
    if node.get("additionalProperties") is True:
        node.pop("additionalProperties")
        node["x-kubernetes-preserve-unknown-fields"] = True
    return {k: _structural(v, defs) for k, v in node.items()}


def _object_defaults(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Default nested objects and lists to empty so their own defaults and CEL rules apply."""
    for name, field in model.model_fields.items():
        prop = schema["properties"].get(field.alias or name)
        if prop is None or field.is_required():
            continue
        if prop.get("type") == "object" and "properties" in prop and field.default_factory:
            prop.setdefault("default", {})
        if prop.get("type") == "array" and field.default_factory:
            prop.setdefault("default", [])


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of a model, $refs inlined and titles dropped."""
    raw = model.model_json_schema(by_alias=True)
    defs = raw.pop("$defs", {})
    schema: dict[str, Any] = _structural(raw, defs)
    return schema


def spec_schema() -> dict[str, Any]:
    """The spec schema with the cross-field rules attached as CEL validations."""
    schema = model_schema(VLLMDataParallelSpec)
    _object_defaults(schema, VLLMDataParallelSpec)
    schema["x-kubernetes-validations"] = [
        {
            "rule": r.cel,
            "message": r.message,
            "fieldPath": f".{r.field}",
            "reason": "FieldValueInvalid",
        }
        for r in RULES
    ] + [
        {"rule": r.cel, "message": r.message, "fieldPath": f".{r.field}",
         "reason": "FieldValueForbidden"}
        for r in TRANSITION_RULES
    ]  # fmt: skip
    return schema


def build_crd() -> dict[str, Any]:
    """The complete CustomResourceDefinition manifest."""
    status = model_schema(VLLMDataParallelStatus)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{constants.PLURAL}.{constants.GROUP}"},
        "spec": {
            "group": constants.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": constants.KIND,
                "listKind": f"{constants.KIND}List",
                "plural": constants.PLURAL,
                "singular": constants.SINGULAR,
                "shortNames": list(constants.SHORT_NAMES),
                "categories": ["all", "vllm"],
            },
            "versions": [
                {
                    "name": constants.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {
                        "status": {},
                        # kubectl scale, HPA and KEDA: the head pods are the replicas' pods.
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A data-parallel vLLM deployment on a KubeRay "
                            "RayCluster: one engine per DP rank behind one OpenAI API.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                # The name rule's fieldPath must resolve in the schema;
                                # name is one of the two metadata fields a CRD may declare.
                                "metadata": {
                                    "type": "object",
                                    "properties": {"name": {"type": "string"}},
                                },
                                "spec": spec_schema(),
                                "status": status,
                            },
                            "x-kubernetes-validations": [
                                {
                                    "rule": r.cel,
                                    "message": r.message,
                                    "fieldPath": ".metadata.name",
                                    "reason": "FieldValueInvalid",
                                }
                                for r in NAME_RULES
                            ],
                        }
                    },
                }
            ],
        },
    }
