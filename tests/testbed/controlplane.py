"""The control plane both modes share: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, the KubeRay operator and the CRDs (KubeRay's and ours).

Each runs as a plain process started by procs.Launcher (recorded PID, own log in the state
dir); the mode's `down` stops them by recorded PID. A `Profile` says how a mode runs them:
the kwok mode binds 127.0.0.1 and runs no node controllers; the real-node mode binds an
address of its own (on `lo`) that pods reach through the `kubernetes` Service.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pki
from binaries import find_etcd
from common import REPO, free_port, http_get, log, wait_for
from procs import Launcher, State

ADMISSION_ALWAYS = ("OwnerReferencesPermissionEnforcement",)
# Components that act as cluster admin; each mode adds its own users.
ADMIN_USERS = {
    "admin": ("admin", "system:masters"),
    "kube-controller-manager": ("system:kube-controller-manager", "system:masters"),
    "kube-scheduler": ("system:kube-scheduler", "system:masters"),
    "kuberay-operator": ("kuberay-operator", "system:masters"),
}


@dataclass(frozen=True)
class Profile:
    """How a mode runs the control plane."""

    address: str  # the API server binds and advertises it
    apiserver_port: int | None  # None: a free port
    service_cidr: str
    authorization: str
    endpoint_reconciler: str  # "none": no endpoints for the `kubernetes` Service
    admission_enable: tuple[str, ...]
    admission_disable: tuple[str, ...]
    controllers: tuple[str, ...]
    kubelet_client: bool  # the API server talks to kubelets (logs, exec)


#: Write requests, at Metadata level (who, what, the User-Agent, the answer's code), and not at
#: the RequestReceived stage: the log shows which operator process wrote what, at a cost of one
#: line per write. Node heartbeats (node leases, node status) are left out. Reads are logged
#: only for the benchmark's operator (its ServiceAccounts' group; probes through the service
#: proxy excepted), so a bench can name every request it makes at rest.
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: None
    namespaces: [kube-node-lease]
  - level: None
    resources: [{group: "", resources: [nodes, nodes/status]}]
  - level: Metadata
    verbs: [create, update, patch, delete, deletecollection]
  - level: None
    resources: [{group: "", resources: [services/proxy, pods/proxy]}]
  - level: Metadata
    userGroups: ["system:serviceaccounts:vllmdp-bench-system"]
    verbs: [get, list, watch]
  - level: None
"""


def _profiling() -> str:
    """`--profiling` of the API server: off, unless VLLMDP_TESTBED_PROFILING=1 asks for its
    /debug/pprof endpoints (CPU profiles of a benchmark's steps; docs/benchmarks.md)."""
    return "true" if os.environ.get("VLLMDP_TESTBED_PROFILING") == "1" else "false"


def audit_log(root: Path) -> Path:
    """The API server's audit log (JSON lines) in a state dir."""
    return root / "logs" / "audit.log"


