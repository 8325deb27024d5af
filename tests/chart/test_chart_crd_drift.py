"""The chart ships a byte-for-byte copy of the generated CRD (`make crds` writes both).

Helm installs what is under the chart's crds/ on first install, so a stale copy would install
an old schema while the repository's crds/ (and the tests against it) moved on.
"""

from __future__ import annotations

import difflib

import chartlib

CRD_NAME = "vllmdp.io_vllmdataparallels.yaml"
SOURCE = chartlib.REPO / "crds" / CRD_NAME
CHART_COPY = chartlib.CHART / "crds" / CRD_NAME
FIX = "run `make crds` (generates crds/ and copies the CRD into charts/vllm-dp-operator/crds/)"


def test_generated_crd_exists() -> None:
    assert SOURCE.is_file(), f"{SOURCE.relative_to(chartlib.REPO)} is missing: {FIX}"


def test_chart_crd_matches_generated_crd() -> None:
    assert SOURCE.is_file(), f"{SOURCE.relative_to(chartlib.REPO)} is missing: {FIX}"
    assert CHART_COPY.is_file(), f"{CHART_COPY.relative_to(chartlib.REPO)} is missing: {FIX}"
    source, copy = SOURCE.read_bytes(), CHART_COPY.read_bytes()
    if source != copy:
        diff = "".join(difflib.unified_diff(
            copy.decode(errors="replace").splitlines(keepends=True),
            source.decode(errors="replace").splitlines(keepends=True),
            fromfile=str(CHART_COPY.relative_to(chartlib.REPO)),
            tofile=str(SOURCE.relative_to(chartlib.REPO)), n=2))
        raise AssertionError(f"chart CRD drifted from the generated one; {FIX}\n{diff[:6000]}")


def test_chart_crds_dir_holds_only_our_crd() -> None:
    extra = sorted(p.name for p in (chartlib.CHART / "crds").iterdir() if p.name != CRD_NAME)
    assert not extra, f"unexpected files in the chart's crds/: {extra}"


def test_chart_crd_is_the_vllmdataparallel_crd() -> None:
    import yaml

    assert CHART_COPY.is_file(), f"{CHART_COPY.relative_to(chartlib.REPO)} is missing: {FIX}"
    (crd,) = [d for d in yaml.safe_load_all(CHART_COPY.read_text()) if d]
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["metadata"]["name"] == "vllmdataparallels.vllmdp.io"
    assert crd["spec"]["group"] == "vllmdp.io"
    assert crd["spec"]["scope"] == "Namespaced"
    assert crd["spec"]["names"]["plural"] == "vllmdataparallels"
    assert "vdp" in crd["spec"]["names"].get("shortNames", [])
    assert [v["name"] for v in crd["spec"]["versions"]] == ["v1alpha1"]
