"""The real-node mode: the shared control plane, CoreDNS, real nodes (containerd + kubelet
each), kube-proxy and KubeRay, on this host, as root.

`up` order: record the host (hostnet.HostRecord), addresses on lo, etcd, kube-apiserver
(10.202.0.1:6443, reachable from pods as the `kubernetes` Service 10.201.0.1:443),
controller-manager (with node lifecycle), scheduler, CoreDNS, each node's containerd (pause
and probe images imported) and kubelet, `nvidia.com/gpu` on each node's status, kube-proxy,
the NetworkPolicy enforcer (netpolicy.py), KubeRay (resolving cluster names through CoreDNS),
our CRDs, then any image archives given.
`down` deletes every pod while the kubelets run (so CNI tears the pod network down), stops
everything by recorded PID, removes left containers, shims, cgroups and mounts, and restores
the host record; `leftovers` lists anything of ours still there. State: `.cluster/` in the
repository root or $VLLMDP_CLUSTER_DIR.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import addons
import hostnet
import netpolicy
import realnodes
from binaries import PAUSE_IMAGE, netpol_binary, node_bin_dir
from common import REPO, http_get, log, pid_alive, wait_for
from controlplane import ADMISSION_ALWAYS, ControlPlane, Profile
from procs import Launcher, State, stop, stop_all

DEFAULT_NODES = 2
DEFAULT_GPUS = 4
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"
PROFILE = Profile(
    address=hostnet.API_IP,
    apiserver_port=6443,
    service_cidr=hostnet.SERVICE_CIDR,
    authorization="Node,RBAC",
    endpoint_reconciler="lease",
    admission_enable=("NodeRestriction", *ADMISSION_ALWAYS),
    admission_disable=(),
    controllers=(
        "*",
        "-node-ipam-controller",
        "-cloud-node-lifecycle-controller",
        "-service-lb-controller",
        "-node-route-controller",
    ),
    kubelet_client=True,
)
RUNTIME_BINARIES = {"containerd", "containerd-shim-runc-v2", "kubelet", "kube-proxy", "coredns",
                    "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
                    "ray-operator", "runc", "kube-router"}  # fmt: skip


def state_dir() -> Path:
    return Path(os.environ.get("VLLMDP_CLUSTER_DIR") or REPO / ".cluster").resolve()


def nodes_of(st: State) -> list[realnodes.Node]:
    """The nodes the bed in `st` was started with (testbed.json)."""
    return realnodes.plan(st.root, int(st.info().get("node_count", DEFAULT_NODES)))


def every_node(st: State) -> list[realnodes.Node]:
    """Every node a bed in `st` can have had: what `down` cleans and `leftovers` looks at, so
    a bed of 4 nodes whose testbed.json a later `up` of 2 rewrote leaves nothing behind."""
    return realnodes.plan(st.root, realnodes.MAX_NODES)


def components(st: State) -> list[str]:
    """Everything `up` starts, in start order."""
    per_node = [f"{p}-{n.name}" for n in nodes_of(st) for p in ("containerd", "kubelet")]
    return ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "coredns",
            *per_node, "kube-proxy", netpolicy.COMPONENT, "kuberay-operator"]  # fmt: skip


def healthy(st: State) -> bool:
    info, alive = st.info(), st.alive()
    if not info.get("up_seconds") or set(alive) != set(components(st)) or not all(alive.values()):
        return False
    return http_get(f"{info['server']}/readyz", info["admin_token"])[0] == 200


def _node_ready(item: dict[str, Any]) -> bool:
    conds = item["status"].get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def advertise_gpus(cp: ControlPlane, nodes: list[realnodes.Node], count: int) -> None:
    """The documented way to advertise an extended resource: PATCH the node's status capacity;
    kubelet then copies it into allocatable on its next status update."""
    patch = [{"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": str(count)}]
    for n in nodes:
        cp.kubectl("patch", "node", n.name, "--subresource=status", "--type=json",
                   "-p", json.dumps(patch))  # fmt: skip

    def allocatable() -> bool:
        items = json.loads(cp.kubectl("get", "nodes", "-o", "json").stdout)["items"]
        have = {i["metadata"]["name"]: i["status"].get("allocatable", {}) for i in items}
        gpu = realnodes.GPU_RESOURCE
        return all(have.get(n.name, {}).get(gpu) == str(count) for n in nodes)

    wait_for(f"{realnodes.GPU_RESOURCE} allocatable on every node", allocatable, 60)


def _start_nodes(
    cp: ControlPlane,
    launcher: Launcher,
    host: hostnet.HostRecord,
    nodes: list[realnodes.Node],
    nd: Path,
    gpus: int,
) -> dict[str, dict[str, int]]:
    """Each node's cgroups, containerd (with our images) and kubelet; then wait until every
    node is Ready with its GPUs allocatable. Returns the kubelets' ports."""
    t0 = time.monotonic()
    labels = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": str(gpus),
              "nvidia.com/gpu.product": GPU_PRODUCT, "vllmdp.io/testbed-node": "real"}  # fmt: skip
    node_ports = {}
    for n in nodes:
        host.expect_bridge(n.bridge)
        realnodes.create_cgroups(n)
        realnodes.start_containerd(launcher, n, PAUSE_IMAGE)
        realnodes.log_import([n], sorted((nd / "images").glob("*.tar")))
        node_ports[n.name] = realnodes.start_kubelet(
            launcher, n, nd, cp.kubeconfig_for(n.name), cp.st.pki / "ca.crt", labels)

    def ready() -> bool:
        items = json.loads(cp.kubectl("get", "nodes", "-o", "json").stdout)["items"]
        return {n.name for n in nodes} <= {i["metadata"]["name"] for i in items if _node_ready(i)}

    wait_for("nodes Ready", ready, 120, None, cp.st.logs / f"kubelet-{nodes[-1].name}.log")
    advertise_gpus(cp, nodes, gpus)
    launcher.timings["nodes"] = time.monotonic() - t0
    log(f"{len(nodes)} real node(s) Ready with {gpus} {realnodes.GPU_RESOURCE} each in "
        f"{launcher.timings['nodes']:.1f}s")  # fmt: skip
    return node_ports


