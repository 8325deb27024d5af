"""Fixtures for the control-plane tier: a real kube-apiserver + etcd + controller-manager +
scheduler, kwok fake GPU nodes and the KubeRay operator (tests/testbed/testbed.py).

The session fixture `testbed` reuses a running test bed when $VLLMDP_TESTBED_DIR (default
`.testbed/`) holds a healthy one, and then leaves it running; otherwise it builds (cached) and
starts one, and stops it at the end of the session. With CI=true any build or start failure
fails the tests; outside CI a missing Go toolchain (and no cached binaries) skips them.

These fixtures do not import the operator code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTBED_PY = REPO / "tests" / "testbed" / "testbed.py"


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


@dataclass
class RunningTestbed:
    """Handle on a running test bed."""

    state_dir: Path
    kubeconfig: Path
    admin_token: str
    server: str
    bin_dir: Path
    started_here: bool
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def kubectl_path(self) -> Path:
        return self.bin_dir / "kubectl"

    def env(self) -> dict[str, str]:
        """Environment for a subprocess that should talk to the test bed (e.g. the operator)."""
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "VLLMDP_TESTBED_DIR": str(self.state_dir),
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        }

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl (the test bed's own build) as cluster admin; raise on failure if `check`."""
        cmd = [str(self.kubectl_path), f"--kubeconfig={self.kubeconfig}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed (rc={proc.returncode}):\n"
                f"{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def apply(self, manifest: str | dict[str, Any] | list[dict[str, Any]], *args: str) -> None:
        import yaml

        if isinstance(manifest, dict):
            manifest = yaml.safe_dump(manifest)
        elif isinstance(manifest, list):
            manifest = yaml.safe_dump_all(manifest)
        self.kubectl(
            "apply", "--server-side", "--force-conflicts", "-f", "-", *args, input=manifest
        )

    def wait_until(
        self, what: str, check: Callable[[], Any], timeout: float = 60, interval: float = 0.25
    ) -> Any:
        """Poll `check` until it returns a truthy value; return it, or fail after `timeout`."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = check()
            except AssertionError as e:
                last = e
            else:
                if last:
                    return last
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")

    def log_tail(self, component: str, chars: int = 4000) -> str:
        p = self.state_dir / "logs" / f"{component}.log"
        return p.read_text(errors="replace")[-chars:] if p.exists() else ""


def _run(
    args: list[str], env: dict[str, str], timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TESTBED_PY), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _bail(msg: str, *, skippable: bool) -> None:
    if skippable and not _in_ci():
        pytest.skip(msg)
    pytest.fail(msg, pytrace=False)


@pytest.fixture(scope="session")
def testbed() -> Iterator[RunningTestbed]:
    state = Path(os.environ.get("VLLMDP_TESTBED_DIR") or REPO / ".testbed").resolve()
    env = {**os.environ, "VLLMDP_TESTBED_DIR": str(state)}

    started = False
    if _run(["status"], env, timeout=60).returncode != 0:
        bin_dir = _run(["bin-dir"], env, timeout=60).stdout.strip()
        cached = bool(bin_dir) and all(
            (Path(bin_dir) / b).is_file()
            for b in (
                "kube-apiserver",
                "kube-controller-manager",
                "kube-scheduler",
                "kubectl",
                "kwok",
                "ray-operator",
            )
        )
        if not cached and shutil.which("go") is None:
            _bail(
                "control-plane test bed: Go toolchain not found and no cached binaries in "
                f"{bin_dir}; install Go >= 1.26 (or run `python tests/testbed/testbed.py build` "
                "where Go exists)",
                skippable=True,
            )
        build = _run(["build"], env, timeout=3 * 3600)
        if build.returncode != 0:
            _bail(
                f"control-plane test bed: build failed (rc={build.returncode}):\n"
                f"{build.stdout[-4000:]}\n{build.stderr[-8000:]}",
                skippable=False,
            )
        up = _run(["up", "--no-build"], env, timeout=900)
        sys.stderr.write(up.stdout)
        if up.returncode != 0:
            _bail(
                f"control-plane test bed: `up` failed (rc={up.returncode}):\n{up.stdout[-4000:]}\n"
                f"{up.stderr[-8000:]}",
                skippable=False,
            )
        started = True

    info = json.loads((state / "testbed.json").read_text())
    handle = RunningTestbed(
        state_dir=state,
        kubeconfig=Path(info["kubeconfig"]),
        admin_token=info["admin_token"],
        server=info["server"],
        bin_dir=Path(info["bin_dir"]),
        started_here=started,
        info=info,
    )
    try:
        yield handle
    finally:
        if started:
            down = _run(["down"], env, timeout=120)
            if down.returncode != 0:
                sys.stderr.write(f"testbed down failed:\n{down.stdout}\n{down.stderr}\n")


@pytest.fixture
def testbed_namespace(testbed: RunningTestbed, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (without waiting)."""
    base = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    name = f"t-{base}-{os.urandom(3).hex()}"
    testbed.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        testbed.kubectl("delete", "namespace", name, "--wait=false", check=False)
