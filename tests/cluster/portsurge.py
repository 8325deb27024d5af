"""A Surge that moves the API to a new `spec.service.port` (issue 38, item 2), measured from
the client's side: the one procedure of the engine double's scenario C2
(test_operator_availability.py) and of real vLLM's D2 (test_operator_vllm_cpu.py).

- A client on the old port (a new connection per request) runs from before the apply: it must
  lose nothing sent before the switch, since the old generation keeps its port in the
  Service, the slice and the policy until then.
- A client of the new port is made before the apply and starts sending once kube-proxy has a
  rule for that port (nothing can answer there before): it must lose nothing.
- Watches of the slice's ready addresses, and of the Service's and the slice's ports, say when
  the switch came and that each port moved once and never back.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .timeline import READY_BY_ADDRESS, RouteWatch, ready_addresses
from .traffic import Traffic
from .vdp import Vdp

#: The new API port of C2 and D2: outside Linux's ephemeral range and clear of Ray's own ports.
NEW_PORT = 8100
#: A client not yet started: (url, pod name, wait_go) -> Traffic.
Client = Callable[[str, str, bool], Traffic]


def kube_proxy_has(vip: str, port: int) -> bool:
    """Whether the bed's kube-proxy (iptables mode, in the host's network namespace) has a
    rule for vip:port yet."""
    rules = subprocess.run(["iptables", "-t", "nat", "-S", "KUBE-SERVICES"], check=False,
                           capture_output=True, text=True).stdout  # fmt: skip
    return any(f"-d {vip}/32" in r and f"--dport {port} " in f"{r} " for r in rules.splitlines())


@dataclass
class PortSurge:
    """What one Surge to `new_port` did, for the report and the checks."""

    vdp: Vdp
    old_port: int
    new_port: int
    old: Traffic
    new: Traffic
    routes: RouteWatch
    ports: dict[str, RouteWatch]
    applied: float = 0.0
    switched: float = 0.0
    programmed: float = 0.0

    def lines(self, label: str) -> dict[str, str]:
        return {
            f"{label} (old port {self.old_port})": self.old.summary(),
            f"{label} (new port {self.new_port}, from kube-proxy's rule)": (
                f"{self.new.summary()}; kube-proxy had the port "
                f"{self.programmed - self.switched:.1f}s after the slice moved; apply to "
                f"switch {self.switched - self.applied:.0f}s"),
        }  # fmt: skip

    def check(self) -> None:
        res, after = self.old.result, self.new.result
        why = (f"old port: {self.old.summary()}\n{json.dumps(res['failures'][:10], indent=1)}\n"
               f"new port: {self.new.summary()}\n"
               f"{json.dumps(after['failures'][:10], indent=1)}\n"
               + "".join(f"--- {n} ports {w.seen}\n" for n, w in self.ports.items())
               + f"--- slice {self.routes.seen}\n{self.vdp.diagnostics()}")  # fmt: skip
        # The ports move once: after the first line with the new port, never the old one again.
        for name, w in self.ports.items():
            lines = [line.split() for at, line in w.seen if at >= self.applied]
            first = next((i for i, p in enumerate(lines) if str(self.new_port) in p), None)
            assert first is not None, f"the {name} never took port {self.new_port}\n{why}"
            assert all(p == [str(self.new_port)] for p in lines[first:] if p), (
                f"the {name}'s port flapped\n{why}")  # fmt: skip
        # The old port served until the switch (1 s: the watch sees the slice a moment late).
        before = [o for o in res["outages"] if o["from"] < self.switched - 1.0]
        assert before == [] and res["ok"] > 0, f"{before}\n{why}"
        # The new port, from kube-proxy's rule: nothing lost.
        assert after["failed"] == 0 and after["ok"] > 0, why


def surge_to_new_port(vdp: Vdp, doc: dict[str, Any], old_port: int, new_port: int,
                      client: Client, switch_s: float, drain_s: float,
                      label: str) -> PortSurge:  # fmt: skip
    """Apply `doc` (a Surge whose spec.service.port is `new_port`) under the two clients, wait
    for the switch, the old RayCluster's end and status.update cleared, then 5 s of the new
    generation alone with traffic flowing. `label` names the clients' pods."""
    vdp.wait("no update in progress", lambda: "update" not in vdp.status(), 120)
    old_ip = vdp.pods()["head"]["status"]["podIP"]
    vip = vdp.service_ip()
    routes = vdp.watch(READY_BY_ADDRESS)
    ports = {"Service": vdp.watch("{.spec.ports[*].port}", kind="services"),
             "slice": vdp.watch("{.ports[*].port}")}  # fmt: skip
    old = client(f"http://{vip}:{old_port}", f"traffic-{label}", False)
    new = client(f"http://{vip}:{new_port}", f"traffic-{label}new", True)
    run = PortSurge(vdp, old_port, new_port, old, new, routes, ports)
    try:
        with old, new:
            vdp.wait("the slice watch's first line", lambda: routes.seen, 30)
            before = vdp.status()["rayCluster"]
            run.applied = time.time()
            vdp.cluster.apply(doc)
            run.switched = vdp.wait("the slice off the old head", lambda: next((
                at for at, s in routes.seen if at >= run.applied and ready_addresses(s)
                and old_ip not in ready_addresses(s)), None), switch_s)  # fmt: skip
            run.programmed = vdp.wait(f"kube-proxy's rule for port {new_port}", lambda: (
                time.time() if kube_proxy_has(vip, new_port) else None), 30, interval=0.1)
            new.go()
            # By the clusters, not the status: its write may land after the slice's switch.
            vdp.wait("the old RayCluster gone after its drain", lambda: (
                len(left := vdp.live_clusters()) == 1 and before not in left), drain_s)
            vdp.wait("status.update cleared", lambda: "update" not in vdp.status(), 60)
            time.sleep(5)  # the new generation alone, with traffic flowing
    finally:
        for w in (routes, *ports.values()):
            w.stop()
    return run
