"""Fixtures of the reliability tier: the control-plane tier's test bed and namespaces.

The `testbed` and `testbed_namespace` fixtures are the control-plane tier's own (loaded from
its conftest under another module name), so a run of both tiers shares one test bed. The
control-plane helpers (operator_proc, scenario, watchlog) and the test bed's modules (faults,
kwoknodes) are importable from here.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "controlplane"), str(HERE.parent / "testbed")]

_spec = importlib.util.spec_from_file_location("controlplane_fixtures",
                                               HERE.parent / "controlplane" / "conftest.py")
assert _spec is not None and _spec.loader is not None
_cp = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _cp  # dataclasses look their module up there
_spec.loader.exec_module(_cp)

testbed = _cp.testbed
testbed_namespace = _cp.testbed_namespace


from fleet import QUIET  # noqa: E402  (importable once the paths above are set)
from operator_proc import OperatorProcess, install_crd  # noqa: E402


@pytest.fixture
def operator(testbed: Any, testbed_namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    """The operator as a process watching the test's namespace, with probes and timers quiet.

    A module that needs other settings, or to start it itself, defines its own.
    """
    install_crd(testbed)
    op = OperatorProcess(testbed.env(), tmp_path / "operator.log", QUIET)
    op.namespace = testbed_namespace
    op.start()
    yield op
    op.stop()
