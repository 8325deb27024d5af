"""Runs the operator as a real `kopf run` process against the test bed."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from vllm_dp_operator.api.crd import build_crd

# Short timings so relaunch and probe scenarios finish in seconds. The safety resync is left
# long: every scenario must be driven by watch events, not by a resync tick.
OPERATOR_ENV = {
    "VLLMDP_RESYNC_SECONDS": "600",
    "VLLMDP_PROBE_LAUNCHING_SECONDS": "1",
    "VLLMDP_PROBE_SERVING_SECONDS": "2",
    "VLLMDP_PROBE_METRICS_SECONDS": "2",
    # A served engine loses its route after 3 failed probes over 6 s here (90 s by default).
    "VLLMDP_UNROUTE_AFTER_SECONDS": "6",
    "VLLMDP_BACKOFF_BASE_SECONDS": "2",
    "VLLMDP_BACKOFF_CAP_SECONDS": "8",
    "VLLMDP_HEALTH_TIMEOUT_SECONDS": "1",
    # No Ray dashboard answers on kwok pods unless a test starts the job API double: give up
    # confirming an undeliverable stop after 3 s, not a minute.
    "VLLMDP_STOP_CONFIRM_SECONDS": "3",
}


def ray_auth_key_file() -> str:
    """One Ray auth key for every test operator process, as the chart gives every replica
    one: a restarted or failed-over operator derives the tokens its predecessor created."""
    path = Path(os.environ.get("TMPDIR") or "/tmp") / f"vdp-test-ray-auth-key-{os.getuid()}"
    if not path.exists():
        path.write_bytes(os.urandom(32).hex().encode())
        path.chmod(0o600)
    return str(path)


def probe_mode(env: dict[str, str]) -> str:
    """apiserver-proxy where the test bed routes pod IPs into its own namespace, else off.

    It decides how the operator reaches both vLLM's /health and the Ray job API.

    Without that pod network a proxied probe would send traffic to a pod IP off this machine.
    """
    state = Path(env.get("VLLMDP_TESTBED_DIR") or ".testbed")
    return "apiserver-proxy" if (state / "pod_network.json").exists() else "off"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


#: Where the test operators' Leases live (the bed's processes run outside any pod).
LEASE_NAMESPACE = "default"
_IDENTITY = re.compile(r"Leader election on Lease \S+ as (\S+)")


class OperatorProcess:
    """One `kopf run` child process, started and stopped by PID.

    Leader election is on, as shipped. A process given no `lease_name` takes a fresh Lease at
    each start, so a restart after a SIGKILL leads at once instead of waiting out the dead
    process's lease; replicas share one `lease_name` and elect one leader.
    """

    def __init__(self, env: dict[str, str], log: Path, extra_env: dict[str, str] | None = None,
                 lease_name: str | None = None, pod_name: str = "operator"):  # fmt: skip
        self.env = {**env, **OPERATOR_ENV, "VLLMDP_HEALTH_PROBE": probe_mode(env),
                    "VLLMDP_LEASE_NAMESPACE": LEASE_NAMESPACE, "POD_NAME": pod_name,
                    "VLLMDP_READINESS_HOST": "127.0.0.1",
                    "VLLMDP_RAY_AUTH_KEY_FILE": ray_auth_key_file(),
                    **(extra_env or {}), "PYTHONUNBUFFERED": "1"}
        self.log = log
        self.extra_env = extra_env
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.ready_port = 0
        #: The metrics server's port (its /debug/controller serves the counters); a test that
        #: sets VLLMDP_METRICS_PORT itself picks it, else each start takes a free one.
        self.metrics_port = int(self.env.get("VLLMDP_METRICS_PORT") or 0)
        self.lease_name = lease_name
        self._log_from = 0
        #: Watch one namespace (kopf --namespace) instead of all of them.
        self.namespace: str | None = None

    def start(self) -> None:
        self.port = _free_port()
        # Two asks may return the same free port (the first was closed again): never share.
        self.ready_port = _free_port()
        while self.ready_port == self.port:
            self.ready_port = _free_port()
        self.env["VLLMDP_READINESS_PORT"] = str(self.ready_port)
        if "VLLMDP_METRICS_PORT" not in (self.extra_env or {}):
            self.metrics_port = _free_port()
            while self.metrics_port in (self.port, self.ready_port):
                self.metrics_port = _free_port()
            self.env.update(VLLMDP_METRICS_PORT=str(self.metrics_port),
                            VLLMDP_METRICS_HOST="127.0.0.1", VLLMDP_METRICS_AUTH="none")
        self.env["VLLMDP_LEASE_NAME"] = self.lease_name or f"vdp-test-{os.urandom(4).hex()}"
        self._log_from = self.log.stat().st_size if self.log.exists() else 0
        scope = [f"--namespace={self.namespace}"] if self.namespace else ["--all-namespaces"]
        # The children's watches follow the same scope (the chart sets both from one value).
        self.env["VLLMDP_WATCH_NAMESPACES"] = self.namespace or ""
        cmd = [
            sys.executable, "-m", "kopf", "run", "--standalone", *scope,
            f"--liveness=http://127.0.0.1:{self.port}/healthz",
            "-m", "vllm_dp_operator.handlers",
        ]  # fmt: skip
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"operator exited early:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"operator liveness never answered:\n{self.log_tail()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not running"
        return self.proc.pid

    def identity(self) -> str:
        """This run's holderIdentity (its log says it at start)."""
        text = self.log.read_bytes()[self._log_from:].decode(errors="replace")
        found = _IDENTITY.search(text)
        assert found, f"no identity in the operator's log:\n{self.log_tail()}"
        return found.group(1)

    def counters(self) -> dict[str, Any]:
        """The controller's counters (queue, caches, reflectors' requests, readiness), read
        fresh from the metrics server's /debug/controller (metrics auth is off here)."""
        url = f"http://127.0.0.1:{self.metrics_port}/debug/controller"
        with urllib.request.urlopen(url, timeout=5) as resp:
            found: dict[str, Any] = json.loads(resp.read())
        return found

    def readiness(self) -> tuple[int, str]:
        """GET /readyz: the status code and the body."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ready_port}/readyz",
                                        timeout=2) as resp:  # fmt: skip
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError as exc:  # not listening (yet)
            return 0, repr(exc)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def install_crd(testbed: Any) -> None:
    """Apply the CRD generated from the models and wait until the API serves it."""
    testbed.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                    input=yaml.safe_dump(build_crd()))  # fmt: skip
    testbed.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/vllmdataparallels.vllmdp.io")  # fmt: skip
