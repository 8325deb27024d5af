"""Helpers for the operator scenarios on real nodes: the operator installed by helm, engine
images in the nodes, and one `VLLMDataParallel` followed through its children, with every wait
under a deadline that prints the operator's, KubeRay's and the pods' logs when it passes."""

from __future__ import annotations

import base64
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .bed import REPO, RunningCluster, testbed_cli
from .timeline import READY, RouteWatch, route_watch

sys.path.insert(0, str(REPO / "tests" / "testbed"))
import imagebuild
import imagedefs
import images

OPERATOR_NS = "vllm-dp-system"
OPERATOR_LABEL = "app.kubernetes.io/name=vllm-dp-operator"
#: The chart's Lease (release `vdp`): its holder names the operator pod that writes.
OPERATOR_LEASE = "vdp-vllm-dp-operator"
#: The chart's ServiceAccount (release `vdp`), as the API server names its user.
OPERATOR_SA_USER = f"system:serviceaccount:{OPERATOR_NS}:vdp-vllm-dp-operator"
API_PORT = 8000
DASHBOARD_PORT = 8265


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def engine_archive(name: str) -> Path:
    """The image's archive. Outside CI a heavy layer that is not cached yet skips the test
    (`make images` builds it; the CPU engine takes about 10 minutes cold); in CI it is built
    (`.ci/run` runs `make images` first, so this is a cache hit)."""
    top, _ = imagedefs.IMAGES[name]()
    missing = [d.name for d in top.chain()[:-1] if not imagebuild.cached(d)]
    if missing and not in_ci():
        pytest.skip(f"image {name}: layers {missing} not built yet; run `make images` "
                    f"(or `make image-{name}`) first")  # fmt: skip
    return images.build([name])[name]


