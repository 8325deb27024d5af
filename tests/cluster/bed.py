"""A handle on the real-node test bed for tests: kubectl as admin, waiting with diagnostics,
image import and `down`. The bed itself is driven through `tests/testbed/testbed.py cluster`,
so a test session and a shell (`make cluster-up`) share one implementation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
TESTBED_PY = REPO / "tests" / "testbed" / "testbed.py"
# Images `cluster build` makes and `cluster up` imports into every node (test images).
PAUSE_IMAGE = "testbed.local/pause:1"
PROBE_IMAGE = "testbed.local/probe:1"


def state_dir() -> Path:
    return Path(os.environ.get("VLLMDP_CLUSTER_DIR") or REPO / ".cluster").resolve()


def testbed_cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """`testbed.py cluster ARGS...` with this session's environment."""
    env = {**os.environ, "VLLMDP_CLUSTER_DIR": str(state_dir())}
    return subprocess.run([sys.executable, str(TESTBED_PY), "cluster", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@dataclass
class RunningCluster:
    """The running real-node bed, as its testbed.json describes it."""

    state_dir: Path
    started_here: bool
    info: dict[str, Any] = field(default_factory=dict)
    is_down: bool = False

    @classmethod
    def load(cls, started_here: bool) -> RunningCluster:
        root = state_dir()
        return cls(root, started_here, json.loads((root / "testbed.json").read_text()))

    @property
    def kubeconfig(self) -> Path:
        return Path(self.info["kubeconfig"])

    @property
    def bin_dir(self) -> Path:
        return Path(self.info["bin_dir"])

    @property
    def node_bin_dir(self) -> Path:
        """kubelet, kube-proxy, coredns, probe, pause, and images/{pause,probe}.tar."""
        return Path(self.info["node_bin_dir"])

    @property
    def nodes(self) -> list[dict[str, Any]]:
        """name, ip, pod_cidr, bridge, cgroup_root, containerd_socket, containerd_store."""
        return list(self.info["nodes"])

    @property
    def node_names(self) -> list[str]:
        return [n["name"] for n in self.nodes]

    @property
    def gpus_per_node(self) -> int:
        return int(self.info["gpus_per_node"])

    def env(self) -> dict[str, str]:
        """Environment for a subprocess that talks to the bed (kubectl, helm, an operator)."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig),
                "VLLMDP_CLUSTER_DIR": str(self.state_dir),
                "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}  # fmt: skip

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """kubectl (the bed's own build) as cluster admin; AssertionError on failure if `check`."""
        cmd = [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed (rc={proc.returncode}):\n"
                                 f"{proc.stdout}\n{proc.stderr}")  # fmt: skip
        return proc

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def apply(self, manifest: dict[str, Any] | list[dict[str, Any]], *args: str) -> None:
        docs = manifest if isinstance(manifest, list) else [manifest]
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", *args,
                     input=yaml.safe_dump_all(docs))  # fmt: skip

    def log_tail(self, component: str, chars: int = 3000) -> str:
        """The end of a component's log (`kubelet-node-1`, `kuberay-operator`, ...)."""
        p = self.state_dir / "logs" / f"{component}.log"
        return p.read_text(errors="replace")[-chars:] if p.exists() else ""

    def diagnostics(self, ns: str | None = None) -> str:
        """What explains a timeout: pods and events (of `ns`), and the kubelets' log tails."""
        where = ["-n", ns] if ns else ["-A"]
        parts = [self.kubectl("get", "pods", "-o", "wide", *where, check=False).stdout,
                 self.kubectl("get", "events", "--sort-by=.lastTimestamp", *where,
                              check=False).stdout[-4000:]]  # fmt: skip
        parts += [f"--- {c}\n{self.log_tail(c, 2000)}"
                  for c in [f"kubelet-{n}" for n in self.node_names]]  # fmt: skip
        return "\n".join(parts)

    def wait_until(self, what: str, check: Callable[[], Any], timeout: float = 60,
                   interval: float = 0.5, ns: str | None = None) -> Any:  # fmt: skip
        """Poll `check` until truthy and return its value; on timeout fail with diagnostics."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = check()
            except AssertionError as e:
                last = e
            else:
                if last:
                    return last
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}\n"
                             f"{self.diagnostics(ns)}")  # fmt: skip

    def exec(self, ns: str, pod: str, *argv: str,
             check: bool = True) -> subprocess.CompletedProcess[str]:  # fmt: skip
        return self.kubectl("exec", "-n", ns, pod, "--", *argv, check=check)

    def import_images(self, *archives: Path, node: str | None = None) -> str:
        """Import image archives (docker-archive, or OCI layout tars such as images.py's
        deltas) into every node, or only `node`; skipped where that exact image is there."""
        where = ["--node", node] if node else []
        proc = testbed_cli("import", *where, *map(str, archives), timeout=3600)
        if proc.returncode != 0:
            raise AssertionError(f"image import failed:\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout

    def content_digests(self, node: str) -> set[str]:
        """The blobs `node`'s containerd holds: `have` for images.oci_archive(name, out, have),
        so a changed image imports as only its new layers."""
        proc = testbed_cli("content", node, timeout=120)
        if proc.returncode != 0:
            raise AssertionError(f"listing {node}'s content failed:\n{proc.stderr}")
        return set(proc.stdout.split())

    def down(self) -> list[str]:
        """Take the bed down; return what the bed itself reports as left (ideally [])."""
        proc = testbed_cli("down", timeout=600)
        self.is_down = True
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        left = testbed_cli("leftovers", timeout=120)
        return [] if left.returncode == 0 else left.stdout.splitlines()
