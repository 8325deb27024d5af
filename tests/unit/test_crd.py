"""The generated CRD: pinned to the checked-in copies, structural, documented, printable."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from vllm_dp_operator.api.crd import build_crd
from vllm_dp_operator.api.validation import RULES, TRANSITION_RULES

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "vllmdp.io_vllmdataparallels.yaml"
CHART_DIR = REPO / "charts" / "vllm-dp-operator"
CHART_CRD_FILE = CHART_DIR / "crds" / CRD_FILE.name
# Keys of a Kubernetes structural schema node (apiextensions.k8s.io/v1 JSONSchemaProps).
ALLOWED_KEYS = {
    "type",
    "description",
    "properties",
    "items",
    "required",
    "default",
    "enum",
    "format",
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "uniqueItems",
    "minProperties",
    "maxProperties",
    "additionalProperties",
    "nullable",
    "multipleOf",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-validations",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
    "x-kubernetes-int-or-string",
    "x-kubernetes-embedded-resource",
}
CEL_MEMBERS = {"all", "exists", "exists_one", "map", "filter", "size", "matches", "startsWith"}


def _gen_crds() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_crds", REPO / "hack" / "gen_crds.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return build_crd()


@pytest.fixture(scope="module")
def schema(crd: dict[str, Any]) -> dict[str, Any]:
    [version] = crd["spec"]["versions"]
    root: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return root


def _nodes(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node below (and including) `node`, with a readable path."""
    if not isinstance(node, dict):
        return
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from _nodes(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}{{}}")


def _resolve(schema: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The node a `.a.b` field path names, as the API server's ValidFieldPath walks it."""
    node: dict[str, Any] | None = schema
    for part in path.strip(".").split("."):
        node = (node or {}).get("properties", {}).get(part)
    return node


# --- the checked-in copies --------------------------------------------------------------------


def test_crd_file_matches_the_models() -> None:
    gen = _gen_crds()
    assert CRD_FILE.read_text(encoding="utf-8") == gen.render(), (
        "crds/ is stale: run python hack/gen_crds.py"
    )
    assert yaml.safe_load(CRD_FILE.read_text()) == build_crd()


def test_chart_crd_matches_the_models() -> None:
    gen = _gen_crds()
    if not CHART_DIR.exists():
        pytest.skip("no Helm chart yet")
    assert CHART_CRD_FILE.read_text(encoding="utf-8") == gen.render(), (
        "the chart's crds/ is stale: run python hack/gen_crds.py"
    )


def test_gen_crds_check_passes() -> None:
    assert _gen_crds().main(["--check"]) == 0


# --- structural schema ------------------------------------------------------------------------


def test_no_title_ref_anyof_or_closed_objects(schema: dict[str, Any]) -> None:
    for path, node in _nodes(schema):
        assert not {"title", "$ref", "$defs", "anyOf", "oneOf", "allOf"} & node.keys(), path
        assert node.get("additionalProperties") is not False, path
        assert node.keys() <= ALLOWED_KEYS, (path, node.keys() - ALLOWED_KEYS)


def test_every_node_is_typed(schema: dict[str, Any]) -> None:
    for path, node in _nodes(schema):
        if node.get("x-kubernetes-int-or-string"):
            continue
        assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}, (
            path
        )
        if "properties" in node:
            assert node["type"] == "object", path
            assert "additionalProperties" not in node, path  # both: not structural
            assert set(node.get("required", [])) <= node["properties"].keys(), path
        if node["type"] == "array":
            assert isinstance(node.get("items"), dict), path
        if node["type"] == "object" and "properties" not in node:
            # An opaque object keeps its fields only when told to.
            assert (
                node.get("x-kubernetes-preserve-unknown-fields")
                or "additionalProperties" in (node)
                or path == ".metadata"
            ), path


def test_defaults_fit_their_types(schema: dict[str, Any]) -> None:
    python_types = {
        "object": dict,
        "array": list,
        "string": str,
        "integer": int,
        "boolean": bool,
        "number": (int, float),
    }
    for path, node in _nodes(schema):
        if "default" in node and node.get("x-kubernetes-int-or-string"):
            assert isinstance(node["default"], int | str), path
        elif "default" in node:
            assert isinstance(node["default"], python_types[node["type"]]), path
            assert not path.startswith(".metadata"), path
            if "enum" in node:
                assert node["default"] in node["enum"], path


