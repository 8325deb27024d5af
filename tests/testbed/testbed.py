#!/usr/bin/env python3
"""Local control-plane test bed: etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
the kwok controller (fake GPU nodes, simulated pod lifecycles) and the KubeRay operator, all as
plain processes bound to 127.0.0.1.

    python tests/testbed/testbed.py build   # build or reuse the binaries (cached outside the repo)
    python tests/testbed/testbed.py up      # start everything (idempotent), register fake nodes
    python tests/testbed/testbed.py env     # print `export KUBECONFIG=...` lines
    python tests/testbed/testbed.py status  # which components are alive
    python tests/testbed/testbed.py down    # stop exactly what `up` started (by recorded PID)

State (PIDs, logs, kubeconfig, certificates, etcd data) lives in the state dir: `.testbed/` in the
repository root, or $VLLMDP_TESTBED_DIR. Binaries are cached in
${VLLMDP_CACHE:-${XDG_CACHE_HOME:-~/.cache}/vllm-dp-operator}/testbed/bin-<key>/, where <key>
hashes versions.env, go.mod and go.sum. Stdlib + PyYAML only.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import podnet
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VERSIONS_FILE = HERE / "versions.env"
KWOK_CONFIG = HERE / "kwok" / "config.yaml"

# Components in start order; `down` stops them in reverse.
COMPONENTS = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "kuberay-operator",
]
K8S_COMMANDS = ["kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl"]
KUBERAY_MODULE = "github.com/ray-project/kuberay/ray-operator"
KWOK_PACKAGE = "sigs.k8s.io/kwok/cmd/kwok"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
GPU_RESOURCE = "nvidia.com/gpu"
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.0/16"
# kwok gives every simulated node this address (--node-ip); routed into the pod network too.
NODE_IP = "10.0.0.1"

# kube-controller-manager controllers (names as of v1.36; see `--help`). Node lifecycle, IPAM,
# CSR signing, volumes and cloud controllers are left out: there is no kubelet to watch.
KCM_CONTROLLERS = [
    "serviceaccount-token-controller",
    "serviceaccount-controller",
    "root-ca-certificate-publisher-controller",
    "namespace-controller",
    "garbage-collector-controller",
    "job-controller",
    "cronjob-controller",
    "ttl-after-finished-controller",
    "replicaset-controller",
    "deployment-controller",
    "statefulset-controller",
    "endpointslice-controller",
    "endpoints-controller",
    "disruption-controller",
    "pod-garbage-collector-controller",
    "clusterrole-aggregation-controller",
    "resourcequota-controller",
    "service-cidr-controller",
]


# --------------------------------------------------------------------------- paths and versions


def versions() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in VERSIONS_FILE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


# Bump when the way binaries are built changes (flags, stamping), to invalidate the cache.
BUILD_RECIPE = "2"


def version_key() -> str:
    h = hashlib.sha256(f"recipe={BUILD_RECIPE}\0".encode())
    for name in ("versions.env", "go.mod", "go.sum"):
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    return h.hexdigest()[:12]


def cache_root() -> Path:
    base = os.environ.get("VLLMDP_CACHE")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        base = str(Path(xdg) / "vllm-dp-operator")
    return Path(base) / "testbed"


def bin_dir() -> Path:
    return cache_root() / f"bin-{version_key()}"


def state_dir() -> Path:
    return Path(os.environ.get("VLLMDP_TESTBED_DIR") or REPO / ".testbed").resolve()


def log(msg: str) -> None:
    print(f"[testbed] {msg}", flush=True)


# --------------------------------------------------------------------------- build


class BuildError(RuntimeError):
    pass


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    env["GOFLAGS"] = (env.get("GOFLAGS", "") + " -trimpath -buildvcs=false").strip()
    # Go 1.27 turns on the jsonv2 experiment, which breaks the apiserver's OpenAPI.
    with contextlib.suppress(Exception):
        gover = subprocess.run(["go", "env", "GOVERSION"], capture_output=True, text=True).stdout
        minor = int(gover.strip().removeprefix("go").split(".")[1])
        if minor >= 27 and "GOEXPERIMENT" not in env:
            env["GOEXPERIMENT"] = "nojsonv2"
    return env


def _run_build(cmd: list[str], cwd: Path, env: dict[str, str], what: str) -> float:
    t0 = time.monotonic()
    log(f"building {what}: {' '.join(cmd)}")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    dt = time.monotonic() - t0
    if proc.returncode != 0:
        raise BuildError(
            f"building {what} failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr[-6000:]}"
        )
    log(f"built {what} in {dt:.1f}s")
    return dt


def go_available() -> bool:
    return shutil.which("go") is not None


def expected_binaries() -> list[str]:
    return [*K8S_COMMANDS, "kwok", "ray-operator"]


def binaries_present(bd: Path | None = None) -> bool:
    bd = bd or bin_dir()
    return all((bd / b).is_file() for b in expected_binaries()) and (bd / "kuberay-crds").is_dir()


def find_etcd(install: bool = False) -> str:
    """Return the etcd binary: $VLLMDP_ETCD, PATH, or install Debian's etcd-server."""
    cand = os.environ.get("VLLMDP_ETCD") or shutil.which("etcd")
    if not cand and Path("/usr/bin/etcd").is_file():
        cand = "/usr/bin/etcd"
    if cand:
        return cand
    if not install:
        raise BuildError(
            "etcd not found (install the Debian package etcd-server or set VLLMDP_ETCD)"
        )
    pkg = versions().get("ETCD_APT_PACKAGE", "etcd-server")
    apt = shutil.which("apt-get")
    if not apt:
        raise BuildError(f"etcd not found and apt-get is missing: install {pkg} or set VLLMDP_ETCD")
    sudo: list[str] = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else [])
    if os.geteuid() != 0 and not sudo:
        raise BuildError(
            f"etcd not found: install {pkg} (apt-get install {pkg}) or set VLLMDP_ETCD"
        )
    log(f"etcd not found; installing {pkg} with apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (
        [*sudo, apt, "update"],
        [*sudo, apt, "install", "-y", "--no-install-recommends", pkg],
    ):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(
                f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
    # Debian's package may start etcd as a service where systemd runs; we never use that one.
    cand = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").is_file() else None)
    if not cand:
        raise BuildError(f"{pkg} installed but no etcd binary found")
    return cand


def kuberay_module_dir(env: dict[str, str]) -> Path:
    ver = versions()["KUBERAY_VERSION"]
    proc = subprocess.run(
        ["go", "mod", "download", "-json", f"{KUBERAY_MODULE}@{ver}"],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
    )
    try:
        info = json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise BuildError(f"go mod download {KUBERAY_MODULE}@{ver} failed:\n{proc.stderr}") from e
    if info.get("Error") or not info.get("Dir"):
        raise BuildError(f"go mod download {KUBERAY_MODULE}@{ver}: {info.get('Error')}")
    return Path(info["Dir"])


def k8s_version_ldflags(version: str) -> str:
    """Stamp the version like the upstream build does (hack/lib/version.sh); without it the
    binaries report v0.0.0-master+$Format:%H$, which kubectl and Helm cannot parse."""
    major, minor = version.removeprefix("v").split(".")[:2]
    stamp = {
        "gitVersion": version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",
    }
    return " ".join(
        f"-X {pkg}.{k}={val}"
        for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
        for k, val in stamp.items()
    )


def build(force: bool = False) -> Path:
    """Build (or reuse) every binary; return the bin dir. Concurrent builds (two test sessions)
    serialize on a lock file in the cache root."""
    bd = bin_dir()
    find_etcd(install=True)
    if binaries_present(bd) and not force:
        log(f"binaries cached in {bd}")
        return bd
    bd.parent.mkdir(parents=True, exist_ok=True)
    with open(bd.parent / ".build.lock", "w") as lock:
        t0 = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)
        if time.monotonic() - t0 > 1:
            log(f"waited {time.monotonic() - t0:.0f}s for another build")
        if binaries_present(bd) and not force:
            log(f"binaries cached in {bd}")
            return bd
        return _build_locked(bd, force)


