"""Whether kube-controller-manager's garbage collector collects a deleted RayCluster's
dependents: a precondition of every test that frees Kueue quota by deleting a resource.

The collector learns the API's kinds at its discovery resync, every 30 s. After KubeRay's CRDs
are deleted and installed again (tests/controlplane/test_kuberay_absent.py), the dependents of
a deleted RayCluster (Kueue's Workload, which holds the quota) stay until the collector has
caught up: tens of seconds in which a test that waits for the quota reads the bed's past as its
own failure. The proof is a ConfigMap owned by a RayCluster that is deleted: it goes once the
collector follows RayClusters again.
"""

from __future__ import annotations

import json
import time
from typing import Any

NAME, NAMESPACE = "vllmdp-gc-probe", "default"


def wait_gc_follows_rayclusters(testbed: Any, timeout: float = 120) -> float:
    """Block until the collector collects a deleted RayCluster's dependent; the seconds it took.
    Fails with the controller manager's log when it does not within `timeout`."""
    k = testbed.kubectl
    k("-n", NAMESPACE, "delete", f"configmap/{NAME}", f"raycluster/{NAME}", "--ignore-not-found",
      "--wait=true", timeout=60)  # fmt: skip
    pod = {"containers": [{"name": "ray-head", "image": "gc-probe"}]}
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster",
               "metadata": {"name": NAME, "namespace": NAMESPACE},
               # Suspended: KubeRay makes no pod for it.
               "spec": {"suspend": True,
                        "headGroupSpec": {"rayStartParams": {}, "template": {"spec": pod}}}}
    uid = k("create", "-f", "-", "-o", "jsonpath={.metadata.uid}",
            input=json.dumps(cluster)).stdout.strip()  # fmt: skip
    owned = {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": NAME, "namespace": NAMESPACE, "ownerReferences": [
                 {"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": NAME, "uid": uid}]}}
    k("create", "-f", "-", input=json.dumps(owned))
    k("-n", NAMESPACE, "delete", f"raycluster/{NAME}", "--wait=false")
    t0 = time.monotonic()
    while k("-n", NAMESPACE, "get", f"configmap/{NAME}", check=False).returncode == 0:
        if time.monotonic() - t0 > timeout:
            raise AssertionError(
                f"the garbage collector did not collect a deleted RayCluster's ConfigMap in "
                f"{timeout:.0f}s\nkube-controller-manager log:\n"
                f"{testbed.log_tail('kube-controller-manager')}")  # fmt: skip
        time.sleep(0.5)
    return time.monotonic() - t0
