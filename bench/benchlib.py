"""What the control-plane benchmark stands on: the test bed, the operator under test, counters.

- `Testbed`: the running test bed (started through its CLI when none is healthy).
- `BenchOperator`: the operator as a `kopf run` process, logged in as the chart's own
  ServiceAccount with the chart's RBAC, and with FlowSchemas of its own, so the API server's
  `apiserver_flowcontrol_dispatched_requests_total{flow_schema=...}` counts exactly the
  requests this process makes (watches included), apart from KubeRay's and the benchmark's;
  split by kind (`SCHEMAS`): Lease renewals, status writes, other writes, and the rest.
- Process counters from /proc (RSS, CPU seconds) and small statistics helpers.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from vllm_dp_operator.config import Config

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "controlplane"))
sys.path.insert(0, str(REPO / "tests" / "chart"))

import chartlib  # noqa: E402
from operator_proc import OperatorProcess, install_crd  # noqa: E402

STATE = Path(os.environ.get("VLLMDP_TESTBED_DIR") or REPO / ".testbed").resolve()
TESTBED_PY = REPO / "tests" / "testbed" / "testbed.py"
#: The bed's API server logs every write here, and this bench's operator's reads, one JSON
#: line each, with its user (the bed's `controlplane.audit_log` and `AUDIT_POLICY`).
AUDIT_LOG = STATE / "logs" / "audit.log"
FLOW_SCHEMA = "vllmdp-bench-operator"
_WRITES = ["create", "update", "patch", "delete", "deletecollection"]
#: The operator's requests by kind: FlowSchema name suffix -> (precedence, verbs, resources).
#: The lowest precedence matches first; the catch-all FLOW_SCHEMA takes what is left. Service
#: proxy requests (the probes) never reach priority and fairness (the API server exempts
#: long-running requests other than watches), so `proxy_requests` counts them instead.
SCHEMAS: dict[str, tuple[int, list[str], list[str]]] = {
    "leases": (470, _WRITES, ["leases"]),  # leader election's renewals
    "lease-reads": (475, ["get", "list", "watch"], ["leases"]),  # its reads of the record
    "status": (480, _WRITES, ["vllmdataparallels/status"]),
    "writes": (490, _WRITES, ["*"]),
}
#: Leader election's requests, counted apart (a renewal every 2 s, whatever the number of
#: resources): its writes, and its reads of the record (none while a leader's renewals land).
LEASES = ("leases", "lease-reads")
SYSTEM_NS = "vllmdp-bench-system"


def pct(values: Iterable[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def median(values: Iterable[float]) -> float:
    """The median of some numbers."""
    return float(statistics.median(list(values)))


def spread(values: Iterable[float]) -> tuple[float, float]:
    """The smallest and the largest of some numbers (a median's spread over windows)."""
    ordered = sorted(values)
    return ordered[0], ordered[-1]


class Testbed:
    """The control-plane test bed, through its CLI only."""

    def __init__(self) -> None:
        self.started_here = False
        self.env = {**os.environ, "VLLMDP_TESTBED_DIR": str(STATE)}

    def _cli(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(TESTBED_PY), *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout, check=False)

    def ensure_up(self) -> None:
        """Reuse a healthy test bed, else start one (and stop it in `down`)."""
        if self._cli("status", timeout=60).returncode != 0:
            up = self._cli("up")
            if up.returncode != 0:
                raise SystemExit(f"test bed did not start:\n{up.stdout[-3000:]}{up.stderr[-3000:]}")
            self.started_here = True
        info = json.loads((STATE / "testbed.json").read_text())
        self.kubeconfig = Path(info["kubeconfig"])
        self.bin_dir = Path(info["bin_dir"])

    def down(self) -> None:
        """Stop the test bed if this run started it."""
        if self.started_here:
            self._cli("down", timeout=120)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of the bed's components that converging loads (the API server,
        etcd, KubeRay, kwok), by name, from the PIDs the bed recorded."""
        pids = json.loads((STATE / "pids.json").read_text())
        names = ("kube-apiserver", "etcd", "kuberay-operator", "kwok")
        return {n: cpu_seconds(pids[n]["pid"]) for n in names if n in pids}

    def operator_env(self) -> dict[str, str]:
        return {**self.env, "KUBECONFIG": str(self.kubeconfig),
                "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 900) -> subprocess.CompletedProcess[str]:  # fmt: skip
        proc = subprocess.run([str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}",
                               *args], input=input, text=True, capture_output=True,
                              timeout=timeout, check=False)  # fmt: skip
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
        return proc


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def shipped_settings(**over: str) -> dict[str, str]:
    """The operator's environment as the chart ships it (Config defaults), with overrides."""
    d = Config()
    env = {
        "VLLMDP_RESYNC_SECONDS": str(d.resync_seconds),
        "VLLMDP_PROBE_LAUNCHING_SECONDS": str(d.probe_launching_seconds),
        "VLLMDP_PROBE_SERVING_SECONDS": str(d.probe_serving_seconds),
        "VLLMDP_PROBE_METRICS_SECONDS": str(d.probe_metrics_seconds),
        "VLLMDP_HEALTH_TIMEOUT_SECONDS": str(d.health_timeout_seconds),
        "VLLMDP_BACKOFF_BASE_SECONDS": str(d.backoff_base_seconds),
        "VLLMDP_BACKOFF_CAP_SECONDS": str(d.backoff_cap_seconds),
        "VLLMDP_WORKERS": str(d.workers),
        "VLLMDP_STOP_CONFIRM_SECONDS": str(d.stop_confirm_seconds),
    }
    return {**env, **over}