def _build_locked(bd: Path, force: bool) -> Path:
    if not go_available():
        raise BuildError("Go toolchain not found (needed to build the test bed binaries)")
    v = versions()
    env = _go_env()
    bd.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=bd))
    times: dict[str, float] = {}
    try:
        t_all = time.monotonic()
        if force or not (bd / "ray-operator").is_file():
            times["ray-operator"] = _run_build(
                ["go", "install", "-ldflags=-s -w", f"{KUBERAY_MODULE}@{v['KUBERAY_VERSION']}"],
                HERE,
                dict(env, GOBIN=str(tmp)),
                f"KubeRay operator {v['KUBERAY_VERSION']}",
            )
            os.replace(tmp / "ray-operator", bd / "ray-operator")
        if force or not (bd / "kuberay-crds").is_dir():
            src = kuberay_module_dir(env) / "config" / "crd" / "bases"
            dst = tmp / "kuberay-crds"
            dst.mkdir()
            for f in sorted(src.glob("ray.io_*.yaml")):
                shutil.copyfile(f, dst / f.name)
            if not any(dst.iterdir()):
                raise BuildError(f"no KubeRay CRDs in {src}")
            if (bd / "kuberay-crds").exists():
                shutil.rmtree(bd / "kuberay-crds")
            os.replace(dst, bd / "kuberay-crds")
        if force or not (bd / "kwok").is_file():
            times["kwok"] = _run_build(
                ["go", "install", "-ldflags=-s -w", f"{KWOK_PACKAGE}@{v['KWOK_VERSION']}"],
                HERE,
                dict(env, GOBIN=str(tmp)),
                f"kwok {v['KWOK_VERSION']}",
            )
            os.replace(tmp / "kwok", bd / "kwok")
        for cmd in K8S_COMMANDS:
            if force or not (bd / cmd).is_file():
                times[cmd] = _run_build(
                    [
                        "go",
                        "build",
                        f"-ldflags=-s -w {k8s_version_ldflags(v['KUBERNETES_VERSION'])}",
                        "-o",
                        str(tmp / cmd),
                        f"k8s.io/kubernetes/cmd/{cmd}",
                    ],
                    HERE,
                    env,
                    f"{cmd} {v['KUBERNETES_VERSION']}",
                )
                os.replace(tmp / cmd, bd / cmd)
        total = time.monotonic() - t_all
        info_file = bd / "BUILD_INFO.json"
        info = json.loads(info_file.read_text()) if info_file.exists() else {}
        info.update(
            {"versions": v, "key": version_key(), "seconds": {**info.get("seconds", {}), **times}}
        )
        info_file.write_text(json.dumps(info, indent=2) + "\n")
        log(f"build done in {total:.1f}s -> {bd}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return bd


# --------------------------------------------------------------------------- process helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child is not alive.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def pid_matches(pid: int, exe: str) -> bool:
    """Guard against PID reuse: the recorded binary must be argv[0] of the process."""
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return pid_alive(pid)  # no /proc: trust the record
    return argv0 == exe


def rss_mib(pid: int) -> float | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def http_get(url: str, token: str | None = None, timeout: float = 2.0) -> tuple[int, str]:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(
            req, timeout=timeout, context=ctx if url.startswith("https") else None
        ) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


def wait_for(
    what: str, check: Any, timeout: float, proc_pid: int | None = None, logfile: Path | None = None
) -> float:
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout:
        if proc_pid is not None and not pid_alive(proc_pid):
            tail = (
                logfile.read_text(errors="replace")[-4000:] if logfile and logfile.exists() else ""
            )
            raise RuntimeError(
                f"{what}: process {proc_pid} exited while starting. Log tail:\n{tail}"
            )
        try:
            ok = check()
        except Exception as e:  # readiness probes raise while things start
            ok, last = False, e
        if ok:
            return time.monotonic() - t0
        time.sleep(0.2)
    tail = logfile.read_text(errors="replace")[-4000:] if logfile and logfile.exists() else ""
    raise RuntimeError(
        f"{what} not ready after {timeout:.0f}s (last error: {last}). Log tail:\n{tail}"
    )


# --------------------------------------------------------------------------- state


class State:
    def __init__(self, root: Path | None = None) -> None:
        self.root = root or state_dir()
        self.pids_file = self.root / "pids.json"
        self.info_file = self.root / "testbed.json"
        self.logs = self.root / "logs"
        self.pki = self.root / "pki"
        self.kubeconfig = self.root / "kubeconfig"

    def pids(self) -> dict[str, dict[str, Any]]:
        if self.pids_file.exists():
            return json.loads(self.pids_file.read_text())  # type: ignore[no-any-return]
        return {}

    def save_pids(self, pids: dict[str, dict[str, Any]]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.pids_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(pids, indent=2) + "\n")
        os.replace(tmp, self.pids_file)

    def info(self) -> dict[str, Any]:
        if self.info_file.exists():
            return json.loads(self.info_file.read_text())  # type: ignore[no-any-return]
        return {}

    def alive(self) -> dict[str, bool]:
        out = {}
        for name, rec in self.pids().items():
            out[name] = pid_alive(rec["pid"]) and pid_matches(rec["pid"], rec["exe"])
        return out

    def healthy(self) -> bool:
        info = self.info()
        alive = self.alive()
        if not info or set(alive) != set(COMPONENTS) or not all(alive.values()):
            return False
        code, _ = http_get(f"{info['server']}/readyz", info["admin_token"])
        return code == 200


# --------------------------------------------------------------------------- certificates


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_pki(pki: Path) -> None:
    """CA, apiserver serving cert (127.0.0.1/localhost/kubernetes.default...), SA key pair."""
    pki.mkdir(parents=True, exist_ok=True)
    if (pki / "apiserver.crt").exists() and (pki / "sa.key").exists():
        return
    if not shutil.which("openssl"):
        raise RuntimeError("openssl is required to create the test bed certificates")
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "3650",
        "-subj",
        "/CN=vllmdp-testbed-ca",
        "-keyout",
        str(pki / "ca.key"),
        "-out",
        str(pki / "ca.crt"),
    )
    ext = pki / "apiserver.ext"
    ext.write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
        "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n"
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=kube-apiserver",
        "-keyout",
        str(pki / "apiserver.key"),
        "-out",
        str(pki / "apiserver.csr"),
    )
    openssl(
        "x509",
        "-req",
        "-in",
        str(pki / "apiserver.csr"),
        "-CA",
        str(pki / "ca.crt"),
        "-CAkey",
        str(pki / "ca.key"),
        "-CAcreateserial",
        "-days",
        "3650",
        "-extfile",
        str(ext),
        "-out",
        str(pki / "apiserver.crt"),
    )
    openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
    openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def write_kubeconfig(path: Path, server: str, ca: Path, token: str, user: str) -> None:
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "testbed",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca.read_bytes()).decode(),
                },
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [
            {
                "name": "testbed",
                "context": {"cluster": "testbed", "user": user, "namespace": "default"},
            }
        ],
        "current-context": "testbed",
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    path.chmod(0o600)


