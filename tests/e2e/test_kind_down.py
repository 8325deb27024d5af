"""`kindbed.py down` leaves nothing of the kind tier on the host. Runs last in this package
(conftest). It looks for what the tier made by its own names, paths, cgroup and addresses,
not through kinddocker's own `leftovers`, so a gap there fails here."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import kinddocker
import kindnode
import pytest

from .conftest import KEEP, KindBed

pytestmark = [
    pytest.mark.kind,
    pytest.mark.skipif(KEEP, reason="VLLMDP_E2E_KEEP=1 keeps the kind cluster up"),
]
# Chains and jump targets Docker and kind make (DOCKER, DOCKER-USER, DOCKER-ISOLATION-*,
# KIND-MASQ-AGENT, ...), in the legacy tables and in nftables.
CHAIN = re.compile(r"^:((?:DOCKER|KIND)\S*)|-j ((?:DOCKER|KIND)\S*)")
NFT_CHAIN = re.compile(r"\bchain ((?:DOCKER|KIND)\S*)")


def _out(*argv: str) -> str:
    return subprocess.run(list(argv), capture_output=True, text=True).stdout


def _processes(state: Path) -> list[str]:
    """Live processes that belong to the tier: started from its state dir, in its cgroup
    parent (the nodes and all they run), or docker-proxy forwarding to a node."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cgroup = (proc / "cgroup").read_text()
        except OSError:
            continue
        if stat == "Z" or "pytest" in cmdline:  # a zombie holds nothing; PID 1 here never reaps
            continue
        if (f"{state}/" in cmdline or f"/{kinddocker.CGROUP_PARENT}" in cgroup
                or ("docker-proxy" in cmdline and kindnode.NODE_NET in cmdline)):  # fmt: skip
            found.append(f"{proc.name}: {cmdline[:150]}")
    return found


def test_down_leaves_nothing(kind_bed: KindBed) -> None:
    if not kind_bed.started_here:
        pytest.skip("the kind cluster was up before this session started; leaving it up")
    p = kinddocker.paths()
    before = json.loads(p.record.read_text())  # what `start` found on the host
    assert kind_bed.down() == []

    assert _processes(p.root.parent) == []
    mounts = [ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()]
    assert [m for m in mounts if m.startswith(f"{p.root.parent}/")] == []
    links = _out("ip", "-o", "link").splitlines()
    assert [ln for ln in links if kinddocker.BRIDGE in ln or kindnode.CNI_BRIDGE in ln] == []
    if not before["docker0"]:
        assert [ln for ln in links if ": docker0:" in ln] == []
    addrs = _out("ip", "-4", "-o", "addr").splitlines()
    nets = (f"{kindnode.NODE_NET}.", f"{kindnode.POD_NET}.",
            kindnode.SERVICE_SUBNET.removesuffix("0.0/16"))  # fmt: skip
    assert [a for a in addrs if a.split(" inet ", 1)[1].startswith(nets)] == []
    routes = _out("ip", "route").splitlines()
    assert [r for r in routes if r.startswith(nets)] == []
    # Chains (and jumps to them) that were not on the host before `start`, by their names in
    # the legacy tables, then in nftables (iptables-nft's chains, or a table of nft's own).
    had = {c.split(": ", 1)[1] for c in before["chains_before"]}
    for save in ("iptables-save", "ip6tables-save"):
        names = {m.group(1) or m.group(2) for ln in _out(save).splitlines()
                 if (m := CHAIN.search(ln))}  # fmt: skip
        assert names - had == set(), save
    nft = {m.group(1) for m in NFT_CHAIN.finditer(_out("nft", "list", "ruleset"))}
    assert nft - had == set()
    cgroup = Path("/sys/fs/cgroup")
    parent = kinddocker.CGROUP_PARENT
    assert [str(d) for d in [*cgroup.glob(f"*/{parent}"), cgroup / parent] if d.exists()] == []
    assert not p.socket.exists() and not p.pidfile.exists()
    if not before["trust_key"]:
        assert not kinddocker.TRUST_KEY.exists()
