"""The kind tier's own Docker engine: Debian's dockerd, started and stopped here (root).

Everything it owns is its own, so it never meets a Docker the user runs, nor the real-node bed:
- data root, exec root, pidfile, socket, config file and log under `<cache>/kind/docker/`
  (never /var/lib/docker or /var/run/docker.sock); only its trust key has a fixed place,
  /etc/docker/key.json, removed again by `stop` when `start` made it;
- no default bridge (`--bridge=none`: no docker0) and no iptables rules (`--iptables=false`,
  `--ip-masq=false`, `--ip-forward=false`: no DOCKER* chains, no sysctl). Published ports (kind's
  API server port on 127.0.0.1) go through docker-proxy; the nodes reach each other on
  kind's network, a bridge made here with its own name and subnet (NETWORK, BRIDGE, SUBNET,
  off the real-node bed's 10.200-10.202 and the kwok bed's 10.244, 10.96 and 10.0.0.1);
- its own containerd namespace and cgroup parent (/vllmdp-kind);
- its containers run by runc through kindruntime.py, which drops the capabilities this host's
  root lacks. The node image is loaded by kindload.py.

`stop` removes every container and the network, stops the daemon (and the containerd it
started) and `leftovers` names whatever is still there: processes, mounts under the state dir,
the bridge, veths, DOCKER*/KIND* iptables chains that were not there before `start`, cgroups.
The data root stays: it is a cache (the node image, loaded once).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hostreqs
import kindruntime
from common import BuildError, cache_root, log

NETWORK = "vllmdp-kind"
BRIDGE = "vdpk-br0"
SUBNET = "10.211.0.0/24"
GATEWAY = "10.211.0.1"
CGROUP_PARENT = "vllmdp-kind"
CONTAINERD_NS = "vllmdp-kind"
# dockerd 20.10 writes its trust key here whatever its other paths (no flag moves it); `stop`
# removes it when `start` found none.
TRUST_KEY = Path("/etc/docker/key.json")
OUR_CHAINS = re.compile(r"^:((DOCKER|KIND)\S*)")


@dataclass(frozen=True)
class Paths:
    """Where the daemon keeps its state; one place, under the cache."""

    root: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def exec_root(self) -> Path:
        return self.root / "exec"

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def pidfile(self) -> Path:
        return self.root / "docker.pid"

    @property
    def log(self) -> Path:
        return self.root / "dockerd.log"

    @property
    def record(self) -> Path:
        return self.root / "host.json"

    @property
    def client_config(self) -> Path:
        return self.root / "client"


def paths() -> Paths:
    return Paths(cache_root() / "kind" / "docker")


def env(p: Paths | None = None) -> dict[str, str]:
    """The environment for `docker` and `kind`: this daemon, and no user client config."""
    p = p or paths()
    return dict(os.environ, DOCKER_HOST=f"unix://{p.socket}", DOCKER_CONFIG=str(p.client_config))


def docker(*args: str, check: bool = True, timeout: float = 300,
           p: Paths | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """Run the docker CLI against this daemon."""
    proc = subprocess.run([hostreqs.command_path("docker"), *args], capture_output=True,
                          text=True, env=env(p), timeout=timeout)  # fmt: skip
    if check and proc.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} failed (rc={proc.returncode}): "
                           f"{proc.stderr.strip()[-3000:]}")  # fmt: skip
    return proc


def _pid(p: Paths) -> int | None:
    try:
        pid = int(p.pidfile.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    return pid


def running(p: Paths | None = None) -> bool:
    p = p or paths()
    return _pid(p) is not None and docker("version", check=False, p=p, timeout=30).returncode == 0


def _chains() -> list[str]:
    found = []
    for save in ("iptables-save", "ip6tables-save"):
        out = subprocess.run([save], capture_output=True, text=True).stdout
        found += [f"{save}: {m.group(1)}" for ln in out.splitlines() if (m := OUR_CHAINS.match(ln))]
    return sorted(set(found))


def preflight() -> None:
    """What would stop kind's nodes from talking to each other on this host, named."""
    out = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True).stdout
    if "-P FORWARD DROP" in out and "-A FORWARD -i " + BRIDGE not in out:
        raise BuildError("the host's FORWARD policy is DROP and this daemon adds no iptables "
                         "rules (--iptables=false): kind's nodes could not reach each other "
                         f"across {BRIDGE} (bridge netfilter)")  # fmt: skip


