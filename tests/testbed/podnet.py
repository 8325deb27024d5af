"""The test bed's pod network: one network namespace of our own that owns the pod and service
CIDRs, so traffic to a simulated pod (the API server's service proxy, say) stays on this
machine and can be answered by a test host.

kwok gives pods addresses from POD_CIDR but runs no containers. Without this, a connection to
a pod IP would follow the machine's default route off the machine. With it, the root namespace
routes POD_CIDR and SERVICE_CIDR over a veth pair into the namespace, which accepts every
address of both ranges locally (`ip route add local ... dev lo`): a server started there with
`ip netns exec <ns> ...` on 0.0.0.0 answers for every pod IP; with none, connections are refused
at once. `down` removes the routes, the veth pair and the namespace.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Link-local addresses for the two ends of the veth pair: never routed anywhere else.
HOST_END = "169.254.77.1"
NS_END = "169.254.77.2"


# Which state dir made which namespace: lets a new test bed reclaim the network of one whose
# processes are gone (network config outlives processes), and refuse one that is still up.
REGISTRY = Path("/run/vllmdp-testbed-podnet")


class PodNetworkError(RuntimeError):
    """The pod network could not be set up (needs root and iproute2)."""


@dataclass(frozen=True)
class PodNetwork:
    """What `up` created, recorded in the test bed's state so `down` removes exactly that."""

    netns: str
    veth: str
    cidrs: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PodNetwork:
        return cls(data["netns"], data["veth"], tuple(data["cidrs"]))

    def exec_argv(self, *argv: str) -> list[str]:
        """argv that runs a command inside the namespace (as the pods' test host)."""
        return ["ip", "netns", "exec", self.netns, *argv]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise PodNetworkError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.stdout}")
    return proc


def names_for(state_dir: Path) -> tuple[str, str]:
    """Namespace and veth names derived from the state dir (veth names are at most 15 chars)."""
    tag = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:6]
    return f"vdptb-{tag}", f"vdptb{tag}"


def _reclaim_stale(cidr: str, is_live: Callable[[Path], bool]) -> None:
    """Remove another state dir's pod network holding `cidr` if its test bed is gone."""
    existing = _ip("route", "show", cidr, check=False).stdout.strip()
    if not existing:
        return
    match = re.search(r"dev (vdptb[0-9a-f]{6})\b", existing)
    record = REGISTRY / f"{match.group(1)}.json" if match else None
    if record is None or not record.exists():
        raise PodNetworkError(f"{cidr} is already routed ({existing}), not by a test bed")
    data = json.loads(record.read_text())
    if is_live(Path(data["state_dir"])):
        raise PodNetworkError(f"{cidr} is routed to the test bed in {data['state_dir']}, "
                              "which is up: stop it first")  # fmt: skip
    down(PodNetwork.from_json(data["network"]))


def up(state_dir: Path, cidrs: tuple[str, ...], is_live: Callable[[Path], bool]) -> PodNetwork:
    """Create the namespace and route the CIDRs into it; undo everything on failure."""
    netns, veth = names_for(state_dir)
    net = PodNetwork(netns, veth, cidrs)
    down(net)  # leftovers of an earlier run of this same state dir
    for cidr in cidrs:
        _reclaim_stale(cidr, is_live)
    try:
        _ip("netns", "add", netns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}n")
        _ip("link", "set", f"{veth}n", "netns", netns)
        _ip("addr", "add", f"{HOST_END}/30", "dev", veth)
        _ip("link", "set", veth, "up")
        inside = ["netns", "exec", netns, "ip"]
        _ip(*inside, "link", "set", "lo", "up")
        _ip(*inside, "addr", "add", f"{NS_END}/30", "dev", f"{veth}n")
        _ip(*inside, "link", "set", f"{veth}n", "up")
        _ip(*inside, "route", "add", "default", "via", HOST_END)
        for cidr in cidrs:
            _ip(*inside, "route", "add", "local", cidr, "dev", "lo")
            _ip("route", "add", cidr, "via", NS_END, "dev", veth)
    except PodNetworkError:
        down(net)
        raise
    REGISTRY.mkdir(mode=0o700, exist_ok=True)
    (REGISTRY / f"{veth}.json").write_text(
        json.dumps({"state_dir": str(state_dir.resolve()), "network": net.to_json()})
    )
    return net


def down(net: PodNetwork) -> None:
    """Remove the routes, the veth pair and the namespace; absent pieces are fine."""
    for cidr in net.cidrs:
        route = _ip("route", "show", cidr, check=False).stdout
        if f"dev {net.veth}" in route:
            _ip("route", "del", cidr, check=False)
    _ip("link", "del", net.veth, check=False)  # deletes both ends
    _ip("netns", "del", net.netns, check=False)
    (REGISTRY / f"{net.veth}.json").unlink(missing_ok=True)