class NotStarted(RuntimeError):
    """`up` refused before it changed anything. Nothing is to be taken down: a `down` now
    would replay an earlier host record and take the addresses (and KUBE-*/CNI-* chains) of
    whatever holds our ranges, another bed's."""


def sized(asked: int | None, running: int, is_up: bool) -> tuple[int, bool]:
    """How many nodes `up` starts (asked, else as many as run, else DEFAULT_NODES), and
    whether the healthy bed that runs already has them."""
    count = asked or (running if is_up else DEFAULT_NODES)
    return count, is_up and count == running


def up(st: State, bd: Path, nd: Path, node_count: int | None, gpus: int,
       images: list[Path]) -> None:  # fmt: skip
    """Start the real-node bed with `node_count` nodes (None: as it runs, else DEFAULT_NODES).
    Idempotent: a healthy bed of that size only gets the images; one of another size is
    taken down and started again with the size asked for."""
    if os.geteuid() != 0:
        raise NotStarted("the real-node bed needs root (containerd, CNI bridges, iptables, "
                         "cgroups, addresses on lo)")  # fmt: skip
    running, is_up = len(nodes_of(st)), healthy(st)
    count, reuse = sized(node_count, running, is_up)
    nodes = realnodes.plan(st.root, count)
    if reuse:
        log(f"already up and healthy with {running} node(s) ({st.root})")
        realnodes.log_import(nodes, images)
        print(f"export KUBECONFIG={st.kubeconfig}", flush=True)
        return
    if is_up:
        log(f"up with {running} node(s), asked for {count}: starting it again")
    if st.pids() or (st.root / "host.json").exists():
        log("found a partial or stale real-node bed; taking it down first")
        down(st)
    if claims := hostnet.foreign_claims(None):
        raise NotStarted(f"our address ranges are already in use here (another real-node bed?): "
                         f"{claims}")  # fmt: skip
    t_up = time.monotonic()
    for d in ("etcd", "nodes", "logs"):
        shutil.rmtree(st.root / d, ignore_errors=True)
    host = hostnet.HostRecord.snapshot(st.root / "host.json")
    for ip in (hostnet.API_IP, hostnet.DNS_IP, *(n.ip for n in nodes)):
        host.add_address(ip)
    host.set_sysctl("net.ipv4.ip_forward", "1")  # pods on one node reach pods on another
    launcher = Launcher(st)
    cp = ControlPlane(st, bd, PROFILE, launcher)
    users = {"coredns": addons.COREDNS_USER, "kube-proxy": addons.KUBE_PROXY_USER,
             "netpol": netpolicy.USER,
             **{n.name: (f"system:node:{n.name}", "system:nodes") for n in nodes}}  # fmt: skip
    cp.prepare(users, None, None, (), {
        "mode": "real-nodes", "node_count": len(nodes), "gpus_per_node": gpus,
        "node_bin_dir": str(nd), "pod_cidr": hostnet.POD_CIDR,
        "service_cidr": hostnet.SERVICE_CIDR, "dns_ip": hostnet.DNS_IP,
        "cgroup": "v2" if realnodes.cgroup_v2() else "v1",
        "nodes": [{"name": n.name, "ip": n.ip, "pod_cidr": n.pod_cidr, "bridge": n.bridge,
                   "cgroup_root": n.cgroup_root, "containerd_socket": str(n.socket),
                   "containerd_store": str(n.store)} for n in nodes]})  # fmt: skip
    cp.start()
    addons.start_coredns(cp, launcher, nd)
    node_ports = _start_nodes(cp, launcher, host, nodes, nd, gpus)
    addons.start_kube_proxy(cp, launcher, nd, host, nodes[0].name)
    netpolicy.start(cp, launcher, netpol_binary())
    resolv = st.root / "resolv.conf"
    resolv.write_text(f"nameserver {hostnet.DNS_IP}\nsearch svc.cluster.local cluster.local\n"
                      "options ndots:5\n")  # fmt: skip
    cp.start_kuberay(resolv)
    cp.install_our_crds()
    realnodes.log_import(nodes, images)
    total = time.monotonic() - t_up
    st.update_info(node_ports=node_ports, up_seconds=round(total, 2),
                   timings={k: round(v, 2) for k, v in launcher.timings.items()})  # fmt: skip
    rss = st.rss()
    log("RSS MiB: " + ", ".join(f"{n}={v:.0f}" for n, v in rss.items())
        + f"; total {sum(rss.values()):.0f}")  # fmt: skip
    log(f"up in {total:.1f}s")
    print(f"export KUBECONFIG={st.kubeconfig}", flush=True)


