"""A real multi-node Ray cluster on one machine: one node per loopback IP, each its own session.

Every node is a ``ray start --block`` child started in a new session, so this module owns
its PID and can kill exactly its process group (never ``ray stop``, which kills every Ray
process on the machine). Fixed ports, all below the kernel's ephemeral range, keep nodes from
colliding with each other and leave the ephemeral range to what the tests probe.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HEAD_IP = "127.0.0.2"
PORTS_PER_NODE = 100
CANDIDATE_BASES = range(24000, 32000, 1000)
# Ray's job supervisor (on the head) SIGKILLs a stopping job this long after its SIGTERM; the
# operator sets it on the Ray pods to the drain grace (Ray's default is 3 s).
STOP_WAIT_S = 8
# RAY_health_check_* make the head notice a stopped node in about 1.5 s instead of about 13 s.
HEAD_ENV = {
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_failure_threshold": "3",
    "RAY_JOB_STOP_WAIT_TIME_S": str(STOP_WAIT_S),
}


def ephemeral_port_range() -> tuple[int, int]:
    """Return the kernel's ephemeral (auto-assigned) TCP port range."""
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def _port_free(port: int) -> bool:
    """True when nothing listens on ``port`` on any address."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def pick_port_base(nodes: int) -> int:
    """Find a block of ``nodes * PORTS_PER_NODE`` ports below the ephemeral range, all free."""
    low, _ = ephemeral_port_range()
    for base in CANDIDATE_BASES:
        ports = [base + n * PORTS_PER_NODE + k for n in range(nodes) for k in (*range(10), 20, 59)]
        if max(ports) < low and all(_port_free(p) for p in ports):
            return base
    raise RuntimeError("no free block of ports for the Ray test cluster")


@dataclass
class RayNode:
    """One ``ray start --block`` process and what it was started with."""

    ip: str
    gpus: int
    process: subprocess.Popen[bytes]
    temp_dir: Path
    log_path: Path

    def session_pids(self) -> list[int]:
        """Return the PIDs still alive in this node's session (its Ray processes)."""
        sid = self.process.pid
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            # After ")": state, ppid, pgrp, session.
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(stat.parent.name))
        return pids

    def stop(self, grace: float = 2.0) -> None:
        """Stop every process of this node: SIGTERM to its group, then SIGKILL."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and self.session_pids():
                time.sleep(0.1)
            if not self.session_pids():
                break
        self.process.wait(timeout=10)
        left = self.session_pids()
        if left:
            raise RuntimeError(f"Ray node {self.ip} left processes behind: {left}")


@dataclass
class RayTestbed:
    """Start and stop Ray nodes on loopback IPs under one short temp root."""

    root: Path
    port_base: int
    nodes: list[RayNode] = field(default_factory=list)

    @property
    def gcs_address(self) -> str:
        """The head's GCS address (what RAY_ADDRESS points to)."""
        return f"{HEAD_IP}:{self.port_base}"

    @property
    def dashboard_url(self) -> str:
        """The head's dashboard: Ray's job API and state API, as KubeRay's head serves them."""
        return f"http://{HEAD_IP}:{self.port_base + 7}"

    def _ports(self, slot: int) -> list[str]:
        """Return the fixed-port flags for the node in ``slot`` (0 = head)."""
        b = self.port_base + slot * PORTS_PER_NODE
        return [
            f"--node-manager-port={b + 1}",
            f"--object-manager-port={b + 2}",
            f"--dashboard-agent-listen-port={b + 3}",
            f"--dashboard-agent-grpc-port={b + 4}",
            f"--metrics-export-port={b + 5}",
            f"--runtime-env-agent-port={b + 6}",
            f"--min-worker-port={b + 20}",
            f"--max-worker-port={b + 59}",
        ]

    def start_node(self, ip: str, gpus: int, slot: int, cgroup: Path | None = None) -> RayNode:
        """Start one node (the head when ``ip`` is HEAD_IP); ``cgroup`` holds all its processes."""
        temp_dir = self.root / f"n{slot}"
        log_path = self.root / f"n{slot}.log"
        head = ip == HEAD_IP
        args = [
            str(Path(sys.executable).with_name("ray")),
            "start",
            "--block",
            f"--node-ip-address={ip}",
            f"--num-gpus={gpus}",
            "--num-cpus=1",
            "--object-store-memory=100000000",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
            *self._ports(slot),
        ]
        if head:
            args += [
                "--head",
                f"--port={self.port_base}",
                # As on a KubeRay head: jobs are submitted, and GPU holders listed, through it.
                "--include-dashboard=true",
                f"--dashboard-host={HEAD_IP}",
                f"--dashboard-port={self.port_base + 7}",
                f"--ray-client-server-port={self.port_base + 8}",
            ]
        else:
            args.append(f"--address={self.gcs_address}")
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(HEAD_ENV if head else {})}
        env.pop("RAY_ADDRESS", None)

        def enter_cgroup() -> None:
            if cgroup is not None:
                (cgroup / "cgroup.procs").write_text(str(os.getpid()))

        with log_path.open("wb") as log:
            process = subprocess.Popen(
                args,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=enter_cgroup if cgroup is not None else None,
            )
        node = RayNode(ip, gpus, process, temp_dir, log_path)
        self.nodes.append(node)
        return node

    def alive_ips(self) -> set[str]:
        """Return the IPs of the nodes the GCS reports alive."""
        from ray._raylet import GcsClient  # type: ignore[attr-defined]

        client = GcsClient(address=self.gcs_address)
        infos = client.get_all_node_info(timeout=5)
        return {info.node_manager_address for info in infos.values() if info.state == 0}

    def wait_alive(self, ips: set[str], timeout: float = 60.0) -> None:
        """Wait until the GCS reports exactly ``ips`` alive."""
        deadline = time.monotonic() + timeout
        seen: set[str] | str = "GCS not reachable"
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.process.poll() is not None and node.ip in ips:
                    raise RuntimeError(f"Ray node {node.ip} exited; see {node.log_path}")
            try:
                seen = self.alive_ips()
            except Exception as exc:  # the GCS is still starting
                seen = f"GCS not reachable: {exc}"
            else:
                if seen == ips:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"Ray nodes alive: {seen}, wanted {sorted(ips)}")

    def wait_dashboard(self, timeout: float = 60.0) -> None:
        """Wait until the head's dashboard answers (its job API is then usable)."""
        import urllib.request

        deadline = time.monotonic() + timeout
        error: Exception | None = None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.dashboard_url}/api/version", timeout=5):
                    return
            except OSError as exc:
                error = exc
            time.sleep(0.5)
        head_log = self.root / "n0" / "session_latest" / "logs" / "dashboard.log"
        tail = head_log.read_text(errors="replace")[-3000:] if head_log.exists() else "(no log)"
        raise TimeoutError(f"dashboard {self.dashboard_url} not up: {error}\n{tail}")

    def stop_node(self, node: RayNode) -> None:
        """Stop one node and forget it."""
        node.stop()
        self.nodes.remove(node)

    def stop_all(self) -> None:
        """Stop the workers, then the head."""
        for node in sorted(self.nodes, key=lambda n: n.ip == HEAD_IP):
            node.stop()
        self.nodes.clear()
