"""What the real-node mode changes on the host outside its processes, and how it is undone.

Addresses of its own on `lo` (the API server, CoreDNS and each node's IP, in 10.202.0.0/24),
the nodes' CNI bridges, sysctls (ip_forward, and those kubelet and kube-proxy set), iptables
chains (KUBE-* from kube-proxy and kubelet, CNI-* from the CNI plugins) with the nftables tables
iptables-nft made for them, and host directories the runtime creates. `HostRecord` is written
to `host.json` in the state dir *before* each change, so `restore` undoes exactly that even
after a crash; `leftovers` lists what is still there. Pod, service and host ranges never
overlap the kwok bed's (10.244/16, 10.96/16, 10.0.0.1).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

POD_CIDR = "10.200.0.0/16"  # node i gets 10.200.i.0/24
SERVICE_CIDR = "10.201.0.0/16"
HOST_PREFIX = "10.202.0."  # addresses on lo
API_IP = "10.202.0.1"
DNS_IP = "10.202.0.10"
BRIDGE_PREFIX = "vllmdp-br"
CNI_NETWORK_PREFIX = "vllmdp-node-"  # the CNI network of node i is vllmdp-node-<i>
OUR_CHAINS = re.compile(r"^(KUBE|CNI)-")
# Set by us (ip_forward, bridge netfilter), by kubelet (vm.*, kernel.*: it tunes them unless
# protectKernelDefaults) or possibly by kube-proxy; restored by `restore`.
SYSCTLS = (
    "net.ipv4.ip_forward", "net.ipv4.conf.all.route_localnet", "net.ipv6.conf.all.forwarding",
    "net.bridge.bridge-nf-call-iptables", "net.bridge.bridge-nf-call-ip6tables",
    "vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes", "net.netfilter.nf_conntrack_max",
    "net.netfilter.nf_conntrack_tcp_timeout_established",
    "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
)  # fmt: skip
# Host directories containerd (shim sockets), the CNI library (result cache) and kubelet
# (container log links) create; removed by `restore` only if they were absent before and empty.
RUNTIME_DIRS = ("/run/containerd/s", "/run/containerd", "/var/lib/cni/results", "/var/lib/cni",
                "/var/log/containers")  # fmt: skip


def node_ip(index: int) -> str:
    return f"{HOST_PREFIX}{10 + index}"


def node_pod_cidr(index: int) -> str:
    return f"10.200.{index}.0/24"


def run(*argv: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def read_sysctl(name: str) -> str | None:
    try:
        return " ".join(_sysctl_path(name).read_text().split())
    except OSError:
        return None


def write_sysctl(name: str, value: str) -> None:
    _sysctl_path(name).write_text(value + "\n")


def nft_tables() -> list[str]:
    return [ln.strip() for ln in run("nft", "list", "tables").stdout.splitlines() if ln.strip()]


@dataclass
class HostRecord:
    """The host state before `up` and what `up` added; persisted in <state>/host.json."""

    path: Path
    sysctls: dict[str, str] = field(default_factory=dict)
    nft_tables: list[str] = field(default_factory=list)
    absent_dirs: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    bridges: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> HostRecord | None:
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return cls(path=path, **data)

    @classmethod
    def snapshot(cls, path: Path) -> HostRecord:
        """The host as it is now, before `up` changes it (kept if an earlier `up` left one)."""
        earlier = cls.load(path)
        if earlier is not None:
            return earlier
        rec = cls(path=path, nft_tables=nft_tables(),
                  absent_dirs=[d for d in RUNTIME_DIRS if not Path(d).exists()])  # fmt: skip
        rec.sysctls = {n: v for n in SYSCTLS if (v := read_sysctl(n)) is not None}
        rec.save()
        return rec

    def save(self) -> None:
        data = asdict(self)
        del data["path"]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(data, indent=2) + "\n")

    def add_address(self, ip: str) -> None:
        """Put ip/32 on lo (recorded first)."""
        if ip not in self.addresses:
            self.addresses.append(ip)
            self.save()
        if f" {ip}/32 " not in run("ip", "-4", "-o", "addr", "show", "dev", "lo").stdout:
            run("ip", "addr", "add", f"{ip}/32", "dev", "lo", check=True)

    def expect_bridge(self, name: str) -> None:
        """Record a bridge the CNI plugin will create for a node."""
        if name not in self.bridges:
            self.bridges.append(name)
            self.save()

    def set_sysctl(self, name: str, value: str) -> None:
        if read_sysctl(name) is not None and read_sysctl(name) != value:
            write_sysctl(name, value)

    def restore(self) -> list[str]:
        """Undo everything recorded (iptables last-resort cleanup included); return problems."""
        problems = []
        for ip in self.addresses:
            run("ip", "addr", "del", f"{ip}/32", "dev", "lo")
        for br in self.bridges:
            run("ip", "link", "del", br)
        problems += clean_iptables()
        for table in nft_tables():
            if table not in self.nft_tables and _nft_table_empty(table):
                run("nft", "delete", *table.split())
        for name, value in self.sysctls.items():
            if read_sysctl(name) != value:
                try:
                    write_sysctl(name, value)
                except OSError as e:
                    problems.append(f"sysctl {name}: cannot restore {value}: {e}")
        for f in runtime_files(self.path.parent):
            f.unlink()
        for d in self.absent_dirs:  # deepest first, as listed
            p = Path(d)
            if p.is_dir() and not any(p.iterdir()):
                p.rmdir()
        return problems


def runtime_files(state_root: Path) -> list[Path]:
    """Files our pods left in shared host directories when their sandbox never went through
    CNI DEL (the runtime was stopped under them): the CNI result cache of our networks and
    of those sandboxes' loopback, and kubelet's links to logs under our state dir."""
    found: list[Path] = []
    results = Path("/var/lib/cni/results")
    if results.is_dir():
        ours = [f for f in results.iterdir() if f.name.startswith(CNI_NETWORK_PREFIX)]
        sandboxes = {f.name.rsplit("-", 2)[-2] for f in ours}
        found += ours + [f for f in results.iterdir()
                         if f.name.startswith("cni-loopback-")
                         and f.name.rsplit("-", 2)[-2] in sandboxes]  # fmt: skip
    links = Path("/var/log/containers")
    if links.is_dir():
        found += [f for f in links.iterdir()
                  if f.is_symlink() and os.readlink(f).startswith(f"{state_root}/")]  # fmt: skip
    return found


def _nft_table_empty(table: str) -> bool:
    """True when an nftables table (`table ip filter`) holds chains with no rules."""
    out = run("nft", "list", *table.split()).stdout
    body = [ln.strip() for ln in out.splitlines()]
    return not [ln for ln in body if ln and not ln.startswith(("table ", "chain ", "type ", "}"))]


def iptables_leftovers() -> list[str]:
    """Our chains (KUBE-*, CNI-*) still present, as `iptables -t nat KUBE-SERVICES`."""
    found = []
    for ipt in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle", "raw"):
            save = run(f"{ipt}-save", "-t", table)
            if save.returncode == 0:
                found += [f"{ipt} -t {table} {ln[1:].split()[0]}" for ln in save.stdout.splitlines()
                          if ln.startswith(":") and OUR_CHAINS.match(ln[1:])]  # fmt: skip
    return found


def clean_iptables() -> list[str]:
    """Delete rules jumping to our chains, then flush and delete our chains, in both families."""
    problems = []
    for ipt in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle", "raw"):
            save = run(f"{ipt}-save", "-t", table)
            if save.returncode != 0:
                continue
            lines = save.stdout.splitlines()
            chains = [ln[1:].split()[0] for ln in lines
                      if ln.startswith(":") and OUR_CHAINS.match(ln[1:])]  # fmt: skip
            for ln in lines:
                jumps_to_ours = re.search(r"-j (KUBE|CNI)-", ln)
                if ln.startswith("-A ") and jumps_to_ours and not OUR_CHAINS.match(ln.split()[1]):
                    run(ipt, "-t", table, "-D", *shlex.split(ln[3:]))
            for verb in ("-F", "-X"):
                for chain in chains:
                    proc = run(ipt, "-t", table, verb, chain)
                    if proc.returncode != 0 and verb == "-X":
                        problems.append(f"{ipt} -t {table} -X {chain}: {proc.stderr.strip()}")
    return problems


def addresses_in_our_ranges() -> list[str]:
    """Interface addresses in our pod range or our host range, as `dev addr`."""
    out = run("ip", "-4", "-o", "addr").stdout
    found = []
    for ln in out.splitlines():
        parts = ln.split()
        addr = parts[3]
        if addr.startswith(("10.200.", HOST_PREFIX)):
            found.append(f"{parts[1]} {addr}")
    return found


def our_links() -> list[str]:
    out = run("ip", "-o", "link").stdout
    names = [ln.split(":")[1].strip().split("@")[0] for ln in out.splitlines() if ":" in ln]
    return [n for n in names if n.startswith(BRIDGE_PREFIX)]


def listeners(proc_net_tcp: str) -> list[str]:
    """TCP sockets listening on an address of our host range, as `ip:port`, from the text of
    /proc/net/tcp. A listener outlives the address it was bound to: another bed's API server
    still holds 10.202.0.1:6443 after that address is gone from lo."""
    found = []
    for line in proc_net_tcp.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 4 or fields[3] != "0A":  # 0A: LISTEN
            continue
        addr_hex, port_hex = fields[1].split(":")
        ip = ".".join(str(b) for b in reversed(bytes.fromhex(addr_hex)))
        if ip.startswith(HOST_PREFIX):
            found.append(f"{ip}:{int(port_hex, 16)}")
    return found


def foreign_claims(ours: HostRecord | None) -> list[str]:
    """Routes, addresses or listeners in our ranges that this bed did not make (another
    bed's, say)."""
    mine = set(ours.addresses if ours else [])
    problems = [f"listener {a}" for a in listeners(Path("/proc/net/tcp").read_text())]
    problems += [a for a in addresses_in_our_ranges()
                if a.split()[1].split("/")[0] not in mine
                and not a.split()[0].startswith(BRIDGE_PREFIX)]  # fmt: skip
    for cidr in (POD_CIDR, SERVICE_CIDR, HOST_PREFIX + "0/24"):
        for how in ("root", "match"):  # routes inside the range, and routes covering it
            for ln in run("ip", "route", "show", how, cidr).stdout.splitlines():
                if ln.split()[0] != "default" and BRIDGE_PREFIX not in ln:
                    problems.append(f"route {ln.strip()}")
    return sorted(set(problems))
