"""The admission policy that fences the operator's ServiceAccount: shipped and on by default
where the API server serves ValidatingAdmissionPolicy (1.30+), bound to the chart's own
ServiceAccount only, and off with `admissionPolicy.enabled: false`. What it refuses is shown
on a real API server (tests/controlplane/test_operator_least_privilege.py)."""

from __future__ import annotations

from typing import Any

import chartlib


def _fence(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in chartlib.by_kind(objects, kind) if o["metadata"]["name"].endswith("-fence")]


def test_on_by_default_bound_to_the_chart_service_account_only() -> None:
    objects = chartlib.render((), (), release="vdp", namespace="ops")
    [policy] = _fence(objects, "ValidatingAdmissionPolicy")
    [binding] = _fence(objects, "ValidatingAdmissionPolicyBinding")
    [sa] = chartlib.by_kind(objects, "ServiceAccount")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    [match] = policy["spec"]["matchConditions"]
    assert match["expression"] == (
        f'request.userInfo.username == "system:serviceaccount:ops:{sa["metadata"]["name"]}"')
    fenced = {r for rule in policy["spec"]["matchConstraints"]["resourceRules"]
              for r in rule["resources"]}  # fmt: skip
    assert fenced == {"rayclusters", "rayjobs", "services", "endpointslices",
                      "networkpolicies", "poddisruptionbudgets"}


def test_off_when_asked_and_absent_where_the_api_server_lacks_it() -> None:
    off = chartlib.render((), ("admissionPolicy.enabled=false",))
    assert not _fence(off, "ValidatingAdmissionPolicy")
    older = chartlib.render((), (), api_versions=())
    assert not chartlib.by_kind(older, "ValidatingAdmissionPolicy")


def test_the_tenancy_policy_renders_the_chart_values_and_is_on_by_default() -> None:
    assert not [o for o in chartlib.by_kind(chartlib.render((), ("tenancy.enabled=false",)),
                                            "ValidatingAdmissionPolicy")
                if o["metadata"]["name"].endswith("-tenancy")]  # fmt: skip
    objects = chartlib.render((), ("engineImage=reg.example/vdp:1.2",
                                   "tenancy.allowedPriorityClasses={gpu-high}"))
    [policy] = [o for o in chartlib.by_kind(objects, "ValidatingAdmissionPolicy")
                if o["metadata"]["name"].endswith("-tenancy")]  # fmt: skip
    fields = [v["message"].split(":")[0] for v in policy["spec"]["validations"]]
    assert fields == ["spec.image", "spec.priorityClassName", "spec.serviceAccountName",
                      "spec.service.type", "spec.service.annotations", "spec.env"]
    image, priority = policy["spec"]["validations"][:2]
    assert '["reg.example/vdp"]' in image["expression"]
    assert '["gpu-high"]' in priority["expression"]
    # Judged when the spec is written: a finalizer's removal from a resource admitted before
    # the policy is not refused.
    [when] = policy["spec"]["matchConditions"]
    assert when["expression"] == "request.operation == 'CREATE' || object.spec != oldObject.spec"


def test_the_token_secret_names_are_reserved_for_the_operator_by_default() -> None:
    objects = chartlib.render((), (), release="vdp", namespace="ops")
    [policy] = [o for o in chartlib.by_kind(objects, "ValidatingAdmissionPolicy")
                if o["metadata"]["name"].endswith("-token-secrets")]  # fmt: skip
    [binding] = [o for o in chartlib.by_kind(objects, "ValidatingAdmissionPolicyBinding")
                 if o["metadata"]["name"].endswith("-token-secrets")]  # fmt: skip
    [sa] = chartlib.by_kind(objects, "ServiceAccount")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    [rule] = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["secrets"] and rule["operations"] == ["CREATE", "UPDATE"]
    conditions = {m["name"]: m["expression"] for m in policy["spec"]["matchConditions"]}
    assert f'"system:serviceaccount:ops:{sa["metadata"]["name"]}"' in conditions[
        "not-the-operator"]  # fmt: skip
    assert "-ray-token(-[0-9a-f]{16})?$" in conditions["a-token-secret-name"]
    off = chartlib.render((), ("tenancy.reserveTokenSecretNames=false",))
    assert not [o for o in off if o["metadata"]["name"].endswith("-token-secrets")]
