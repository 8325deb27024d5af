"""`helm lint` and `helm template` of the chart: defaults, every ci/*.yaml values file, and
values the schema must reject."""

from __future__ import annotations

import re
from pathlib import Path

import chartlib
import pytest
import yaml

VALUES_CASES = [pytest.param((), id="defaults")] + [
    pytest.param((p,), id=p.stem) for p in chartlib.CI_VALUES
]


def test_ci_values_files_exist() -> None:
    names = {p.name for p in chartlib.CI_VALUES}
    assert {"namespace-scope-values.yaml", "apiserver-proxy-values.yaml"} <= names


@pytest.mark.parametrize("values", VALUES_CASES)
def test_lint_strict_chart_as_shipped(helm_bin: str, values: tuple[Path, ...]) -> None:
    # The real chart directory, as the README's `helm install` uses it: no warnings at all.
    chartlib.helm("lint", "--strict", str(chartlib.CHART), *[f"--values={v}" for v in values])


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


def test_chart_has_no_dependencies_to_fetch(helm_bin: str) -> None:
    # Helm refuses to template or install a chart whose declared dependency is missing from
    # charts/, even a disabled one; KubeRay is installed with its own chart instead.
    meta = yaml.safe_load((chartlib.CHART / "Chart.yaml").read_text())
    assert "dependencies" not in meta
    chartlib.helm("template", "x", str(chartlib.CHART))  # the plain directory renders


@pytest.mark.parametrize(
    "bad",
    [
        "rbac.scope=namespace",
        "healthProbe.mode=tcp",
        "watchNamespace=llm-serving",
        "watchNamespaces={Not_A_Namespace}",
        "watchNamespaces={a,a}",
        "resyncSeconds=0",
        "workers=0",
        "nosuchkey=1",
        "image.pullPolicy=Sometimes",
        "extraEnv[0].name=VLLMDP_ENGINE_IMAGE",
        "kuberay.enabled=true",
        "stopConfirmSeconds=0",
        "replicas=0",
        "leaderElection.leaseDurationSeconds=0",
        "podDisruptionBudget.maxUnavailable=0",
        "readiness.port=0",
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
