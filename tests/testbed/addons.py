"""Cluster services of the real-node mode, run as host processes: CoreDNS (cluster DNS on
10.202.0.10:53, an address of ours on lo) and one kube-proxy (iptables mode) for the host
network namespace, where every node lives.

Both are recorded by procs.Launcher and stopped by recorded PID; kube-proxy's iptables chains
are removed by `kube-proxy --cleanup` and then hostnet.clean_iptables. Also a tiny DNS client,
so the host can ask CoreDNS without a resolver library.
"""

from __future__ import annotations

import random
import socket
import struct
import subprocess
from pathlib import Path

import yaml
from common import free_port, http_get, log, user_cluster_role
from controlplane import ControlPlane
from hostnet import DNS_IP, POD_CIDR, HostRecord
from procs import Launcher

# Least privilege for CoreDNS's kubernetes plugin (as upstream's system:coredns role).
COREDNS_RBAC = user_cluster_role("vllmdp:testbed:coredns", [
    {"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
     "verbs": ["list", "watch"]},
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
     "verbs": ["list", "watch"]},
])  # fmt: skip
COREDNS_USER = ("vllmdp:testbed:coredns", "vllmdp:testbed")
# kube-proxy's identity: the bootstrap RBAC binds system:node-proxier to this user.
KUBE_PROXY_USER = ("system:kube-proxy", "system:node-proxies")


def corefile(kubeconfig: Path, health: int, ready: int) -> str:
    return f"""cluster.local:53 in-addr.arpa:53 {{
    bind {DNS_IP}
    errors
    health 127.0.0.1:{health}
    ready 127.0.0.1:{ready}
    kubernetes cluster.local in-addr.arpa {{
        kubeconfig {kubeconfig} testbed
        pods insecure
        fallthrough in-addr.arpa
    }}
    cache 5
}}
.:53 {{
    bind {DNS_IP}
    errors
    forward . /etc/resolv.conf
    cache 30
}}
"""


def start_coredns(cp: ControlPlane, launcher: Launcher, nd: Path) -> None:
    """CoreDNS, ready once its kubernetes plugin has synced with the API server."""
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(COREDNS_RBAC))
    ports = {"health": free_port(), "ready": free_port()}
    conf = cp.st.root / "Corefile"
    conf.write_text(corefile(cp.kubeconfig_for("coredns"), ports["health"], ports["ready"]))
    ready = f"http://127.0.0.1:{ports['ready']}/ready"
    launcher.launch("coredns", [str(nd / "coredns"), "-conf", str(conf)],
                    lambda: http_get(ready)[0] == 200, 60)  # fmt: skip
    cp.st.update_info(coredns_ports=ports)


def kube_proxy_config(kubeconfig: Path, hostname: str, metrics: int, healthz: int,
                      masquerade_all: bool) -> dict[str, object]:  # fmt: skip
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "mode": "iptables", "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": hostname, "clusterCIDR": POD_CIDR,
        "metricsBindAddress": f"127.0.0.1:{metrics}", "healthzBindAddress": f"127.0.0.1:{healthz}",
        # NodePorts only on our node addresses, never on the host's own interfaces.
        "nodePortAddresses": ["10.202.0.0/24"],
        # Leave the conntrack sysctls alone (0 = do not set).
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                      "tcpCloseWaitTimeout": "0s"},
        # localhostNodePorts would set net.ipv4.conf.all.route_localnet=1. Without bridge
        # netfilter, replies between two pods on one bridge bypass conntrack; masquerading all
        # service traffic sends them back through the host instead.
        "iptables": {"localhostNodePorts": False, "masqueradeAll": masquerade_all},
    }  # fmt: skip


def start_kube_proxy(cp: ControlPlane, launcher: Launcher, nd: Path, host: HostRecord,
                     hostname: str) -> None:  # fmt: skip
    bridge_nf = Path("/proc/sys/net/bridge/bridge-nf-call-iptables").exists()
    if bridge_nf:
        host.set_sysctl("net.bridge.bridge-nf-call-iptables", "1")
    else:
        log("no bridge netfilter (br_netfilter) here: kube-proxy masquerades service traffic")
    ports = {"metrics": free_port(), "healthz": free_port()}
    cfg = kube_proxy_config(cp.kubeconfig_for("kube-proxy"), hostname, ports["metrics"],
                            ports["healthz"], masquerade_all=not bridge_nf)  # fmt: skip
    path = cp.st.root / "kube-proxy.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    launcher.launch("kube-proxy", [str(nd / "kube-proxy"), f"--config={path}", "--v=2"],
                    lambda: http_get(f"http://127.0.0.1:{ports['healthz']}/healthz")[0] == 200,
                    60)  # fmt: skip
    cp.st.update_info(kube_proxy_ports=ports)


def kube_proxy_cleanup(nd: Path) -> None:
    """kube-proxy's own removal of its rules (both families; iptables, ipvs, nftables)."""
    if (nd / "kube-proxy").exists():
        subprocess.run([str(nd / "kube-proxy"), "--cleanup", "--v=0"], capture_output=True)


def dns_query(name: str, server: str = DNS_IP, timeout: float = 3.0) -> list[str]:
    """The A records for `name` from `server` (one UDP query; [] for no answer)."""
    qid = random.randrange(1 << 16)
    qname = b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split(".")) + b"\0"
    query = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + qname + struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(query, (server, 53))
        data = s.recv(4096)
    answers = struct.unpack(">H", data[6:8])[0]
    off, found = 12 + len(qname) + 4, []
    for _ in range(answers):
        if data[off] & 0xC0 == 0xC0:
            off += 2
        else:
            while data[off]:
                off += data[off] + 1
            off += 1
        rtype, _cls, _ttl, length = struct.unpack(">HHIH", data[off:off + 10])
        off += 10
        if rtype == 1:
            found.append(socket.inet_ntoa(data[off:off + length]))
        off += length
    return found
