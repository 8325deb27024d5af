"""The vllm tier is opt-in: it installs about 9.5 GB on first use, so it runs only under -m vllm."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip this directory's tests unless the marker expression names `vllm`."""
    if "vllm" in (config.getoption("markexpr") or "").replace("not vllm", ""):
        return
    skip = pytest.mark.skip(reason="opt-in tier: run with -m vllm (make test-vllm-contract)")
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)
