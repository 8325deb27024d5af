"""Real nodes: per node, a containerd (Debian's, with runc and the CNI bridge plugin) and a
kubelet, both in the host network namespace, kept apart by socket, directories, ports,
`podLogsDir`, cgroup root and CNI bridge.

Node i is `node-i`: IP 10.202.0.(10+i) on lo, pods from 10.200.i.0/24 on bridge
`vllmdp-br<i>`, cgroup root `/vllmdp-node-i` (cgroup v1: in every hierarchy; v2: one group),
runtime state in `<state>/nodes/node-i/`. Its containerd image store lives in the cache
(`<cache>/containerd-<node>/`), so imported images survive `down`; nothing runs from it once
containerd stops. The real-node bed (realbed.py) stops the processes by recorded PID; the
helpers here remove what containers leave (tasks, shims, cgroups).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import oci
from common import cache_root, free_port, http_get, log
from hostnet import BRIDGE_PREFIX, CNI_NETWORK_PREFIX, DNS_IP, node_ip, node_pod_cidr
from procs import Launcher

CGROUP_FS = Path("/sys/fs/cgroup")
CNI_BIN_DIR = "/usr/lib/cni"  # Debian's containernetworking-plugins
CONTAINERD = "/usr/bin/containerd"
CTR = "/usr/bin/ctr"
GPU_RESOURCE = "nvidia.com/gpu"
IMAGE_LABEL = "vllmdp.io/image-config"  # the archive's config digest, set on import
K8S_NS = "k8s.io"


@dataclass(frozen=True)
class Node:
    """Where one node's pieces live; ports are picked by `up` and kept in testbed.json."""

    index: int
    dir: Path
    store: Path  # containerd root: content, snapshots, metadata (cached)

    @property
    def name(self) -> str:
        return f"node-{self.index}"

    @property
    def ip(self) -> str:
        return node_ip(self.index)

    @property
    def pod_cidr(self) -> str:
        return node_pod_cidr(self.index)

    @property
    def bridge(self) -> str:
        return f"{BRIDGE_PREFIX}{self.index}"

    @property
    def cgroup_root(self) -> str:
        return f"vllmdp-node-{self.index}"

    @property
    def socket(self) -> Path:
        return self.dir / "containerd.sock"


MAX_NODES = 9  # node IPs 10.202.0.11-19, below the range's other addresses


def plan(state_root: Path, count: int) -> list[Node]:
    if not 1 <= count <= MAX_NODES:
        raise ValueError(f"nodes: {count} is out of range (1..{MAX_NODES}: node IPs are "
                         f"10.202.0.11-{10 + MAX_NODES})")  # fmt: skip
    store = cache_root() / "containerd"
    return [Node(i, state_root / "nodes" / f"node-{i}", store / f"node-{i}")
            for i in range(1, count + 1)]  # fmt: skip


def cgroup_v2() -> bool:
    return (CGROUP_FS / "cgroup.controllers").exists()


def cgroup_dirs(root: str, unified: bool = True) -> list[Path]:
    """The node's cgroup root in every hierarchy (v1), or the one group (v2). On a hybrid v1
    host runc also makes the pod groups in the `unified` (v2) hierarchy; `unified=False`
    leaves that one out (kubelet needs the root only in the v1 hierarchies)."""
    if cgroup_v2():
        return [CGROUP_FS / root]
    hierarchies = [h for h in CGROUP_FS.iterdir() if h.is_dir() and not h.is_symlink()]
    return sorted(h / root for h in hierarchies if unified or h.name != "unified")


def create_cgroups(node: Node) -> None:
    """kubelet refuses a cgroupRoot that is missing from a v1 hierarchy; create it everywhere."""
    if cgroup_v2():
        wanted = (CGROUP_FS / "cgroup.controllers").read_text().split()
        enabled = (CGROUP_FS / "cgroup.subtree_control").read_text().split()
        missing = [c for c in ("cpu", "cpuset", "memory", "pids", "io", "hugetlb")
                   if c in wanted and c not in enabled]  # fmt: skip
        if missing:
            try:
                (CGROUP_FS / "cgroup.subtree_control").write_text(
                    " ".join(f"+{c}" for c in missing))
            except OSError as e:
                raise RuntimeError(
                    f"cgroup v2: cannot enable {missing} for child groups of {CGROUP_FS} ({e}); "
                    "in a container, move its processes out of the root group first") from e
    for d in cgroup_dirs(node.cgroup_root, unified=False):
        d.mkdir(exist_ok=True)