class ControlPlane:
    """Starts and addresses one control plane; `prepare` first, then `start`."""

    def __init__(self, st: State, bd: Path, profile: Profile, launcher: Launcher) -> None:
        self.st, self.bd, self.profile, self.launcher = st, bd, profile, launcher
        self.ports: dict[str, int] = {}
        self.tokens: dict[str, str] = {}

    @property
    def server(self) -> str:
        return f"https://{self.profile.address}:{self.ports['apiserver']}"

    def kubeconfig_for(self, comp: str) -> Path:
        if comp == "admin":
            return self.st.kubeconfig
        return self.st.root / "kubeconfigs" / f"{comp}.kubeconfig"

    def prepare(
        self,
        users: dict[str, tuple[str, str]],
        etcd_port: int | None,
        apiserver_port: int | None,
        extra_ports: tuple[str, ...],
        info: dict[str, Any],
    ) -> None:
        """Certificates, tokens, kubeconfigs and testbed.json, before anything starts."""
        st, p = self.st, self.profile
        for d in ("etcd", "kubeconfigs", "logs"):
            (st.root / d).mkdir(parents=True, exist_ok=True)
        svc_ip = p.service_cidr.split("/")[0].rsplit(".", 1)[0] + ".1"
        pki.make_pki(st.pki, tuple(dict.fromkeys(("127.0.0.1", p.address, svc_ip))))
        api = apiserver_port or p.apiserver_port
        self.ports = {"etcd": etcd_port or free_port(), "etcd-peer": free_port(),
                      "apiserver": api or free_port(p.address)}  # fmt: skip
        for name in ("kcm", "scheduler", "kuberay-metrics", "kuberay-probe", *extra_ports):
            self.ports[name] = free_port()
        all_users = {**ADMIN_USERS, **users}
        _, self.tokens = pki.write_tokens(st.pki, all_users, st.info().get("tokens") or {})
        for comp, (user, _) in all_users.items():
            path = self.kubeconfig_for(comp)
            pki.write_kubeconfig(path, self.server, st.pki / "ca.crt", self.tokens[comp], user)
        st.write_info({"server": self.server, "ports": self.ports,
                       "kubeconfig": str(st.kubeconfig), "admin_token": self.tokens["admin"],
                       "tokens": self.tokens, "bin_dir": str(self.bd), **info})  # fmt: skip

    def start(self) -> None:
        """etcd, then the API server, the controller-manager and the scheduler, each ready."""
        st, p, ports, bd = self.st, self.profile, self.ports, str(self.bd)
        etcd_url = f"http://127.0.0.1:{ports['etcd']}"
        peer = f"http://127.0.0.1:{ports['etcd-peer']}"
        self.launcher.launch(
            "etcd",
            [find_etcd(), "--name=testbed", f"--data-dir={st.root / 'etcd'}",
             f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
             f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
             f"--initial-cluster=testbed={peer}", "--initial-cluster-state=new",
             "--log-level=warn", "--quota-backend-bytes=4294967296"],
            lambda: '"health":"true"' in http_get(f"{etcd_url}/health")[1], 30,
        )  # fmt: skip
        admission = [f"--enable-admission-plugins={','.join(p.admission_enable)}"]
        if p.admission_disable:
            admission.append(f"--disable-admission-plugins={','.join(p.admission_disable)}")
        kubelet_client = [
            f"--kubelet-client-certificate={st.pki / 'kubelet-client.crt'}",
            f"--kubelet-client-key={st.pki / 'kubelet-client.key'}",
            "--kubelet-preferred-address-types=InternalIP",
        ] if p.kubelet_client else []  # fmt: skip
        # The aggregation layer (an APIService served by an extension API server, as KEDA's
        # external metrics are): the API server proxies with the front-proxy client
        # certificate and names the user in these headers.
        proxy = pki.front_proxy(st.pki)
        aggregation = [f"--requestheader-client-ca-file={proxy['ca.crt']}",
                       "--requestheader-allowed-names=front-proxy-client",
                       "--requestheader-username-headers=X-Remote-User",
                       "--requestheader-group-headers=X-Remote-Group",
                       "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                       f"--proxy-client-cert-file={proxy['client.crt']}",
                       f"--proxy-client-key-file={proxy['client.key']}"]  # fmt: skip
        token = self.tokens["admin"]
        policy = st.root / "audit-policy.yaml"
        policy.write_text(AUDIT_POLICY)
        audit = [f"--audit-policy-file={policy}", f"--audit-log-path={audit_log(st.root)}",
                 "--audit-log-format=json", "--audit-log-maxsize=200",
                 "--audit-log-maxbackup=1"]  # fmt: skip
        self.launcher.launch(
            "kube-apiserver",
            [f"{bd}/kube-apiserver", f"--etcd-servers={etcd_url}",
             f"--bind-address={p.address}", f"--advertise-address={p.address}",
             f"--secure-port={ports['apiserver']}", f"--cert-dir={st.pki}",
             f"--tls-cert-file={st.pki / 'apiserver.crt'}",
             f"--tls-private-key-file={st.pki / 'apiserver.key'}",
             f"--client-ca-file={st.pki / 'ca.crt'}", f"--token-auth-file={st.pki / 'tokens.csv'}",
             f"--authorization-mode={p.authorization}", "--anonymous-auth=true",
             "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
             f"--service-account-key-file={st.pki / 'sa.pub'}",
             f"--service-account-signing-key-file={st.pki / 'sa.key'}",
             f"--service-cluster-ip-range={p.service_cidr}",
             f"--endpoint-reconciler-type={p.endpoint_reconciler}", *admission, *kubelet_client,
             *aggregation,
             # Debian's etcd 3.4.23 lacks RequestWatchProgress. With WatchList on, the apiserver
             # turns every watch from resourceVersion 0 into a watch-list request and refuses it
             # ("required storage feature RequestWatchProgress is disabled"); kwok always
             # watches from 0, so it would see pod changes only on relists (up to ~30 s late).
             "--feature-gates=WatchList=false", *audit,
             "--allow-privileged=true", f"--profiling={_profiling()}", "--v=1"],
            lambda: http_get(f"{self.server}/readyz", token)[0] == 200, 120,
        )  # fmt: skip
        k = str(self.kubeconfig_for("kube-controller-manager"))
        t0 = time.monotonic()
        pid = self.launcher.start(
            "kube-controller-manager",
            [f"{bd}/kube-controller-manager", f"--kubeconfig={k}",
             f"--authentication-kubeconfig={k}", f"--authorization-kubeconfig={k}",
             "--leader-elect=false", "--bind-address=127.0.0.1", f"--secure-port={ports['kcm']}",
             f"--controllers={','.join(p.controllers)}",
             f"--service-account-private-key-file={st.pki / 'sa.key'}",
             f"--root-ca-file={st.pki / 'ca.crt'}", f"--service-cluster-ip-range={p.service_cidr}",
             "--use-service-account-credentials=false", "--concurrent-gc-syncs=4", "--v=1"],
        )  # fmt: skip
        kcm_log = st.logs / "kube-controller-manager.log"
        wait_for("kube-controller-manager",
                 lambda: http_get(f"https://127.0.0.1:{ports['kcm']}/healthz")[0] == 200,
                 60, pid, kcm_log)  # fmt: skip
        # The serviceaccount controller must create default/default before pods are admitted.
        wait_for("serviceaccount default/default",
                 lambda: self.kubectl("get", "sa", "default", "-n", "default",
                                      check=False).returncode == 0,
                 60, pid, kcm_log)  # fmt: skip
        self.launcher.timings["kube-controller-manager"] = time.monotonic() - t0
        log(f"kube-controller-manager ready in {time.monotonic() - t0:.1f}s (pid {pid})")
        k = str(self.kubeconfig_for("kube-scheduler"))
        self.launcher.launch(
            "kube-scheduler",
            [f"{bd}/kube-scheduler", f"--kubeconfig={k}", f"--authentication-kubeconfig={k}",
             f"--authorization-kubeconfig={k}", "--leader-elect=false",
             "--bind-address=127.0.0.1", f"--secure-port={ports['scheduler']}", "--v=1"],
            lambda: http_get(f"https://127.0.0.1:{ports['scheduler']}/readyz")[0] == 200, 60,
        )  # fmt: skip

    def start_kuberay(self, resolv_conf: Path | None = None) -> None:
        """KubeRay's CRDs, then its operator. With `resolv_conf`, the operator runs in a mount
        namespace of its own where that file is /etc/resolv.conf, so it resolves the cluster
        names (`<cluster>-head-svc.<ns>.svc.cluster.local`) it polls Ray jobs on."""
        t0 = time.monotonic()
        crds = sorted((self.bd / "kuberay-crds").glob("*.yaml"))
        self.kubectl("apply", "--server-side", "--force-conflicts", *[f"-f={c}" for c in crds])
        names = [f"crd/{c.name.removeprefix('ray.io_').removesuffix('.yaml')}.ray.io" for c in crds]
        self.kubectl("wait", "--for=condition=Established", "--timeout=60s", *names)
        exe = str(self.bd / "ray-operator")
        argv = [exe, f"--metrics-addr=127.0.0.1:{self.ports['kuberay-metrics']}",
                f"--health-probe-bind-address=127.0.0.1:{self.ports['kuberay-probe']}",
                "--enable-leader-election=false", "--log-stdout-encoder=console"]  # fmt: skip
        if resolv_conf is not None:
            # unshare execs sh, which execs the operator: one PID throughout; the private mount
            # namespace (and the bind mount in it) ends with that process.
            script = 'mount --bind "$0" /etc/resolv.conf && exec "$@"'
            argv = ["unshare", "--mount", "--propagation=private", "sh", "-c", script,
                    str(resolv_conf), *argv]  # fmt: skip
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig_for("kuberay-operator")))
        probe = f"http://127.0.0.1:{self.ports['kuberay-probe']}/readyz"
        self.launcher.launch("kuberay-operator", argv, lambda: http_get(probe)[0] == 200, 60,
                             env=env, exe=exe)  # fmt: skip
        self.launcher.timings["kuberay-operator"] = time.monotonic() - t0

    def install_our_crds(self) -> None:
        """Our CRD(s) from crds/*.yaml, if the repository has them."""
        ours = sorted((REPO / "crds").glob("*.yaml")) + sorted((REPO / "crds").glob("*.yml"))
        if not ours:
            log("no crds/*.yaml in the repository; skipping our CRD")
            return
        t0 = time.monotonic()
        self.kubectl("apply", "--server-side", "--force-conflicts", *[f"-f={c}" for c in ours])
        out = self.kubectl("get", *[f"-f={c}" for c in ours], "-o", "name").stdout.split()
        crd_names = [n for n in out if n.startswith("customresourcedefinition")]
        if crd_names:
            self.kubectl("wait", "--for=condition=Established", "--timeout=60s", *crd_names)
        self.launcher.timings["crds"] = time.monotonic() - t0
        log(f"installed {', '.join(c.name for c in ours)} in {time.monotonic() - t0:.1f}s")

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """kubectl (the bed's own build) with the admin kubeconfig."""
        return kubectl(self.bd, self.st.kubeconfig, *args, check=check, input=input,
                       timeout=timeout)  # fmt: skip


def kubectl(
    bd: Path,
    kubeconfig: Path,
    *args: str,
    check: bool = True,
    input: str | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    cmd = [str(bd / "kubectl"), f"--kubeconfig={kubeconfig}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"kubectl {' '.join(args)} failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc
