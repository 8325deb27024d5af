"""`cluster down` leaves nothing of the real-node bed on the host. Runs last in this package
(conftest); it looks for what the bed made by its names, prefixes and paths only, since other
test beds may run on this host at other times."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from .bed import RunningCluster

pytestmark = pytest.mark.cluster


def _out(*argv: str) -> str:
    return subprocess.run(list(argv), capture_output=True, text=True).stdout


def _sysctl(name: str) -> str:
    return " ".join((Path("/proc/sys") / name.replace(".", "/")).read_text().split())


def test_down_leaves_nothing(cluster: RunningCluster) -> None:
    if not cluster.started_here:
        pytest.skip("the bed was up before this session started; leaving it up")
    ours = [str(cluster.state_dir), *(n["containerd_store"] for n in cluster.nodes)]
    reported = cluster.down()
    assert reported == [], reported

    procs = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        # A zombie has released everything; PID 1 here never reaps them.
        if stat != "Z" and any(o in cmdline for o in ours) and "pytest" not in cmdline:
            procs.append(f"{proc.name}: {cmdline[:150]}")
    assert procs == []
    mounts = [ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()]
    assert [m for m in mounts if m.startswith(tuple(f"{o}/" for o in ours))] == []
    assert [ln for ln in _out("ip", "-o", "link").splitlines() if "vllmdp-br" in ln] == []
    addrs = _out("ip", "-4", "-o", "addr").splitlines()
    assert [a for a in addrs if re.search(r" inet 10\.(200|201|202)\.", a)] == []
    routes = _out("ip", "route").splitlines()
    assert [r for r in routes if r.startswith(("10.200.", "10.201.", "10.202."))] == []
    for save in ("iptables-save", "ip6tables-save"):
        chains = [ln for ln in _out(save).splitlines() if re.match(r"^:(KUBE|CNI)-", ln)]
        rules = [ln for ln in _out(save).splitlines() if re.search(r"-j (KUBE|CNI)-", ln)]
        assert chains == [] and rules == [], save  # kube-router's KUBE-ROUTER-*/-POD-FW-* too
    # The NetworkPolicy enforcer's address sets (kube-router: KUBE-SRC-*, KUBE-DST-*), and its
    # kernel probe's throwaway namespace.
    ipsets = [n for n in _out("ipset", "list", "-n").split() if n.startswith("KUBE-")]
    assert ipsets == []
    assert "vdptb-nftq" not in _out("ip", "netns", "list")
    # Every node's cgroup root by its prefix, whatever the node count (`cluster up --nodes`).
    assert {n["cgroup_root"] for n in cluster.nodes} == {
        f"vllmdp-node-{i}" for i in range(1, len(cluster.nodes) + 1)}
    cgroup = Path("/sys/fs/cgroup")
    cgroups = [str(p) for p in [*cgroup.glob("*/vllmdp-node-*"), *cgroup.glob("vllmdp-node-*")]]
    assert cgroups == []
    netns = [ln for ln in _out("ip", "netns", "list").splitlines() if ln.startswith("cni-")]
    assert netns == []  # the runtime keeps pod namespaces under its state dir; none leak here
    before = json.loads((cluster.state_dir / "host.restored.json").read_text())
    changed = {k: (_sysctl(k), v) for k, v in before["sysctls"].items() if _sysctl(k) != v}
    assert changed == {}