# --------------------------------------------------------------------------- nodes


def node_manifests(
    gpu_nodes: int, gpus_per_node: int, cpu_nodes: int, gpu_product: str, instance_type: str
) -> list[dict[str, Any]]:
    nodes = []

    def node(
        name: str, labels: dict[str, str], taints: list[dict[str, str]], res: dict[str, str]
    ) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "type": "kwok",
                    "topology.kubernetes.io/region": "testbed",
                    "topology.kubernetes.io/zone": "testbed-a",
                    **labels,
                },
            },
            "spec": {"taints": taints} if taints else {},
            "status": {"capacity": res, "allocatable": res},
        }

    for i in range(gpu_nodes):
        nodes.append(
            node(
                f"gpu-node-{i}",
                {
                    "nvidia.com/gpu.present": "true",
                    "nvidia.com/gpu.count": str(gpus_per_node),
                    "nvidia.com/gpu.product": gpu_product,
                    "nvidia.com/gpu.memory": "81559",
                    "node.kubernetes.io/instance-type": instance_type,
                    "vllmdp.io/testbed-node": "gpu",
                },
                [{"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}],
                {
                    "cpu": "64",
                    "memory": "512Gi",
                    "pods": "110",
                    "ephemeral-storage": "1Ti",
                    GPU_RESOURCE: str(gpus_per_node),
                },
            )
        )
    for i in range(cpu_nodes):
        nodes.append(
            node(
                f"cpu-node-{i}",
                {"node.kubernetes.io/instance-type": "m5.4xlarge", "vllmdp.io/testbed-node": "cpu"},
                [],
                {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "200Gi"},
            )
        )
    return nodes


# --------------------------------------------------------------------------- up / down


class Testbed:
    def __init__(self, st: State, bd: Path) -> None:
        self.st = st
        self.bd = bd

    # kubectl with the admin kubeconfig
    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bd / "kubectl"), f"--kubeconfig={self.st.kubeconfig}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"kubectl {' '.join(args)} failed (rc={proc.returncode}):\n"
                f"{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def launch(
        self,
        name: str,
        argv: list[str],
        ready: Callable[[], Any],
        timeout: float,
        timings: dict[str, float],
        env: dict[str, str] | None = None,
    ) -> int:
        """Start a component, wait until `ready()`, record how long it took; return its PID."""
        t0 = time.monotonic()
        pid = self.start(name, argv, env)
        wait_for(name, ready, timeout, pid, self.st.logs / f"{name}.log")
        timings[name] = time.monotonic() - t0
        return pid

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        self.st.logs.mkdir(parents=True, exist_ok=True)
        logfile = self.st.logs / f"{name}.log"
        with open(logfile, "ab") as lf:
            lf.write(f"\n==== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
            lf.flush()
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=lf,
                stderr=subprocess.STDOUT,
                env=env or dict(os.environ),
                cwd=self.st.root,
                start_new_session=True,
            )
        pids = self.st.pids()
        pids[name] = {"pid": proc.pid, "exe": argv[0], "log": str(logfile), "started": time.time()}
        self.st.save_pids(pids)
        return proc.pid

    def up(
        self,
        gpu_nodes: int,
        gpus_per_node: int,
        cpu_nodes: int,
        etcd_port: int | None,
        apiserver_port: int | None,
        keep_data: bool,
        gpu_product: str,
        instance_type: str,
    ) -> None:
        st = self.st
        if st.healthy():
            log(f"already up and healthy ({st.root}); nothing to do")
            return
        if st.pids():
            log("found a partial or stale test bed; stopping what it recorded first")
            down(st)
        st.root.mkdir(parents=True, exist_ok=True)
        for d in ("etcd", "kubeconfigs", "logs"):
            (st.root / d).mkdir(exist_ok=True)
        if not keep_data and (st.root / "etcd").exists():
            shutil.rmtree(st.root / "etcd")
        t_up = time.monotonic()
        timings: dict[str, float] = {}
        # Before anything runs: traffic to pod and service IPs must stay on this machine.
        net = start_pod_network(st)
        etcd = find_etcd(install=False)
        make_pki(st.pki)

        ports = {
            "etcd": etcd_port or int(os.environ.get("VLLMDP_TESTBED_ETCD_PORT", 0)) or free_port(),
            "etcd-peer": free_port(),
            "apiserver": apiserver_port
            or int(os.environ.get("VLLMDP_TESTBED_APISERVER_PORT", 0))
            or free_port(),
            "kcm": free_port(),
            "scheduler": free_port(),
            "kwok": free_port(),
            "kuberay-metrics": free_port(),
            "kuberay-probe": free_port(),
        }
        server = f"https://127.0.0.1:{ports['apiserver']}"
        # Tokens: reuse across restarts so exported kubeconfigs stay valid.
        prev = st.info()
        tokens = prev.get("tokens") or {}
        users = {
            "admin": ("admin", "system:masters"),
            "kube-controller-manager": ("system:kube-controller-manager", "system:masters"),
            "kube-scheduler": ("system:kube-scheduler", "system:masters"),
            "kwok": ("kwok-controller", "system:masters"),
            "kuberay-operator": ("kuberay-operator", "system:masters"),
        }
        for comp in users:
            tokens.setdefault(comp, secrets.token_hex(24))
        token_file = st.pki / "tokens.csv"
        token_file.write_text(
            "".join(f'{tokens[c]},{u},{u},"{g}"\n' for c, (u, g) in users.items())
        )
        token_file.chmod(0o600)
        kcfg = {}
        for comp, (user, _) in users.items():
            path = (
                st.kubeconfig if comp == "admin" else st.root / "kubeconfigs" / f"{comp}.kubeconfig"
            )
            write_kubeconfig(path, server, st.pki / "ca.crt", tokens[comp], user)
            kcfg[comp] = str(path)
        st.info_file.write_text(
            json.dumps(
                {
                    "server": server,
                    "ports": ports,
                    "kubeconfig": str(st.kubeconfig),
                    "admin_token": tokens["admin"],
                    "tokens": tokens,
                    "bin_dir": str(self.bd),
                    "etcd": etcd,
                    "gpu_nodes": gpu_nodes,
                    "gpus_per_node": gpus_per_node,
                    "cpu_nodes": cpu_nodes,
                },
                indent=2,
            )
            + "\n"
        )
        st.info_file.chmod(0o600)

        # etcd
        pid = self.launch(
            "etcd",
            [
                etcd,
                "--name=testbed",
                f"--data-dir={st.root / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{ports['etcd']}",
                f"--advertise-client-urls=http://127.0.0.1:{ports['etcd']}",
                f"--listen-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
                f"--initial-cluster=testbed=http://127.0.0.1:{ports['etcd-peer']}",
                "--initial-cluster-state=new",
                "--log-level=warn",
                "--quota-backend-bytes=4294967296",
            ],
            lambda: '"health":"true"' in http_get(f"http://127.0.0.1:{ports['etcd']}/health")[1],
            30,
            timings,
        )
        log(f"etcd ready on 127.0.0.1:{ports['etcd']} in {timings['etcd']:.1f}s (pid {pid})")

        # kube-apiserver
        token = tokens["admin"]
        pid = self.launch(
            "kube-apiserver",
            [
                str(self.bd / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{ports['etcd']}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={ports['apiserver']}",
                f"--cert-dir={st.pki}",
                f"--tls-cert-file={st.pki / 'apiserver.crt'}",
                f"--tls-private-key-file={st.pki / 'apiserver.key'}",
                f"--client-ca-file={st.pki / 'ca.crt'}",
                f"--token-auth-file={token_file}",
                "--authorization-mode=RBAC",
                "--anonymous-auth=true",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={st.pki / 'sa.pub'}",
                f"--service-account-signing-key-file={st.pki / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--endpoint-reconciler-type=none",
                # No node-lifecycle controller runs, so nothing would lift the not-ready taint that
                # this admission plugin puts on new nodes.
                "--disable-admission-plugins=TaintNodesByCondition",
                # On in OpenShift: blockOwnerDeletion needs update on the owner's finalizers.
                # The least-privilege scenario proves the chart grants it.
                "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
                # Debian's etcd 3.4.23 lacks RequestWatchProgress. With WatchList on, the apiserver
                # turns every watch from resourceVersion 0 into a watch-list request and refuses it
                # ("required storage feature RequestWatchProgress is disabled"); kwok always watches
                # from 0, so it would see pod changes only on periodic relists (up to ~30 s late).
                "--feature-gates=WatchList=false",
                "--allow-privileged=true",
                "--profiling=false",
                "--v=1",
            ],
            lambda: http_get(f"{server}/readyz", token)[0] == 200,
            120,
            timings,
        )
        log(f"kube-apiserver ready at {server} in {timings['kube-apiserver']:.1f}s (pid {pid})")

        # kube-controller-manager
        t0 = time.monotonic()
        k = kcfg["kube-controller-manager"]
        pid = self.start(
            "kube-controller-manager",
            [
                str(self.bd / "kube-controller-manager"),
                f"--kubeconfig={k}",
                f"--authentication-kubeconfig={k}",
                f"--authorization-kubeconfig={k}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports['kcm']}",
                f"--controllers={','.join(KCM_CONTROLLERS)}",
                f"--service-account-private-key-file={st.pki / 'sa.key'}",
                f"--root-ca-file={st.pki / 'ca.crt'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--use-service-account-credentials=false",
                "--concurrent-gc-syncs=4",
                "--v=1",
            ],
        )
        wait_for(
            "kube-controller-manager",
            lambda: http_get(f"https://127.0.0.1:{ports['kcm']}/healthz")[0] == 200,
            60,
            pid,
            st.logs / "kube-controller-manager.log",
        )
        # The serviceaccount controller must create default/default before pods can be admitted.
        wait_for(
            "serviceaccount default/default",
            lambda: (
                self.kubectl(
                    "get", "serviceaccount", "default", "-n", "default", check=False
                ).returncode
                == 0
            ),
            60,
            pid,
            st.logs / "kube-controller-manager.log",
        )
        timings["kube-controller-manager"] = time.monotonic() - t0
        log(
            f"kube-controller-manager ready in {timings['kube-controller-manager']:.1f}s "
            f"(pid {pid})"
        )

        # kube-scheduler
        k = kcfg["kube-scheduler"]
        pid = self.launch(
            "kube-scheduler",
            [
                str(self.bd / "kube-scheduler"),
                f"--kubeconfig={k}",
                f"--authentication-kubeconfig={k}",
                f"--authorization-kubeconfig={k}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports['scheduler']}",
                "--v=1",
            ],
            lambda: http_get(f"https://127.0.0.1:{ports['scheduler']}/readyz")[0] == 200,
            60,
            timings,
        )
        log(f"kube-scheduler ready in {timings['kube-scheduler']:.1f}s (pid {pid})")

        # kwok controller
        pid = self.launch(
            "kwok",
            [
                str(self.bd / "kwok"),
                f"--kubeconfig={kcfg['kwok']}",
                f"--config={KWOK_CONFIG}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                f"--cidr={POD_CIDR}",
                f"--node-ip={NODE_IP}",
                f"--server-address=127.0.0.1:{ports['kwok']}",
            ],
            lambda: http_get(f"http://127.0.0.1:{ports['kwok']}/healthz")[0] == 200,
            60,
            timings,
        )
        log(f"kwok controller ready in {timings['kwok']:.1f}s (pid {pid})")

        # fake nodes
        t0 = time.monotonic()
        nodes = node_manifests(gpu_nodes, gpus_per_node, cpu_nodes, gpu_product, instance_type)
        existing = set(self.kubectl("get", "nodes", "-o", "name").stdout.split())
        new = [n for n in nodes if f"node/{n['metadata']['name']}" not in existing]
        if new:
            self.kubectl("create", "-f", "-", input=yaml.safe_dump_all(new))
        names = [n["metadata"]["name"] for n in nodes]

        def nodes_ready() -> bool:
            out = self.kubectl("get", "nodes", "-o", "json").stdout
            ready = {
                n["metadata"]["name"]
                for n in json.loads(out)["items"]
                if any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in n["status"].get("conditions", [])
                )
            }
            return set(names) <= ready

        wait_for("nodes Ready", nodes_ready, 60, pid, st.logs / "kwok.log")
        timings["nodes"] = time.monotonic() - t0
        log(
            f"{gpu_nodes} GPU node(s) x {gpus_per_node} {GPU_RESOURCE} + "
            f"{cpu_nodes} CPU node(s) Ready in "
            f"{timings['nodes']:.1f}s"
        )

        # KubeRay CRDs + operator
        t0 = time.monotonic()
        crds = sorted((self.bd / "kuberay-crds").glob("*.yaml"))
        self.kubectl("apply", "--server-side", "--force-conflicts", *[f"-f={c}" for c in crds])
        self.kubectl(
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            *[f"crd/{c.name.removeprefix('ray.io_').removesuffix('.yaml')}.ray.io" for c in crds],
        )
        env = dict(os.environ, KUBECONFIG=kcfg["kuberay-operator"])
        pid = self.start(
            "kuberay-operator",
            [
                str(self.bd / "ray-operator"),
                f"--metrics-addr=127.0.0.1:{ports['kuberay-metrics']}",
                f"--health-probe-bind-address=127.0.0.1:{ports['kuberay-probe']}",
                "--enable-leader-election=false",
                "--log-stdout-encoder=console",
            ],
            env=env,
        )
        wait_for(
            "kuberay-operator",
            lambda: http_get(f"http://127.0.0.1:{ports['kuberay-probe']}/readyz")[0] == 200,
            60,
            pid,
            st.logs / "kuberay-operator.log",
        )
        timings["kuberay-operator"] = time.monotonic() - t0
        log(
            f"KubeRay operator ready in {timings['kuberay-operator']:.1f}s (pid {pid}; CRDs: "
            f"{', '.join(c.name for c in crds)})"
        )

        # our CRD(s), if the repo has them
        ours = sorted((REPO / "crds").glob("*.yaml")) + sorted((REPO / "crds").glob("*.yml"))
        if ours:
            t0 = time.monotonic()
            self.kubectl("apply", "--server-side", "--force-conflicts", *[f"-f={c}" for c in ours])
            names_out = self.kubectl("get", *[f"-f={c}" for c in ours], "-o", "name").stdout.split()
            crd_names = [n for n in names_out if n.startswith("customresourcedefinition")]
            if crd_names:
                self.kubectl("wait", "--for=condition=Established", "--timeout=60s", *crd_names)
            timings["crds"] = time.monotonic() - t0
            log(
                f"installed {', '.join(str(c.relative_to(REPO)) for c in ours)} "
                f"in {timings['crds']:.1f}s"
            )
        else:
            log("no crds/*.yaml in the repository; skipping our CRD")

        total = time.monotonic() - t_up
        info = st.info()
        info["pod_network"] = net.to_json() if net else None
        info["timings"] = {k: round(v, 2) for k, v in timings.items()}
        info["up_seconds"] = round(total, 2)
        st.info_file.write_text(json.dumps(info, indent=2) + "\n")
        rss = {n: rss_mib(r["pid"]) for n, r in st.pids().items()}
        log("RSS MiB: " + ", ".join(f"{n}={v:.0f}" for n, v in rss.items() if v is not None))
        log(f"up in {total:.1f}s. export KUBECONFIG={st.kubeconfig}")


