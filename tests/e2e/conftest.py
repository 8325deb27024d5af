"""The kind tier's bed (tests/testbed/kindbed.py), shared by this package's modules.

`kind_bed` (package scope) brings the tier up, or finds it up, and takes it down after the
last test of this package, unless VLLMDP_E2E_KEEP=1 or it was up before the session.
`test_kind_down.py` runs last: it takes the bed down itself and checks the host.
Where the tier's own Docker engine cannot run (not root, its host commands missing), the
tests skip and say why; nothing else skips.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testbed"))
import kindbed
import kindbins

KEEP = os.environ.get("VLLMDP_E2E_KEEP") == "1"
LAST = ("test_kind_down.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Within this package, run the modules in LAST last."""
    here = os.path.dirname(__file__)
    slots = [i for i, it in enumerate(items) if str(it.path).startswith(here + os.sep)]
    ours = sorted((items[i] for i in slots), key=lambda it: it.path.name in LAST)  # stable
    for i, it in zip(slots, ours, strict=True):
        items[i] = it


def _kind_tier_or_skip() -> None:
    """Skip, saying why, where this tier's own Docker engine cannot run."""
    import hostreqs

    if os.geteuid() != 0:
        pytest.skip("the kind tier starts its own Docker engine (dockerd): run it as root")
    try:
        hostreqs.ensure_uses("kind")
    except hostreqs.MissingHostCommand as exc:
        pytest.skip(f"the kind tier's host commands are missing: {exc}")
    if shutil.which("go") is None and not kindbins.present():
        pytest.skip("the kind tier builds kind, kubeadm and etcd: no Go toolchain and none cached")


@dataclass
class KindBed:
    """The tier's cluster for this session, and whether this session brought it up."""

    bed: kindbed.Bed
    started_here: bool
    left: list[str] | None = field(default=None)

    @property
    def is_down(self) -> bool:
        return self.left is not None

    def down(self) -> list[str]:
        """`kindbed.py down` once; what it reported left on the host."""
        if self.left is None:
            self.left = kindbed.down()
        return self.left


@pytest.fixture(scope="package")
def kind_bed() -> Iterator[KindBed]:
    _kind_tier_or_skip()
    started = kindbed.CLUSTER not in kindbed.status()["clusters"]
    handle: KindBed | None = None
    try:
        handle = KindBed(kindbed.up(), started_here=started)
        yield handle
    finally:
        if started and not KEEP and not (handle and handle.is_down):
            left = handle.down() if handle else kindbed.down()
            assert left == [], f"`kindbed.py down` left these on the host: {left}"
