"""Client traffic through a Service, from a pod, counted: `with Traffic(...) as t:`.

The client (`traffic_client.py`, shipped in a ConfigMap) runs in a pod of an image the bed
already holds (the engine double's, for its python3) and POSTs completions to the Service's
ClusterIP without pause. Entering waits until its pod is Ready, which its readiness probe makes
mean "the first 200 came back": counting starts there, so the client's own start is no failure.
Leaving stops it first (`/stop`: what lands after is dropped, so its own stop is none either),
keeps the final tally in `t.result`, then deletes the pod and the ConfigMap. Counts are read
from the host through the pod's IP, so they can be read while the API server is down.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from .bed import RunningCluster

SCRIPT = Path(__file__).with_name("traffic_client.py")
PORT = 8089


def client_manifests(name: str, ns: str, image: str, url: str, model: str, rate: float,
                     api_key_secret: tuple[str, str] | None = None,
                     node: str | None = None,
                     keep_alive: bool = False, wait_go: bool = False,
                     ) -> list[dict[str, Any]]:  # fmt: skip
    """The ConfigMap with the script and the client's pod. The pod asks no CPU: the bed's
    nodes are promised to the Ray pods. The API key, if any, comes from its Secret as env."""
    labels = {"app.kubernetes.io/name": "traffic-client", "app.kubernetes.io/instance": name}
    env = ([{"name": "VLLMDP_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": api_key_secret[0], "key": api_key_secret[1]}}}] if api_key_secret else [])
    container: dict[str, Any] = {
        "name": "client", "image": image, "imagePullPolicy": "Never",
        "command": ["python3", "/client/traffic_client.py", "--url", url, "--model", model,
                    "--rate", str(rate), "--port", str(PORT),
                    *(["--keep-alive"] if keep_alive else []),
                    *(["--wait-go"] if wait_go else [])],
        "env": env, "ports": [{"containerPort": PORT, "name": "counts"}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": PORT},
                           "periodSeconds": 1, "failureThreshold": 1},
        "volumeMounts": [{"name": "script", "mountPath": "/client"}],
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
    }  # fmt: skip
    spec: dict[str, Any] = {
        "containers": [container], "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        # Pod Security `restricted`, as the vLLM CPU scenarios' namespace enforces: the
        # engine images' own non-root user (engine_image/Dockerfile).
        "securityContext": {"runAsNonRoot": True, "runAsUser": 2000,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "volumes": [{"name": "script", "configMap": {"name": name}}],
    }  # fmt: skip
    if node:
        spec["nodeName"] = node
    return [{"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": name, "namespace": ns, "labels": labels},
             "data": {"traffic_client.py": SCRIPT.read_text()}},
            {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": name, "namespace": ns, "labels": labels},
             "spec": spec}]  # fmt: skip


def summary(result: dict[str, Any]) -> str:
    """One line: failed/total, rate, and each outage as the client saw it."""
    outages = ", ".join(
        f"{o['failed']} failed over {(o['to'] or result['stopped_at']) - o['from']:.1f}s"
        for o in result["outages"]) or "none"  # fmt: skip
    conns = result.get("connections")
    kept = f" ({conns['reused']} on a kept connection, {conns['opened']} opened)" if conns else ""
    return (f"{result['failed']}/{result['total']} failed{kept}, {result['rate']:.1f} req/s "
            f"over {result['counting_s']:.0f}s; outages: {outages}")


@dataclass
class Traffic:
    """One client pod sending completions to `url` (the Service) for the `with` block."""

    cluster: RunningCluster
    ns: str
    url: str
    model: str
    image: str
    name: str = "traffic"
    rate: float = 10.0
    api_key_secret: tuple[str, str] | None = None
    start_timeout: float = 120
    #: Kept-alive connections from a pool instead of a new connection per request.
    keep_alive: bool = False
    #: Start idle, and send from `go()` on (its pod is Ready before).
    wait_go: bool = False
    result: dict[str, Any] = field(default_factory=dict)
    pod_ip: str = ""

    def _get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://{self.pod_ip}:{PORT}{path}", timeout=10) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def counts(self) -> dict[str, Any]:
        """The tally so far (see traffic_client.Tally.snapshot)."""
        return self._get("/counts")

    def go(self) -> None:
        """Start sending (a client made with `wait_go`)."""
        self._get("/go")

    def logs(self) -> str:
        return self.cluster.kubectl("logs", "-n", self.ns, self.name, "--tail=60",
                                    check=False).stdout  # fmt: skip

    def __enter__(self) -> Traffic:
        docs = client_manifests(self.name, self.ns, self.image, self.url, self.model, self.rate,
                                self.api_key_secret, keep_alive=self.keep_alive,
                                wait_go=self.wait_go)  # fmt: skip
        self.cluster.kubectl("delete", "pod,configmap", self.name, "-n", self.ns,
                             "--ignore-not-found", "--wait=true", timeout=60)  # fmt: skip
        self.cluster.apply(docs)

        def ready() -> str | None:
            pod = self.cluster.kubectl_json("get", "pod", self.name, "-n", self.ns)
            ok = any(c["type"] == "Ready" and c["status"] == "True"
                     for c in pod["status"].get("conditions") or [])  # fmt: skip
            return pod["status"].get("podIP") if ok else None

        self.pod_ip = self.cluster.wait_until(
            f"the traffic client's first 200 from {self.url}", ready, self.start_timeout,
            explain=lambda: f"--- traffic client log\n{self.logs()}\n"
            + self.cluster.diagnostics(self.ns))  # fmt: skip
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        try:
            self.result = self._get("/stop")
        except OSError:
            if et is None:
                raise  # else the block's own failure says more than an unreachable client
        finally:
            self.cluster.kubectl("delete", "pod,configmap", self.name, "-n", self.ns,
                                 "--wait=false", check=False)  # fmt: skip
        if et is None and self.keep_alive:
            # A server that closes every connection (an HTTP/1.0 answer) makes this a
            # new-connection client: what it counted would say nothing of kept connections.
            conns = self.result.get("connections") or {}
            assert conns.get("reused", 0) > 0, (
                f"{self.name}: no request went on a kept connection: {conns}")

    def summary(self) -> str:
        return summary(self.result)