class BenchOperator:
    """The operator under test, with the chart's identity and a FlowSchema of its own."""

    def __init__(self, tb: Testbed, log: Path) -> None:
        self.tb, self.log = tb, log
        self.proc: OperatorProcess | None = None
        #: The VLLMDP_* settings of the running process, and the overrides of the defaults.
        self.settings: dict[str, str] = {}
        self.overrides: dict[str, str] = {}
        self.probe = "off"

    def setup(self, probe: str = "off") -> None:
        """The CRD, the chart's identity for a probe mode (VLLMDP_HEALTH_PROBE), FlowSchemas."""
        self.probe = probe
        install_crd(self.tb)
        self.tb.kubectl("create", "namespace", SYSTEM_NS, check=False)
        self.identity = chartlib.apply_operator_identity(
            self.tb.kubectl, "bench", SYSTEM_NS, (), (f"healthProbe.mode={probe}",))
        self.kubeconfig = chartlib.operator_kubeconfig(
            self.tb.kubectl, self.identity, self.tb.kubeconfig, STATE / "bench-operator.kubeconfig")
        subject = {"kind": "ServiceAccount", "serviceAccount": {
            "name": self.identity.service_account, "namespace": SYSTEM_NS}}  # fmt: skip

        def schema(name: str, precedence: int, verbs: list[str], resources: list[str],
                   non_resource: bool) -> dict[str, Any]:  # fmt: skip
            rule: dict[str, Any] = {"subjects": [subject], "resourceRules": [{
                "verbs": verbs, "apiGroups": ["*"], "resources": resources,
                "namespaces": ["*"], "clusterScope": True}]}  # fmt: skip
            if non_resource:
                rule["nonResourceRules"] = [{"verbs": ["*"], "nonResourceURLs": ["*"]}]
            return {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema",
                    "metadata": {"name": name},
                    "spec": {"matchingPrecedence": precedence,
                             "priorityLevelConfiguration": {"name": "workload-high"},
                             "distinguisherMethod": {"type": "ByUser"}, "rules": [rule]}}

        docs = [schema(FLOW_SCHEMA, 500, ["*"], ["*"], True)]
        docs += [schema(f"{FLOW_SCHEMA}-{k}", p, v, r, False) for k, (p, v, r) in SCHEMAS.items()]
        self.tb.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))

    def start(self, **settings: str) -> None:
        self.overrides = settings
        env = {**self.tb.operator_env(), "KUBECONFIG": str(self.kubeconfig)}
        self.settings = {**shipped_settings(**settings), "VLLMDP_HEALTH_PROBE": self.probe}
        # The chart's Role for the Lease is in the release namespace, as in a real install.
        self.proc = OperatorProcess(env, self.log, {**self.settings,
                                                    "VLLMDP_LEASE_NAMESPACE": SYSTEM_NS})
        self.proc.start()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def teardown(self) -> None:
        self.stop()
        self.tb.kubectl("delete", "flowschema", FLOW_SCHEMA,
                        *(f"{FLOW_SCHEMA}-{k}" for k in SCHEMAS), "--ignore-not-found",
                        check=False)  # fmt: skip
        chartlib.delete_operator_identity(self.tb.kubectl, self.identity)

    @property
    def pid(self) -> int:
        assert self.proc is not None and self.proc.proc is not None
        return self.proc.proc.pid

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the operator process so far."""
        return cpu_seconds(self.pid)

    def memory_mib(self) -> dict[str, float]:
        """Current (VmRSS) and peak (VmHWM) resident memory, in MiB."""
        out = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
        return out

    def health(self) -> dict[str, Any]:
        """The controller's own counters, from the liveness endpoint."""
        assert self.proc is not None
        with urllib.request.urlopen(f"http://127.0.0.1:{self.proc.port}/healthz",
                                    timeout=5) as resp:  # fmt: skip
            doc: dict[str, Any] = json.loads(resp.read())
        return dict(doc.get("controller") or {})


