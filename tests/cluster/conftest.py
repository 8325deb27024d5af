"""Fixtures for the cluster tier: the real-node test bed (tests/testbed/realbed.py).

`cluster` (package scope) reuses a healthy bed in $VLLMDP_CLUSTER_DIR (default `.cluster/`)
and leaves it running; otherwise it builds what is missing (cached), starts one, and takes it
down when the last test of this package has run, so the tiers after it start on a clean host.
Outside CI it skips without root or without Go and cached binaries; in CI it fails instead.
`test_realnodes_down.py` always runs last in this package.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator

import pytest

from .bed import RunningCluster, testbed_cli

# The bed's own smoke tests first (cheap, and they explain a broken bed), the operator
# scenarios next, the check that `down` leaves nothing last.
FIRST = ("test_realnodes_bed.py",)
LAST = ("test_realnodes_down.py",)
#: Nodes the bed starts with: a Surge of examples/dev-cpu.yaml puts its second head (2 CPUs,
#: a node's all) on a third node, beside the serving generation's two. $VLLMDP_BED_NODES asks
#: for more (`make test-replicas-vllm`: two replicas of it, and room to drain one's node).
NODES = int(os.environ.get("VLLMDP_BED_NODES") or 3)


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _bail(msg: str, *, skippable: bool) -> None:
    if skippable and not _in_ci():
        pytest.skip(msg)
    pytest.fail(msg, pytrace=False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Within this package, run the modules in FIRST first and those in LAST last."""
    here = os.path.dirname(__file__)
    slots = [i for i, it in enumerate(items) if str(it.path).startswith(here + os.sep)]
    ours = [items[i] for i in slots]
    ours.sort(key=lambda it: (it.path.name not in FIRST) + 2 * (it.path.name in LAST))  # stable
    for i, it in zip(slots, ours, strict=True):
        items[i] = it


@pytest.fixture(scope="package")
def cluster() -> Iterator[RunningCluster]:
    if os.geteuid() != 0:
        _bail("real-node test bed: needs root (containerd, CNI bridges, iptables, cgroups)",
              skippable=True)  # fmt: skip
    started = False
    if testbed_cli("status", timeout=60).returncode != 0:
        if shutil.which("go") is None and testbed_cli("cached", timeout=60).returncode != 0:
            _bail("real-node test bed: no Go toolchain and no cached binaries", skippable=True)
        up = testbed_cli("up", "--nodes", str(NODES), timeout=3 * 3600)
        sys.stderr.write(up.stdout[-6000:])
        if up.returncode != 0:
            _bail(f"real-node test bed: `cluster up` failed (rc={up.returncode}):\n"
                  f"{up.stdout[-4000:]}\n{up.stderr[-8000:]}", skippable=False)  # fmt: skip
        started = True
    handle = RunningCluster.load(started_here=started)
    try:
        yield handle
    finally:
        if started and not handle.is_down:
            left = handle.down()
            if left:
                sys.stderr.write("real-node bed: left after down:\n" + "\n".join(left) + "\n")


@pytest.fixture
def ns(cluster: RunningCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (without waiting)."""
    base = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    name = f"t-{base}-{os.urandom(3).hex()}"
    cluster.kubectl("create", "namespace", name)
    cluster.wait_until("the default ServiceAccount", lambda: cluster.kubectl(
        "get", "sa", "default", "-n", name, check=False).returncode == 0, 30)  # fmt: skip
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="package")
def operator(cluster: RunningCluster) -> RunningCluster:
    """The operator, installed by `helm install` of the chart with its image in every node."""
    from .vdp import install_operator

    install_operator(cluster)
    return cluster