def _delete_pods(st: State) -> None:
    """Delete every pod while the kubelets run, so each sandbox goes through CNI DEL."""
    info = st.info()
    kubelets = [n for n, a in st.alive().items() if a and n.startswith("kubelet-")]
    if not info or not kubelets:
        return
    if http_get(f"{info['server']}/readyz", info["admin_token"])[0] != 200:
        return
    cp = ControlPlane(st, Path(info["bin_dir"]), PROFILE, Launcher(st))
    cp.kubectl("delete", "pods", "--all", "-A", "--grace-period=1", "--wait=false", check=False)

    def gone() -> bool:
        return not cp.kubectl("get", "pods", "-A", "-o", "name", check=False).stdout.strip()

    try:
        wait_for("every pod deleted", gone, 90)
    except RuntimeError as e:
        log(f"{e}; removing what is left directly")


def _unmount_under(roots: list[Path]) -> None:
    prefixes = tuple(f"{r}/" for r in roots)
    mounts = [ln.split()[4].replace("\\040", " ")
              for ln in Path("/proc/self/mountinfo").read_text().splitlines()]  # fmt: skip
    for m in sorted((m for m in mounts if m.startswith(prefixes)), key=lambda m: -m.count("/")):
        if hostnet.run("umount", m).returncode != 0:
            hostnet.run("umount", "-l", m)


def down(st: State) -> list[str]:
    """Stop and remove everything `up` made; return what is still left (ideally nothing)."""
    held = hostnet.listeners(Path("/proc/net/tcp").read_text())
    if another_bed_up((st.root / "host.json").exists(), any(st.alive().values()), held):
        log(f"nothing of the bed in {st.root} runs, and another listens in its ranges "
            f"({', '.join(held)}): leaving the host to that one")  # fmt: skip
        return []
    t0 = time.monotonic()
    info, nodes = st.info(), every_node(st)
    nd = Path(info.get("node_bin_dir") or node_bin_dir())
    stop(st, "kuberay-operator")  # nothing may recreate pods from here on
    stop(st, "kube-controller-manager")
    _delete_pods(st)
    for n in nodes:
        stop(st, f"kubelet-{n.name}")
    for n in nodes:
        realnodes.remove_containers(n)
        stop(st, f"containerd-{n.name}")
    realnodes.kill_shims(nodes)
    stop_all(st, [netpolicy.COMPONENT, "kube-proxy", "coredns", "kube-scheduler",
                  "kube-apiserver", "etcd"])  # fmt: skip
    addons.kube_proxy_cleanup(nd)
    problems = [p for n in nodes for p in realnodes.remove_cgroups(n)]
    _unmount_under([st.root, *(n.store for n in nodes)])
    # Restoring is idempotent: with only the record of an earlier `down`, `down` repairs.
    restored = st.root / "host.restored.json"
    host = hostnet.HostRecord.load(st.root / "host.json") or hostnet.HostRecord.load(restored)
    if host is not None:
        problems += host.restore()
        os.replace(host.path, restored)
    problems += netpolicy.remove_ipsets()  # once restore has removed the rules that use them
    if not [m for m in _mounts() if m.startswith(f"{st.root}/")]:
        shutil.rmtree(st.root / "nodes", ignore_errors=True)
    left = problems + leftovers(st)
    log(f"down in {time.monotonic() - t0:.1f}s; "
        + ("nothing left" if not left else "LEFT: " + "; ".join(left)))  # fmt: skip
    return left


