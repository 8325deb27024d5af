"""Fixtures of the reliability tier: the control-plane tier's test bed and namespaces.

The `testbed` and `testbed_namespace` fixtures are the control-plane tier's own (loaded from
its conftest under another module name), so a run of both tiers shares one test bed. The
control-plane helpers (operator_proc, scenario, watchlog) and the test bed's modules (faults,
kwoknodes) are importable from here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

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
