"""Fixtures for the chart tier: pure `helm lint`/`helm template` checks, no cluster.

They need only the helm binary, built once from its Go module by ensure_helm.sh into the
test-bed tool cache (about 2.5 min cold on 2 cores, instant afterwards). Without Go and
without a cached helm they skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

# The test folders are not packages; make the shared helper importable the same way from
# every tier (tests/controlplane and tests/e2e do the same).
sys.path.insert(0, str(Path(__file__).resolve().parent))
import chartlib


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


@pytest.fixture(scope="session")
def helm_bin() -> str:
    """Path to helm ($VLLMDP_HELM, or helm v3.22.0 cached/built by ensure_helm.sh)."""
    try:
        return chartlib.helm_binary()
    except chartlib.HelmUnavailable as exc:
        if shutil.which("go") is None and not _in_ci():
            pytest.skip(f"helm not cached and Go not installed to build it: {exc}")
        pytest.fail(str(exc), pytrace=False)
