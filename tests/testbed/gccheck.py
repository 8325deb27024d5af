"""Whether kube-controller-manager's garbage collector follows a kind yet.

The collector learns the API's kinds at its discovery resync, every 30 s: until then a
dependent of a deleted object of a new (or reinstalled) kind stays, and so does whatever it
holds (Kueue's Workload holds quota). The proof is an owner of that kind, deleted with a
dependent: the dependent goes once the collector follows the kind. Used by the Kueue bed
(kueuebed.py) and by the control-plane tests that reinstall KubeRay's CRDs.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from typing import Any

#: `kubectl` with the bed's kubeconfig: the arguments, and `check` and `input` as keywords.
Kubectl = Callable[..., subprocess.CompletedProcess[str]]


def _ref(doc: dict[str, Any]) -> list[str]:
    meta = doc["metadata"]
    where = ["-n", meta["namespace"]] if meta.get("namespace") else []
    return [*where, f"{doc['kind'].lower()}/{meta['name']}"]


def wait_collected(kc: Kubectl, owner: dict[str, Any], dependent: dict[str, Any],
                   timeout: float) -> float:  # fmt: skip
    """Create `owner`, then `dependent` owned by it; delete the owner and wait until the
    collector deletes the dependent. The seconds that took; TimeoutError after `timeout`."""
    for doc in (dependent, owner):  # an earlier run's, if it was cut short
        kc("delete", *_ref(doc), "--ignore-not-found", "--wait=true")
    uid = kc("create", "-f", "-", "-o", "jsonpath={.metadata.uid}",
             input=json.dumps(owner)).stdout.strip()  # fmt: skip
    ref = {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": uid,
    }
    owned = {**dependent, "metadata": {**dependent["metadata"], "ownerReferences": [ref]}}
    kc("create", "-f", "-", input=json.dumps(owned))
    kc("delete", *_ref(owner), "--wait=false")
    t0 = time.monotonic()
    while kc("get", *_ref(dependent), check=False).returncode == 0:
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"the garbage collector did not collect {'/'.join(_ref(dependent))}"
                               f" of a deleted {owner['kind']} in {timeout:.0f}s")  # fmt: skip
        time.sleep(0.5)
    return time.monotonic() - t0
