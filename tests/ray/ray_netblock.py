"""Cutting one Ray node off from the launcher's ephemeral ports, for real, with netfilter.

Every node of the test cluster is a set of local processes, and on loopback every address
reaches every other, whatever IP a node advertises (the kernel even picks 127.0.0.1 as the
source address). So a node is told apart by its processes: the node is started inside its
own cgroup v2 group, and an iptables rule in OUTPUT matching that cgroup rejects TCP to the
head's IP on the kernel's ephemeral port range, where the launcher's preflight socket binds.
Ray's own ports are fixed below that range, so the node stays a healthy Ray member: its Ray
tasks run and report back, only the ZMQ connection to the launcher is refused, as a network
policy or a firewall between pods would do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def cgroup2_root() -> Path | None:
    """Return where the cgroup v2 hierarchy is mounted, if it is."""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[2] == "cgroup2":
            return Path(parts[1])
    return None


@dataclass
class NodeCgroup:
    """A cgroup v2 group for one Ray node's processes, and the netfilter rule that cuts it off."""

    root: Path
    name: str

    @property
    def path(self) -> Path:
        """The group's directory."""
        return self.root / self.name

    def _rule(self, dest_ip: str, ports: tuple[int, int]) -> list[str]:
        """Return the iptables rule spec (without -A/-D)."""
        return [
            "OUTPUT",
            "-p",
            "tcp",
            "-d",
            dest_ip,
            "--dport",
            f"{ports[0]}:{ports[1]}",
            "-m",
            "cgroup",
            "--path",
            self.name,
            "-m",
            "comment",
            "--comment",
            f"vllmdp-ray-tier-{os.getpid()}",
            "-j",
            "REJECT",
            "--reject-with",
            "tcp-reset",
        ]

    @contextmanager
    def blocked(self, dest_ip: str, ports: tuple[int, int]) -> Iterator[None]:
        """Reject this group's TCP connections to ``dest_ip`` on ``ports`` while inside."""
        rule = self._rule(dest_ip, ports)
        subprocess.run(["iptables", "-A", *rule], check=True, capture_output=True)
        try:
            yield
        finally:
            subprocess.run(["iptables", "-D", *rule], check=True, capture_output=True)

    def remove(self) -> None:
        """Delete the (empty) group."""
        if self.path.exists():
            self.path.rmdir()


def make_node_cgroup(name: str) -> tuple[NodeCgroup | None, str]:
    """Create a cgroup for a node if this machine can cut it off; else (None, why not)."""
    if os.geteuid() != 0:
        return None, "needs root for iptables and cgroups"
    if shutil.which("iptables") is None:
        return None, "iptables is not installed (apt-get install iptables)"
    root = cgroup2_root()
    if root is None:
        return None, "no cgroup v2 hierarchy is mounted"
    group = NodeCgroup(root, name)
    try:
        group.path.mkdir(exist_ok=True)
    except OSError as exc:
        return None, f"cannot create cgroup {group.path}: {exc}"
    probe = subprocess.run(
        ["iptables", "-C", *group._rule("127.0.0.254", (1, 1))], capture_output=True, text=True
    )
    # -C exits 1 when the rule is valid but absent; 2 when the match/target is unsupported.
    if probe.returncode not in (0, 1):
        group.remove()
        return None, f"iptables cannot match cgroups here: {probe.stderr.strip()}"
    return group, ""
