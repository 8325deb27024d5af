"""Whether kube-controller-manager's garbage collector collects a deleted RayCluster's
dependents: a precondition of every test that frees Kueue quota by deleting a resource.

After KubeRay's CRDs are deleted and installed again (tests/controlplane/test_kuberay_absent.py),
the dependents of a deleted RayCluster (Kueue's Workload, which holds the quota) stay until the
collector's next discovery resync: tens of seconds in which a test that waits for the quota
reads the bed's past as its own failure. The proof (tests/testbed/gccheck.py) is a ConfigMap
owned by a RayCluster that is deleted.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1] / "testbed"))
from gccheck import wait_collected

NAME, NAMESPACE = "vllmdp-gc-probe", "default"


def wait_gc_follows_rayclusters(testbed: Any, timeout: float = 120) -> float:
    """Block until the collector collects a deleted RayCluster's dependent; the seconds it took.
    Fails with the controller manager's log when it does not within `timeout`."""
    meta = {"name": NAME, "namespace": NAMESPACE}
    pod = {"containers": [{"name": "ray-head", "image": "gc-probe"}]}
    cluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": meta,
        # Suspended: KubeRay makes no pod for it.
        "spec": {
            "suspend": True,
            "headGroupSpec": {"rayStartParams": {}, "template": {"spec": pod}},
        },
    }
    owned = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}
    try:
        return wait_collected(testbed.kubectl, cluster, owned, timeout)
    except TimeoutError as e:
        raise AssertionError(
            f"{e}\nkube-controller-manager log:\n{testbed.log_tail('kube-controller-manager')}"
        ) from None
