"""The chart's `kubeVersion` floor is what the CRD really needs, derived from its CEL rules.

An API server refuses a CRD whose validation rules call a CEL library it does not offer to new
expressions. k8s.io/apiserver (pkg/cel/environment/base.go) introduces each library at a
version (`IntroducedVersion`), and a server offers it to new expressions one minor later: it
compiles them for its `MinCompatibilityVersion`, one minor below its own, so that a rollback
can still read what it stored. So a library introduced at 1.N works in a new CRD from 1.N+1.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "vllm-dp-operator" / "Chart.yaml"
CRDS = sorted((REPO / "crds").glob("*.yaml"))

# CEL calls by the library that defines them -> the first minor whose API server accepts them
# in a new expression (IntroducedVersion + 1). Base CEL (size, matches, startsWith, all,
# exists, ...) is older than any floor considered here.
LIBRARY_FLOOR: dict[str, tuple[int, int]] = {
    r"\bisQuantity\(|\bquantity\(": (1, 29),  # library.Quantity, introduced at 1.28
    r"\.indexOf\(|\.lastIndexOf\(|\.lowerAscii\(|\.upperAscii\(|\.replace\(|\.split\(|"
    r"\.substring\(|\.trim\(|\.join\(": (1, 28),  # ext.Strings v0, 1.27 (v2 at 1.29)
    r"\bsets\.": (1, 30),  # ext.Sets, 1.29
    r"\bisIP\(|\bip\(|\bisCIDR\(|\bcidr\(": (1, 31),  # library.IP / CIDR, 1.30
    r"\.validate\(|\bformat\.": (1, 32),  # library.Format, 1.31
    r"\bisSemver\(|\bsemver\(": (1, 34),  # library.SemverLib, 1.33
}
# Rule fields: `reason` and `fieldPath` arrived with 1.28's CRD validation rules.
RULE_FIELD_FLOOR = {"reason": (1, 28), "fieldPath": (1, 28), "messageExpression": (1, 27)}


def _rules(node: object) -> list[dict[str, object]]:
    found: list[dict[str, object]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "x-kubernetes-validations":
                found.extend(value)
            else:
                found.extend(_rules(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(_rules(item))
    return found


def needed_floor() -> tuple[tuple[int, int], str]:
    """The highest minor any rule of the shipped CRDs needs, and the rule that needs it."""
    floor, why = (1, 25), "CRD validation rules (beta, on by default)"
    for path in CRDS:
        for rule in _rules(yaml.safe_load(path.read_text())):
            for pattern, minor in LIBRARY_FLOOR.items():
                if re.search(pattern, str(rule["rule"])) and minor > floor:
                    floor, why = minor, f"{path.name}: {rule['rule']}"
            for field, minor in RULE_FIELD_FLOOR.items():
                if field in rule and minor > floor:
                    floor, why = minor, f"{path.name}: a rule's {field}"
    return floor, why


def chart_floor() -> tuple[int, int]:
    constraint = yaml.safe_load(CHART.read_text())["kubeVersion"]
    match = re.fullmatch(r">=\s*1\.(\d+)\.0(-0)?", constraint.strip())
    assert match, f"kubeVersion {constraint!r} is not a plain floor '>=1.N.0-0'"
    return 1, int(match.group(1))


def test_the_floor_is_no_lower_than_the_crd_needs() -> None:
    need, why = needed_floor()
    assert chart_floor() >= need, f"the CRD needs Kubernetes >= {need[0]}.{need[1]} ({why})"


def test_the_floor_is_no_higher_than_the_crd_needs() -> None:
    """No tighter than needed either: the floor is what some rule requires, not a guess."""
    need, why = needed_floor()
    assert chart_floor() == need, (
        f"kubeVersion says >= 1.{chart_floor()[1]}, the CRD needs only 1.{need[1]} ({why}): "
        "lower it, or name what else needs the higher floor"
    )


def test_the_library_table_catches_a_quantity_rule() -> None:
    """The scan sees a rule it must see (guards the scan itself, not the chart)."""
    rule = "isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))"
    assert re.search(next(iter(LIBRARY_FLOOR)), rule)
