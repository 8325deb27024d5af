"""KEDA on the running real-node bed, installed from its own manifests, for the autoscaling
tier: `up` by the tier's fixture (or `testbed.py cluster keda-up`), `down` after it.

- What is installed is KEDA's kustomize tree as shipped (binaries.build_keda copies its
  `config/`), `config/minimal` rendered by kubectl's kustomize: the CRDs, the ServiceAccount
  and RBAC, the operator's and the metrics API server's Deployments, and the APIService
  `v1beta1.external.metrics.k8s.io`, which the API server serves through its aggregation
  layer (controlplane.py's front-proxy flags). KEDA makes and rotates its own certificates
  and writes the APIService's CA bundle (its `--enable-cert-rotation`).
- Changed for the bed, and only this: the images are the one-file images built here (never
  pulled); the pods ask no CPU, since real-vLLM replicas take whole nodes' CPUs (the bed's
  traffic clients ask none either); the operator does not patch admission webhooks, which
  `config/minimal` leaves out (they validate ScaledObjects and scale nothing).
- Ready when both Deployments are Available and the APIService says Available.

`down` deletes the APIService first (an aggregated API without a server fails discovery for
every later client), then what lies outside KEDA's namespace (cluster-wide RBAC, bindings in
kube-system), then the namespace; the CRDs stay.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import realbed
import realnodes
import yaml
from binaries import KEDA_COMMANDS, build_keda, keda_dir, keda_image, keda_present
from common import log
from controlplane import kubectl
from procs import State

NAMESPACE = "keda"
APISERVICE = "v1beta1.external.metrics.k8s.io"
DEPLOYMENTS = ("keda-operator", "keda-metrics-apiserver")
#: KEDA's container images, by the last part of the name its manifests give them, to the
#: binaries built here.
IMAGES = {"keda": "keda", "keda-metrics-apiserver": "keda-adapter"}


def _for_the_bed(doc: dict[str, Any]) -> dict[str, Any]:
    """One of KEDA's objects as the bed runs it (the module's docstring says what changes)."""
    if doc.get("kind") != "Deployment":
        return doc
    for c in doc["spec"]["template"]["spec"]["containers"]:
        repo = c["image"].rsplit(":", 1)[0].rsplit("/", 1)[-1]
        if repo not in IMAGES:
            raise RuntimeError(f"KEDA's manifests name an image not built here: {c['image']}")
        c["image"], c["imagePullPolicy"] = keda_image(IMAGES[repo]), "Never"
        c.get("resources", {}).get("requests", {}).pop("cpu", None)
        c.get("resources", {}).get("limits", {}).pop("cpu", None)
        if IMAGES[repo] == "keda":  # the operator
            c["args"] = [*c.get("args", []), "--enable-webhook-patching=false"]
    return doc


def manifests(kd: Path, bd: Path, kubeconfig: Path) -> list[dict[str, Any]]:
    """KEDA's `config/minimal`, rendered and changed for the bed."""
    out = kubectl(bd, kubeconfig, "kustomize", str(kd / "config" / "minimal")).stdout
    return [_for_the_bed(d) for d in yaml.safe_load_all(out) if d]


def _available(bd: Path, kubeconfig: Path) -> list[str]:
    """What of KEDA is not yet available (empty: all of it)."""
    waiting = []
    for name in DEPLOYMENTS:
        dep = kubectl(bd, kubeconfig, "get", "deployment", name, "-n", NAMESPACE,
                      "-o", "jsonpath={.status.availableReplicas}",
                      check=False).stdout.strip()  # fmt: skip
        if dep in ("", "0"):
            waiting.append(f"deployment {name}")
    api = kubectl(bd, kubeconfig, "get", "apiservice", APISERVICE, "-o",
                  'jsonpath={.status.conditions[?(@.type=="Available")].status}',
                  check=False).stdout.strip()  # fmt: skip
    if api != "True":
        waiting.append(f"apiservice {APISERVICE} (Available={api or '?'})")
    return waiting


def up(st: State, timeout: float = 300) -> None:
    """Build (cached), import the images into every node, install, wait until available."""
    kd = build_keda()
    bd = Path(st.info()["bin_dir"])
    realnodes.log_import(realbed.nodes_of(st), [kd / "images" / f"{b}.tar"
                                                for b in KEDA_COMMANDS.values()])  # fmt: skip
    docs = manifests(kd, bd, st.kubeconfig)
    t0 = time.monotonic()
    kubectl(bd, st.kubeconfig, "apply", "--server-side", "--force-conflicts", "-f", "-",
            input=yaml.safe_dump_all(docs))  # fmt: skip
    while waiting := _available(bd, st.kubeconfig):
        if time.monotonic() - t0 > timeout:
            pods = kubectl(bd, st.kubeconfig, "get", "pods", "-n", NAMESPACE, "-o", "wide",
                           check=False).stdout  # fmt: skip
            logs = "".join(
                kubectl(bd, st.kubeconfig, "logs", f"deployment/{d}", "-n", NAMESPACE,
                        "--tail=30", check=False).stdout for d in DEPLOYMENTS)  # fmt: skip
            raise RuntimeError(f"KEDA not available in {timeout:.0f}s: {waiting}\n{pods}\n{logs}")
        time.sleep(2)
    log(f"KEDA available in {time.monotonic() - t0:.1f}s")


def down(st: State) -> None:
    """Remove what `up` installed but the CRDs (see the module's docstring)."""
    info = st.info()
    if not info.get("bin_dir"):
        return
    bd = Path(info["bin_dir"])
    kubectl(bd, st.kubeconfig, "delete", "apiservice", APISERVICE, "--ignore-not-found",
            check=False)  # fmt: skip
    kd = keda_dir()
    if not keda_present(kd):  # never installed from this pin: nothing of it to remove
        return
    # What lies outside KEDA's namespace: cluster-wide RBAC, and its bindings in kube-system.
    outside = [d for d in manifests(kd, bd, st.kubeconfig)
               if d["kind"] not in ("CustomResourceDefinition", "Namespace")
               and d["metadata"].get("namespace") != NAMESPACE]  # fmt: skip
    kubectl(bd, st.kubeconfig, "delete", "--ignore-not-found", "-f", "-",
            input=yaml.safe_dump_all(outside), check=False)  # fmt: skip
    kubectl(bd, st.kubeconfig, "delete", "namespace", NAMESPACE, "--ignore-not-found",
            "--wait=true", check=False, timeout=180)  # fmt: skip
