"""Kueue on a running kwok bed, as a host process with its webhooks: started by `up` (the
Kueue tests' fixture, or `testbed.py kueue-up`), stopped by `down` (or the bed's own `down`).

Kueue runs as it really runs, with its admission webhooks and CRD conversion, served over TLS
on 127.0.0.1 with a certificate from the bed's CA (pki.py); its own certificate management is
off. The API server calls it by URL: the webhook configurations and the CRDs' conversion are
Kueue's own manifests (copied by binaries.build_kueue) with the service reference rewritten.
Its RayCluster integration alone is on: the operator's head RayJobs carry no queue label and
are not Kueue's. A ClusterQueue `gpu-cq` holds 8 nvidia.com/gpu (one kwok node's) and
preempts lower priorities; WorkloadPriorityClasses `low` and `high`; a test adds the
LocalQueue in its own namespace (`local_queue`).

Kueue reads its metrics certificate from a fixed path, /etc/kueue/metrics/certs: it runs in a
mount namespace of its own where an overlay adds that folder to /etc, so the host's /etc is
never written. The bed's API server is shared by every tier: Kueue's webhooks for RayClusters
see only namespaces labelled NAMESPACE_LABEL, so a Kueue that has stopped can refuse no other
test's RayCluster; `down` removes the webhooks.
"""

from __future__ import annotations

import base64
import copy
import shutil
import time
from pathlib import Path
from typing import Any

import pki
import yaml
from binaries import build_kueue
from common import free_port, http_get, log
from controlplane import kubectl
from gccheck import wait_collected
from procs import Launcher, State, stop

NAME = "kueue"
NAMESPACE = "kueue-system"
#: Namespaces whose RayClusters Kueue's webhooks see.
NAMESPACE_LABEL = "vllmdp.io/testbed-kueue"
CLUSTER_QUEUE = "gpu-cq"
GPU_QUOTA = 8
WEBHOOKS = ("vllmdp-testbed-kueue-mutating", "vllmdp-testbed-kueue-validating")
PRIORITIES = {"low": 100, "high": 1000}


def _config(ports: dict[str, int], cert_dir: Path) -> dict[str, Any]:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['health']}"},
        "metrics": {"bindAddress": f"127.0.0.1:{ports['metrics']}"},
        "webhook": {"port": ports["webhook"], "host": "127.0.0.1", "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "integrations": {"frameworks": ["ray.io/raycluster"]},
    }  # fmt: skip


def _client(port: int, path: str, ca: str) -> dict[str, Any]:
    return {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca}


def _ours(webhook: dict[str, Any]) -> bool:
    # Kueue's own kinds, and the one integration that is on.
    rules = webhook.get("rules") or []
    return any("kueue.x-k8s.io" in r.get("apiGroups", []) or "rayclusters" in r.get("resources",
               []) for r in rules)  # fmt: skip


def webhook_configs(kd: Path, port: int, ca: str) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, calling 127.0.0.1:`port` by URL."""
    out = []
    for doc, name in zip(yaml.safe_load_all((kd / "config" / "webhook.yaml").read_text()),
                         WEBHOOKS, strict=True):  # fmt: skip
        doc = copy.deepcopy(doc)
        doc["metadata"] = {"name": name}
        hooks = [h for h in doc["webhooks"] if _ours(h)]
        for hook in hooks:
            hook["clientConfig"] = _client(port, hook["clientConfig"]["service"]["path"], ca)
            if any("rayclusters" in r.get("resources", []) for r in hook["rules"]):
                hook["namespaceSelector"] = {"matchLabels": {NAMESPACE_LABEL: "true"}}
        doc["webhooks"] = hooks
        out.append(doc)
    return out


def crds(kd: Path, port: int, ca: str) -> list[dict[str, Any]]:
    """Kueue's CRDs, with the conversion webhook of those its patches give one."""
    conversion = {}
    for f in sorted((kd / "config" / "conversion").glob("*.yaml")):
        patch = yaml.safe_load(f.read_text())
        conversion[patch["metadata"]["name"]] = patch["spec"]["conversion"]
    out = []
    for f in sorted((kd / "config" / "crds").glob("*.yaml")):
        crd = yaml.safe_load(f.read_text())
        conv = copy.deepcopy(conversion.get(crd["metadata"]["name"]))
        if conv:
            conv["webhook"]["clientConfig"] = _client(port, "/convert", ca)
            crd["spec"]["conversion"] = conv
        out.append(crd)
    return out


def queue_objects() -> list[dict[str, Any]]:
    """The ResourceFlavor, the ClusterQueue and the WorkloadPriorityClasses."""
    group = "kueue.x-k8s.io/v1beta2"
    flavor = {"apiVersion": group, "kind": "ResourceFlavor", "metadata": {"name": "gpu"}}
    quotas = {"cpu": "1000", "memory": "10Ti", "nvidia.com/gpu": str(GPU_QUOTA)}
    queue = {
        "apiVersion": group, "kind": "ClusterQueue", "metadata": {"name": CLUSTER_QUEUE},
        "spec": {
            "namespaceSelector": {},
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [{
                "coveredResources": list(quotas),
                "flavors": [{"name": "gpu", "resources": [
                    {"name": k, "nominalQuota": v} for k, v in quotas.items()]}],
            }],
        },
    }  # fmt: skip
    classes = [{"apiVersion": group, "kind": "WorkloadPriorityClass", "metadata": {"name": n},
                "value": v, "description": f"{n} priority (test bed)"}
               for n, v in PRIORITIES.items()]  # fmt: skip
    return [flavor, queue, *classes]