def remove_cgroups(node: Node) -> list[str]:
    """Kill what still runs in the node's cgroups, then remove them deepest first."""
    problems = []
    for top in cgroup_dirs(node.cgroup_root):
        if not top.exists():
            continue
        groups = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for group in [*groups, top]:
            for _ in range(50):
                procs = (group / "cgroup.procs").read_text().split() if group.exists() else []
                for pid in procs:
                    os.kill(int(pid), signal.SIGKILL)
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                problems.append(f"cgroup {group} not removable")
    return problems


def cni_config(node: Node) -> dict[str, Any]:
    """One bridge per node, its gateway on the host; host-local addresses from the node's /24."""
    ipam = {"type": "host-local", "dataDir": str(node.dir / "ipam"),
            "ranges": [[{"subnet": node.pod_cidr}]], "routes": [{"dst": "0.0.0.0/0"}]}  # fmt: skip
    bridge = {"type": "bridge", "bridge": node.bridge, "isGateway": True, "ipMasq": False,
              "hairpinMode": True, "ipam": ipam}  # fmt: skip
    return {"cniVersion": "0.4.0", "name": f"{CNI_NETWORK_PREFIX}{node.index}", "plugins": [bridge]}


def containerd_config(node: Node, sandbox_image: str) -> str:
    """containerd 1.6 config (version 2): everything under the node's dirs."""
    d = node.dir
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{node.store}"
state = "{d / 'containerd-state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "{node.socket}"
[ttrpc]
  address = "{node.socket}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d / 'opt'}"
[{cri}]
  sandbox_image = "{sandbox_image}"
  enable_unprivileged_ports = true
  # Root may lack CAP_SYS_RESOURCE (it does on this kind of VM): runc then cannot give the
  # sandbox the oom_score_adj -998 kubelet asks for, and every sandbox fails without this.
  restrict_oom_score_adj = true
  disable_apparmor = true
  netns_mounts_under_state_dir = true
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{d / 'runc'}"
  [{cri}.cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{d / 'cni'}"
"""


def kubelet_config(node: Node, ca: Path, port: int, healthz_port: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs", "cgroupRoot": f"/{node.cgroup_root}",
        "containerRuntimeEndpoint": f"unix://{node.socket}",
        "address": node.ip, "port": port, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": healthz_port,
        # The API server proves itself with a client certificate from the bed's CA.
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(ca)}},
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDomain": "cluster.local", "clusterDNS": [DNS_IP], "podCIDR": node.pod_cidr,
        "failSwapOn": False, "podLogsDir": str(node.dir / "pod-logs"),
        "serializeImagePulls": False, "maxPods": 110,
        # Check status every 2 s (default 10 s): the GPUs patched into capacity reach
        # allocatable on the next check, which `up` waits for. Unchanged status is not sent.
        "nodeStatusUpdateFrequency": "2s",
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                         "imagefs.available": "1%"},
        # Images are imported, never pulled: never collect them.
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
    }  # fmt: skip
    if not cgroup_v2():
        cfg["failCgroupV1"] = False  # kubelet >= 1.35 refuses cgroup v1 unless told
    return cfg


def ctr(node: Node, *args: str, check: bool = True, timeout: float = 600) -> str:
    proc = subprocess.run([CTR, "-a", str(node.socket), "-n", K8S_NS, *args],
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    if check and proc.returncode != 0:
        raise RuntimeError(f"ctr {' '.join(args)} on {node.name}: {proc.stderr.strip()}")
    return proc.stdout


def start_containerd(launcher: Launcher, node: Node, sandbox_image: str) -> None:
    for sub in ("cni", "ipam", "pod-logs", "kubelet", "opt", "runc"):
        (node.dir / sub).mkdir(parents=True, exist_ok=True)
    node.store.mkdir(parents=True, exist_ok=True)
    (node.dir / "cni" / "10-bridge.conflist").write_text(json.dumps(cni_config(node), indent=1))
    (node.dir / "containerd.toml").write_text(containerd_config(node, sandbox_image))
    launcher.launch(f"containerd-{node.name}",
                    [CONTAINERD, "--config", str(node.dir / "containerd.toml")],
                    lambda: ctr(node, "version", timeout=5), 60)  # fmt: skip
    # A store kept in the cache may hold containers of a bed that was never stopped.
    remove_containers(node)


def start_kubelet(launcher: Launcher, node: Node, nd: Path, kubeconfig: Path, ca: Path,
                  labels: dict[str, str]) -> dict[str, int]:  # fmt: skip
    ports = {"kubelet": free_port(node.ip), "healthz": free_port()}
    cfg = kubelet_config(node, ca, ports["kubelet"], ports["healthz"])
    (node.dir / "kubelet.json").write_text(json.dumps(cfg, indent=1))
    launcher.launch(
        f"kubelet-{node.name}",
        [str(nd / "kubelet"), f"--config={node.dir / 'kubelet.json'}",
         f"--kubeconfig={kubeconfig}", f"--root-dir={node.dir / 'kubelet'}",
         f"--cert-dir={node.dir / 'kubelet' / 'pki'}", f"--hostname-override={node.name}",
         f"--node-ip={node.ip}", f"--node-labels={','.join(f'{k}={v}' for k, v in labels.items())}",
         "--v=2"],
        lambda: http_get(f"http://127.0.0.1:{ports['healthz']}/healthz")[0] == 200, 90,
    )  # fmt: skip
    return ports


def remove_containers(node: Node) -> None:
    """Kill every task and delete every container of the node's containerd (CRI's included)."""
    if not node.socket.exists():
        return
    for task in ctr(node, "tasks", "ls", "-q", check=False).split():
        ctr(node, "tasks", "delete", "--force", task, check=False)  # SIGKILL, wait, delete
    for container in ctr(node, "containers", "ls", "-q", check=False).split():
        ctr(node, "containers", "delete", container, check=False)


def kill_shims(nodes: list[Node]) -> None:
    """Shims are re-parented away from containerd; find ours by the address they were given."""
    markers = [f"-address\0{node.socket}\0".encode() for node in nodes]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            if any(m in cmdline for m in markers):
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            continue


def stored_as(stored: str, tag: str) -> bool:
    """Whether containerd's name `stored` is the archive's `tag`: containerd keeps a bare
    `name:tag` under the default registry's `library/` path, and `ns/name:tag` under that
    registry, so compare past the registry part."""
    if stored == tag:
        return True
    parts = stored.split("/")
    if len(parts) < 2 or "." not in parts[0] or "." in tag.split("/")[0]:
        return False
    rest = "/".join(parts[1:])
    return rest == (tag if "/" in tag else f"library/{tag}")


def node_images(node: Node) -> dict[str, str]:
    """ref -> the config digest recorded when we imported it (empty if not ours)."""
    out = {}
    for line in ctr(node, "images", "ls").splitlines()[1:]:
        fields = line.split()
        labels = dict(kv.split("=", 1) for kv in fields[-1].split(",") if "=" in kv)
        out[fields[0]] = labels.get(IMAGE_LABEL, "")
    return out


def archive_image(archive: Path) -> tuple[list[str], str]:
    """The names and the config digest (the image ID) of a docker-archive, or of an OCI
    layout tar (images.py's delta archives: the blobs a node holds left out)."""
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        if "manifest.json" in names:
            entry = oci.read_manifest(archive)
            config = "sha256:" + entry["Config"].removesuffix(".json")
            return list(entry.get("RepoTags") or []), config
        index_file = tar.extractfile("index.json") if "index.json" in names else None
        if index_file is None:
            raise ValueError(f"{archive}: neither a docker-archive nor an OCI layout tar")
        (desc,) = json.load(index_file)["manifests"]
        manifest = tar.extractfile(f"blobs/sha256/{desc['digest'].split(':', 1)[1]}")
        if manifest is None:
            raise ValueError(f"{archive}: no manifest blob {desc['digest']}")
        name = desc.get("annotations", {}).get("io.containerd.image.name")
        return ([name] if name else []), str(json.load(manifest)["config"]["digest"])


def content_digests(node: Node) -> set[str]:
    """The blobs the node's content store holds (what an OCI delta archive may leave out)."""
    return set(ctr(node, "content", "ls", "-q").split())


def import_image(node: Node, archive: Path) -> str:
    """Import an image archive into the node unless it holds that exact image; say which."""
    tags, digest = archive_image(archive)
    if not tags:
        raise ValueError(f"{archive}: the archive names no image")

    def held() -> dict[str, list[str]]:
        have = node_images(node)
        return {t: [ref for ref in have if stored_as(ref, t)] for t in tags}

    before, have = held(), node_images(node)
    if all(refs and all(have[r] == digest for r in refs) for refs in before.values()):
        return f"{node.name}: {', '.join(tags)} already there ({digest[:19]})"
    t0 = time.monotonic()
    ctr(node, "images", "import", "--no-unpack=false", str(archive), timeout=1800)
    for refs in held().values():
        for ref in refs:
            ctr(node, "images", "label", ref, f"{IMAGE_LABEL}={digest}")
    return f"{node.name}: imported {', '.join(tags)} in {time.monotonic() - t0:.1f}s"


def log_import(nodes: list[Node], archives: list[Path]) -> None:
    for archive in archives:
        for node in nodes:
            log(import_image(node, archive))