def start_pod_network(st: State) -> podnet.PodNetwork | None:
    """Route the pod and service CIDRs into a namespace of ours (see podnet.py)."""
    try:
        net = podnet.up(st.root, (POD_CIDR, SERVICE_CIDR, f"{NODE_IP}/32"),
                        is_live=lambda root: any(State(root).alive().values()))
    except (PodNetError, OSError) as exc:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            raise
        log(f"pod network not set up ({exc}); pod IPs are unreachable, so run the operator "
            "with VLLMDP_HEALTH_PROBE=off")
        return None
    (st.root / "pod_network.json").write_text(json.dumps(net.to_json()) + "\n")
    log(f"pod network: {', '.join(net.cidrs)} routed into netns {net.netns}")
    return net


def stop_pod_network(st: State) -> None:
    """Remove what start_pod_network made, as recorded in the state dir."""
    record = st.root / "pod_network.json"
    if record.exists():
        podnet.down(podnet.PodNetwork.from_json(json.loads(record.read_text())))
        record.unlink()
        log("pod network removed")


PodNetError = podnet.PodNetworkError


def down(st: State | None = None, timeout: float = 10.0) -> None:
    st = st or State()
    pids = st.pids()
    if not pids:
        stop_pod_network(st)
        log(f"nothing recorded in {st.root}; nothing to stop")
        return
    for name in reversed([*COMPONENTS, *[n for n in pids if n not in COMPONENTS]]):
        rec = pids.get(name)
        if not rec:
            continue
        pid = rec["pid"]
        if not pid_alive(pid):
            log(f"{name} (pid {pid}) already gone")
        elif not pid_matches(pid, rec["exe"]):
            log(f"{name}: pid {pid} now belongs to another program; leaving it alone")
        else:
            os.kill(pid, signal.SIGTERM)
            t0 = time.monotonic()
            while pid_alive(pid) and time.monotonic() - t0 < timeout:
                time.sleep(0.1)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            if pid_alive(pid):
                log(f"{name} (pid {pid}) ignored SIGTERM for {timeout:.0f}s; SIGKILL")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            log(f"stopped {name} (pid {pid})")
        del pids[name]
        st.save_pids(pids)
    st.pids_file.unlink(missing_ok=True)
    stop_pod_network(st)


