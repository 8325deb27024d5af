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
from vllm_dp_operator.api.quantity import quantity_value

REPO = Path(__file__).resolve().parents[2]
TESTBED_PY = REPO / "tests" / "testbed" / "testbed.py"
# Images `cluster build` makes and `cluster up` imports into every node (test images).
PAUSE_IMAGE = "testbed.local/pause:1"
PROBE_IMAGE = "testbed.local/probe:1"


# What a check against the bed may raise while the state it waits for is not there yet.
NOT_YET = (AssertionError, OSError, ValueError, KeyError, subprocess.SubprocessError)


def millicores(quantity: str) -> int:
    """A CPU quantity as the scheduler counts it: `1` -> 1000, `900m` -> 900."""
    return round(quantity_value(str(quantity)) * 1000)


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

    def node_load(self) -> dict[str, dict[str, Any]]:
        """Per node: allocatable CPU (millicores) and each pod bound there that still holds its
        requests (not Succeeded or Failed, terminating ones included, as the scheduler counts)."""
        nodes = self.kubectl_json("get", "nodes")["items"]
        load: dict[str, dict[str, Any]] = {
            n["metadata"]["name"]: {"allocatable_m": millicores(n["status"]["allocatable"]["cpu"]),
                                    "pods": []} for n in nodes}  # fmt: skip
        for pod in self.kubectl_json("get", "pods", "-A")["items"]:
            node = pod["spec"].get("nodeName")
            if node not in load or pod["status"].get("phase") in ("Succeeded", "Failed"):
                continue
            cpu = sum(millicores(c.get("resources", {}).get("requests", {}).get("cpu", "0"))
                      for c in pod["spec"]["containers"])  # fmt: skip
            meta = pod["metadata"]
            load[node]["pods"].append({"pod": f"{meta['namespace']}/{meta['name']}",
                                       "cpu_m": cpu,
                                       "terminating": "deletionTimestamp" in meta})  # fmt: skip
        return load

    def node_load_text(self) -> str:
        """`node_load` as lines: what each node's CPU is promised to."""
        try:
            load = self.node_load()
        except NOT_YET as e:
            return f"--- CPU requests per node: {e!r}"
        lines = ["--- CPU requests per node (scheduler's view)"]
        for node, held in sorted(load.items()):
            used = sum(p["cpu_m"] for p in held["pods"])
            lines.append(f"{node}: {used}m of {held['allocatable_m']}m requested")
            lines += [f"  {p['pod']} {p['cpu_m']}m" + (" (terminating)" if p["terminating"]
                                                      else "") for p in held["pods"]]  # fmt: skip
        return "\n".join(lines)

    def wait_nodes_hold_only(self, namespaces: set[str], timeout: float = 180) -> None:
        """Wait until no pod outside `namespaces` is bound to a node: an earlier test's pods,
        still terminating after its namespace was deleted without waiting, hold CPU requests
        the scheduler counts, and a Ray head sized to a whole node would stay Pending."""

        def quiet() -> bool:
            strays = [p["pod"] for held in self.node_load().values() for p in held["pods"]
                      if p["pod"].split("/")[0] not in namespaces]  # fmt: skip
            assert not strays, f"still on the nodes: {strays}"
            return True

        self.wait_until(f"the nodes to hold only pods of {sorted(namespaces)}", quiet, timeout,
                        interval=1.0)  # fmt: skip

    def diagnostics(self, ns: str | None = None) -> str:
        """What explains a timeout: pods and events (of `ns`), what each node's CPU is
        promised to, and the kubelets' log tails."""
        where = ["-n", ns] if ns else ["-A"]
        parts = [self.kubectl("get", "pods", "-o", "wide", *where, check=False).stdout,
                 self.node_load_text(),
                 self.kubectl("get", "events", "--sort-by=.lastTimestamp", *where,
                              check=False).stdout[-4000:]]  # fmt: skip
        parts += [f"--- {c}\n{self.log_tail(c, 2000)}"
                  for c in [f"kubelet-{n}" for n in self.node_names]]  # fmt: skip
        return "\n".join(parts)

    def wait_until(self, what: str, check: Callable[[], Any], timeout: float = 60,
                   interval: float = 0.5, ns: str | None = None,
                   explain: Callable[[], str] | None = None) -> Any:  # fmt: skip
        """Poll `check` until truthy and return its value. A check that raises (an assertion,
        a kubectl or HTTP error) counts as not yet. On timeout fail with `explain()`, else with
        the bed's diagnostics (of `ns`)."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = check()
            except NOT_YET as e:
                last = e
            else:
                if last:
                    return last
            time.sleep(interval)
        why = explain() if explain else self.diagnostics(ns)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: "
                             f"{last!r}\n{why}")  # fmt: skip

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
