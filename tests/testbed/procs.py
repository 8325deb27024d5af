"""Processes of one test bed and their records in its state dir.

`Launcher.start` runs a component in its own session with stdout and stderr in
`logs/<name>.log` and records its PID, binary and argv in `pids.json`; `stop` sends SIGTERM to a
recorded PID (SIGKILL after a timeout) after checking the PID still runs that binary, and drops
the record. Nothing is ever stopped by name. `testbed.json` holds what clients need (server,
kubeconfig, ports, tokens, timings).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from common import log, pid_alive, wait_for


def pid_matches(pid: int, exe: str) -> bool:
    """Guard against PID reuse: the recorded binary must be argv[0] of the process."""
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return pid_alive(pid)  # no /proc: trust the record
    return argv0 == exe


def rss_mib(pid: int) -> float | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


class State:
    """One test bed's state dir: pids.json, testbed.json, logs/, pki/, kubeconfig."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pids_file = root / "pids.json"
        self.info_file = root / "testbed.json"
        self.logs = root / "logs"
        self.pki = root / "pki"
        self.kubeconfig = root / "kubeconfig"

    def pids(self) -> dict[str, dict[str, Any]]:
        if self.pids_file.exists():
            return json.loads(self.pids_file.read_text())  # type: ignore[no-any-return]
        return {}

    def save_pids(self, pids: dict[str, dict[str, Any]]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.pids_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(pids, indent=2) + "\n")
        os.replace(tmp, self.pids_file)

    def info(self) -> dict[str, Any]:
        if self.info_file.exists():
            return json.loads(self.info_file.read_text())  # type: ignore[no-any-return]
        return {}

    def write_info(self, info: dict[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.info_file.write_text(json.dumps(info, indent=2) + "\n")
        self.info_file.chmod(0o600)  # holds tokens

    def update_info(self, **fields: Any) -> None:
        self.write_info({**self.info(), **fields})

    def alive(self) -> dict[str, bool]:
        return {
            name: pid_alive(rec["pid"]) and pid_matches(rec["pid"], rec["exe"])
            for name, rec in self.pids().items()
        }

    def rss(self) -> dict[str, float]:
        out = {}
        for name, rec in self.pids().items():
            mib = rss_mib(rec["pid"])
            if mib is not None:
                out[name] = mib
        return out


class Launcher:
    """Starts components of one test bed and keeps how long each took to become ready."""

    def __init__(self, st: State) -> None:
        self.st = st
        self.timings: dict[str, float] = {}

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        exe: str | None = None,
    ) -> int:
        """Start `argv` in its own session; record it under `name`. `exe` is the binary the
        process ends up running when argv[0] is a wrapper that execs it (unshare, sh)."""
        self.st.logs.mkdir(parents=True, exist_ok=True)
        logfile = self.st.logs / f"{name}.log"
        with open(logfile, "ab") as lf:
            lf.write(f"\n==== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
            lf.flush()
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=lf,
                stderr=subprocess.STDOUT,
                env=env or dict(os.environ),
                cwd=self.st.root,
                start_new_session=True,
            )
        pids = self.st.pids()
        pids[name] = {
            "pid": proc.pid,
            "exe": exe or argv[0],
            "argv": argv,  # faults.py starts it again the same way
            "log": str(logfile),
            "started": time.time(),
        }
        self.st.save_pids(pids)
        return proc.pid

    def launch(
        self,
        name: str,
        argv: list[str],
        ready: Callable[[], Any],
        timeout: float,
        env: dict[str, str] | None = None,
        exe: str | None = None,
    ) -> int:
        """Start a component, wait until `ready()`, record how long it took; return its PID."""
        t0 = time.monotonic()
        pid = self.start(name, argv, env, exe)
        wait_for(name, ready, timeout, pid, self.st.logs / f"{name}.log")
        self.timings[name] = time.monotonic() - t0
        log(f"{name} ready in {self.timings[name]:.1f}s (pid {pid})")
        return pid


def stop(st: State, name: str, timeout: float = 10.0) -> None:
    """Stop the recorded component `name` (if it still runs its binary) and drop its record."""
    pids = st.pids()
    rec = pids.get(name)
    if rec is None:
        return
    pid = rec["pid"]
    if not pid_alive(pid):
        log(f"{name} (pid {pid}) already gone")
    elif not pid_matches(pid, rec["exe"]):
        log(f"{name}: pid {pid} now belongs to another program; leaving it alone")
    else:
        os.kill(pid, signal.SIGTERM)
        t0 = time.monotonic()
        while pid_alive(pid) and time.monotonic() - t0 < timeout:
            time.sleep(0.1)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        if pid_alive(pid):
            log(f"{name} (pid {pid}) ignored SIGTERM for {timeout:.0f}s; SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log(f"stopped {name} (pid {pid})")
    pids = st.pids()
    pids.pop(name, None)
    st.save_pids(pids)


def stop_all(st: State, order: Iterable[str], timeout: float = 10.0) -> None:
    """Stop every recorded component: those in `order` in that order, then any others."""
    order = list(order)
    for name in [*order, *[n for n in st.pids() if n not in order]]:
        stop(st, name, timeout)
    st.pids_file.unlink(missing_ok=True)
