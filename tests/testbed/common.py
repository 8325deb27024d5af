"""Shared helpers of the test bed: paths, pinned versions, the cache root, logging, HTTP probes
and waiting. Starts nothing and leaves nothing behind. Standard library only."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VERSIONS_FILE = HERE / "versions.env"


class BuildError(RuntimeError):
    """A binary, package or image the test bed needs could not be built or installed."""


def versions() -> dict[str, str]:
    """The pins in versions.env (KEY=value lines)."""
    out: dict[str, str] = {}
    for line in VERSIONS_FILE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def cache_root() -> Path:
    """${VLLMDP_CACHE:-${XDG_CACHE_HOME:-~/.cache}/vllm-dp-operator}/testbed: builds, shared."""
    base = os.environ.get("VLLMDP_CACHE")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        base = str(Path(xdg) / "vllm-dp-operator")
    return Path(base) / "testbed"


def user_cluster_role(user: str, rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A ClusterRole named after a bed component's user, with `rules`, bound to that user."""
    rbac = "rbac.authorization.k8s.io"
    return [
        {"apiVersion": f"{rbac}/v1", "kind": "ClusterRole", "metadata": {"name": user},
         "rules": rules},
        {"apiVersion": f"{rbac}/v1", "kind": "ClusterRoleBinding", "metadata": {"name": user},
         "roleRef": {"apiGroup": rbac, "kind": "ClusterRole", "name": user},
         "subjects": [{"apiGroup": rbac, "kind": "User", "name": user}]},
    ]  # fmt: skip


def log(msg: str) -> None:
    print(f"[testbed] {msg}", flush=True)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def pid_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (PID 1 here does not reap orphans) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def http_get(url: str, token: str | None = None, timeout: float = 2.0) -> tuple[int, str]:
    """GET `url` (TLS unverified: a readiness probe); (status, body), or (0, error)."""
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(
            req, timeout=timeout, context=ctx if url.startswith("https") else None
        ) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


def kubectl_table(text: str) -> list[dict[str, str]]:
    """`kubectl get`'s table as one header -> value dict per row. Columns are cut where their
    headers start, so an empty cell (an UPDATE column with no update) reads as "" and shifts
    nothing."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    header = lines[0]
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    names = [header[a:b].strip() for a, b in bounds]
    return [{n: row[a:b].strip() for n, (a, b) in zip(names, bounds, strict=True)}
            for row in lines[1:]]  # fmt: skip


def log_tail(logfile: Path | None, chars: int = 4000) -> str:
    if logfile and logfile.exists():
        return logfile.read_text(errors="replace")[-chars:]
    return ""


def wait_for(
    what: str,
    check: Callable[[], Any],
    timeout: float,
    proc_pid: int | None = None,
    logfile: Path | None = None,
) -> float:
    """Poll `check` until truthy; return the seconds it took. Fail early when `proc_pid` dies,
    and on a timeout, with the tail of `logfile`."""
    t0 = time.monotonic()
    last: Any = None
    while time.monotonic() - t0 < timeout:
        if proc_pid is not None and not pid_alive(proc_pid):
            raise RuntimeError(
                f"{what}: process {proc_pid} exited while starting. Log tail:\n{log_tail(logfile)}"
            )
        try:
            ok = check()
        except Exception as e:  # readiness probes raise while things start
            ok, last = False, e
        if ok:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise RuntimeError(
        f"{what} not ready after {timeout:.0f}s (last error: {last}). "
        f"Log tail:\n{log_tail(logfile)}"
    )