def another_bed_up(made_changes: bool, ours_alive: bool, listeners: list[str]) -> bool:
    """Whether a `down` now would take another bed apart: this one changed nothing since its
    last `down` (no host.json) and runs nothing, yet something listens in our range. The
    node cgroups, `kube-proxy --cleanup`, the KUBE-*/CNI-* chains and the addresses on lo
    are named alike for every real-node bed on a host."""
    return not made_changes and not ours_alive and bool(listeners)


def _mounts() -> list[str]:
    return [ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()]


def leftovers(st: State) -> list[str]:
    """Anything of this bed still on the host: processes, cgroups, mounts, network namespaces
    (nsfs mounts under our dirs), bridges, addresses, iptables chains, changed sysctls."""
    nodes = every_node(st)
    roots = [str(st.root), *(str(n.store) for n in nodes)]
    found = [f"process {name} (pid {rec['pid']})" for name, rec in st.pids().items()
             if pid_alive(rec["pid"])]  # fmt: skip
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = b" ".join(argv).decode(errors="replace")
        if (proc.name.isdigit() and Path(argv[0].decode(errors="replace")).name in RUNTIME_BINARIES
                and any(r in text for r in roots) and pid_alive(int(proc.name))):  # fmt: skip
            found.append(f"process {proc.name}: {text[:120]}")
    found += [f"cgroup {d}" for n in nodes for d in realnodes.cgroup_dirs(n.cgroup_root)
              if d.exists()]  # fmt: skip
    found += [f"mount {m}" for m in _mounts() if m.startswith(tuple(f"{r}/" for r in roots))]
    found += [f"link {link}" for link in hostnet.our_links()]
    found += [f"address {a}" for a in hostnet.addresses_in_our_ranges()]
    found += [f"iptables chain {c}" for c in hostnet.iptables_leftovers()]
    found += [f"ipset {s}" for s in netpolicy.ipset_leftovers()]
    found += [f"file {f}" for f in hostnet.runtime_files(st.root)]
    record = hostnet.HostRecord.load(st.root / "host.restored.json")
    if record is not None:
        found += [f"sysctl {k}={hostnet.read_sysctl(k)} (was {v})"
                  for k, v in record.sysctls.items() if hostnet.read_sysctl(k) != v]  # fmt: skip
        found += [f"nft {t}" for t in hostnet.nft_tables() if t not in record.nft_tables]
        found += [f"directory {d}" for d in record.absent_dirs if Path(d).exists()]
    return found


def status(st: State) -> bool:
    pids = st.pids()
    if not pids:
        print(f"real-node bed in {st.root}: not running")
        return False
    alive, rss = st.alive(), st.rss()
    for name in components(st):
        rec = pids.get(name)
        state = "not started" if rec is None else ("alive" if alive.get(name) else "DEAD")
        extra = f" (pid {rec['pid']}, RSS {rss.get(name, 0):.0f} MiB)" if rec else ""
        print(f"  {name:26s} {state}{extra}")
    ok = healthy(st)
    print(f"real-node bed in {st.root}: {'healthy' if ok else 'NOT healthy'}")
    return ok


def env_lines(st: State) -> list[str]:
    info = st.info()
    lines = [f"export VLLMDP_CLUSTER_DIR={st.root}", f"export KUBECONFIG={st.kubeconfig}"]
    if info:
        lines.append(f"export PATH={info['bin_dir']}:$PATH")
    return lines
