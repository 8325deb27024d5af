"""`helm lint` and `helm template` of the chart: defaults, every ci/*.yaml values file, and
values the schema must reject."""

from __future__ import annotations

import re
from pathlib import Path

import chartlib
import pytest

VALUES_CASES = [pytest.param((), id="defaults")] + [
    pytest.param((p,), id=p.stem) for p in chartlib.CI_VALUES
]
MISSING_DEPENDENCY_WARNING = "chart directory is missing these dependencies: kuberay-operator"


def test_ci_values_files_exist() -> None:
    names = {p.name for p in chartlib.CI_VALUES}
    assert {"namespace-scope-values.yaml", "apiserver-proxy-values.yaml"} <= names


@pytest.mark.parametrize("values", VALUES_CASES)
def test_lint_chart_as_shipped(helm_bin: str, values: tuple[Path, ...]) -> None:
    # The real chart directory: the only finding allowed beyond INFO is the missing optional
    # KubeRay dependency (when it has not been vendored).
    proc = chartlib.helm("lint", str(chartlib.CHART), *[f"--values={v}" for v in values])
    findings = [ln for ln in proc.stdout.splitlines() if ln.startswith(("[WARNING]", "[ERROR]"))]
    allowed = [] if chartlib.dependency_vendored() else [MISSING_DEPENDENCY_WARNING]
    unexpected = [f for f in findings if not any(a in f for a in allowed)]
    assert not unexpected, proc.stdout


@pytest.mark.parametrize("values", VALUES_CASES)
def test_lint_strict_renderable_chart(helm_bin: str, values: tuple[Path, ...]) -> None:
    chart = chartlib.renderable_chart(values)
    chartlib.helm("lint", "--strict", str(chart), *[f"--values={v}" for v in values])


@pytest.mark.parametrize("values", VALUES_CASES)
def test_template_renders_expected_kinds(helm_bin: str, values: tuple[Path, ...]) -> None:
    objects = chartlib.render(values)
    kinds = sorted({o["kind"] for o in objects})
    assert {"Deployment", "ServiceAccount"} <= set(kinds)
    assert {"ClusterRole", "Role"} & set(kinds), kinds
    for obj in objects:
        labels = obj["metadata"].get("labels") or {}
        assert labels.get("app.kubernetes.io/managed-by") == "Helm", obj["metadata"]
        assert labels.get("app.kubernetes.io/name") == "vllm-dp-operator", obj["metadata"]


def test_unvendored_dependency_blocks_plain_template(helm_bin: str) -> None:
    # Pins the Helm behaviour chartlib works around (and docs/install.md describes): if a
    # future helm renders charts with a missing disabled dependency, drop the workaround.
    if chartlib.dependency_vendored():
        pytest.skip("kuberay-operator is vendored under charts/; nothing to pin")
    proc = chartlib.helm("template", "x", str(chartlib.CHART), check=False)
    assert proc.returncode != 0
    assert "missing in charts/ directory: kuberay-operator" in proc.stderr


def test_kuberay_enabled_needs_vendored_dependency(helm_bin: str) -> None:
    if chartlib.dependency_vendored():
        objects = chartlib.render(set_values=["kuberay.enabled=true"])
        names = [o["metadata"]["name"] for o in chartlib.by_kind(objects, "Deployment")]
        assert any("kuberay" in n for n in names), names
    else:
        with pytest.raises(chartlib.DependencyUnavailable):
            chartlib.render(set_values=["kuberay.enabled=true"])


@pytest.mark.parametrize(
    "bad",
    [
        "rbac.scope=everything",
        "healthProbe.mode=tcp",
        "watchNamespace=Not_A_Namespace",
        "resyncSeconds=0",
        "workers=0",
        "nosuchkey=1",
        "image.pullPolicy=Sometimes",
        "extraEnv[0].name=VLLMDP_ENGINE_IMAGE",
    ],
)
def test_schema_rejects_bad_values(helm_bin: str, bad: str) -> None:
    proc = chartlib.helm("template", *chartlib.template_args(set_values=[bad]), check=False)
    assert proc.returncode != 0, f"{bad} was accepted"
    assert "schema" in proc.stderr.lower(), proc.stderr


def test_every_values_key_has_a_comment() -> None:
    # values.yaml is the chart's reference: every key has a comment line right above it.
    # The leaves of `resources` are a plain Kubernetes ResourceRequirements, documented once.
    undocumented = []
    lines = (chartlib.CHART / "values.yaml").read_text().splitlines()
    inside_resources = False
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z_][\w-]*):", line)
        if not match:
            continue
        if not match.group(1):
            inside_resources = match.group(2) == "resources"
        elif inside_resources:
            continue
        if i == 0 or not lines[i - 1].lstrip().startswith("#"):
            undocumented.append(line)
    assert not undocumented, "keys without a comment:\n" + "\n".join(undocumented)