_DISPATCHED = re.compile(
    r'^apiserver_flowcontrol_dispatched_requests_total\{([^}]*)\}\s+([0-9.e+]+)$', re.M)


def operator_requests_by_kind(metrics_text: str) -> dict[str, float]:
    """Requests the API server dispatched for each of the operator's FlowSchemas so far:
    "other" for the catch-all, else the keys of SCHEMAS (every key present)."""
    names = {FLOW_SCHEMA: "other", **{f"{FLOW_SCHEMA}-{k}": k for k in SCHEMAS}}
    out = dict.fromkeys(names.values(), 0.0)
    for labels, value in _DISPATCHED.findall(metrics_text):
        found = _FLOW_SCHEMA_LABEL.search(labels)
        if found and found.group(1) in names:
            out[names[found.group(1)]] += float(value)
    return out


_FLOW_SCHEMA_LABEL = re.compile(r'(?:^|,)flow_schema="([^"]*)"')
_REQUESTS = re.compile(r'^apiserver_request_total\{([^}]*)\}\s+([0-9.e+]+)$', re.M)


def proxy_requests(metrics_text: str) -> float:
    """Service-proxy requests the API server answered so far, from every client (on the test
    bed only the operator sends any: its probes and Ray job API calls)."""
    return sum(float(value) for labels, value in _REQUESTS.findall(metrics_text)
               if 'resource="services"' in labels and 'subresource="proxy"' in labels)


def audit_mark(log: Path = AUDIT_LOG) -> int:
    """Where the audit log ends now: the start of a window for `audited`."""
    return log.stat().st_size if log.exists() else 0


def audited(start: int, log: Path = AUDIT_LOG) -> dict[str, int]:
    """Requests in the API server's audit log from byte `start` on, by user, verb and resource:
    every client's writes (KubeRay's status writes, for one, wake the operator, so while they
    go on the bed is not at rest) and the bench operator's reads. A watch counts once, when it
    starts."""
    counts: dict[str, int] = {}
    if not log.exists():
        return {"no audit log": 1}
    if log.stat().st_size < start:  # rotated: the writes before the rotation are not counted
        counts["audit log rotated"], start = 1, 0
    with log.open("rb") as f:
        f.seek(start)
        for line in f:
            event = json.loads(line)
            if event.get("verb") == "watch" and event.get("stage") != "ResponseStarted":
                continue
            who = event.get("user", {}).get("username", "?")
            ref = event.get("objectRef") or {}
            what = ref.get("resource", "?")
            if ref.get("subresource"):
                what += f"/{ref['subresource']}"
            key = f"{who.removeprefix('system:serviceaccount:')} {event.get('verb')} {what}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def operator_requests(metrics_text: str, kinds: tuple[str, ...] | None = None) -> float:
    """Requests the API server dispatched for the operator so far: all its FlowSchemas, or
    those of `kinds` (keys of operator_requests_by_kind, e.g. LEASES)."""
    by_kind = operator_requests_by_kind(metrics_text)
    return sum(v for k, v in by_kind.items() if kinds is None or k in kinds)
