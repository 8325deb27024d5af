"""The operator in the real-node bed, the way a user installs it: its image imported into every
node, then `helm install` of the chart from this checkout.

The pod runs the image exactly as the chart's Deployment runs it (in-cluster config, its own
ServiceAccount, the chart's least-privilege RBAC, the `service-dns` health probe through
cluster DNS). The only differences from a user's install are local: the image comes from the
nodes' own stores (`imagePullPolicy: Never`, no registry), and a few timings are shorter so a
test sees a relaunch in seconds rather than minutes.

    testbed.py cluster operator [--set key=value ...]   # build/import the image, helm install
    testbed.py cluster operator-down                    # helm uninstall (cluster down does too)

`template()` renders the chart with the same values, for what a test needs to see as the
install made it (the PodMonitor the real-engine tier turns into a Prometheus scrape job).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import images
import realbed
import realnodes
import yaml
from common import BuildError, log
from procs import State

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "vllm-dp-operator"
ENSURE_HELM = REPO / "tests" / "chart" / "ensure_helm.sh"
IMAGE = "vllm-dp-operator"
RELEASE = "vdp"
NAMESPACE = "vllm-dp-system"
# Local image, nothing to pull; quicker probes and backoff than the chart's defaults, so the
# tier and `make dev` see Serving and a relaunch sooner. The operator's pod requests no CPU:
# the bed's nodes have 2 CPUs each, and the Ray head of a DP=2 resource with one API server
# asks for all of one node (1 CPU + 1 per API server), so the chart's 100m request would keep
# that head Pending whenever the scheduler put the operator on the node the worker did not
# take. The tenancy policy admits the bed's own engine images. Everything else is the chart's.
VALUES = (f"image.repository={IMAGE}", f"image.tag={images.TAG}", "image.pullPolicy=Never",
          "healthProbe.mode=service-dns", "healthProbe.launchingSeconds=2",
          "healthProbe.servingSeconds=5", "healthProbe.metricsSeconds=5",
          "backoff.baseSeconds=5", "backoff.capSeconds=60",
          "stopConfirmSeconds=30", "resources.requests.cpu=0",
          # The chart's tenancy policy allows the engine images the bed builds.
          "tenancy.allowedImages={vllm-dp-engine-cpu,vllm-dp-engine-double}")  # fmt: skip


def helm_binary() -> str:
    """$VLLMDP_HELM, else the pinned helm the chart tests build and cache."""
    if override := os.environ.get("VLLMDP_HELM"):
        return override
    proc = subprocess.run(["bash", str(ENSURE_HELM)], capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    if proc.returncode != 0:
        raise BuildError(f"{ENSURE_HELM} failed:\n{proc.stderr[-4000:]}")
    return proc.stdout.strip().splitlines()[-1]


def _helm(st: State, *args: str, timeout: float = 300) -> str:
    env = {**os.environ, "KUBECONFIG": str(st.kubeconfig),
           **{f"HELM_{k}_HOME": str(st.root / "helm" / k.lower())
              for k in ("CACHE", "CONFIG", "DATA")}}  # fmt: skip
    proc = subprocess.run([helm_binary(), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"helm {' '.join(args)} failed (rc={proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")  # fmt: skip
    return proc.stdout


def template(*extra: str) -> list[dict[str, Any]]:
    """`helm template` of the release with the values `install` uses plus `extra`
    (`key=value`): the objects it renders."""
    proc = subprocess.run([helm_binary(), "template", RELEASE, str(CHART),
                           f"--namespace={NAMESPACE}",
                           *(f"--set={v}" for v in (*VALUES, *extra))],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"helm template failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def install(st: State, archive: Path | None = None, extra: tuple[str, ...] = (),
            timeout: float = 180) -> dict[str, Any]:  # fmt: skip
    """Import the operator image (built or taken from the cache) into every node and
    `helm upgrade --install` the chart; return once every operator pod is Ready (the chart
    runs two, a leader and a standby, both Ready: synced, and the Lease API answering)."""
    if not realbed.healthy(st):
        raise RuntimeError(f"no healthy real-node bed in {st.root}; run `cluster up`")
    t0 = time.monotonic()
    archive = archive or images.build([IMAGE])[IMAGE]
    realnodes.log_import(realbed.nodes_of(st), [archive])
    t_import = time.monotonic() - t0
    # The tag stays `dev` while the image changes: the image ID on the pod template makes a
    # rebuilt image roll the Deployment on a bed that already runs an older one.
    image_id = images.image_id(archive).removeprefix("sha256:")[:16]
    sets = [*(f"--set={v}" for v in (*VALUES, *extra)),
            f"--set-string=podAnnotations.vllmdp\\.io/image-id={image_id}"]
    _helm(st, "upgrade", "--install", RELEASE, str(CHART), f"--namespace={NAMESPACE}",
          "--create-namespace", *sets, "--wait", f"--timeout={int(timeout)}s",
          timeout=timeout + 30)  # fmt: skip
    took = time.monotonic() - t0
    log(f"operator: image {images.image_id(archive)[:19]} imported in {t_import:.1f}s, "
        f"chart `{RELEASE}` in {NAMESPACE} (every replica) Ready after {took:.1f}s")  # fmt: skip
    return {"release": RELEASE, "namespace": NAMESPACE, "image": images.ref(IMAGE),
            "image_id": images.image_id(archive), "seconds": round(took, 1)}  # fmt: skip


def uninstall(st: State) -> None:
    """`helm uninstall` the release, if the bed is up and holds it."""
    if not realbed.healthy(st):
        return
    listed = _helm(st, "list", f"--namespace={NAMESPACE}", "-q")
    if RELEASE in listed.split():
        _helm(st, "uninstall", RELEASE, f"--namespace={NAMESPACE}", "--wait", "--timeout=60s")
        log(f"operator: release `{RELEASE}` uninstalled")