def start(p: Paths | None = None, timeout: float = 60) -> Paths:
    """Start the daemon (or find it running) and make kind's network; return its paths."""
    p = p or paths()
    if running(p):
        _ensure_network(p)
        return p
    hostreqs.ensure_uses("kind")
    preflight()
    for d in (p.data, p.exec_root, p.client_config):
        d.mkdir(parents=True, exist_ok=True)
    config = p.root / "daemon.json"
    config.write_text("{}\n")  # never the host's /etc/docker/daemon.json
    runtime = kindruntime.write_shim(p.root / kindruntime.NAME, hostreqs.command_path("runc"),
                                     sys.executable)  # fmt: skip
    p.record.write_text(json.dumps({"chains_before": _chains(), "docker0": _has_link("docker0"),
                                    "run_containerd": Path("/run/containerd").exists(),
                                    "trust_key": TRUST_KEY.exists()}))
    argv = [hostreqs.command_path("dockerd"), f"--data-root={p.data}",
            f"--exec-root={p.exec_root}", f"--pidfile={p.pidfile}", f"--host=unix://{p.socket}",
            f"--config-file={config}",
            "--bridge=none", "--iptables=false", "--ip-masq=false", "--ip-forward=false",
            f"--cgroup-parent={CGROUP_PARENT}", f"--containerd-namespace={CONTAINERD_NS}",
            f"--containerd-plugins-namespace={CONTAINERD_NS}-plugins",
            f"--add-runtime={kindruntime.NAME}={runtime}", f"--default-runtime={kindruntime.NAME}",
            "--storage-driver=overlay2"]  # fmt: skip
    t0 = time.monotonic()
    with p.log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = p.log.read_text(errors="replace").splitlines()[-20:]
            raise BuildError(f"dockerd exited (rc={proc.returncode}); {p.log}:\n"
                             + "\n".join(tail))  # fmt: skip
        if docker("version", check=False, p=p, timeout=10).returncode == 0:
            break
        time.sleep(0.5)
    else:
        raise BuildError(f"dockerd did not answer on {p.socket} in {timeout:.0f}s; see {p.log}")
    log(f"kind: dockerd {proc.pid} up in {time.monotonic() - t0:.1f}s ({p.socket})")
    _ensure_network(p)
    return p


def _ensure_network(p: Paths) -> None:
    """kind's network, made before kind makes its own (KIND_EXPERIMENTAL_DOCKER_NETWORK)."""
    if docker("network", "inspect", NETWORK, check=False, p=p).returncode == 0:
        return
    docker("network", "create", "--driver=bridge", f"--subnet={SUBNET}", f"--gateway={GATEWAY}",
           f"--opt=com.docker.network.bridge.name={BRIDGE}",
           "--opt=com.docker.network.bridge.enable_ip_masquerade=false",
           "--opt=com.docker.network.driver.mtu=1500", NETWORK, p=p)  # fmt: skip


def stop(p: Paths | None = None, timeout: float = 60) -> list[str]:
    """Remove every container and kind's network, stop the daemon; return `leftovers`."""
    p = p or paths()
    pid = _pid(p)
    if pid is not None and running(p):
        ids = docker("ps", "-aq", p=p).stdout.split()
        if ids:
            docker("rm", "--force", "--volumes", *ids, p=p, timeout=300)
        for net in docker("network", "ls", "--format={{.Name}}", p=p).stdout.split():
            if net not in ("bridge", "host", "none"):
                docker("network", "rm", net, p=p, check=False)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.3)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    for proc in _our_processes(p):
        os.kill(proc, signal.SIGKILL)
    _remove_cgroups()
    p.pidfile.unlink(missing_ok=True)
    p.socket.unlink(missing_ok=True)
    _remove_run_containerd(p)
    if _record(p).get("trust_key") is False:
        TRUST_KEY.unlink(missing_ok=True)
    return leftovers(p)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _our_processes(p: Paths) -> list[int]:
    """Processes started from this daemon's state dir (dockerd, its containerd, shims)."""
    mine = []
    marker = str(p.root).encode()
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker in (d / "cmdline").read_bytes():
                    mine.append(int(d.name))
            except OSError:
                continue
    return mine


def _cgroup_dirs() -> list[Path]:
    base = Path("/sys/fs/cgroup")
    return sorted(d for d in [base / CGROUP_PARENT, *base.glob(f"*/{CGROUP_PARENT}")] if d.is_dir())


def _remove_cgroups() -> None:
    """rmdir our cgroup parent's groups (empty once the containers are gone), deepest first."""
    for top in _cgroup_dirs():
        for d in sorted((x for x in top.rglob("*") if x.is_dir()), key=lambda x: -len(x.parts)):
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def _remove_run_containerd(p: Paths) -> None:
    """containerd's shims put their sockets under /run/containerd/s; remove the directory when
    it was not there before `start` and is empty now."""
    if _record(p).get("run_containerd", True):
        return
    for d in (Path("/run/containerd/s"), Path("/run/containerd")):
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()


def leftovers(p: Paths | None = None) -> list[str]:
    """What the daemon or kind's nodes left on the host, one line each (empty: nothing)."""
    p = p or paths()
    found = [f"process {pid}" for pid in _our_processes(p)]
    mounts = Path("/proc/mounts").read_text().splitlines()
    found += [f"mount {ln.split()[1]}" for ln in mounts if str(p.root) in ln.split()[1]]
    record = _record(p)
    found += [f"link {name}" for name in (BRIDGE, "docker0") if _has_link(name)
              and not (name == "docker0" and record.get("docker0"))]  # fmt: skip
    before = set(record.get("chains_before", []))
    found += [f"iptables chain {c}" for c in _chains() if c not in before]
    found += [f"cgroup {d}" for d in _cgroup_dirs()]
    if p.socket.exists():
        found.append(f"socket {p.socket}")
    if record.get("trust_key") is False and TRUST_KEY.exists():
        found.append(f"file {TRUST_KEY}")
    return found


def _has_link(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", "dev", name], capture_output=True).returncode == 0


def _record(p: Paths) -> dict[str, Any]:
    """What `start` saw on the host before it changed anything."""
    try:
        out: dict[str, Any] = json.loads(p.record.read_text())
    except (OSError, ValueError):
        return {}
    return out


def purge(p: Paths | None = None) -> None:
    """Delete the data root too (the cached node image): a cold start next time."""
    p = p or paths()
    if _pid(p) is not None:
        raise RuntimeError("stop the daemon first")
    shutil.rmtree(p.root, ignore_errors=True)