def import_engine(cluster: RunningCluster, name: str) -> str:
    """`testbed.py cluster load NAME`: into every node, only the blobs it lacks (a changed
    launcher or glue is a few MB; the vLLM layer is imported once per node store, which the
    bed keeps between runs). Returns what each import did."""
    engine_archive(name)  # skips or builds, as documented there
    proc = testbed_cli("load", name, timeout=3600)
    if proc.returncode != 0:
        raise AssertionError(f"loading {name} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return proc.stdout.strip()


def install_operator(cluster: RunningCluster) -> None:
    """`testbed.py cluster operator`: the operator image into every node, `helm install`."""
    proc = testbed_cli("operator", timeout=1800)
    sys.stderr.write(proc.stderr[-2000:])
    if proc.returncode != 0:
        diag = cluster.diagnostics(OPERATOR_NS)
        raise AssertionError(f"installing the operator failed:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}\n{diag}")  # fmt: skip


def own_namespace(cluster: RunningCluster, name: str) -> None:
    """A fresh namespace `name` for one scenario, on nodes that hold the operator's pod and
    nothing else: the scenario's Ray head asks for most of a node's CPU, so pods an earlier
    test left terminating would keep it Pending (and fail this test for that one's leftovers)."""
    cluster.kubectl("delete", "namespace", name, "--ignore-not-found", "--wait=true",
                    timeout=180)  # fmt: skip
    cluster.wait_nodes_hold_only({OPERATOR_NS}, timeout=180)
    cluster.kubectl("create", "namespace", name)
    cluster.wait_until("the default ServiceAccount", lambda: cluster.kubectl(
        "get", "sa", "default", "-n", name, check=False).returncode == 0, 30)  # fmt: skip


def operator_logs(cluster: RunningCluster, tail: int = 80) -> str:
    """The end of each operator pod's log, the leader's first (the chart runs two replicas;
    the Lease's holderIdentity is `<pod name>_<per-process suffix>`)."""
    k = cluster.kubectl
    lease = k("get", "lease", OPERATOR_LEASE, "-n", OPERATOR_NS, "-o",
              "jsonpath={.spec.holderIdentity}", check=False).stdout.strip()  # fmt: skip
    leader = lease.rsplit("_", 1)[0] if lease else ""
    pods = k("get", "pods", "-n", OPERATOR_NS, "-l", OPERATOR_LABEL, "-o",
             "jsonpath={.items[*].metadata.name}", check=False).stdout.split()  # fmt: skip
    parts = []
    for pod in sorted(pods, key=lambda p: p != leader):
        role = "leader" if pod == leader else "standby"
        logs = k("logs", "-n", OPERATOR_NS, pod, f"--tail={tail}", check=False).stdout
        parts.append(f"--- operator pod {pod} ({role})\n{logs[-6000:]}")
    return "\n".join(parts) or f"--- operator: no pods (Lease holder {lease or 'none'})"


def operator_values(*values: str) -> None:
    """`helm upgrade` the bed's operator with these values on top of the bed's own (none:
    the bed's own again)."""
    proc = testbed_cli("operator", *(f"--set={v}" for v in values), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


def report(request: pytest.FixtureRequest, prefix: str, lines: dict[str, str]) -> None:
    """Print each scenario's line past pytest's capture (a module fixture's teardown is
    captured, and shown only on failure), for docs/benchmarks.md."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    text = "".join(f"[{prefix}] {k}: {v}\n" for k, v in lines.items())
    if capture is None or not text:
        return
    with capture.global_and_fixture_disabled():
        sys.stderr.write("\n" + text)


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 30,
         headers: dict[str, str] | None = None) -> Any:  # fmt: skip
    """GET (or POST `body` as JSON) from the host; the answer's JSON (or text)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                          **(headers or {})})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read().decode()
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def http_status(url: str, headers: dict[str, str] | None = None,
                body: dict[str, Any] | None = None) -> int:  # fmt: skip
    """The HTTP status of one request from the host (an error status too)."""
    try:
        http(url, body, timeout=30, headers=headers)
    except urllib.error.HTTPError as e:
        return e.code
    return 200


# Run inside an engine pod (both images have python3): GET or POST from the pod network.
_POD_HTTP = ("import json,sys,urllib.request as u;b=sys.argv[2].encode() or None;"
             "h={'Content-Type':'application/json',**json.loads(sys.argv[3] or '{}')};"
             "r=u.Request(sys.argv[1],data=b,headers=h);"
             "print(u.urlopen(r,timeout=60).read().decode())")  # fmt: skip


@dataclass
class Vdp:
    """One VLLMDataParallel in its own namespace, with the cluster it runs on."""

    cluster: RunningCluster
    ns: str
    name: str

    # --- reading -------------------------------------------------------------------------
    def get(self) -> dict[str, Any]:
        return self.cluster.kubectl_json("get", "vdp", self.name, "-n", self.ns)  # type: ignore[no-any-return]

    def status(self) -> dict[str, Any]:
        return self.get().get("status") or {}

    def pods(self) -> dict[str, dict[str, Any]]:
        """The Ray pods by role (`head`, `worker`), running ones only."""
        items = self.cluster.kubectl_json("get", "pods", "-n", self.ns,
                                          "-l", "ray.io/node-type")["items"]  # fmt: skip
        return {p["metadata"]["labels"]["ray.io/node-type"]: p for p in items
                if p["status"].get("phase") == "Running"
                and not p["metadata"].get("deletionTimestamp")}  # fmt: skip

    def watch(self, fields: str = READY, kind: str = "endpointslices") -> RouteWatch:
        """The resource's EndpointSlice (or, by `kind`, its Service), one line per change in
        the form of `fields` (timeline.route_watch)."""
        kubectl = [str(self.cluster.bin_dir / "kubectl"), f"--kubeconfig={self.cluster.kubeconfig}"]
        return route_watch(kubectl, self.ns, f"{self.name}-api", fields, kind)

    def heads(self) -> dict[str, dict[str, Any]]:
        """The running head pods by replica index."""
        items = self.cluster.kubectl_json("get", "pods", "-n", self.ns,
                                          "-l", "ray.io/node-type=head")["items"]  # fmt: skip
        return {p["metadata"]["labels"].get("vllmdp.io/replica", "0"): p for p in items
                if p["status"].get("phase") == "Running"
                and not p["metadata"].get("deletionTimestamp")}  # fmt: skip

    def ready_replicas(self, n: int) -> dict[str, Any] | None:
        """The status when `n` replicas are wanted and `n` routed, else None."""
        st = self.status()
        return st if st.get("readyReplicas") == n and st.get("replicas") == n else None

    def service_ip(self) -> str:
        svc = self.cluster.kubectl_json("get", "svc", f"{self.name}-api", "-n", self.ns)
        return str(svc["spec"]["clusterIP"])

    def ray_token(self) -> str | None:
        """The serving cluster's Ray auth token, read as an admin reads it from the Secret its
        authOptions name (the operator never does)."""
        secret = self.cluster.kubectl(
            "get", "raycluster", str(self.status().get("rayCluster")), "-n", self.ns,
            "-o", "jsonpath={.spec.authOptions.secretName}",
            check=False).stdout.strip()  # fmt: skip
        if not secret:
            return None
        proc = self.cluster.kubectl("get", "secret", secret, "-n", self.ns,
                                    "-o", "jsonpath={.data.auth_token}", check=False)  # fmt: skip
        raw = proc.stdout.strip() if proc.returncode == 0 else ""
        return base64.b64decode(raw).decode() if raw else None

    def token_secrets(self) -> list[str]:
        """The resource's Ray token Secrets (by their labels), as an admin lists them."""
        return self.cluster.kubectl(
            "get", "secrets", "-n", self.ns, "-o", "name", "-l",
            f"app.kubernetes.io/instance={self.name},app.kubernetes.io/component=ray-auth",
        ).stdout.split()  # fmt: skip

    def ray_headers(self) -> dict[str, str]:
        """KubeRay's header for the dashboard, when the cluster has a token."""
        token = self.ray_token()
        return {"x-ray-authorization": f"Bearer {token}"} if token else {}

    def dashboard_url(self, path: str) -> str:
        """The head pod's dashboard from the host."""
        return f"http://{self.pods()['head']['status']['podIP']}:{DASHBOARD_PORT}{path}"

    def dashboard_jobs(self) -> dict[str, dict[str, Any]]:
        """Ray's job table, from the host through the head pod's dashboard: by submission id."""
        jobs = http(self.dashboard_url("/api/jobs/"), timeout=10, headers=self.ray_headers())
        return {j["submission_id"]: j for j in jobs if j.get("submission_id")}

    def job_logs(self, submission_id: str) -> str:
        out = http(self.dashboard_url(f"/api/jobs/{submission_id}/logs"), timeout=10,
                   headers=self.ray_headers())  # fmt: skip
        return str(out.get("logs", "")) if isinstance(out, dict) else str(out)

    def rayjob(self, name: str) -> dict[str, Any] | None:
        proc = self.cluster.kubectl("get", "rayjob", name, "-n", self.ns, "-o", "json",
                                    check=False)  # fmt: skip
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def live_clusters(self) -> list[str]:
        """The RayClusters in the namespace not being deleted (two while a Surge runs)."""
        items = self.cluster.kubectl_json("get", "rayclusters", "-n", self.ns)["items"]
        return sorted(cl["metadata"]["name"] for cl in items
                      if not cl["metadata"].get("deletionTimestamp"))  # fmt: skip

    def children(self) -> list[str]:
        """Everything left in the namespace that the resource made (names by kind)."""
        out = self.cluster.kubectl("get", "rayclusters,rayjobs,services,endpointslices,pods",
                                   "-n", self.ns, "-o", "name").stdout  # fmt: skip
        return out.split()

    def from_pod(self, url: str, body: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None) -> Any:  # fmt: skip
        """GET/POST from inside the worker pod (another node than the head)."""
        pod = self.pods()["worker"]["metadata"]["name"]
        out = self.cluster.exec(self.ns, pod, "python3", "-c", _POD_HTTP, url,
                                json.dumps(body) if body is not None else "",
                                json.dumps(headers or {})).stdout  # fmt: skip
        try:
            return json.loads(out)
        except ValueError:
            return out

    # --- waiting -------------------------------------------------------------------------
    def diagnostics(self) -> str:
        k = self.cluster.kubectl
        parts = [k("get", "vdp,raycluster,rayjob,svc,pods", "-n", self.ns, "-o", "wide",
                   check=False).stdout,
                 "--- vdp status\n" + json.dumps(self.status_or_none(), indent=1)[-3000:],
                 operator_logs(self.cluster),
                 "--- kuberay-operator\n" + self.cluster.log_tail("kuberay-operator", 3000)]
        for role, pod in self.pods_or_empty().items():
            logs = k("logs", "-n", self.ns, pod["metadata"]["name"], "--tail=40",
                     check=False).stdout  # fmt: skip
            parts.append(f"--- {role} pod {pod['metadata']['name']}\n{logs[-3000:]}")
        try:
            for sid, job in self.dashboard_jobs().items():
                parts.append(f"--- ray job {sid} {job.get('status')}\n"
                             f"{self.job_logs(sid)[-3000:]}")  # fmt: skip
        except Exception as e:  # diagnostics must not hide the failure
            parts.append(f"--- ray jobs: {e!r}")
        return "\n".join(parts) + "\n" + self.cluster.diagnostics(self.ns)

    def status_or_none(self) -> dict[str, Any] | None:
        try:
            return self.status()
        except AssertionError:
            return None

    def pods_or_empty(self) -> dict[str, dict[str, Any]]:
        try:
            return self.pods()
        except AssertionError:
            return {}

    def wait(self, what: str, check: Callable[[], Any], timeout: float,
             interval: float = 1.0) -> Any:  # fmt: skip
        """Poll `check` until truthy; past `timeout` fail with everything that explains it."""
        return self.cluster.wait_until(what, check, timeout, interval, explain=self.diagnostics)

    def wait_update_started(self, timeout: float = 60) -> str:
        """Wait for `status.update` Starting (a Surge's new generation); its RayCluster."""
        return str(self.wait("status.update Starting", lambda: (
            u := self.status().get("update") or {}).get("phase") == "Starting" and u["to"],
            timeout))  # fmt: skip

    def wait_phase(self, phase: str, timeout: float, job: str | None = None) -> dict[str, Any]:
        """Wait for `phase` (of head job `job`, if given, else of a job other than none)."""
        def reached() -> dict[str, Any] | None:
            st = self.status()
            ok = st.get("phase") == phase and (job is None or st.get("headJob") == job)
            return st if ok else None
        return self.wait(f"phase {phase}" + (f" with head job {job}" if job else ""), reached,
                         timeout)  # type: ignore[no-any-return]