def test_root_metadata_declares_only_name(schema: dict[str, Any]) -> None:
    metadata = schema["properties"]["metadata"]
    assert metadata["type"] == "object"
    assert set(metadata.get("properties", {})) <= {"name", "generateName"}


def test_every_spec_and_status_property_has_a_description(schema: dict[str, Any]) -> None:
    for top in ("spec", "status"):
        for path, node in _nodes(schema["properties"][top], f".{top}"):
            for name, child in (node.get("properties") or {}).items():
                assert child.get("description", "").strip(), f"{path}.{name}"


def test_spec_requires_model_and_data_parallel(schema: dict[str, Any]) -> None:
    assert schema["required"] == ["spec"]
    assert set(schema["properties"]["spec"]["required"]) == {"model", "dataParallel"}


# --- CEL rules --------------------------------------------------------------------------------


def test_every_rule_is_a_cel_validation(schema: dict[str, Any]) -> None:
    rules = schema["properties"]["spec"]["x-kubernetes-validations"]
    assert [(r["rule"], r["message"], r["fieldPath"]) for r in rules] == [
        (r.cel, r.message, f".{r.field}") for r in (*RULES, *TRANSITION_RULES)
    ]


def test_cel_field_paths_resolve(schema: dict[str, Any]) -> None:
    """The API server rejects a CRD whose rule fieldPath names no field of the schema."""
    spec = schema["properties"]["spec"]
    for rule in spec["x-kubernetes-validations"]:
        assert _resolve(spec, rule["fieldPath"]) is not None, rule["fieldPath"]
        transition = "oldSelf" in rule["rule"]
        assert rule["reason"] == ("FieldValueForbidden" if transition else "FieldValueInvalid")
    for rule in schema["x-kubernetes-validations"]:
        assert _resolve(schema, rule["fieldPath"]) is not None, rule["fieldPath"]


def test_cel_rules_name_existing_fields(schema: dict[str, Any]) -> None:
    spec = schema["properties"]["spec"]
    for rule in spec["x-kubernetes-validations"]:
        for match in re.finditer(r"self((?:\.\w+)+)", rule["rule"]):
            node: dict[str, Any] | None = spec
            for part in match.group(1).strip(".").split("."):
                child = (node or {}).get("properties", {}).get(part)
                if child is None:
                    assert part in CEL_MEMBERS, (rule["rule"], part)
                    break
                node = child


def test_cel_divisions_are_guarded(schema: dict[str, Any]) -> None:
    """A CEL division by zero is an evaluation error, not a rule message: guard each divisor."""
    spec = schema["properties"]["spec"]
    for rule in spec["x-kubernetes-validations"]:
        for divisor in re.findall(r"% (self(?:\.\w+)+)", rule["rule"]):
            node = _resolve(spec, divisor.removeprefix("self"))
            assert node is not None
            guarded = f"{divisor} == 0 ||" in rule["rule"] or node.get("minimum", 0) >= 1
            assert guarded, rule["rule"]


# --- names and printer columns ----------------------------------------------------------------


def test_names_and_scope(crd: dict[str, Any]) -> None:
    assert crd["metadata"]["name"] == "vllmdataparallels.vllmdp.io"
    assert crd["spec"]["scope"] == "Namespaced"
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["singular"]) == (
        "VLLMDataParallel",
        "vllmdataparallels",
        "vllmdataparallel",
    )
    assert "vdp" in names["shortNames"]
    [version] = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}}  # fmt: skip


def test_printer_columns(crd: dict[str, Any], schema: dict[str, Any]) -> None:
    [version] = crd["spec"]["versions"]
    columns = version["additionalPrinterColumns"]
    assert [c["name"] for c in columns] == ["DP", "TP", "Pods", "Ready", "Phase", "Update",
                                          "Load", "Endpoint", "Age"]  # fmt: skip
    for column in columns:
        path = column["jsonPath"]
        if path == ".metadata.creationTimestamp":
            assert column["type"] == "date"
            continue
        node = _resolve(schema, path)
        assert node is not None, path
        assert node["type"] == column["type"], path
