"""Faults done to one pod from the host, as root: SIGKILL its container's process, or drop its
traffic to some addresses with iptables in its own network namespace.

A container's process is found through its node's containerd (`ctr tasks ls`: the task's PID
in the host's PID namespace), by the container ID the kubelet reports in the pod's status.
The DROP rules live in the pod's network namespace only (`nsenter --net` by that PID), so the
host's and kube-proxy's rules are untouched, and `dropped()` removes them on the way out, even
when the block fails; the namespace goes with the pod anyway.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from typing import Any

from . import vdp  # noqa: F401 (importing it puts tests/testbed on sys.path)
from .bed import RunningCluster

IPTABLES = "iptables"
NSENTER = "nsenter"


def container_pid(cluster: RunningCluster, pod: dict[str, Any], container: str) -> int:
    """The host PID of `container`'s main process in `pod` (Running), from its node's containerd."""
    import realnodes  # tests/testbed, on sys.path once vdp is imported

    node = next(n for n in cluster.nodes if n["name"] == pod["spec"]["nodeName"])
    [cid] = [s["containerID"].split("://", 1)[1]
             for s in pod["status"].get("containerStatuses") or []
             if s["name"] == container and s.get("containerID")]  # fmt: skip
    out = subprocess.run([realnodes.CTR, "-a", node["containerd_socket"], "-n",
                          realnodes.K8S_NS, "tasks", "ls"], capture_output=True, text=True,
                         check=True, timeout=30).stdout  # fmt: skip
    for line in out.splitlines()[1:]:
        task, pid, *_ = line.split()
        if task == cid:
            return int(pid)
    raise AssertionError(f"no task {cid} of {pod['metadata']['name']}/{container} on "
                         f"{node['name']}:\n{out}")  # fmt: skip


def sigkill(pid: int) -> None:
    """SIGKILL a container's process from the host: no handler runs, nothing is released."""
    os.kill(pid, signal.SIGKILL)


def _in_netns(pid: int, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([NSENTER, f"--target={pid}", "--net", "--", *argv],
                          capture_output=True, text=True, check=check, timeout=30)  # fmt: skip


def drop_rules(pid: int) -> str:
    """The OUTPUT chain of the pod's network namespace, as iptables lists it."""
    return _in_netns(pid, IPTABLES, "-S", "OUTPUT", check=False).stdout


@contextlib.contextmanager
def dropped(pids: list[int], addresses: list[str]) -> Iterator[None]:
    """In the network namespace of each process in `pids`, DROP every packet out to
    `addresses` for the `with` block (a TCP connect then hangs until its timeout, as a
    partition does), and remove the rules afterwards, failure or not."""
    added: list[tuple[int, str]] = []
    try:
        for pid in pids:
            for addr in addresses:
                _in_netns(pid, IPTABLES, "-w", "-I", "OUTPUT", "-d", f"{addr}/32", "-j", "DROP")
                added.append((pid, addr))
        yield
    finally:
        errors = []
        for pid, addr in added:
            proc = _in_netns(pid, IPTABLES, "-w", "-D", "OUTPUT", "-d", f"{addr}/32", "-j",
                             "DROP", check=False)  # fmt: skip
            if proc.returncode != 0 and os.path.exists(f"/proc/{pid}"):
                errors.append(f"{pid} {addr}: {proc.stderr.strip()}")
        if errors:
            raise AssertionError(f"could not remove the DROP rules: {errors}")