def status(st: State | None = None) -> bool:
    st = st or State()
    pids = st.pids()
    if not pids:
        print(f"test bed in {st.root}: not running")
        return False
    alive = st.alive()
    for name in COMPONENTS:
        rec = pids.get(name)
        if rec is None:
            print(f"  {name:26s} not started")
        else:
            rss = rss_mib(rec["pid"]) if alive.get(name) else None
            extra = f", RSS {rss:.0f} MiB" if rss else ""
            print(
                f"  {name:26s} {'alive' if alive.get(name) else 'DEAD'} (pid {rec['pid']}{extra})"
            )
    ok = st.healthy()
    print(f"test bed in {st.root}: {'healthy' if ok else 'NOT healthy'}")
    return ok


def env_lines(st: State | None = None) -> list[str]:
    st = st or State()
    info = st.info()
    lines = [
        f"export VLLMDP_TESTBED_DIR={st.root}",
        f"export KUBECONFIG={st.kubeconfig}",
    ]
    if info:
        lines.append(f"export PATH={info['bin_dir']}:$PATH")
        lines.append(f"export VLLMDP_TESTBED_SERVER={info['server']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build or reuse the binaries")
    b.add_argument("--force", action="store_true", help="rebuild even if cached")
    sub.add_parser("bin-dir", help="print the binary cache dir")
    u = sub.add_parser("up", help="start the test bed (idempotent)")
    u.add_argument(
        "--nodes",
        type=int,
        default=int(os.environ.get("VLLMDP_TESTBED_NODES", 4)),
        help="fake GPU nodes (env VLLMDP_TESTBED_NODES, default 4)",
    )
    u.add_argument(
        "--gpus-per-node",
        type=int,
        default=int(os.environ.get("VLLMDP_TESTBED_GPUS_PER_NODE", 8)),
        help="nvidia.com/gpu per node (env VLLMDP_TESTBED_GPUS_PER_NODE, default 8)",
    )
    u.add_argument(
        "--cpu-nodes",
        type=int,
        default=int(os.environ.get("VLLMDP_TESTBED_CPU_NODES", 1)),
        help="untainted CPU-only nodes (env VLLMDP_TESTBED_CPU_NODES, default 1)",
    )
    u.add_argument(
        "--gpu-product",
        default=os.environ.get("VLLMDP_TESTBED_GPU_PRODUCT", "NVIDIA-H100-80GB-HBM3"),
    )
    u.add_argument(
        "--instance-type", default=os.environ.get("VLLMDP_TESTBED_INSTANCE_TYPE", "p5.48xlarge")
    )
    u.add_argument(
        "--etcd-port",
        type=int,
        default=None,
        help="default: a free port (env VLLMDP_TESTBED_ETCD_PORT)",
    )
    u.add_argument(
        "--apiserver-port",
        type=int,
        default=None,
        help="default: a free port (env VLLMDP_TESTBED_APISERVER_PORT)",
    )
    u.add_argument("--keep-data", action="store_true", help="keep the etcd data of a previous run")
    u.add_argument(
        "--no-build", action="store_true", help="fail instead of building missing binaries"
    )
    sub.add_parser("down", help="stop what `up` started")
    sub.add_parser("env", help="print shell exports")
    sub.add_parser("status", help="show which components are alive")
    a = p.parse_args(argv)

    try:
        if a.cmd == "build":
            build(force=a.force)
        elif a.cmd == "bin-dir":
            print(bin_dir())
        elif a.cmd == "up":
            st = State()
            if st.healthy():
                log(f"already up and healthy ({st.root}); nothing to do")
                return 0
            bd = bin_dir() if a.no_build else build()
            if not binaries_present(bd):
                raise BuildError(f"binaries missing in {bd}; run `build`")
            tb = Testbed(st, bd)
            try:
                tb.up(
                    a.nodes,
                    a.gpus_per_node,
                    a.cpu_nodes,
                    a.etcd_port,
                    a.apiserver_port,
                    a.keep_data,
                    a.gpu_product,
                    a.instance_type,
                )
            except BaseException:
                log(f"up failed; stopping what was started (logs stay in {st.logs})")
                down(st)
                raise
        elif a.cmd == "down":
            down()
        elif a.cmd == "env":
            print("\n".join(env_lines()))
        elif a.cmd == "status":
            return 0 if status() else 1
    except BuildError as e:
        print(f"[testbed] BUILD ERROR: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"[testbed] ERROR: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
