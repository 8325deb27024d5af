"""Faults injected into a running test bed: stop one of its own components (etcd, the API
server) for a while, then start it again exactly as it was started; or freeze one (SIGSTOP)
for a while, so that it answers nothing and then carries on where it was.

The component is found in the state dir's `pids.json` (PID, binary, argv recorded by
procs.Launcher), stopped by that PID (SIGTERM, or SIGKILL for a crash), and started again by a
new Launcher, which records the new PID so `down` stops it as before. Nothing else is touched;
clients of the bed reconnect on their own, and that is what the reliability tier measures.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from common import http_get, pid_alive
from procs import Launcher, State, pid_matches, stop

RESTARTABLE = ("etcd", "kube-apiserver")
#: Components an API-server restart can take down with it, started again by `revive`. The bed
#: has no supervisor (a cluster's kubelet restarts its static pods); kube-scheduler v1.36 exits
#: when its cache sees a pod on another node than it recorded, which a relist after an API
#: server restart can produce.
REVIVABLE = ("kube-scheduler", "kube-controller-manager")


def _ready(st: State, name: str) -> Callable[[], bool]:
    info = st.info()
    if name == "etcd":
        url = f"http://127.0.0.1:{info['ports']['etcd']}/health"
        return lambda: '"health":"true"' in http_get(url)[1]
    server, token = info["server"], info["admin_token"]
    return lambda: http_get(f"{server}/readyz", token)[0] == 200


def stop_component(root: Path, name: str, crash: bool = False) -> dict[str, object]:
    """Stop a recorded component (SIGKILL when `crash`); return its record, to start it again."""
    if name not in RESTARTABLE:
        raise ValueError(f"{name}: only {', '.join(RESTARTABLE)} can be restarted")
    st = State(root)
    rec = st.pids().get(name)
    if rec is None or "argv" not in rec:
        raise RuntimeError(f"{name} is not recorded with its argv in {st.pids_file}")
    if crash and pid_alive(rec["pid"]) and pid_matches(rec["pid"], rec["exe"]):
        os.kill(rec["pid"], signal.SIGKILL)
    stop(st, name)
    return dict(rec)


def start_component(root: Path, name: str, rec: dict[str, object], timeout: float = 120) -> float:
    """Start a component stopped by stop_component; return seconds until it was ready."""
    argv = rec["argv"]
    assert isinstance(argv, list)
    return _launch(State(root), name, [str(a) for a in argv], str(rec["exe"]), timeout)


def revive(root: Path, timeout: float = 60) -> list[str]:
    """Start again, as `up` started it, each REVIVABLE component whose process is gone;
    return their names (none: nothing was down)."""
    st = State(root)
    revived = []
    for name in REVIVABLE:
        rec = st.pids().get(name)
        if rec is None or "argv" not in rec:
            continue
        if pid_alive(rec["pid"]) and pid_matches(rec["pid"], rec["exe"]):
            continue
        argv = [str(a) for a in rec["argv"]]
        port = next(a.split("=", 1)[1] for a in argv if a.startswith("--secure-port="))
        url = f"https://127.0.0.1:{port}/healthz"

        def healthy(url: str = url) -> bool:
            return http_get(url)[0] == 200

        Launcher(st).launch(name, argv, healthy, timeout, exe=str(rec["exe"]))
        revived.append(name)
    return revived


def _launch(st: State, name: str, argv: list[str], exe: str, timeout: float) -> float:
    launcher = Launcher(st)
    launcher.launch(name, argv, _ready(st, name), timeout, exe=exe)
    return launcher.timings[name]


def restart(root: Path, name: str, down_seconds: float, crash: bool = False) -> float:
    """Stop `name`, keep it down `down_seconds`, start it again; return its time to ready."""
    rec = stop_component(root, name, crash)
    time.sleep(down_seconds)
    return start_component(root, name, rec)


@contextlib.contextmanager
def frozen(root: Path, name: str) -> Iterator[None]:
    """A recorded component frozen (SIGSTOP) for the block, then thawed (SIGCONT), by its PID."""
    rec = State(root).pids().get(name)
    if rec is None or not pid_matches(rec["pid"], rec["exe"]):
        raise RuntimeError(f"{name} is not running as recorded in {root / 'pids.json'}")
    os.kill(rec["pid"], signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(rec["pid"], signal.SIGCONT)


def pause(root: Path, name: str, seconds: float) -> None:
    """Freeze a recorded component for `seconds` (SIGSTOP, then SIGCONT), by its PID."""
    with frozen(root, name):
        time.sleep(seconds)
