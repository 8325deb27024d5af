"""NetworkPolicy enforcement on the real-node bed: kube-router's firewall controller alone
(`github.com/cloudnativelabs/kube-router/v2`, `--run-firewall`, no router, no service proxy),
a host process beside the CNI bridges and kube-proxy. It needs only iptables (NFLOG, REJECT,
physdev and set matches) and ipset. That version has published security flaws: acceptable on
a throwaway test bed, never in a cluster.

Why not SIG Network's `sigs.k8s.io/kube-network-policies` (v0.8.0): it judges every new
connection in user space through nftables' `queue` expression, which needs the kernel's
CONFIG_NFT_QUEUE (`check_kernel` tries it in a throwaway network namespace and records the
answer in testbed.json), and it reads only an in-cluster config. Where a kernel has the
option, it could run in a host-network pod on ENFORCED_NODE instead.

Either acts only for the pods of the node it is named for (by node name or node IP), and keeps
one set of chains per network namespace: two in one namespace delete each other's. Every
node of this bed lives in the host's network namespace, so one enforcer runs, for node-1
(`ENFORCED_NODE`); a test that needs enforcement puts its pods there. Traffic from the host
itself (KubeRay, kubelet probes, a test's host client) is the node's, which NetworkPolicy
always admits.

Started by realbed.up after kube-proxy, stopped by recorded PID in realbed.down. Its chains
(KUBE-ROUTER-*, KUBE-POD-FW-*, KUBE-NWPLCY-*) go with hostnet's KUBE-* cleanup, then its
ipsets (KUBE-SRC-*, KUBE-DST-*) with `remove_ipsets`; `ipset_leftovers` is what `leftovers`
reports. (`kube-router --cleanup-config` is not used: it also flushes IPVS and removes routing
state that is not its firewall's.)
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml
from common import free_port, http_get, log, user_cluster_role
from controlplane import ControlPlane
from hostnet import SERVICE_CIDR, run
from procs import Launcher

KUBE_ROUTER = "kube-router"
COMPONENT = "netpol-enforcer"
ENFORCED_NODE = "node-1"
USER = ("vllmdp:testbed:netpol", "vllmdp:testbed")
# ipsets the firewall controller makes (pkg/controllers/netpol: KUBE-SRC-*, KUBE-DST-*).
IPSET_PREFIXES = ("KUBE-SRC-", "KUBE-DST-")
# Read-only, what its informers list and watch (pods, namespaces, policies; nodes for its own
# address; services and endpoints, which its shared informer factory starts too).
RBAC = user_cluster_role(USER[0], [
    {"apiGroups": [""], "resources": ["pods", "namespaces", "nodes", "services", "endpoints"],
     "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
     "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
     "verbs": ["get", "list", "watch"]},
])  # fmt: skip


def nft_queue_works() -> bool:
    """Whether nftables' queue expression loads here, tried in a namespace made for it."""
    netns = "vdptb-nftq"
    run("ip", "netns", "del", netns)
    if run("ip", "netns", "add", netns).returncode != 0:
        return False
    try:
        rules = ("table inet vdptb { chain c { type filter hook forward priority 0; "
                 "queue num 100 bypass; } }")  # fmt: skip
        proc = subprocess.run(["ip", "netns", "exec", netns, "nft", "-f", "-"], input=rules,
                              capture_output=True, text=True)  # fmt: skip
        return proc.returncode == 0
    finally:
        run("ip", "netns", "del", netns)


def check_kernel() -> dict[str, object]:
    """Why this bed runs kube-router: kube-network-policies judges every new connection through
    nftables' `queue` expression (CONFIG_NFT_QUEUE) and reads only an in-cluster config (no
    kubeconfig flag in v0.8.0), so it needs that kernel option and a pod of its own."""
    works = nft_queue_works()
    if not works:
        log("this kernel lacks nftables' queue expression (CONFIG_NFT_QUEUE), which "
            "kube-network-policies needs: NetworkPolicy is enforced by kube-router's firewall")
    return {"nft_queue": works}


def argv(binary: Path, kubeconfig: Path, health: int) -> list[str]:
    """kube-router's firewall controller alone, acting for ENFORCED_NODE."""
    return [str(binary), f"--kubeconfig={kubeconfig}", f"--hostname-override={ENFORCED_NODE}",
            "--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
            "--enable-cni=false", "--enable-ipv6=false",
            f"--service-cluster-ip-range={SERVICE_CIDR}", f"--health-port={health}",
            "--metrics-port=0", "--v=1"]  # fmt: skip


def _ready(health: int) -> bool:
    if http_get(f"http://127.0.0.1:{health}/healthz")[0] != 200:
        return False
    # /healthz answers before the first sync: wait for its chains too.
    return "KUBE-ROUTER-FORWARD" in run("iptables-save", "-t", "filter").stdout


def start(cp: ControlPlane, launcher: Launcher, binary: Path) -> None:
    """Start the enforcer with its own identity; ready once it has programmed the host."""
    kernel = check_kernel()
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(RBAC))
    health = free_port()
    launcher.launch(COMPONENT, argv(binary, cp.kubeconfig_for("netpol"), health),
                    lambda: _ready(health), 60)  # fmt: skip
    cp.st.update_info(netpol={"enforcer": KUBE_ROUTER, "node": ENFORCED_NODE,
                              "health_port": health, **kernel})  # fmt: skip


def remove_ipsets() -> list[str]:
    """Destroy the firewall's ipsets (once no iptables rule uses them); return what stays."""
    for name in ipset_leftovers():
        run("ipset", "destroy", name)
    return [f"ipset {n}: not removable" for n in ipset_leftovers()]


def ipset_leftovers() -> list[str]:
    """The firewall's ipsets still on the host (none once the bed is down)."""
    if shutil.which("ipset") is None:
        return []  # no ipset here: none was made
    proc = run("ipset", "list", "-n")
    return [n for n in proc.stdout.split() if n.startswith(IPSET_PREFIXES)]