def local_queue(namespace: str, name: str = "gpu") -> dict[str, Any]:
    """A LocalQueue of the bed's ClusterQueue in `namespace`."""
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterQueue": CLUSTER_QUEUE}}  # fmt: skip


def up(st: State) -> dict[str, Any]:
    """Build (cached) and start Kueue on the running bed; return its ports. Idempotent."""
    info = st.info()
    if NAME in st.pids() and st.alive().get(NAME) and info.get("kueue"):
        log("Kueue already running")
        return dict(info["kueue"])
    kd = build_kueue()
    bd = Path(info["bin_dir"])
    root = st.root / "kueue"
    certs, etc = root / "certs", root / "etc" / "kueue" / "metrics" / "certs"
    for d in (certs, etc):
        d.mkdir(parents=True, exist_ok=True)
    crt, key = pki.serving_cert(st.pki, "kueue-webhook", "127.0.0.1")
    for d in (certs, etc):
        shutil.copyfile(crt, d / "tls.crt")
        shutil.copyfile(key, d / "tls.key")
    ca = base64.b64encode((st.pki / "ca.crt").read_bytes()).decode()
    ports = {"webhook": free_port(), "health": free_port(), "metrics": free_port()}

    def apply(docs: list[dict[str, Any]]) -> None:
        kubectl(bd, st.kubeconfig, "apply", "--server-side", "--force-conflicts", "-f", "-",
                input=yaml.safe_dump_all(docs))  # fmt: skip

    apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}])
    apply(crds(kd, ports["webhook"], ca))
    kubectl(bd, st.kubeconfig, "wait", "--for=condition=Established", "--timeout=60s",
            *[f"crd/{c['metadata']['name']}" for c in crds(kd, 0, "")])  # fmt: skip
    conf = root / "config.yaml"
    conf.write_text(yaml.safe_dump(_config(ports, certs), sort_keys=False))
    exe = str(kd / "kueue")
    # unshare execs sh, which execs Kueue: one PID; the overlay ends with its mount namespace.
    script = 'mount -t overlay overlay -o lowerdir="$0":/etc /etc && exec "$@"'
    argv = ["unshare", "--mount", "--propagation=private", "sh", "-c", script,
            str(root / "etc"), exe, f"--config={conf}", "--feature-gates=VisibilityOnDemand=false",
            "--zap-log-level=2"]  # fmt: skip
    env = {"KUBECONFIG": str(st.kubeconfig), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    ready = f"http://127.0.0.1:{ports['health']}/readyz"
    Launcher(st).launch(NAME, argv, lambda: http_get(ready)[0] == 200, 120, env=env, exe=exe)
    apply(webhook_configs(kd, ports["webhook"], ca))
    # The webhooks answer once Kueue serves them: retried, the first objects go through them.
    _retry(lambda: apply(queue_objects()))
    _gc_knows_kueue(bd, st.kubeconfig)
    st.update_info(kueue=ports)
    return ports


def _gc_knows_kueue(bd: Path, kubeconfig: Path, timeout: float = 90) -> None:
    """Wait until the garbage collector follows Kueue's kinds (gccheck.py): until then the
    Workload of a deleted RayCluster stays, and so does its quota."""
    name = "vllmdp-testbed-gc-probe"
    owner = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": name}, "rules": []}  # fmt: skip
    probe = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass", "value": 0,
             "metadata": {"name": name}}  # fmt: skip
    took = wait_collected(lambda *a, **kw: kubectl(bd, kubeconfig, *a, **kw), owner, probe,
                          timeout)  # fmt: skip
    log(f"the garbage collector collects Kueue's kinds ({took:.1f}s)")


def _retry(step: Any, attempts: int = 30) -> None:
    for i in range(attempts):
        try:
            step()
            return
        except RuntimeError:
            if i == attempts - 1:
                raise
            time.sleep(1)


def down(st: State) -> None:
    """Remove Kueue's webhooks, then stop the process (by its recorded PID).

    Its CRDs stay: its objects carry finalizers only a running Kueue removes, so deleting
    them would leave the CRDs terminating; the next `up` applies them again.
    """
    info = st.info()
    if info.get("bin_dir"):
        kubectl(Path(info["bin_dir"]), st.kubeconfig, "delete", "--ignore-not-found",
                "mutatingwebhookconfiguration/" + WEBHOOKS[0],
                "validatingwebhookconfiguration/" + WEBHOOKS[1], check=False)  # fmt: skip
    stop(st, NAME)
    st.update_info(kueue=None)
